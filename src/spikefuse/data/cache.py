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

:meth:`CachedDataset.batch` builds a batch in one pass, the kept counts stacked as they are and converted to float32
once, into a buffer reused once its batch is dropped (:func:`spikefuse.ops.buffers.empty`): a fresh float32 tensor
per sample, their stack and the loop's time-major copy each page-fault anew on the CPU (N-MNIST, batches of 128 at
T=10: 12 MB each). :func:`batch_loader` is the DataLoader that reads batches so, in a shuffled DataLoader's order.

A cache fills in the process that reads it: in DataLoader workers each worker fills its own copy, which a
non-persistent worker drops at the end of every epoch; use it with ``num_workers=0`` (``spikefuse train`` does) or
``persistent_workers=True``.
"""

from __future__ import annotations

import operator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    default_collate,
)

from ..ops import buffers

__all__ = ["CACHES", "DEFAULT_CACHE_BYTES", "CachedBatches", "CachedDataset", "batch_loader"]

#: ``load_dataset``'s ``cache`` values: None (frame every sample at every read) or "memory"
CACHES: tuple[str | None, ...] = (None, "memory")

#: The most bytes a cache keeps by default: 2 GiB, each split its own. The full N-MNIST's 60,000 training samples at
#: T=10 take 1.4 GB as uint8 counts; DVS Gesture's 1,077 at T=20 and 128x128, 0.7 GB.
DEFAULT_CACHE_BYTES = 2 * 2**30


class _Kept:
    """A kept tensor: ``tensor`` as stored, given back as ``dtype`` (a class of its own, so that a field that is a
    tuple is never taken for one)."""

    __slots__ = ("tensor", "dtype")

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype):
        self.tensor, self.dtype = tensor, dtype


def _compact(value):
    """``value`` as kept: a float32 tensor of integers 0..255 as uint8 (given back as float32), another tensor as a
    copy of its own; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype == torch.float32 and value.numel():
        small = value.to(torch.uint8)
        if torch.equal(small.to(torch.float32).view(torch.int32), value.view(torch.int32)):  # bits: -0.0, NaN
            return _Kept(small, torch.float32)
    value = value.detach().clone()
    return _Kept(value, value.dtype)


def _expand(kept):
    if not isinstance(kept, _Kept):
        return kept
    tensor = kept.tensor
    return tensor.to(kept.dtype) if tensor.dtype != kept.dtype else tensor.clone()  # the caller's own either way


def _nbytes(kept) -> int:
    return kept.tensor.numel() * kept.tensor.element_size() if isinstance(kept, _Kept) else 0


def _given(kept):
    """A kept sample (``(single, values)``) as the data set gave it."""
    single, values = kept
    out = tuple(_expand(v) for v in values)
    return out[0] if single else out


def _fields(kept, item):
    """``(single, values)`` of a sample as :meth:`CachedDataset._read` gives it; None for a tuple of a type of its own
    (a namedtuple, which ``default_collate`` collates into its type)."""
    if kept is not None:
        return kept
    if not isinstance(item, tuple):
        return True, (item,)
    return (False, item) if type(item) is tuple else None


def _stackable(column) -> tuple[torch.Size, torch.dtype] | None:
    """``(shape, dtype)`` of the samples' values of a field when :meth:`CachedDataset.batch` stacks them into a
    buffer: plain CPU tensors (kept, or as read), all of one shape and of one dtype as given back; else None (the
    field is collated by ``default_collate``)."""
    shapes, dtypes = set(), set()
    for value in column:
        tensor = value.tensor if isinstance(value, _Kept) else value
        if not isinstance(tensor, torch.Tensor) or tensor.is_nested or tensor.layout != torch.strided:
            return None
        if tensor.device.type != "cpu" or tensor.requires_grad:
            return None
        shapes.add(tensor.shape)
        dtypes.add(value.dtype)  # a kept tensor's: the dtype it is given back as
    return (shapes.pop(), dtypes.pop()) if len(shapes) == len(dtypes) == 1 else None


