import pickle

import numpy as np
import pytest
import torch

from spikefuse.data import DataError, DatasetInfo, load_dataset
from spikefuse.data.cifar10 import CIFAR10_CLASSES


def write_cifar(root, n=4, protocol=2, seed=0):
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=n)]
        batch = {b"batch_label": f"batch {i}".encode(), b"labels": labels, b"data": data, b"filenames": [b"x.png"] * n}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=protocol)
        out[name] = (data, labels)
    return out


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar_round_trip(tmp_path, protocol):
    ref = write_cifar(tmp_path, protocol=protocol)
    train, info = load_dataset("cifar10", tmp_path, train=True, T=32)
    assert info == DatasetInfo("cifar10", in_channels=3, num_classes=10, height=32, width=32, kind="static")
    assert len(train) == 20 and train.classes == CIFAR10_CLASSES
    x, y = train[5]  # second image of data_batch_2
    data, labels = ref["data_batch_2"]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert y == labels[1]
    # channel-major layout: the first 1024 bytes are the red plane, row by row
    assert torch.equal((x * 255).round().to(torch.uint8), torch.from_numpy(data[1].reshape(3, 32, 32)))
    test, _ = load_dataset("cifar10", tmp_path / "cifar-10-batches-py", train=False, T=32)  # folder itself as root
    assert test.targets.tolist() == ref["test_batch"][1]
    assert 0.0 <= float(test.data.min()) and float(test.data.max()) <= 1.0


def test_cifar_missing(tmp_path):
    with pytest.raises(DataError) as e:
        load_dataset("cifar10", tmp_path, train=True, T=4)
    msg = str(e.value)
    assert "data_batch_1" in msg and "cifar-10-batches-py" in msg and "test_batch" in msg
    write_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(DataError, match="data_batch_4 not found"):
        load_dataset("cifar10", tmp_path, train=True, T=4)


def test_cifar_truncated_and_garbage(tmp_path):
    write_cifar(tmp_path)
    p = tmp_path / "cifar-10-batches-py" / "test_batch"
    p.write_bytes(p.read_bytes()[:200])
    with pytest.raises(DataError) as e:
        load_dataset("cifar10", tmp_path, train=False, T=4)
    assert "test_batch" in str(e.value) and "corrupt or truncated" in str(e.value)
    p.write_bytes(b"\x00garbage")
    with pytest.raises(DataError, match="test_batch"):
        load_dataset("cifar10", tmp_path, train=False, T=4)


def test_cifar_wrong_content(tmp_path):
    write_cifar(tmp_path)
    p = tmp_path / "cifar-10-batches-py" / "test_batch"
    with open(p, "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(DataError, match=r"uint8 array \[N, 3072\]"):
        load_dataset("cifar10", tmp_path, train=False, T=4)
    with open(p, "wb") as f:
        pickle.dump({b"images": np.zeros((2, 3072), np.uint8)}, f)
    with pytest.raises(DataError, match="missing key"):
        load_dataset("cifar10", tmp_path, train=False, T=4)
    with open(p, "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1, 2]}, f)
    with pytest.raises(DataError, match="2 images but 3 labels"):
        load_dataset("cifar10", tmp_path, train=False, T=4)


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_cifar_refuses_foreign_objects(tmp_path):
    write_cifar(tmp_path)
    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": [0]}, f)
    with pytest.raises(DataError, match="refusing to load builtins.print"):
        load_dataset("cifar10", tmp_path, train=False, T=4)
