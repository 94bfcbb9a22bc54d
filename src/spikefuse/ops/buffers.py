"""A cache of the fused CPU kernels' big output buffers, reused once nothing but the cache holds them.

Writing a freshly allocated ``[T, N]`` output costs more on the CPU than the kernel that fills it: glibc maps
every large allocation anew and returns it to the OS on free, so each call page-faults (and the OS zeroes) every
page again -- at T=32, N=1M the forward of one LIF layer took 63 ms into fresh outputs and 30 ms into reused ones
(``spikefuse bench neuron``). The CUDA caching allocator keeps freed blocks for the same reason; torch's CPU
allocator does not, so the fused CPU kernels keep their own small cache.

A cached buffer is a tensor of the cache's own over the buffer's memory. A request for the same number of bytes
reuses it when nothing else can reach that memory (:func:`_idle`): no other tensor, view, autograd saved tensor or
numpy array (the storage's use count), no Python reference to the storage object, no shared memory (a buffer sent
to another process is never reused), so a buffer still in use is never handed out again.
The cache holds at most :func:`cpu_cache_limit` bytes (default a quarter of the machine's memory, or the
``SPIKEFUSE_CPU_CACHE_MB`` environment variable); idle buffers are dropped, oldest first, to make room, and an
allocation that does not fit is made as a plain, uncached tensor. :func:`empty_cpu_cache` drops every idle
buffer; ``set_cpu_cache_limit(0)`` turns the cache off.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading

import torch

__all__ = [
    "empty",
    "full",
    "cpu_cache_bytes",
    "cpu_cache_limit",
    "set_cpu_cache_limit",
    "empty_cpu_cache",
    "SettingError",
]

# Smaller buffers come from glibc's heap, whose pages stay mapped between calls: nothing to gain.
_MIN_BYTES = 1 << 20

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _default_limit() -> int:
    env = os.environ.get("SPIKEFUSE_CPU_CACHE_MB", "").strip()
    if env:
        try:
            return max(0, int(env)) << 20
        except ValueError:
            raise SettingError(
                f"the environment variable SPIKEFUSE_CPU_CACHE_MB must be a whole number of MiB (0: "
                f"no cache), got {env!r}"
            ) from None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 1 << 30


class SettingError(ValueError):
    """A spikefuse setting from the environment that cannot be used; the message says which and what it takes."""


_lock = threading.Lock()
_cache: list[torch.Tensor] = []  # oldest first
_limit: int | None = (
    None  # read at the first use (cpu_cache_limit): a bad environment value fails a call, not the import
)


def fresh(shape, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` whose untouched pages are advised as transparent huge pages.

    With THP in ``madvise`` mode, ``madvise(MADV_HUGEPAGE)`` on the still untouched buffer makes the first writes
    fault in 2 MiB pages instead of 4 KiB ones, 512x fewer faults; it is only advice, so where the kernel refuses
    nothing changes.
    """
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if _libc is not None and nbytes >= 4 * _HUGE_PAGE:
        start = (out.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        end = (out.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
        if end > start:
            _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return out


def _holders(buffer: torch.Tensor) -> tuple[int, int]:
    """``(use count, Python references)`` of ``buffer``'s storage, as :func:`_idle` reads them."""
    storage = buffer.untyped_storage()
    return _use_count(storage._cdata), sys.getrefcount(storage)


_UNHELD: tuple[int, int] | None = None


def _unheld() -> tuple[int, int]:
    """What :func:`_holders` reads of a buffer only the cache holds, measured once (the references torch itself
    keeps to a storage object differ between its versions)."""
    global _UNHELD
    if _UNHELD is None:
        made = torch.empty(1)
        cached = made.detach()
        made.untyped_storage().data_ptr()  # a storage object made and dropped, as a caller's use of its outputs does
        del made
        _UNHELD = _holders(cached)
    return _UNHELD


def _idle(buffer: torch.Tensor) -> bool:
    """Whether nothing but the cache can reach ``buffer``'s memory: no other tensor, view or numpy array of it (the
    storage's use count), no Python reference to its storage object (``t.untyped_storage()`` kept by a user: one
    object per storage, which the use count does not see, so its reference count), and not in shared memory (sent to
    another process: a DataLoader worker's output, a ``torch.multiprocessing`` queue)."""
    return not buffer.untyped_storage().is_shared() and _holders(buffer) == _unheld()


def _shrink_to(target: int, forget_busy: bool) -> int:
    """Drop cached buffers until at most ``target`` bytes are cached: idle ones first, oldest first, then (with
    ``forget_busy``) ones still in use, which their holders keep alive until they are done. The caller holds the
    lock. Returns the bytes still cached."""
    cached = sum(_nbytes(b) for b in _cache)
    order = sorted(_cache, key=lambda b: not _idle(b)) if forget_busy else [b for b in _cache if _idle(b)]
    for buffer in order:
        if cached <= target:
            break
        # by identity: list.remove would compare the tensors before it with ==, which is elementwise
        del _cache[next(i for i, b in enumerate(_cache) if b is buffer)]
        cached -= _nbytes(buffer)
    return cached


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.untyped_storage().nbytes()


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor, in a cached buffer nobody else holds when there is one of the same size."""
    nbytes = math.prod(shape) * dtype.itemsize
    limit = cpu_cache_limit()
    if nbytes < _MIN_BYTES or limit == 0:
        return fresh(shape, dtype)
    with _lock:
        for buffer in _cache:
            if _nbytes(buffer) == nbytes and _idle(buffer):
                return torch.empty(0, dtype=dtype).set_(buffer.untyped_storage(), 0, tuple(shape))
        _cache[:] = [b for b in _cache if not b.untyped_storage().is_shared()]  # in another process: never again
        cached = _shrink_to(limit - nbytes, forget_busy=False)
        out = fresh(shape, dtype)
        if cached + nbytes <= limit:
            _cache.append(out.detach())  # a tensor of its own: what users hold of the memory is then visible
        return out


def full(shape, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full`` from the cache on the CPU (eager mode; elsewhere and under ``torch.compile`` plain
    ``torch.full``): for the ``[N]`` initial states and zero state gradients the autograd layer creates per call."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return torch.full(tuple(shape), value, dtype=dtype, device=device)
    return empty(shape, dtype).fill_(value)


def cpu_cache_bytes() -> tuple[int, int]:
    """``(cached, idle)``: bytes of every cached buffer, and of those nothing outside the cache holds."""
    with _lock:
        return sum(_nbytes(b) for b in _cache), sum(_nbytes(b) for b in _cache if _idle(b))


def cpu_cache_limit() -> int:
    """The most bytes the cache holds (0: off); read from ``SPIKEFUSE_CPU_CACHE_MB`` at the first use."""
    global _limit
    if _limit is None:
        _limit = _default_limit() if _use_count is not None else 0
    return _limit


def set_cpu_cache_limit(nbytes: int) -> None:
    """Hold at most ``nbytes`` in cached buffers (0 turns the cache off); idle buffers above it are dropped."""
    global _limit
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"the CPU cache limit is a number of bytes >= 0, got {nbytes!r}")
    if nbytes and _use_count is None:
        raise RuntimeError(
            "this torch has no torch._C._storage_Use_Count, so the CPU buffer cache cannot tell when a buffer is "
            "free; it stays off"
        )
    with _lock:
        _limit = nbytes
        _shrink_to(_limit, forget_busy=True)


def empty_cpu_cache() -> None:
    """Drop every idle cached buffer (its memory goes back to the OS); buffers still in use stay cached."""
    with _lock:
        _shrink_to(0, forget_busy=False)
