"""The embedded default data set: scikit-learn's bundled 8x8 handwritten digits (no files needed).

1797 grey images with 17 levels (0..16), 10 classes, scaled here to [0, 1]. The train/test split is a fixed
stratified 80/20 split (its own fixed seed, independent of the ``seed`` argument, so that every run evaluates
on the same 360 test images).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from ._common import DataError, DatasetInfo, TensorDataset

__all__ = ["load_digits_arrays", "digits_split", "load_digits"]

NUM_CLASSES = 10
TEST_FRACTION = 0.2
SPLIT_SEED = 0


def _bundled_digits_file():
    """scikit-learn's bundled ``datasets/data/digits.csv.gz``, found without importing scikit-learn (slow)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def _read_digits_csv(path) -> tuple[np.ndarray, np.ndarray]:
    import gzip

    try:
        with gzip.open(path, "rt") as f:
            data = np.loadtxt(f, delimiter=",", dtype=np.float64)
    except (OSError, EOFError, ValueError) as exc:
        raise DataError(f"scikit-learn's bundled digits file {path} is unreadable: {exc}") from exc
    if data.ndim != 2 or data.shape[1] != 65:
        raise DataError(f"scikit-learn's bundled digits file {path}: expected 65 columns, got shape {data.shape}")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


@lru_cache(maxsize=1)
def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 digits as float32 ``[N, 8, 8]`` in [0, 1] and int64 labels ``[N]`` (read-only arrays).

    Reads scikit-learn's bundled file directly (what ``sklearn.datasets.load_digits`` reads), falling back to
    ``load_digits`` itself.
    """
    path = _bundled_digits_file()
    if path is not None:
        raw_images, raw_labels = _read_digits_csv(path)
    else:
        try:
            from sklearn.datasets import load_digits as _sk_load_digits
        except ImportError as exc:
            raise DataError(
                "data set 'digits' needs scikit-learn (its bundled digits file): pip install scikit-learn"
            ) from exc
        bunch = _sk_load_digits()
        raw_images, raw_labels = bunch.images, bunch.target
    images = np.asarray(raw_images, dtype=np.float32) / 16.0
    labels = np.asarray(raw_labels, dtype=np.int64)
    if images.shape != (1797, 8, 8) or labels.shape != (1797,) or labels.min() < 0 or labels.max() > 9:
        raise DataError(f"scikit-learn's digits have an unexpected shape {images.shape} / labels {labels.shape}")
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


@lru_cache(maxsize=2)
def digits_split(train: bool) -> np.ndarray:
    """Indices of the fixed stratified 80/20 split (sorted)."""
    _, labels = load_digits_arrays()
    rng = np.random.default_rng(SPLIT_SEED)
    test_idx = []
    for c in range(NUM_CLASSES):
        idx = np.flatnonzero(labels == c)
        idx = rng.permutation(idx)
        test_idx.append(idx[: int(round(TEST_FRACTION * len(idx)))])
    test_mask = np.zeros(len(labels), dtype=bool)
    test_mask[np.concatenate(test_idx)] = True
    out = np.flatnonzero(~test_mask if train else test_mask)
    out.setflags(write=False)
    return out


def resize_images(images: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear resize of ``[N, C, h, w]`` to ``size x size``, clamped to [0, 1]."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    out = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return out.clamp_(0.0, 1.0)


def load_digits(*, train: bool, size: int | None = None) -> tuple[TensorDataset, DatasetInfo]:
    """The static digits: samples ``[1, size, size]`` float32 in [0, 1] (size 8 by default)."""
    size = 8 if size is None else int(size)
    if size < 2:
        raise DataError(f"digits: size must be >= 2, got {size}")
    images, labels = load_digits_arrays()
    idx = digits_split(train)
    x = torch.from_numpy(images[idx].copy()).unsqueeze(1)
    x = resize_images(x, size).contiguous()
    y = torch.from_numpy(labels[idx].copy())
    info = DatasetInfo("digits", in_channels=1, num_classes=NUM_CLASSES, height=size, width=size, kind="static")
    return TensorDataset(x, y, classes=tuple(str(i) for i in range(NUM_CLASSES))), info
