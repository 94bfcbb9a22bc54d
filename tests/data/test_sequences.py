"""The long-sequence data sets: sequential MNIST (row by row, pixel by pixel, permuted) on small idx files the tests
write, and the SHD/SSC reader on small HDF5 files written in the layout of Cramer et al. 2020 (variable-length
float16 spike times in seconds, uint16 units, labels), malformed and hostile files refused by message."""

import h5py
import numpy as np
import pytest
import torch

from spikefuse.data import DataError, load_dataset
from spikefuse.data.sequences import CHANNELS, DURATION, PERMUTATION_SEED, permutation

from .test_mnist import write_mnist


def test_smnist_rows_pixels_and_permutation(tmp_path):
    write_mnist(tmp_path, n_train=6, n_test=3)
    images, _ = load_dataset("mnist", tmp_path, train=True, T=1)
    rows, info = load_dataset("smnist", tmp_path, train=True, T=28)
    pixels, pinfo = load_dataset("smnist", tmp_path, train=True, T=784)
    permuted, qinfo = load_dataset("psmnist", tmp_path, train=True, T=784)
    image, label = images[2]
    assert (info.kind, info.in_channels, pinfo.in_channels, qinfo.name) == ("sequence", 28, 1, "psmnist")
    assert torch.equal(rows[2][0], image[0]) and rows[2][1] == label
    assert torch.equal(pixels[2][0][:, 0], image.reshape(-1))
    order = permutation()
    assert torch.equal(permuted[2][0][:, 0], image.reshape(-1)[order])
    assert sorted(order.tolist()) == list(range(784)) and not torch.equal(order, torch.arange(784))
    assert torch.equal(order, torch.randperm(784, generator=torch.Generator().manual_seed(PERMUTATION_SEED)))
    test, _ = load_dataset("psmnist", tmp_path, train=False, T=784)  # the same permutation for the test split
    test_images, _ = load_dataset("mnist", tmp_path, train=False, T=1)
    assert torch.equal(test[1][0][:, 0], test_images[1][0].reshape(-1)[order])
    with pytest.raises(DataError, match="smnist runs T=28 or T=784"):
        load_dataset("smnist", tmp_path, train=True, T=100)
    with pytest.raises(DataError, match="psmnist runs T=784"):
        load_dataset("psmnist", tmp_path, train=True, T=28)
    with pytest.raises(ValueError, match="no image size to set"):
        load_dataset("smnist", tmp_path, train=True, T=28, size=14)


def write_shd(path, samples, labels, units_dtype=np.uint16):
    """An SHD/SSC file: ``samples`` a list of (times in seconds, units) per sample."""
    with h5py.File(path, "w") as f:
        times = f.create_dataset("spikes/times", (len(samples),), dtype=h5py.vlen_dtype(np.float16))
        units = f.create_dataset("spikes/units", (len(samples),), dtype=h5py.vlen_dtype(units_dtype))
        for i, (t, u) in enumerate(samples):
            times[i] = np.asarray(t, dtype=np.float16)
            units[i] = np.asarray(u, dtype=units_dtype)
        f.create_dataset("labels", data=np.asarray(labels, dtype=np.uint16))
        f.create_dataset("extra/speaker", data=np.zeros(len(samples), dtype=np.uint16))


def _samples(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(0, 300))
        out.append((np.sort(rng.uniform(0, 1.3, k)), rng.integers(0, CHANNELS, k)))
    return out


@pytest.mark.parametrize("name", ["shd", "ssc"])
def test_shd_reader_bins_every_spike(tmp_path, name):
    train, test = _samples(7), _samples(3, seed=1)
    write_shd(tmp_path / f"{name}_train.h5", train, np.arange(7) % 5)
    write_shd(tmp_path / f"{name}_test.h5", test + [([1.39, 1.5, 0.0], [699, 3, 0])], [1, 2, 3, 4])
    ds, info = load_dataset(name, tmp_path, train=True, T=50)
    assert (info.kind, info.in_channels, info.num_classes, len(ds)) == ("sequence", 700, 20 if name == "shd" else 35, 7)
    for i, (times, units) in enumerate(train):
        frames, label = ds[i]
        assert frames.shape == (50, CHANNELS) and frames.dtype == torch.float32 and label == i % 5
        want = np.zeros((50, CHANNELS), np.float32)
        t = np.asarray(times, np.float16).astype(np.float64)
        np.add.at(want, (np.minimum((t * 50 / DURATION).astype(int), 49), units), 1)
        assert torch.equal(frames, torch.from_numpy(want))
    last, _ = load_dataset(name, tmp_path, train=False, T=14)[0][3]
    assert last[13, 699] == 1 and last[13, 3] == 1 and last[0, 0] == 1  # after the duration: the last frame


def test_shd_reader_refuses_bad_files(tmp_path):
    def fails(match, T=10):
        with pytest.raises(DataError, match=match):
            load_dataset("shd", tmp_path, train=True, T=T)

    fails("shd_train.h5: no such file")
    (tmp_path / "shd_train.h5").write_bytes(b"not hdf5 at all")
    fails("not a readable HDF5 file")
    write_shd(tmp_path / "shd_train.h5", [([0.1], [701])], [0])
    fails("units outside 0..699")
    write_shd(tmp_path / "shd_train.h5", [([0.1, 0.2], [1])], [0])
    fails("2 spike times but 1 units")
    write_shd(tmp_path / "shd_train.h5", [([-0.1], [1])], [0])
    fails("negative or not finite")
    write_shd(tmp_path / "shd_train.h5", [([0.1], [1])], [20])
    fails(r"labels must lie in 0..19")
    with h5py.File(tmp_path / "shd_train.h5", "w") as f:
        f.create_dataset("labels", data=np.zeros(1, np.uint16))
    fails("no dataset 'spikes/times'")


def test_shd_reader_refuses_external_storage(tmp_path):
    """A dataset whose bytes live in another file (HDF5 external storage) would read that file: refused."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.uint16).tobytes())
    write_shd(tmp_path / "shd_train.h5", [([0.1], [1])] * 4, [0, 0, 0, 0])
    with h5py.File(tmp_path / "shd_train.h5", "a") as f:
        del f["labels"]
        f.create_dataset("labels", shape=(4,), dtype=np.uint16, external=[(str(secret), 0, 8)])
    with pytest.raises(DataError, match="external or virtual storage is refused"):
        load_dataset("shd", tmp_path, train=True, T=10)
