"""The long-sequence data sets: sequential MNIST (row by row, pixel by pixel, permuted) on small idx files the tests
write, and the SHD/SSC reader on small HDF5 files written in the layout of Cramer et al. 2020 (variable-length
float16 spike times in seconds, uint16 units, labels), malformed and hostile files refused by message."""

import h5py
import numpy as np
import pytest
import torch

from spikefuse.data import DataError, load_dataset
from spikefuse.data.sequences import CHANNELS, DURATION, PERMUTATION_SEED, bernoulli_steps, permutation

from spikefuse.cli import main

from ..hostile_files import FOREIGN, HOSTILE, make_hostile, peak_rss_growth
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


def write_shd(path, samples, labels, units_dtype=np.uint16, times_dtype=np.float16):
    """An SHD/SSC file: ``samples`` a list of (times in seconds, units) per sample."""
    with h5py.File(path, "w") as f:
        times = f.create_dataset("spikes/times", (len(samples),), dtype=h5py.vlen_dtype(times_dtype))
        units = f.create_dataset("spikes/units", (len(samples),), dtype=h5py.vlen_dtype(units_dtype))
        for i, (t, u) in enumerate(samples):
            times[i] = np.asarray(t, dtype=times_dtype)
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
    fails(r"spikes/units must be whole numbers in 0..699, got 701 \(sample 0\)")
    write_shd(tmp_path / "shd_train.h5", [([0.1, 0.2], [1])], [0])
    fails("2 spike times but 1 units")
    write_shd(tmp_path / "shd_train.h5", [([-0.1], [1])], [0])
    fails(r"spike times must be finite and >= 0, got -0.09")
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
    with pytest.raises(DataError, match=r"'labels' is stored outside the file \(external storage\)"):
        load_dataset("shd", tmp_path, train=True, T=10)


@pytest.mark.parametrize("case", HOSTILE)
def test_shd_reader_refuses_hostile_files(tmp_path, case):
    """Each hostile case of tests/hostile_files.py in place of the labels: one DataError naming the file and the
    dataset, raised before anything outside the file is read (the foreign file would pass as labels)."""
    path = tmp_path / "shd_train.h5"
    write_shd(path, _samples(4), [0, 1, 2, 3])
    message = make_hostile(path, "labels", case, tmp_path)
    with pytest.raises(DataError, match=message) as err:
        load_dataset("shd", tmp_path, train=True, T=10)
    assert str(path) in str(err.value) and "'labels" in str(err.value) and "\n" not in str(err.value)
    assert str(FOREIGN) not in str(err.value)


def test_shd_reader_bounds_memory_of_declared_samples(tmp_path):
    """A 3 KB file declaring 4M samples in chunks never written: refused before a read allocates them (reading it
    took the process from 550 to 1,930 MiB)."""
    path = tmp_path / "shd_train.h5"
    n = 4_000_000
    with h5py.File(path, "w") as f:
        for key, dtype in (("spikes/times", np.float16), ("spikes/units", np.uint16)):
            f.create_dataset(key, (n,), dtype=h5py.vlen_dtype(dtype), chunks=(1 << 12,))
        f.create_dataset("labels", (n,), dtype=np.uint16, chunks=(1 << 12,))
    assert path.stat().st_size < 10_000
    growth, outcome = peak_rss_growth(
        "from spikefuse.data import load_dataset", f"load_dataset('shd', {str(tmp_path)!r}, train=True, T=10)"
    )
    assert outcome.startswith("DataError") and "its datasets declare more than" in outcome, outcome
    assert growth < 64 << 20, f"peak memory grew by {growth >> 20} MiB"


def _vlen(f, key, arrays, dtype):
    data = f.create_dataset(key, (len(arrays),), dtype=h5py.vlen_dtype(dtype))
    for i, a in enumerate(arrays):
        data[i] = np.asarray(a, dtype=dtype)


@pytest.mark.parametrize(
    "key, make, message",
    [
        (
            "labels",
            lambda f, k: f.create_dataset(k, data=[0.0, 1.5]),
            r"labels must be whole numbers, got 1.5 \(sample 1\)",
        ),
        ("labels", lambda f, k: f.create_dataset(k, data=[0.0, np.nan]), r"labels must be whole numbers, got nan"),
        (
            "labels",
            lambda f, k: f.create_dataset(k, data=np.zeros(2, [("a", "u2"), ("b", "u2")])),
            r"labels must hold integers, got a compound type",
        ),
        (
            "labels",
            lambda f, k: f.create_dataset(k, data=np.array([b"one", b"two"])),
            r"labels must hold integers, got \|S3",
        ),
        (
            "labels",
            lambda f, k: f.create_dataset(k, data=["one", "two"], dtype=h5py.string_dtype()),
            r"labels must hold integers, got variable-length strings",
        ),
        (
            "spikes/times",
            lambda f, k: f.create_dataset(k, data=[0.1, 0.2]),
            r"spikes/times must hold one variable-length array of numbers per sample, got float64",
        ),
        (
            "spikes/times",
            lambda f, k: f.create_dataset(k, data=["0.1", "0.2"], dtype=h5py.string_dtype()),
            r"spikes/times must hold one variable-length array of numbers per sample, got variable-length strings",
        ),
        (
            "spikes/times",
            lambda f, k: _vlen(f, k, [[1], [2]], np.int32),
            r"spikes/times must hold floating-point seconds, got int32",
        ),
        (
            "spikes/units",
            lambda f, k: _vlen(f, k, [[1.0], [np.nan]], np.float32),
            r"spikes/units must be whole numbers in 0..699, got nan \(sample 1\)",
        ),
        (
            "spikes/units",
            lambda f, k: _vlen(f, k, [[1.5], [2.0]], np.float32),
            r"spikes/units must be whole numbers in 0..699, got 1.5 \(sample 0\)",
        ),
    ],
)
def test_shd_reader_refuses_other_types(tmp_path, key, make, message):
    """Types no SHD/SSC file has: one DataError naming the file, never a traceback nor a silent truncation."""
    path = tmp_path / "shd_train.h5"
    write_shd(path, [([0.1], [1]), ([0.2], [2])], [0, 1])
    with h5py.File(path, "a") as f:
        del f[key]
        make(f, key)
    with pytest.raises(DataError, match=message) as err:
        load_dataset("shd", tmp_path, train=True, T=10)
    assert str(path) in str(err.value)


