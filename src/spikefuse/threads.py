"""One place to fix the CPU thread count of torch and of the fused CPU kernels' numba, and the thread pool that
runs the fused LIF kernels' blocks."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait

import torch

_numba_started = False


def _start_numba_threads() -> None:
    """Start numba's threading layer once, keeping torch's thread count.

    numba's OpenMP layer shares libgomp with torch, and starting it (the first ``numba.get_num_threads()`` or
    parallel launch) sets the OpenMP thread count back to every core: a user's ``torch.set_num_threads(1)`` made
    before the first fused call was silently undone, and torch and numba then both ran on every core.
    """
    global _numba_started
    if not _numba_started:
        import numba

        threads = torch.get_num_threads()
        numba.get_num_threads()
        torch.set_num_threads(threads)
        _numba_started = True


def kernel_threads(work: int, serial_below: int) -> int:
    """The threads a kernel over ``work`` elements gets: torch's count (users set it in one place), or one below
    ``serial_below``, where waking other threads costs more than it saves."""
    return 1 if work < serial_below else max(1, torch.get_num_threads())


def match_numba_threads(work: int | None = None, serial_below: int = 0) -> int:
    """Give numba as many threads as torch has (so users set the count in one place); one thread when ``work`` is
    below ``serial_below``, where waking the thread pool costs more than it saves. Returns the count set."""
    import numba

    _start_numba_threads()
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if work is not None and work < serial_below:
        threads = 1
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads


def set_threads(threads: int) -> None:
    """Use ``threads`` CPU threads in torch and (when the fused CPU backend's numba is installed) numba."""
    torch.set_num_threads(threads)
    try:
        match_numba_threads()
    except ImportError:  # the fused CPU backend's numba is optional
        return


_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_workers = 0


def _block_pool(workers: int) -> ThreadPoolExecutor:
    """A pool with at least ``workers`` threads, made again in a forked child (whose copy has no threads)."""
    global _pool, _pool_pid, _pool_workers
    if _pool is None or _pool_pid != os.getpid() or _pool_workers < workers:
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spikefuse-blocks")
        _pool_pid, _pool_workers = os.getpid(), workers
    return _pool


def run_blocks(kernel, nblocks: int, threads: int, *args) -> None:
    """``kernel(b0, b1, *args)`` over blocks ``[0, nblocks)`` in ``threads`` contiguous chunks, one on this thread.

    For numba functions compiled ``nogil=True``: the same static split as a ``prange`` over the blocks, without
    numba's parallel compilation, which cost more than a second of a kernel's first call (its compile time is
    what a user waits for before the first gradient).
    """
    parts = max(1, min(threads, nblocks))
    if parts == 1:
        kernel(0, nblocks, *args)
        return
    bounds = [nblocks * i // parts for i in range(parts + 1)]
    pool = _block_pool(parts - 1)
    futures = [pool.submit(kernel, bounds[i], bounds[i + 1], *args) for i in range(1, parts)]
    try:
        kernel(bounds[0], bounds[1], *args)
    finally:
        wait(futures)  # no chunk still writing into the caller's tensors when an error leaves here
    for f in futures:
        f.result()