def _stack(column, shape: torch.Size, dtype: torch.dtype, stack_dim: int) -> torch.Tensor:
    """The tensors of ``column`` stacked along ``stack_dim`` into a reused buffer of ``dtype``, in one conversion
    where they are all kept in one dtype (the counts' uint8); the batch dimension moved to the front."""
    tensors = [v.tensor if isinstance(v, _Kept) else v for v in column]
    dim = min(stack_dim, len(shape))
    size = (*shape[:dim], len(tensors), *shape[dim:])
    out = buffers.empty(size, dtype)
    stored = {t.dtype for t in tensors}
    if stored == {dtype}:
        torch.stack(tensors, dim, out=out)
    elif len(stored) == 1:
        out.copy_(torch.stack(tensors, dim, out=buffers.empty(size, stored.pop())))
    else:  # some samples as read (past max_bytes) beside kept ones
        for k, tensor in enumerate(tensors):
            out.select(dim, k).copy_(tensor)
    return out.movedim(dim, 0)


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

    def _read(self, index) -> tuple[tuple | None, object]:
        """``((single, kept values), None)`` for a sample kept (read and kept now if it was not yet), or ``(None,
        sample)`` for one read from the data set and not kept (past ``max_bytes``)."""
        n = len(self.dataset)
        i = operator.index(index)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a data set of {n} samples")
        i %= n
        kept = self._kept.get(i)
        if kept is None:
            item = self.dataset[i]
            if self._full:
                return None, item
            single = not isinstance(item, tuple)
            kept = tuple(_compact(v) for v in ((item,) if single else item))
            size = sum(_nbytes(v) for v in kept)
            if self.cached_bytes + size > self.max_bytes:
                self._full = True  # the samples not kept yet are framed at every read from here on
                return None, item
            self._kept[i] = kept = (single, kept)
            self.cached_bytes += size
        return kept, None

    def __getitem__(self, index):
        kept, item = self._read(index)
        return item if kept is None else _given(kept)

    def batch(self, indices, stack_dim: int = 0):
        """``default_collate([self[i] for i in indices])``, value for value and bit for bit, built in one pass.

        Each tensor field of the samples (plain CPU tensors of one shape and dtype) is stacked along ``stack_dim``
        (at most the field's number of dimensions) into a buffer of :func:`spikefuse.ops.buffers.empty`, reused once
        nothing else holds it, the kept uint8 counts converted to float32 once for the batch; it is given back with
        the batch dimension moved to the front. With ``stack_dim=1`` a ``[B, T, ...]`` batch is thus a view of a
        contiguous time-major ``[T, B, ...]`` tensor: ``x.transpose(0, 1).contiguous()`` copies nothing. The other
        fields (labels, ...) are collated by ``default_collate``, as are samples of any other form than a tensor or
        a tuple of fields. Samples not kept are read as ``self[i]`` reads them (filling the cache as it does).
        """
        if isinstance(stack_dim, bool) or not isinstance(stack_dim, int) or stack_dim < 0:
            raise ValueError(f"stack_dim must be a dimension >= 0, got {stack_dim!r}")
        reads = [self._read(i) for i in indices]
        samples = [_fields(kept, item) for kept, item in reads]
        if not samples or None in samples or len({(single, len(values)) for single, values in samples}) != 1:
            return default_collate([item if kept is None else _given(kept) for kept, item in reads])
        single = samples[0][0]
        fields = []
        for column in zip(*(values for _, values in samples)):
            form = _stackable(column)
            if form is None:  # a list of the samples, a tuple of a field's values, as default_collate collates them
                values = [_expand(v) for v in column]
                fields.append(default_collate(values if single else tuple(values)))
            else:
                fields.append(_stack(column, *form, stack_dim))
        return fields[0] if single else fields

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


class CachedBatches(Dataset):
    """The batches of a :class:`CachedDataset`, or of a ``Subset`` of one, for a DataLoader that reads a batch at a
    time (``batch_size=None``, a ``BatchSampler`` as its sampler): ``batches[[i, j, ...]]`` is
    ``dataset.batch(...)`` of those samples of ``dataset``, stacked along ``stack_dim``. Its length is the samples'
    (what a training loop reads of ``len(loader.dataset)``)."""

    def __init__(self, dataset: Dataset, stack_dim: int = 0):
        self.dataset, self.stack_dim = dataset, stack_dim
        self._indices = None  # positions in the subset -> the cache's indices
        while isinstance(dataset, Subset):
            indices = list(dataset.indices)
            self._indices = indices if self._indices is None else [indices[i] for i in self._indices]
            dataset = dataset.dataset
        if not isinstance(dataset, CachedDataset):
            raise TypeError(
                "CachedBatches reads the batches of a CachedDataset or of a Subset of one, got "
                f"{type(dataset).__name__}"
            )
        self.cache = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices):
        if self._indices is not None:
            indices = [self._indices[i] for i in indices]
        return self.cache.batch(indices, self.stack_dim)


def batch_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
    stack_dim: int = 0,
) -> DataLoader:
    """A DataLoader of ``dataset``'s batches built by :meth:`CachedDataset.batch` (``dataset``: a cache or a ``Subset``
    of one): the batches, the order and the draws from ``generator`` (or from torch's global generator without one)
    of ``DataLoader(dataset, batch_size, shuffle=shuffle, generator=generator)``, in the main process.

    Such a DataLoader's iterator draws its base seed from the generator, then its ``RandomSampler`` a permutation at
    the first batch; this one's does the same with the same sampler, handed its batches of indices whole."""
    order = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
    sampler = BatchSampler(order, batch_size, drop_last=False)
    return DataLoader(
        CachedBatches(dataset, stack_dim), batch_size=None, sampler=sampler, generator=generator, num_workers=0
    )
