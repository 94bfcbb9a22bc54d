"""The readers and a short training run on the real data files of ``../shared/data`` (MNIST's original idx files,
SLAYER's 1,100 real N-MNIST recordings). Seconds each: small subsets. Skipped, with the reason, where the folder is
absent (a clone outside this environment); ``SPIKEFUSE_SHARED_DATA`` points elsewhere."""

import hashlib
import os
from pathlib import Path

import pytest
import torch

from spikefuse.data import load_dataset
from spikefuse.train import TrainConfig, fit

SHARED = Path(os.environ.get("SPIKEFUSE_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
MNIST, NMNIST = SHARED / "mnist", SHARED / "nmnist-small"
needs_mnist = pytest.mark.skipif(not MNIST.is_dir(), reason=f"no real MNIST files at {MNIST}")
needs_nmnist = pytest.mark.skipif(not NMNIST.is_dir(), reason=f"no real N-MNIST recordings at {NMNIST}")

# The published md5 sums of the four MNIST files (also in ../shared/data/README.md).
MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}


@needs_mnist
def test_real_mnist_files_read_as_published():
    for name, md5 in MNIST_MD5.items():
        assert hashlib.md5((MNIST / name).read_bytes()).hexdigest() == md5, name
    train, info = load_dataset("mnist", MNIST, train=True, T=1)
    test, _ = load_dataset("mnist", MNIST, train=False, T=1)
    assert (len(train), len(test)) == (60000, 10000)
    assert (info.in_channels, info.height, info.width, info.num_classes, info.kind) == (1, 28, 28, 10, "static")
    image, label = train[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert 0.0 <= float(image.min()) and float(image.max()) == 1.0
    assert label == 5  # the first training image of MNIST is a 5
    labels = torch.tensor([test[i][1] for i in range(len(test))])
    assert torch.bincount(labels, minlength=10).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@needs_nmnist
def test_real_nmnist_recordings_frame_into_T_steps():
    train, info = load_dataset("nmnist", NMNIST, train=True, T=5)
    test, _ = load_dataset("nmnist", NMNIST, train=False, T=5)
    assert (len(train), len(test)) == (1000, 100)
    assert (info.in_channels, info.height, info.width, info.kind) == (2, 34, 34, "event")
    frames, label = test[0]
    assert frames.shape == (5, 2, 34, 34) and 0 <= label <= 9
    per_frame = frames.sum(dim=(1, 2, 3))
    # Framing by equal event counts: every frame holds (nearly) the same number of the recording's events
    assert float(per_frame.min()) > 0 and float(per_frame.max() - per_frame.min()) <= 1


@pytest.mark.parametrize(
    "dataset, root",
    [pytest.param("mnist", MNIST, marks=needs_mnist), pytest.param("nmnist", NMNIST, marks=needs_nmnist)],
)
def test_training_on_real_data_runs_and_the_loss_falls(tmp_path, dataset, root):
    """Two short epochs on a seeded subset: the run finishes, writes its files, and the training loss falls
    (test accuracy after 16 steps is not yet a stable signal: BatchNorm's running statistics lag)."""
    cfg = TrainConfig(
        model="resnet-tiny",
        dataset=dataset,
        data_dir=str(root),
        T=2,
        epochs=2,
        batch_size=32,
        train_subset=256,
        test_subset=64,
        out=str(tmp_path),
        progress=False,
        threads=2,
        lr=3e-3,
    )
    history = fit(cfg, log=lambda msg: None)
    assert [r["epoch"] for r in history] == [1, 2]
    assert history[1]["train_loss"] < history[0]["train_loss"] < 2.5
    assert all(0.0 <= r["test_acc"] <= 1.0 for r in history)
    assert (tmp_path / "checkpoint.pt").is_file()
