"""Data parallel: DDP over 2 gloo ranks gives the same update as one process on the joint batch; failures of a
rank surface as errors within a timeout instead of hangs.

The DDP ranks are ranks {0, 1} of the group that test_timesplit.py spawns once per session (``ddp_check`` runs
there on that pair's process group), to save a process start-up.

BatchNorm in the DDP check: the model's ``SeqToBatch(nn.BatchNorm2d)`` is swapped for the CPU/gloo-capable
synchronized BatchNorm (``convert_sync_batchnorm``, statistics over the global batch), so the DDP run and the
joint-batch run normalize with the same statistics in training mode; its running buffers are compared too.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing import ProcessRaisedException

import spikefuse.nn as snn
from spikefuse.distributed import ddp, launch, run_data_parallel, timesplit_lif

BACKEND = os.environ.get("SPIKEFUSE_TEST_DIST_BACKEND", "reference")  # see test_timesplit.py
STEPS = 3
LR = 0.05  # small enough that no layer saturates: every step has live gradients


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        snn.SeqToBatch(nn.Conv2d(2, 4, 3, padding=1)),
        snn.SeqToBatch(nn.BatchNorm2d(4)),
        snn.LIF(0.5, 0.5, learnable_decay=True, channels=4, backend=BACKEND),
        snn.Flatten(),
        snn.SeqToBatch(nn.Linear(4 * 5 * 5, 3)),
        snn.LIF(0.6, 0.4, v_reset=None, backend=BACKEND),
    ).double()


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(6, 4, 2, 5, 5, generator=g, dtype=torch.float64) * 2  # [T, B=4, C, H, W]
    labels = torch.tensor([0, 2, 1, 2])
    return x, labels


def _train(model, x, labels):
    """Plain SGD steps (written out: the first use of torch.optim imports torch._dynamo, seconds per process)."""
    losses = []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        rate = model(x).mean(0)
        loss = nn.functional.cross_entropy(rate * 4, labels)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.grad)
        losses.append(loss.item())
    return losses


def ddp_check(group):
    """One rank's DDP run over ``group`` (2 ranks), each on its half of the batch."""
    x, labels = _data()
    model = ddp.wrap_model(ddp.convert_sync_batchnorm(_model(), group), group)
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    losses = _train(model, ddp.shard(x, dim=1, group=group), ddp.shard(labels, group=group))
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return dict(losses=losses, state=state, rank=ddp.rank(group), world=ddp.world_size(group))


@pytest.fixture
def ddp_runs():
    from .test_timesplit import shared_reports

    return [shared_reports()[r]["ddp"] for r in (0, 1)]


def test_ddp_equals_one_process_on_joint_batch(ddp_runs):
    x, labels = _data()
    ref = _model()
    ref_losses = _train(ref, x, labels)
    ref_state = ref.state_dict()
    assert [(run["rank"], run["world"]) for run in ddp_runs] == [(0, 2), (1, 2)]
    # each rank's loss is the mean over its half batch; their mean is the joint-batch loss
    joint = [(a + b) / 2 for a, b in zip(ddp_runs[0]["losses"], ddp_runs[1]["losses"])]
    assert joint == pytest.approx(ref_losses, rel=1e-9)
    assert len(set(round(v, 6) for v in ref_losses)) == STEPS  # the model keeps learning: not a saturated case
    for run in ddp_runs:
        # the synchronized BN keeps nn.BatchNorm's names (minus SeqToBatch's ".module")
        got = run["state"]
        assert len(got) == len(ref_state)
        for key, want in ref_state.items():
            have = got[key] if key in got else got[key.replace(".module.", ".")]
            if want.dtype == torch.int64:
                assert torch.equal(have, want), key
            else:
                torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-9, msg=key)


def _raising_worker(rank, world):
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")
    x = torch.rand(4, 3, requires_grad=True)  # rank 0 waits for rank 1's state gradient: would hang without help
    timesplit_lif(x, decay=0.5, threshold=0.5, backend=BACKEND).sum().backward()
    dist.barrier()


def test_raising_rank_fails_the_launch_quickly():
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 1 failed on purpose"):
        launch(_raising_worker, 2, timeout=90, pg_timeout=timedelta(seconds=20), threads=1)
    assert time.monotonic() - start < 90


def _sleeping_worker(rank, world):
    time.sleep(600)


def test_launch_timeout_terminates_the_ranks():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running"):
        launch(_sleeping_worker, 1, timeout=1.0)
    assert time.monotonic() - start < 30


def _train_fn(args):
    return ("trained", args, ddp.world_size())


def test_run_data_parallel_spawns_ranks_and_returns_rank0():
    assert run_data_parallel(_train_fn, 2, {"lr": 1}, timeout=60, pg_timeout=timedelta(seconds=30)) == (
        "trained",
        {"lr": 1},
        2,
    )


def test_run_data_parallel_joins_a_torchrun_group(monkeypatch):
    """Under torchrun (RANK/WORLD_SIZE/MASTER_* set) it joins that group in this process instead of spawning."""
    from spikefuse.distributed.ddp import free_port

    for key, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    ).items():
        monkeypatch.setenv(key, value)
    assert run_data_parallel(_train_fn, 8, "a", backend="gloo", pg_timeout=30) == ("trained", "a", 1)
    assert not dist.is_initialized()


def test_run_data_parallel_single_process_runs_in_place():
    assert run_data_parallel(_train_fn, 1, {"lr": 1}) == ("trained", {"lr": 1}, 1)
    assert ddp.wrap_model(nn.Linear(2, 2)).__class__ is nn.Linear
    assert torch.equal(ddp.shard(torch.arange(5)), torch.arange(5))
