"""One place to fix the CPU thread count of torch and of the fused CPU kernels' numba."""

from __future__ import annotations

import contextlib
import os

import torch

_numba_pid: int | None = None  # the process that started numba's threads (a forked child inherits the value)


def _start_numba_threads() -> None:
    """Start numba's threading layer once, keeping torch's thread count.

    numba's OpenMP layer shares libgomp with torch, and starting it (the first ``numba.get_num_threads()`` or
    parallel launch) sets the OpenMP thread count back to every core: a user's ``torch.set_num_threads(1)`` made
    before the first fused call was silently undone, and torch and numba then both ran on every core.
    """
    global _numba_pid
    if _numba_pid == os.getpid():
        return
    if _numba_pid is not None:
        _check_fork_safe()
    import numba

    threads = torch.get_num_threads()
    numba.get_num_threads()
    torch.set_num_threads(threads)
    _numba_pid = os.getpid()


def _check_fork_safe() -> None:
    """In a process forked after numba's threads started: refuse where numba's layer is GNU OpenMP, whose thread
    pool does not survive fork() (numba would terminate the process at the first parallel launch, a DataLoader
    worker dying without a word)."""
    import numba

    try:
        from numba.np.ufunc import omppool

        gnu_omp = numba.threading_layer() == "omp" and omppool.openmp_vendor == "GNU"
    except (ImportError, ValueError):  # no OpenMP layer, or none started
        gnu_omp = False
    if gnu_omp:
        raise RuntimeError(
            "spikefuse's fused CPU kernels cannot run in this process: it was forked from one that had already run "
            "them, and numba's GNU OpenMP threads do not survive fork(). Start worker processes with 'spawn' or "
            "'forkserver' (a torch DataLoader: multiprocessing_context='forkserver'), or set "
            "NUMBA_THREADING_LAYER=workqueue before the first fused call (fork-safe; not for calls from several "
            "threads at once)."
        )


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


@contextlib.contextmanager
def threads_while(threads: int | None):
    """Use ``threads`` CPU threads (:func:`set_threads`) inside the block and the count from before it after; no
    change when ``threads`` is None or 0 (a caller's own count, e.g. a test's, is left as it is)."""
    previous = torch.get_num_threads()
    if threads:
        set_threads(threads)
    try:
        yield
    finally:
        if threads:
            set_threads(previous)
