import gzip
import struct

import numpy as np
import pytest
import torch

from spikefuse.data import DataError, DatasetInfo, load_dataset
from spikefuse.data.mnist import read_idx


def idx_bytes(arr: np.ndarray, magic: int) -> bytes:
    return struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in arr.shape) + arr.astype(">u1").tobytes()


def write_mnist(folder, n_train=12, n_test=5, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        for kind, arr, magic in (("images-idx3", images, 0x803), ("labels-idx1", labels, 0x801)):
            name = f"{prefix}-{kind}-ubyte"
            data = idx_bytes(arr, magic)
            if gz:
                with gzip.open(folder / (name + ".gz"), "wb") as f:
                    f.write(data)
            else:
                (folder / name).write_bytes(data)
        out[prefix] = (images, labels)
    return out


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_round_trip(tmp_path, gz):
    ref = write_mnist(tmp_path, gz=gz)
    for train, prefix in ((True, "train"), (False, "t10k")):
        ds, info = load_dataset("mnist", tmp_path, train=train, T=8)
        assert info == DatasetInfo("mnist", in_channels=1, num_classes=10, height=28, width=28, kind="static")
        images, labels = ref[prefix]
        assert len(ds) == len(labels)
        x, y = ds[3]
        assert x.shape == (1, 28, 28) and x.dtype == torch.float32
        assert y == int(labels[3]) and isinstance(y, int)
        assert torch.equal((ds.data[:, 0] * 255).round().to(torch.uint8), torch.from_numpy(images))
        assert ds.targets.tolist() == labels.tolist()


def test_mnist_torchvision_layout_and_resize(tmp_path):
    ref = write_mnist(tmp_path / "MNIST" / "raw", gz=True)
    ds, info = load_dataset("mnist", str(tmp_path), train=False, T=4, size=14)
    assert (info.height, info.width) == (14, 14) and ds[0][0].shape == (1, 14, 14)
    assert ds.targets.tolist() == ref["t10k"][1].tolist()


def test_read_idx_big_endian_types(tmp_path):
    arr = (np.arange(6).reshape(2, 3) * 100000 - 250000).astype(">i4")
    p = tmp_path / "ints-idx2"
    p.write_bytes(bytes([0, 0, 0x0C, 2]) + struct.pack(">II", 2, 3) + arr.tobytes())
    out = read_idx(p)
    assert out.dtype == np.int32 and out.tolist() == arr.tolist()


def test_missing_mnist_names_layout(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("mnist", tmp_path, train=True, T=4)
    msg = str(e.value)
    assert "train-images-idx3-ubyte" in msg and "train-labels-idx1-ubyte" in msg
    assert "t10k-images-idx3-ubyte" in msg and "MNIST/raw" in msg and str(tmp_path) in msg
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("mnist", tmp_path / "nope", train=True, T=4)


def test_missing_labels_only(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte \(or .gz\) not found"):
        load_dataset("mnist", tmp_path, train=False, T=4)


def test_truncated_idx(tmp_path):
    write_mnist(tmp_path)
    p = tmp_path / "train-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(DataError) as e:
        load_dataset("mnist", tmp_path, train=True, T=4)
    assert "train-images-idx3-ubyte" in str(e.value) and "truncated" in str(e.value)
    p.write_bytes(b"\x00\x00")
    with pytest.raises(DataError, match="too short"):
        load_dataset("mnist", tmp_path, train=True, T=4)


def test_wrong_magic_and_swapped_files(tmp_path):
    write_mnist(tmp_path)
    img = tmp_path / "train-images-idx3-ubyte"
    lbl = tmp_path / "train-labels-idx1-ubyte"
    data = img.read_bytes()
    img.write_bytes(b"\x12\x34" + data[2:])
    with pytest.raises(DataError, match="bad magic number 0x1234"):
        load_dataset("mnist", tmp_path, train=True, T=4)
    img.write_bytes(lbl.read_bytes())  # a labels file where images belong
    with pytest.raises(DataError, match="magic number 0x00000801, expected 0x00000803"):
        load_dataset("mnist", tmp_path, train=True, T=4)


def test_count_mismatch_and_bad_labels(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(3, np.uint8), 0x801))
    with pytest.raises(DataError, match="12 images but .* 3 labels"):
        load_dataset("mnist", tmp_path, train=True, T=4)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.full(12, 11, np.uint8), 0x801))
    with pytest.raises(DataError, match="labels must be 0..9"):
        load_dataset("mnist", tmp_path, train=True, T=4)


def test_corrupt_gzip(tmp_path):
    write_mnist(tmp_path, gz=True)
    p = tmp_path / "t10k-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:30])
    with pytest.raises(DataError) as e:
        load_dataset("mnist", tmp_path, train=False, T=4)
    assert "t10k-images-idx3-ubyte.gz" in str(e.value) and "gzip" in str(e.value)
    p.write_bytes(b"definitely not gzip")
    with pytest.raises(DataError, match="gzip"):
        load_dataset("mnist", tmp_path, train=False, T=4)


def test_root_none_without_env(monkeypatch):
    monkeypatch.delenv("SPIKEFUSE_DATA", raising=False)
    with pytest.raises(DataError, match="needs a root folder"):
        load_dataset("mnist", None, train=True, T=4)


def test_gzip_bomb_is_read_no_further_than_its_header_says(tmp_path):
    """A small gzip file whose stream holds far more than its header declares: refused after reading the header's
    size and one byte more, not after decompressing everything (a 64 KB file here decompresses to 64 MB)."""
    import tracemalloc

    header = (0x00000801).to_bytes(4, "big") + (10).to_bytes(4, "big")
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(header + bytes(10))
        for _ in range(64):
            f.write(bytes(1 << 20))
    assert path.stat().st_size < 1 << 17
    tracemalloc.start()
    with pytest.raises(DataError, match=r"has trailing bytes: header declares dimensions \(10,\)"):
        read_idx(path, expect_magic=0x00000801)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 22, f"allocated {peak} bytes"


def test_declared_size_out_of_bounds(tmp_path):
    """Dimensions whose product passes any sensible size (and int64): refused from the header alone."""
    path = tmp_path / "huge-idx"
    path.write_bytes((0x00000803).to_bytes(4, "big") + b"\xff\xff\xff\xff" * 3)
    with pytest.raises(
        DataError,
        match=r"declares dimensions \(4294967295, 4294967295, 4294967295\), \d+ data bytes, "
        r"more than the",
    ):
        read_idx(path)


def test_gzip_declaring_far_more_than_it_compresses_is_refused_before_reading(tmp_path):
    """A 2.3 MB gzip file whose header declares 512 MB of images and whose stream holds them (zeros): refused from
    the header, since no idx data set compresses 64-fold; reading it took 512 MB, as float32 four times that."""
    from ..hostile_files import peak_rss_growth

    n = (512 << 20) // 784
    path = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write((0x00000803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (n, 28, 28)))
        zeros = bytes(784 * (n // 32))
        for _ in range(32):
            f.write(zeros)
        f.write(bytes(784 * (n % 32)))
    assert path.stat().st_size < 4 << 20
    growth, outcome = peak_rss_growth("from spikefuse.data.mnist import read_idx", f"read_idx({str(path)!r})")
    assert outcome.startswith("DataError") and "64 times the compressed file's" in outcome, outcome
    assert growth < 64 << 20, f"peak memory grew by {growth >> 20} MiB"
