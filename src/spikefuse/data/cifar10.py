"""CIFAR-10 from its published python pickle batches.

Layout (the extracted ``cifar-10-python.tar.gz``)::

    <root>/cifar-10-batches-py/data_batch_1 ... data_batch_5   (10000 training images each)
    <root>/cifar-10-batches-py/test_batch                      (10000 test images)

(``<root>`` may also be the ``cifar-10-batches-py`` folder itself.) Each batch is a pickled dict with
``b"data"``: uint8 array ``[N, 3072]`` (row-major 3x32x32, channels R, G, B) and ``b"labels"``: N ints 0..9.
The pickles are read with an unpickler that only admits numpy arrays and plain Python values.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from ._common import DataError, DatasetInfo, TensorDataset, resolve_root

__all__ = ["CIFAR10_CLASSES", "CIFAR10_LAYOUT", "read_cifar_batch", "load_cifar10"]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
CIFAR10_LAYOUT = f"""  <root>/{FOLDER}/data_batch_1 ... data_batch_5   (training batches)
  <root>/{FOLDER}/test_batch                      (test batch)
  (the extracted cifar-10-python.tar.gz; <root> may also be the {FOLDER} folder itself)"""

_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
    ("builtins", "bytearray"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name} (a CIFAR batch holds only arrays and lists)"
            )
        if module.startswith("numpy.core."):
            module = "numpy._core." + module[len("numpy.core.") :]
        return super().find_class(module, name)


def _get(d: dict, key: str):
    for k in (key.encode(), key):
        if k in d:
            return d[k]
    return None


def read_cifar_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> (uint8 images ``[N, 3, 32, 32]``, int64 labels ``[N]``); DataError if malformed."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"CIFAR-10 batch {path}: cannot read ({exc})") from exc
    try:
        d = _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # any unpickling failure: truncated, garbage, foreign objects
        raise DataError(
            f"CIFAR-10 batch {path}: not a readable CIFAR-10 python pickle (corrupt or truncated?): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(d, dict):
        raise DataError(f"CIFAR-10 batch {path}: expected a pickled dict, got {type(d).__name__}")
    data, labels = _get(d, "data"), _get(d, "labels")
    if data is None or labels is None:
        keys = sorted(k.decode() if isinstance(k, bytes) else str(k) for k in d)
        raise DataError(f"CIFAR-10 batch {path}: missing key b'data' or b'labels' (keys: {keys})")
    data = np.asarray(data)
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"CIFAR-10 batch {path}: labels are not integers ({exc})") from exc
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(
            f"CIFAR-10 batch {path}: b'data' must be a uint8 array [N, 3072], got {data.dtype} {list(data.shape)}"
        )
    if labels.ndim != 1 or labels.shape[0] != data.shape[0]:
        raise DataError(
            f"CIFAR-10 batch {path}: {data.shape[0]} images but {labels.shape[0] if labels.ndim else 0} labels"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"CIFAR-10 batch {path}: labels must be 0..9, found {labels.min()}..{labels.max()}")
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(root, *, train: bool, size: int | None = None) -> tuple[TensorDataset, DatasetInfo]:
    """Samples ``[3, 32, 32]`` float32 in [0, 1] (resized bilinearly if ``size`` is given)."""
    base = resolve_root(root, "cifar10", CIFAR10_LAYOUT)
    folder = base / FOLDER if (base / FOLDER).is_dir() else base
    names = TRAIN_FILES if train else TEST_FILES
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise DataError(
            f"CIFAR-10 {'training' if train else 'test'} split: {', '.join(missing)} not found in {folder}; "
            f"the files must be laid out as:\n{CIFAR10_LAYOUT}"
        )
    parts = [read_cifar_batch(folder / n) for n in names]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    h = w = 32
    if size is not None and int(size) != 32:
        from .digits import resize_images

        x = resize_images(x, int(size))
        h = w = int(size)
    info = DatasetInfo("cifar10", in_channels=3, num_classes=10, height=h, width=w, kind="static")
    return TensorDataset(x.contiguous(), torch.from_numpy(labels), classes=CIFAR10_CLASSES), info
