import os
import subprocess
import sys

import pytest
import torch

from spikefuse.threads import threads_while


def test_threads_while_sets_the_count_inside_and_restores_it_after():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with threads_while(target):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before


def test_threads_while_restores_the_count_after_an_error():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with pytest.raises(RuntimeError, match="inside"):
        with threads_while(target):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [None, 0])
def test_threads_while_without_a_count_leaves_the_callers(threads):
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    torch.set_num_threads(target)
    try:
        with threads_while(threads):
            assert torch.get_num_threads() == target
        assert torch.get_num_threads() == target
    finally:
        torch.set_num_threads(before)


_FORKED_CALL = """
import multiprocessing, torch, spikefuse
spikefuse.lif(torch.rand(4, 64, 512), decay=0.5, threshold=0.3)  # numba's threads start here

def child(queue):
    try:
        spikefuse.lif(torch.rand(4, 64, 512), decay=0.5, threshold=0.3)
        queue.put("ran")
    except RuntimeError as err:
        queue.put(str(err))

context = multiprocessing.get_context("fork")
queue = context.Queue()
worker = context.Process(target=child, args=(queue,))
worker.start()
print(queue.get(timeout=60))
worker.join()
"""


def test_a_forked_process_is_refused_with_what_to_do_where_numba_threads_do_not_survive_fork():
    """numba's GNU OpenMP layer terminates a process forked after its threads started, at its first parallel
    launch (a DataLoader worker died without a word): spikefuse refuses first, saying how to start the workers."""
    omppool = pytest.importorskip("numba.np.ufunc.omppool", reason="numba has no OpenMP layer here")
    if omppool.openmp_vendor != "GNU":
        pytest.skip("numba's OpenMP layer here is not GNU's")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    run = subprocess.run([sys.executable, "-c", _FORKED_CALL], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "forked from one that had already run them" in run.stdout, run.stdout
    assert "multiprocessing_context='forkserver'" in run.stdout
    # the fork-safe layer it names runs in the forked child
    env["NUMBA_THREADING_LAYER"] = "workqueue"
    run = subprocess.run([sys.executable, "-c", _FORKED_CALL], capture_output=True, text=True, timeout=300, env=env)
    assert run.stdout.strip() == "ran", run.stdout + run.stderr
