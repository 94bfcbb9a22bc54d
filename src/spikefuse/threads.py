"""One place to fix the CPU thread count of torch and of the fused CPU kernels' numba."""

from __future__ import annotations

import contextlib
import os

import torch

_numba_started = False
_forked_after_start = False  # this process was forked from one whose numba threads had started


def _mark_fork() -> None:
    global _forked_after_start, _numba_started
    _forked_after_start, _numba_started = _numba_started, False


os.register_at_fork(after_in_child=_mark_fork)


def _start_numba_threads() -> None:
    """Start numba's threading layer once, keeping torch's thread count.

    numba's OpenMP layer shares libgomp with torch, and starting it (the first ``numba.get_num_threads()`` or
    parallel launch) sets the OpenMP thread count back to every core: a user's ``torch.set_num_threads(1)`` made
    before the first fused call was silently undone, and torch and numba then both ran on every core.
    """
    global _numba_started
    if _numba_started:
        return
    if _forked_after_start:
        _check_fork_safe()
    import numba

    threads = torch.get_num_threads()
    numba.get_num_threads()
    torch.set_num_threads(threads)
    _numba_started = True


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
