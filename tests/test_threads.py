"""The CPU thread count shared by torch and numba, and the block runner of the fused LIF kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from spikefuse.threads import run_blocks


@pytest.mark.parametrize("nblocks,threads", [(0, 2), (1, 2), (2, 2), (7, 2), (7, 3), (5, 8), (9, 1)])
def test_run_blocks_covers_every_block_once(nblocks, threads):
    seen = np.zeros(nblocks, dtype=np.int64)
    workers = set()

    def kernel(b0, b1, out):
        workers.add(threading.get_ident())
        out[b0:b1] += 1

    run_blocks(kernel, nblocks, threads, seen)
    assert (seen == 1).all()
    assert threading.get_ident() in workers  # the caller runs a chunk itself
    assert len(workers) == 1 if min(threads, nblocks) <= 1 else len(workers) >= 2


def test_run_blocks_waits_for_every_chunk_before_raising():
    finished = []

    def kernel(b0, b1):
        if b0 == 0:
            raise ValueError("chunk 0 failed")
        threading.Event().wait(0.05)
        finished.append(b0)

    with pytest.raises(ValueError, match="chunk 0 failed"):
        run_blocks(kernel, 4, 2)
    assert finished == [2]

    def failing_worker(b0, b1):
        if b0 > 0:
            raise RuntimeError("worker chunk failed")

    with pytest.raises(RuntimeError, match="worker chunk failed"):
        run_blocks(failing_worker, 4, 2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_run_blocks_in_a_forked_child():
    """A forked child inherits the pool object but none of its threads: it must make its own."""
    run_blocks(lambda b0, b1: None, 2, 2)  # the parent's pool exists
    code = (
        "import os, numpy as np\n"
        "from spikefuse.threads import run_blocks\n"
        "def fill(b0, b1, out): out[b0:b1] = 1\n"
        "run_blocks(fill, 2, 2, np.zeros(2))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    out = np.zeros(6)\n"
        "    run_blocks(fill, 6, 2, out)\n"
        "    os._exit(0 if out.sum() == 6 else 1)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["0"]


def test_first_numba_launch_keeps_torch_threads():
    """Starting numba's OpenMP layer reset the OpenMP thread count torch shares: a ``torch.set_num_threads(1)``
    made before the first numba-parallel call (here bit-packing spikes) was undone. Needs a fresh process, where
    numba has not started yet."""
    code = (
        "import torch, numba\n"
        "from spikefuse.ops import bitpack\n"
        "torch.set_num_threads(1)\n"
        "bitpack.pack(torch.ones(4, 100_000))\n"
        "print(torch.get_num_threads(), numba.get_num_threads())\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="2", NUMBA_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["1", "1"]
