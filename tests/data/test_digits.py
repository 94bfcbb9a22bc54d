import numpy as np
import pytest
import torch

from spikefuse.data import DATASETS, DatasetInfo, load_dataset


def test_digits_shapes_and_info():
    train, info = load_dataset("digits", None, train=True, T=8)
    test, tinfo = load_dataset("digits", None, train=False, T=8)
    assert info == DatasetInfo("digits", in_channels=1, num_classes=10, height=8, width=8, kind="static")
    assert tinfo == info
    assert len(train) + len(test) == 1797
    assert abs(len(test) - 0.2 * 1797) <= 10
    x, y = train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32
    assert isinstance(y, int) and 0 <= y < 10
    assert float(train.data.min()) == 0.0 and float(train.data.max()) == 1.0


def test_digits_split_is_disjoint_deterministic_and_stratified():
    a, _ = load_dataset("digits", None, train=True, T=4, seed=0)
    b, _ = load_dataset("digits", None, train=True, T=4, seed=5)  # the split does not depend on seed
    test, _ = load_dataset("digits", None, train=False, T=4)
    assert torch.equal(a.data, b.data) and torch.equal(a.targets, b.targets)
    # no image of the test split appears in the training split
    train_keys = {tuple(v) for v in a.data.flatten(1).mul(16).round().to(torch.int64).tolist()}
    test_keys = [tuple(v) for v in test.data.flatten(1).mul(16).round().to(torch.int64).tolist()]
    assert sum(k in train_keys for k in test_keys) < 5  # sklearn's digits contain a few duplicate images
    for ds in (a, test):
        counts = np.bincount(ds.targets.numpy(), minlength=10)
        frac = counts / counts.sum()
        assert np.all(np.abs(frac - 0.1) < 0.012), counts


def test_digits_upsampled():
    ds, info = load_dataset("digits", None, train=False, T=8, size=16)
    assert (info.height, info.width) == (16, 16)
    assert ds[0][0].shape == (1, 16, 16)
    assert 0.0 <= float(ds.data.min()) and float(ds.data.max()) <= 1.0
    small, _ = load_dataset("digits", None, train=False, T=8)
    assert torch.equal(ds.targets, small.targets)
    # upsampling keeps the mean brightness roughly
    assert abs(ds.data.mean().item() - small.data.mean().item()) < 0.02


def test_unknown_name_and_bad_args():
    assert "digits" in DATASETS
    with pytest.raises(ValueError, match="unknown data set"):
        load_dataset("imagenet", None, train=True, T=4)
    with pytest.raises(ValueError, match="framing"):
        load_dataset("digits-events", None, train=True, T=4, framing="space")


def test_bundled_file_matches_sklearn_loader():
    sk = pytest.importorskip("sklearn.datasets")
    from spikefuse.data.digits import load_digits_arrays

    images, labels = load_digits_arrays()
    bunch = sk.load_digits()
    assert np.array_equal(images, bunch.images.astype(np.float32) / 16.0)
    assert np.array_equal(labels, bunch.target)
