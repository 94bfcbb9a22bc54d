"""One place to fix the CPU thread count of torch and of the fused CPU backend's numba."""

from __future__ import annotations

import torch


def set_threads(threads: int) -> None:
    """Use ``threads`` CPU threads in torch and (when the fused CPU backend's numba is installed) numba."""
    torch.set_num_threads(threads)
    try:
        import numba
    except ImportError:
        return
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    # Starting numba's OpenMP threading layer can reset the OpenMP thread count torch shares (seen in a rank
    # forked from a fork server): set torch's again.
    torch.set_num_threads(threads)