def test_shd_reader_takes_whole_floats_and_bins_huge_times_last(tmp_path):
    """Labels and units written as floats holding whole numbers read as those integers; a finite spike time far
    beyond the duration (1e19 s, past int64 once scaled) counts in the last frame, like every late spike."""
    path = tmp_path / "shd_train.h5"
    write_shd(path, [([1e19, 0.5, 3e38], [3, 4, 5])], [0], times_dtype=np.float32)
    with h5py.File(path, "a") as f:
        del f["labels"], f["spikes/units"]
        f.create_dataset("labels", data=[7.0])
        _vlen(f, "spikes/units", [[3.0, 4.0, 5.0]], np.float64)
    frames, label = load_dataset("shd", tmp_path, train=True, T=10)[0][0]
    assert label == 7 and frames.sum() == 3
    assert frames[9, 3] == 1 and frames[9, 5] == 1 and frames[int(0.5 / DURATION * 10), 4] == 1


def _compound_labels(path, tmp_path):
    with h5py.File(path, "a") as f:
        n = len(f["labels"])
        del f["labels"]
        f.create_dataset("labels", data=np.zeros(n, [("a", "u2"), ("b", "u2")]))


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda path, tmp: make_hostile(path, "labels", "external link", tmp), r"'labels' is an external link"),
        (_compound_labels, r"labels must hold integers, got a compound type"),
    ],
)
def test_cli_reports_a_bad_shd_file_in_one_line(tmp_path, capsys, spoil, message):
    import re

    write_shd(tmp_path / "shd_train.h5", _samples(8), np.arange(8) % 3)
    write_shd(tmp_path / "shd_test.h5", _samples(4, seed=1), np.arange(4) % 3)
    spoil(tmp_path / "shd_train.h5", tmp_path)
    argv = ["train", "--dataset", "shd", "--model", "srnn", "--data-dir", str(tmp_path), "--out", str(tmp_path / "run")]
    assert main([*argv, "--T", "4", "--epochs", "1", "--batch-size", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spikefuse: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(message, err) and "shd_train.h5" in err, err


def test_time_major_collate_batches_sequences_time_first():
    """``collate_fn=spikefuse.data.time_major``: ``[T, B, F]`` batches, the labels as the default collate gives them
    (the default's ``[B, T, F]`` fed to a model of ``[T, B, F]`` inputs swaps time and batch silently)."""
    from torch.utils.data import DataLoader

    from spikefuse.data import TensorDataset, time_major

    data = torch.rand(6, 5, 3)  # 6 samples of T=5 steps, 3 features
    ds = TensorDataset(data, torch.arange(6))
    x, labels = next(iter(DataLoader(ds, batch_size=4, collate_fn=time_major)))
    assert x.shape == (5, 4, 3) and x.is_contiguous() and torch.equal(x, data[:4].transpose(0, 1))
    assert torch.equal(labels, torch.arange(4))


def test_bernoulli_steps_draws_each_intensity_as_a_spike_at_every_step():
    """``bernoulli_steps``: ``[T, B, F]`` spikes in the input's float dtype (float32 from integers), a spike where a
    uniform draw of ``generator`` lies below the intensity (the draws ``encode``'s "poisson" makes), so 0 never and 1
    always spikes and the rate follows the intensity; refused for other ranks."""
    from spikefuse.data import encode

    steps = torch.rand(50, 40, 6, generator=torch.Generator().manual_seed(1))
    steps[:, :, 0], steps[:, :, 1] = 0.0, 1.0
    batch_first = steps.transpose(0, 1).contiguous()  # a loader's batch; its time-major view is not contiguous
    spikes = bernoulli_steps(batch_first.transpose(0, 1), torch.Generator().manual_seed(2))
    u = torch.rand(steps.shape, generator=torch.Generator().manual_seed(2))
    assert spikes.dtype == torch.float32 and torch.equal(spikes, (u < steps).float())
    assert not spikes[:, :, 0].any() and spikes[:, :, 1].all()
    assert abs(float(spikes.mean()) - float(steps.mean())) < 0.01
    image = steps[0].reshape(40, 6, 1, 1)  # encode's draws for an image of the same values, T steps
    again = encode(image, 50, generator=torch.Generator().manual_seed(2)).reshape(50, 40, 6)
    assert torch.equal(bernoulli_steps(steps[:1].expand(50, 40, 6), torch.Generator().manual_seed(2)), again)
    assert bernoulli_steps(torch.ones(3, 2, 4, dtype=torch.uint8)).dtype == torch.float32
    with pytest.raises(ValueError, match=r"bernoulli_steps takes sequences \[T, B, F\], got shape \(2, 4\)"):
        bernoulli_steps(torch.rand(2, 4))
