"""MNIST from its published idx files (parsed here with numpy; torchvision not needed).

Files (each may also be gzipped, ``<name>.gz``), in ``root/`` or in ``root/MNIST/raw/`` (torchvision's layout)::

    train-images-idx3-ubyte   train-labels-idx1-ubyte   (60000 training images / labels)
    t10k-images-idx3-ubyte    t10k-labels-idx1-ubyte    (10000 test images / labels)

The idx format: two zero bytes, a type byte (0x08 = unsigned byte), the number of dimensions, then each
dimension as a big-endian uint32, then the data (big-endian), row-major. Images have magic 0x00000803 and
3 dimensions (N, 28, 28); labels 0x00000801 and 1 dimension (N).
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from ._common import DataError, DatasetInfo, TensorDataset, resolve_root

__all__ = [
    "IDX_IMAGES_MAGIC",
    "IDX_LABELS_MAGIC",
    "IDX_MAX_BYTES",
    "IDX_MAX_EXPANSION",
    "read_idx",
    "find_mnist_files",
    "load_mnist",
    "MNIST_LAYOUT",
]

IDX_IMAGES_MAGIC = 0x00000803
IDX_LABELS_MAGIC = 0x00000801
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

MNIST_LAYOUT = """  <root>/train-images-idx3-ubyte   (60000 training images; or train-images-idx3-ubyte.gz)
  <root>/train-labels-idx1-ubyte   (or .gz)
  <root>/t10k-images-idx3-ubyte    (10000 test images; or .gz)
  <root>/t10k-labels-idx1-ubyte    (or .gz)
  (or the same files in <root>/MNIST/raw/, torchvision's layout)"""


#: The most data bytes an idx file may declare (every published idx data set is far below it): a header declaring
#: more is refused before anything is allocated.
IDX_MAX_BYTES = 1 << 32
#: How many times its compressed size a gzipped idx file may declare (MNIST's files compress 2 to 5-fold): a small
#: file of a long run of zeros declaring more is refused before it is decompressed into memory.
IDX_MAX_EXPANSION = 64


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def read_idx(path: str | os.PathLike, *, expect_magic: int | None = None) -> np.ndarray:
    """Parse an idx file (optionally gzipped) into a numpy array of its declared type and shape.

    The header is read and checked first, then exactly the data it declares (at most :data:`IDX_MAX_BYTES`, and for
    a gzipped file at most :data:`IDX_MAX_EXPANSION` times its size), so a small file that decompresses to far more
    than its header says allocates no more than that. Raises DataError
    naming the file for a wrong magic number, unknown type, a declared size out of bounds, or a size that does not
    match the declared dimensions (truncated or padded file).
    """
    path = Path(path)
    what = "not a valid gzip file or truncated" if path.name.endswith(".gz") else "unreadable"
    try:
        with _open(path) as f:
            head = f.read(4)
            if len(head) < 4:
                raise DataError(
                    f"idx file {path}: only {len(head)} bytes, too short for the 4-byte idx header (truncated?)"
                )
            magic = int.from_bytes(head, "big")
            if head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES or head[3] == 0:
                raise DataError(
                    f"idx file {path}: bad magic number 0x{magic:08X} (expected 0x00000803 for images or 0x00000801 "
                    "for labels): not an idx file"
                )
            if expect_magic is not None and magic != expect_magic:
                raise DataError(f"idx file {path}: magic number 0x{magic:08X}, expected 0x{expect_magic:08X}")
            ndim = head[3]
            raw_dims = f.read(4 * ndim)
            if len(raw_dims) < 4 * ndim:
                raise DataError(
                    f"idx file {path}: truncated header ({4 + len(raw_dims)} bytes, {ndim} dimensions "
                    f"need {4 + 4 * ndim})"
                )
            dims = tuple(int.from_bytes(raw_dims[4 * i : 4 * i + 4], "big") for i in range(ndim))
            dtype = _IDX_DTYPES[head[2]]
            expected = dtype.itemsize
            for d in dims:  # Python integers: no overflow
                expected *= d
            if expected > IDX_MAX_BYTES:
                raise DataError(
                    f"idx file {path}: its header declares dimensions {dims}, {expected} data bytes, more "
                    f"than the {IDX_MAX_BYTES} an idx file may hold here: not an idx data set"
                )
            compressed = path.stat().st_size
            if path.name.endswith(".gz") and expected > IDX_MAX_EXPANSION * compressed + (1 << 20):
                raise DataError(
                    f"idx file {path}: its header declares dimensions {dims}, {expected} data bytes, more than "
                    f"{IDX_MAX_EXPANSION} times the compressed file's {compressed} bytes: not an idx data set"
                )
            data = f.read(expected + 1)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(f"MNIST file {path}: {what} ({exc})") from exc
    if len(data) != expected:
        state = "truncated" if len(data) < expected else "has trailing bytes"
        held = len(data) if len(data) < expected else "more than that"
        raise DataError(
            f"idx file {path}: {state}: header declares dimensions {dims} ({expected} data bytes) but "
            f"the file holds {held} data bytes"
        )
    arr = np.frombuffer(data, dtype=dtype).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=False)


