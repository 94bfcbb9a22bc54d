"""A memory cache of a data set's samples, filled as they are read (``load_dataset(..., cache="memory")``).

The event and sequence data sets frame a recording each time a sample is read (N-MNIST: reading the file and tonic's
``ToFrame``, 0.35 ms a sample, as much as a small model's training step); their samples are the same at every read
(nothing random happens in ``__getitem__``: Poisson coding and every other per-epoch draw run on the batch, in the
training loop), so an epoch after the first can take them from memory. Like tonic's ``MemoryCachedDataset``, the
cache fills as samples are first read: the first epoch reads every file once, the later ones none.

Event counts are kept in the narrowest type that holds them exactly (``uint8`` where every count of a sample is an
integer 0..255, as in N-MNIST's frames: a quarter of float32) and given back as float32, bit for bit the samples the
data set gives; a cache holds at most ``max_bytes`` (:data:`DEFAULT_CACHE_BYTES`), samples past it are framed at every
read, as without a cache.

A cache fills in the process that reads it: in DataLoader workers each worker fills its own copy, which a
non-persistent worker drops at the end of every epoch; use it with ``num_workers=0`` (``spikefuse train`` does) or
``persistent_workers=True``.
"""

from __future__ import annotations

import operator

import torch
from torch.utils.data import Dataset

__all__ = ["CACHES", "DEFAULT_CACHE_BYTES", "CachedDataset"]

#: ``load_dataset``'s ``cache`` values: None (frame every sample at every read) or "memory"
CACHES: tuple[str | None, ...] = (None, "memory")

#: The most bytes a cache keeps by default: 2 GiB, each split its own. The full N-MNIST's 60,000 training samples at
#: T=10 take 1.4 GB as uint8 counts; DVS Gesture's 1,077 at T=20 and 128x128, 0.7 GB.
DEFAULT_CACHE_BYTES = 2 * 2**30


def _compact(value):
    """``value`` as kept: a float32 tensor of integers 0..255 as uint8 (``(tensor, float32)``), another tensor as a
    copy of its own; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype == torch.float32 and value.numel():
        small = value.to(torch.uint8)
        if torch.equal(small.to(torch.float32).view(torch.int32), value.view(torch.int32)):  # bits: -0.0, NaN
            return small, torch.float32
    return value.detach().clone(), None


def _expand(kept):
    if not isinstance(kept, tuple):
        return kept
    tensor, dtype = kept
    return tensor.to(dtype) if dtype is not None else tensor.clone()  # a tensor of the caller's own either way


def _nbytes(kept) -> int:
    return kept[0].numel() * kept[0].element_size() if isinstance(kept, tuple) else 0


class CachedDataset(Dataset):
    """``dataset``'s samples kept in memory as they are first read, up to ``max_bytes`` of tensors.

    ``cached[i]`` gives what ``dataset[i]`` gives, bit for bit (a fresh tensor at each read: a caller may change it in
    place); attributes the cache lacks (``targets``, ``files``, ``events``, ...) are the data set's. ``cached_samples``
    and ``cached_bytes`` say how full it is.
    """

    def __init__(self, dataset: Dataset, max_bytes: int = DEFAULT_CACHE_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(
                f"max_bytes must be a number of bytes >= 0 (0 keeps nothing), got {max_bytes!r}; the default "
                f"DEFAULT_CACHE_BYTES is {DEFAULT_CACHE_BYTES}"
            )
        self.dataset = dataset
        self.max_bytes = max_bytes
        self._kept: dict[int, tuple] = {}
        self._full = False
        self.cached_bytes = 0

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def cached_samples(self) -> int:
        return len(self._kept)

    def __getitem__(self, index):
        n = len(self.dataset)
        i = operator.index(index)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a data set of {n} samples")
        i %= n
        kept = self._kept.get(i)
        if kept is None:
            item = self.dataset[i]
            if self._full:
                return item
            single = not isinstance(item, tuple)
            kept = tuple(_compact(v) for v in ((item,) if single else item))
            size = sum(_nbytes(v) for v in kept)
            if self.cached_bytes + size > self.max_bytes:
                self._full = True  # the samples not kept yet are framed at every read from here on
                return item
            self._kept[i] = kept = (single, kept)
            self.cached_bytes += size
        single, values = kept
        out = tuple(_expand(v) for v in values)
        return out[0] if single else out

    def __getattr__(self, name):
        dataset = self.__dict__.get("dataset")  # absent while unpickling: no recursion
        if dataset is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(dataset, name)

    def __repr__(self) -> str:
        return (
            f"CachedDataset({self.dataset!r}, {self.cached_samples} of {len(self)} samples in "
            f"{self.cached_bytes / 2**20:.1f} MiB, max {self.max_bytes / 2**20:.0f} MiB)"
        )
