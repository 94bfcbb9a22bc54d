"""N-MNIST and DVS Gesture readers on small files written in the published formats (tonic's layouts)."""

import numpy as np
import pytest
import torch

from spikefuse.data import DataError, DatasetInfo, load_dataset

tonic = pytest.importorskip("tonic")


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    """Any download attempt fails the test."""
    import tonic.dataset
    import tonic.download_utils

    def boom(*a, **k):
        raise AssertionError("tried to download")

    monkeypatch.setattr(tonic.download_utils, "download_url", boom)
    monkeypatch.setattr(tonic.download_utils, "download_and_extract_archive", boom)
    monkeypatch.setattr(tonic.dataset, "download_and_extract_archive", boom)


def nmnist_bytes(x, y, t, p) -> bytes:
    """N-MNIST's 40-bit events: x (8 bits), y (8), polarity (1) + time stamp in us (23)."""
    x, y, t, p = (np.asarray(v, dtype=np.int64) for v in (x, y, t, p))
    raw = np.stack([x, y, (p << 7) | ((t >> 16) & 0x7F), (t >> 8) & 0xFF, t & 0xFF], axis=1)
    return raw.astype(np.uint8).tobytes()


def write_nmnist(root, per_class=2, classes=(0, 3, 7), n_events=40, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for split in ("Train", "Test"):
        for c in classes:
            folder = root / "NMNIST" / split / str(c)
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(per_class):
                ev = dict(
                    x=rng.integers(0, 34, n_events),
                    y=rng.integers(0, 34, n_events),
                    t=np.sort(rng.integers(0, 300_000, n_events)),
                    p=rng.integers(0, 2, n_events),
                )
                path = folder / f"{k + 1:05d}.bin"
                path.write_bytes(nmnist_bytes(**ev))
                out[str(path)] = (ev, c)
    return out


def test_nmnist_round_trip(tmp_path):
    ref = write_nmnist(tmp_path)
    ds, info = load_dataset("nmnist", tmp_path, train=True, T=4)
    assert info == DatasetInfo("nmnist", in_channels=2, num_classes=10, height=34, width=34, kind="event")
    assert len(ds) == 6
    assert sorted(ds.targets.tolist()) == [0, 0, 3, 3, 7, 7]
    for i in range(len(ds)):
        frames, label = ds[i]
        ev, c = ref[ds.files[i]]
        assert frames.shape == (4, 2, 34, 34) and frames.dtype == torch.float32
        assert label == c and isinstance(label, int)
        # 40 events, 4 frames of 10 (the paper's equal-event-count framing); each event lands at (p, y, x)
        assert frames.sum(dim=(1, 2, 3)).tolist() == [10.0] * 4
        expect = torch.zeros(2, 34, 34)
        for b in range(4):
            sl = slice(10 * b, 10 * b + 10)
            expect.zero_()
            expect.index_put_(
                (torch.as_tensor(ev["p"][sl]), torch.as_tensor(ev["y"][sl]), torch.as_tensor(ev["x"][sl])),
                torch.ones(10),
                accumulate=True,
            )
            assert torch.equal(frames[b], expect)
    # time bins: same events, T equal-duration frames
    tds, _ = load_dataset("nmnist", tmp_path / "NMNIST", train=False, T=3, framing="time")  # folder itself as root
    frames, _ = tds[0]
    assert frames.shape == (3, 2, 34, 34) and 0 < frames.sum() <= 40


def test_nmnist_missing_gives_layout(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("nmnist", tmp_path, train=True, T=4)
    msg = str(e.value)
    assert "NMNIST/Train/<digit 0-9>/<id>.bin" in msg and "never downloads" in msg and str(tmp_path) in msg


def test_nmnist_truncated_and_corrupt(tmp_path):
    ref = write_nmnist(tmp_path, classes=(1,), per_class=2)
    ds, _ = load_dataset("nmnist", tmp_path, train=True, T=4)
    bad = ds.files[0]
    with open(bad, "r+b") as f:
        f.truncate(5 * 7 + 3)
    with pytest.raises(DataError) as e:
        ds[0]
    assert bad in str(e.value) and "not a multiple of 5" in str(e.value)
    with open(bad, "wb") as f:  # a y coordinate of 200 on a 34x34 sensor
        f.write(nmnist_bytes([1, 2], [3, 200], [10, 20], [0, 1]))
    with pytest.raises(DataError, match="outside the 34x34 sensor"):
        ds[0]
    assert ds[1][0].shape == (4, 2, 34, 34)  # the good file still reads
    assert len(ref) == 4


def test_nmnist_bad_layout(tmp_path):
    folder = tmp_path / "NMNIST" / "Train"
    folder.mkdir(parents=True)
    (folder / "00001.bin").write_bytes(nmnist_bytes([1], [1], [1], [1]))  # no digit folder
    with pytest.raises(DataError, match="not laid out as expected"):
        load_dataset("nmnist", tmp_path, train=True, T=4)


def write_dvsgesture(
    root, split="ibmGestureTrain", users=("user01_fluorescent", "user02_led"), labels=(0, 5, 10), n_events=60, seed=0
):
    rng = np.random.default_rng(seed)
    out = {}
    for u in users:
        folder = root / "DVSGesture" / split / u
        folder.mkdir(parents=True, exist_ok=True)
        for lab in labels:
            arr = np.stack(
                [
                    rng.integers(0, 128, n_events),
                    rng.integers(0, 128, n_events),
                    rng.integers(0, 2, n_events),
                    np.sort(rng.integers(0, 6000, n_events)),
                ],
                axis=1,
            )
            np.save(folder / f"{lab}.npy", arr.astype(np.int64))
            out[str(folder / f"{lab}.npy")] = (arr, lab)
    return out


def test_dvsgesture_round_trip_and_downsample(tmp_path):
    ref = write_dvsgesture(tmp_path)
    ds, info = load_dataset("dvsgesture", tmp_path, train=True, T=6)
    assert info == DatasetInfo("dvsgesture", in_channels=2, num_classes=11, height=128, width=128, kind="event")
    assert len(ds) == 6 and sorted(ds.targets.tolist()) == [0, 0, 5, 5, 10, 10]
    frames, label = ds[0]
    arr, lab = ref[ds.files[0]]
    assert label == lab and frames.shape == (6, 2, 128, 128)
    assert frames.sum().item() == 60  # 60 events in 6 frames of 10
    ev, _ = ds.events(0)
    assert ev["t"].tolist() == (arr[:, 3] * 1000).tolist()  # ms -> us
    assert ev["x"].tolist() == arr[:, 0].tolist()
    small, sinfo = load_dataset("dvsgesture", tmp_path, train=True, T=6, size=32)
    assert (sinfo.height, sinfo.width) == (32, 32)
    sf, _ = small[0]
    assert sf.shape == (6, 2, 32, 32) and sf.sum().item() == 60
    # each event lands in the 4x4 block of its pixel
    assert torch.equal(sf, frames.reshape(6, 2, 32, 4, 32, 4).sum(dim=(3, 5)))
    tf, _ = load_dataset("dvsgesture", tmp_path, train=True, T=6, framing="time")[0][0]
    assert tf.shape == (6, 2, 128, 128) and 0 < tf.sum() <= 60


def test_dvsgesture_missing_and_corrupt(tmp_path):
    write_dvsgesture(tmp_path)
    with pytest.raises(DataError) as e:  # only the training split is there
        load_dataset("dvsgesture", tmp_path, train=False, T=4)
    assert "ibmGestureTest" in str(e.value) and "user<NN>_<lighting>/<label 0-10>.npy" in str(e.value)
    ds, _ = load_dataset("dvsgesture", tmp_path, train=True, T=4)
    bad = ds.files[2]
    data = open(bad, "rb").read()
    open(bad, "wb").write(data[: len(data) - 100])
    with pytest.raises(DataError) as e:
        ds[2]
    assert bad in str(e.value) and "corrupt or truncated" in str(e.value)
    np.save(bad, np.zeros((5, 3)))
    with pytest.raises(DataError, match=r"expected an \[N, 4\] array"):
        ds[2]


def test_pickles_for_dataloader_workers(tmp_path):
    import pickle

    write_nmnist(tmp_path, classes=(2,), per_class=2)
    write_dvsgesture(tmp_path, users=("user01_fluorescent",), labels=(4,))
    for name in ("nmnist", "dvsgesture"):
        ds, _ = load_dataset(name, tmp_path, train=True, T=3, size=None)
        clone = pickle.loads(pickle.dumps(ds))
        assert len(clone) == len(ds) and torch.equal(clone[0][0], ds[0][0]) and clone[0][1] == ds[0][1]


def test_nmnist_file_of_overflow_events_is_refused(tmp_path):
    """Time-stamp overflow events (y = 240) each shift every later time stamp in tonic's reader, one pass over the
    file per event: a file of nothing else takes time quadratic in its size (a 5 MB file, minutes). No recording
    of N-MNIST's 0.3 s has one; more than a few are refused."""
    write_nmnist(tmp_path, classes=(1,), per_class=1)
    ds, _ = load_dataset("nmnist", tmp_path, train=True, T=4)
    n = 20_000
    with open(ds.files[0], "wb") as f:
        f.write(nmnist_bytes(np.zeros(n), np.full(n, 240), np.zeros(n), np.zeros(n)))
    with pytest.raises(DataError, match=r"holds 20000 time-stamp overflow events \(y = 240\), more than the 64"):
        ds[0]