def _find_one(dirs: list[Path], name: str) -> Path | None:
    for d in dirs:
        for candidate in (name, name + ".gz", name.replace("-idx", ".idx"), name.replace("-idx", ".idx") + ".gz"):
            p = d / candidate
            if p.is_file():
                return p
    return None


def find_mnist_files(root: str | os.PathLike | None, train: bool) -> tuple[Path, Path]:
    """The (images, labels) files of a split; DataError with the expected layout if missing."""
    base = resolve_root(root, "mnist", MNIST_LAYOUT)
    dirs = [base, base / "MNIST" / "raw", base / "raw"]
    img_name, lbl_name = _FILES[train]
    img = _find_one(dirs, img_name)
    lbl = _find_one(dirs, lbl_name)
    if img is None or lbl is None:
        missing = " and ".join(n for n, p in ((img_name, img), (lbl_name, lbl)) if p is None)
        searched = ", ".join(str(d) for d in dirs[:2])
        raise DataError(
            f"MNIST {'training' if train else 'test'} split: {missing} (or .gz) not found in {searched}; "
            f"the files must be laid out as:\n{MNIST_LAYOUT}"
        )
    return img, lbl


def load_mnist(root, *, train: bool, size: int | None = None) -> tuple[TensorDataset, DatasetInfo]:
    """Samples ``[1, 28, 28]`` float32 in [0, 1] (resized bilinearly if ``size`` is given)."""
    img_path, lbl_path = find_mnist_files(root, train)
    images = read_idx(img_path, expect_magic=IDX_IMAGES_MAGIC)
    labels = read_idx(lbl_path, expect_magic=IDX_LABELS_MAGIC)
    if images.ndim != 3:
        raise DataError(f"MNIST images file {img_path}: expected 3 dimensions (N, H, W), got shape {images.shape}")
    if labels.ndim != 1:
        raise DataError(f"MNIST labels file {lbl_path}: expected 1 dimension (N), got shape {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"MNIST: {img_path} holds {images.shape[0]} images but {lbl_path} holds {labels.shape[0]} labels"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"MNIST labels file {lbl_path}: labels must be 0..9, found {labels.min()}..{labels.max()}")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    h, w = images.shape[1:]
    if size is not None and (int(size), int(size)) != (h, w):
        from .digits import resize_images

        x = resize_images(x, int(size))
        h = w = int(size)
    info = DatasetInfo("mnist", in_channels=1, num_classes=10, height=h, width=w, kind="static")
    return TensorDataset(
        x.contiguous(), torch.from_numpy(labels.astype(np.int64)), classes=tuple(map(str, range(10)))
    ), info
