"""Time split over 2 and 3 gloo ranks equals the single-process run: spikes bit for bit, gradients to 1e-5.

One spawned group of 3 ranks runs every check (process start-up dominates the cost): the world of 3 ranks and a
subgroup of ranks {0, 1} (which also runs the DDP check of test_ddp.py: ``shared_reports`` is cached per session). Each rank computes the single-process reference itself on the full sequence (same seed)
and compares its time-split result with it; the test collects the per-rank reports. The same group also runs the
ranks' part of a tiny ``spikefuse bench timesplit --quick`` (the bench test then drives ``run`` with those rows).
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import spikefuse
import spikefuse.nn as snn
from spikefuse.bench import timesplit as bench_timesplit
from spikefuse.distributed import (
    TimeSplitBatchNorm,
    TimeSplitLIF,
    TimeSplitNeuron,
    allreduce_gradients,
    convert_timesplit,
    gather_time,
    launch,
    split_time,
    time_partition,
    time_reduce,
    timesplit_lif,
    timesplit_neuron,
)
from spikefuse.neurons import ALIF_MODEL, CUBA_LIF, NeuronModel

# plain PyTorch by default: no numba compile in every spawned rank. SPIKEFUSE_TEST_DIST_BACKEND=cpu runs the fused kernel.
BACKEND = os.environ.get("SPIKEFUSE_TEST_DIST_BACKEND", "reference")
RTOL = 1e-5
BENCH_ARGV = [
    "timesplit",
    "--quick",
    "--neurons",
    "600",
    "--T",
    "3",
    "6",
    "--ranks",
    "2",
    "3",
    "--repeats",
    "1",
    "--backend",
    BACKEND,
]


def _bench_args(out) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_timesplit.add_parser(parser.add_subparsers())
    return parser.parse_args(BENCH_ARGV + ["--out", str(out)])


def _close(a, b, what, failures, rtol=RTOL):
    """Max error within ``rtol`` of the reference's largest entry (1e-9 absolute for an all-zero reference,
    e.g. the gradient of a conv bias followed by BatchNorm)."""
    a, b = a.detach().double(), b.detach().double()
    err = (a - b).abs().max().item() if a.numel() else 0.0
    scale = max(b.abs().max().item() if b.numel() else 0.0, 1e-4)
    if a.shape != b.shape or err > rtol * scale:
        failures.append(f"{what}: max abs err {err:.3g} (scale {scale:.3g}), shapes {tuple(a.shape)} {tuple(b.shape)}")


def _equal(a, b, what, failures):
    if a.shape != b.shape or not torch.equal(a, b):
        diff = (a != b).sum().item() if a.shape == b.shape else "shape"
        failures.append(f"{what}: not equal ({diff} entries differ)")


# ------------------------------------------------------------------------------------------- single LIF layer

LIF_CASES = [
    # name, x shape, lif kwargs, chunks, learnable decay shape, dtype
    ("hard-[T,B,N]", (9, 3, 5), dict(decay=0.5, threshold=0.6), 2, None, torch.float32),
    ("soft-chunks1", (7, 4, 6), dict(decay=0.8, threshold=0.5, v_reset=None), 1, None, torch.float32),
    ("more-chunks-than-dim1", (8, 2, 6), dict(decay=0.3, threshold=0.4), 4, None, torch.float32),
    ("per-channel-[T,B,C,H]", (6, 2, 3, 4), dict(threshold=0.5), 3, (3,), torch.float32),
    ("per-channel-split-[T,C]", (10, 6), dict(threshold=0.5, v_reset=None), 4, (6,), torch.float64),
    ("scalar-learnable", (5, 4, 3), dict(threshold=0.7, detach_reset=True), 2, (), torch.float32),
]


def _check_lif_layer(group, failures):
    for case, (name, shape, kw, chunks, leak_shape, dtype) in enumerate(LIF_CASES):
        g = torch.Generator().manual_seed(100 + case)  # the same data on every rank
        x = torch.rand(shape, generator=g, dtype=dtype) * 0.9
        grad_spk = torch.rand(shape, generator=g, dtype=dtype)
        grad_state = torch.rand(shape[1:], generator=g, dtype=dtype)
        v0 = (torch.rand(shape[1:], generator=g, dtype=dtype) * 0.5).requires_grad_()
        kw = dict(kw)
        leak = None
        if leak_shape is not None:
            leak = (torch.rand(leak_shape, generator=g, dtype=dtype) * 0.5 + 0.25).requires_grad_()
            kw["decay"] = leak
        # single process, whole sequence
        xr = x.clone().requires_grad_()
        spikes, state = spikefuse.lif(xr, v_init=v0, return_state=True, backend=BACKEND, **kw)
        ((spikes * grad_spk).sum() + (state * grad_state).sum()).backward()
        ref = dict(x=xr.grad, v0=v0.grad.clone(), leak=None if leak is None else leak.grad.clone())
        v0.grad = None
        if leak is not None:
            leak.grad = None
        # time split
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        xl = split_time(x, group).clone().requires_grad_()
        s_l, st_l = timesplit_lif(xl, v_init=v0, return_state=True, backend=BACKEND, group=group, chunks=chunks, **kw)
        loss = (s_l * split_time(grad_spk, group)).sum()
        if rank == size - 1:
            loss = loss + (st_l * grad_state).sum()
            _equal(st_l, state.detach(), f"{name}: final state", failures)
        loss.backward()
        _equal(gather_time(s_l, group), spikes.detach(), f"{name}: spikes", failures)
        _close(gather_time(xl.grad, group), ref["x"], f"{name}: grad x", failures)
        if rank == 0:
            _close(v0.grad, ref["v0"], f"{name}: grad v_init", failures)
        if leak is not None:
            allreduce_gradients([leak], group)
            _close(leak.grad, ref["leak"], f"{name}: grad decay", failures)


def _check_module_stateful(group, failures):
    """TimeSplitLIF(stateful=True) over two calls equals one LIF over the two sequences back to back."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.rand(6, 2, 4, generator=g), torch.rand(5, 2, 4, generator=g)
    whole = snn.LIF(0.5, 0.6, backend=BACKEND)(torch.cat([a, b]))
    m = TimeSplitLIF(0.5, 0.6, backend=BACKEND, stateful=True, group=group, chunks=2)
    with torch.no_grad():
        out = torch.cat([gather_time(m(split_time(a, group)), group), gather_time(m(split_time(b, group)), group)])
    _equal(out, whole, "stateful TimeSplitLIF", failures)


# --------------------------------------------------------------------------------------- any neuron model

#: A user's neuron: three states, the post-reset ones handed on (the next block's first step sees no spike).
THREE_STATES = NeuronModel(
    name="test_timesplit_three_states",
    states=("i", "v", "a"),
    params=("alpha", "decay", "rho", "threshold"),
    step=(
        ("v", "where(s, 0, v)"),
        ("a", "a + s"),
        ("i", "alpha*i + x"),
        ("v", "decay*v + i"),
        ("a", "rho*a"),
    ),
    fire="v - threshold - a",
    handoff=(("v", "where(s, 0, v)"), ("a", "a + s")),
    defaults=(("threshold", 0.5),),
)

NEURON_CASES = [
    # name, model, x shape, parameters (a tuple: a tensor of that shape requiring grad), other arguments, chunks,
    # start states given
    ("cubalif-per-channel", CUBA_LIF, (9, 3, 5), dict(alpha=(5,), beta=0.8, threshold=0.6), {}, 2, True),
    ("cubalif-channels-chunked", CUBA_LIF, (8, 2, 6), dict(alpha=(6,), beta=(6,), threshold=0.5), {}, 4, False),
    (
        "alif-detach-reset",
        ALIF_MODEL,
        (7, 4, 6),
        dict(decay=(), rho=0.7, b0=0.4, beta=(6,)),
        dict(detach_reset=True),
        4,
        True,
    ),
    (
        "user-three-states",
        THREE_STATES,
        (10, 6),
        dict(alpha=0.6, decay=(6,), rho=()),
        dict(surrogate="sigmoid"),
        3,
        True,
    ),
]


def _check_any_neuron(group, failures):
    """timesplit_neuron hands on every state: spikes, final states and gradients (input, start states, parameters)
    as spikefuse.neuron over the whole sequence."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for case, (name, model, shape, param_spec, options, chunks, with_start) in enumerate(NEURON_CASES):
        g = torch.Generator().manual_seed(200 + case)  # the same data on every rank
        x = torch.rand(shape, generator=g) * 0.9
        grad_spikes = torch.rand(shape, generator=g)
        grad_states = [torch.rand(shape[1:], generator=g) for _ in model.states]
        start = [(torch.rand(shape[1:], generator=g) * 0.3).requires_grad_() for _ in model.states]
        params = {
            k: (torch.rand(v, generator=g) * 0.5 + 0.3).requires_grad_() if isinstance(v, tuple) else v
            for k, v in param_spec.items()
        }
        learned = [p for p in params.values() if isinstance(p, torch.Tensor)]
        kw = dict(state=tuple(start) if with_start else None, return_state=True, backend=BACKEND, **options, **params)
        # single process, whole sequence
        xr = x.clone().requires_grad_()
        spikes, final = spikefuse.neuron(xr, model, **kw)
        loss = (spikes * grad_spikes).sum() + sum((f * gf).sum() for f, gf in zip(final, grad_states))
        ref_x, *ref_params = torch.autograd.grad(loss, [xr, *learned], retain_graph=with_start)
        ref_start = torch.autograd.grad(loss, start) if with_start else ()
        # time split
        xl = split_time(x, group).clone().requires_grad_()
        spikes_l, final_l = timesplit_neuron(xl, model, group=group, chunks=chunks, **kw)
        loss = (spikes_l * split_time(grad_spikes, group)).sum()
        if rank == size - 1:
            loss = loss + sum((f * gf).sum() for f, gf in zip(final_l, grad_states))
            for k, f, fr in zip(model.states, final_l, final):
                _equal(f, fr.detach(), f"{name}: final state {k}", failures)
        loss.backward()
        _equal(gather_time(spikes_l, group), spikes.detach(), f"{name}: spikes", failures)
        _close(gather_time(xl.grad, group), ref_x, f"{name}: grad x", failures)
        if rank == 0:
            for k, s, r in zip(model.states, start, ref_start):
                _close(s.grad, r, f"{name}: grad of start state {k}", failures)
        allreduce_gradients(learned, group)
        for k, p, r in zip([k for k, v in params.items() if isinstance(v, torch.Tensor)], learned, ref_params):
            _close(p.grad, r, f"{name}: grad {k}", failures)


def _check_neuron_module_stateful(group, failures):
    """TimeSplitNeuron(stateful=True) of an ALIF over two calls equals one ALIF over the two sequences back to back:
    both states carried between the calls."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.rand(5, 2, 4, generator=g), torch.rand(6, 2, 4, generator=g)
    whole = snn.ALIF(0.8, 0.9, b0=0.5, backend=BACKEND)(torch.cat([a, b]))
    m = TimeSplitNeuron.from_neuron(snn.ALIF(0.8, 0.9, b0=0.5, backend=BACKEND, stateful=True), group, chunks=2)
    with torch.no_grad():
        out = torch.cat([gather_time(m(split_time(a, group)), group), gather_time(m(split_time(b, group)), group)])
    _equal(out, whole, "stateful TimeSplitNeuron", failures)


def _check_lif_as_neuron(group, failures):
    """A LIF is an engine neuron: TimeSplitNeuron.from_neuron of a stateful LIF with a hard reset to -0.2 (its
    membrane starts there) over two calls equals the LIF over the two sequences back to back, gradients included."""
    g = torch.Generator().manual_seed(8)
    a, b = torch.rand(5, 2, 4, generator=g, dtype=torch.float64), torch.rand(6, 2, 4, generator=g, dtype=torch.float64)
    whole = snn.LIF(0.7, 0.5, v_reset=-0.2, learnable_decay=True, backend=BACKEND).double()
    xr = torch.cat([a, b]).requires_grad_()
    ref = whole(xr)
    ref.sum().backward()
    m = TimeSplitNeuron.from_neuron(
        snn.LIF(0.7, 0.5, v_reset=-0.2, learnable_decay=True, backend=BACKEND, stateful=True).double(), group, chunks=2
    )
    xa, xb = split_time(a, group).requires_grad_(), split_time(b, group).requires_grad_()
    out = torch.cat([gather_time(m(xa), group), gather_time(m(xb), group)])
    _equal(out, ref.detach(), "TimeSplitNeuron of a LIF", failures)
    m.reset_state()  # a fresh sequence from the start: the decay's gradient
    m(split_time(a, group)).sum().backward()
    allreduce_gradients(m, group)
    whole.decay.grad = None
    whole(a).sum().backward()
    _close(m.decay.grad, whole.decay.grad, "TimeSplitNeuron of a LIF: grad decay", failures)


# --------------------------------------------------------------------------------------- conv-BN-LIF network


def _network(engine=False):
    """LIF layers, or with ``engine`` a CubaLIF and an ALIF layer (learnable per-channel and scalar parameters)."""
    torch.manual_seed(11)
    if engine:
        first = snn.CubaLIF(0.5, 0.8, 0.5, learnable=("alpha", "beta"), channels=4, backend=BACKEND)
        second = snn.ALIF(0.6, 0.7, b0=0.4, learnable=("rho",), backend=BACKEND)
    else:
        first = snn.LIF(0.5, 0.5, backend=BACKEND, learnable_decay=True, channels=4)
        second = snn.LIF(0.6, 0.4, v_reset=None, backend=BACKEND)
    return nn.Sequential(
        snn.SeqToBatch(nn.Conv2d(2, 4, 3, padding=1)),
        snn.SeqToBatch(nn.BatchNorm2d(4)),
        first,
        snn.SeqToBatch(nn.Conv2d(4, 4, 3, padding=1)),
        snn.SeqToBatch(nn.BatchNorm2d(4)),
        second,
    ).double()


def _check_network(group, failures, lean=False, engine=False):
    """``lean``: the network in its memory-lean form (fused BatchNorm+neuron, spike-input conv) before the split;
    ``engine``: its neurons a CubaLIF and an ALIF."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(7, 2, 2, 5, 5, generator=g, dtype=torch.float64) * 2
    w = torch.randn(2, 4, 5, 5, generator=g, dtype=torch.float64)
    ref_net = _network(engine)
    xr = x.clone().requires_grad_()
    ref_out = ref_net(xr)
    (ref_out.mean(0) * w).sum().backward()

    net = _network(engine)
    if lean:
        snn.to_lean(net)
    net = convert_timesplit(net, group, chunks=2)
    kinds = [type(m).__name__ for m in net.modules()]
    neuron, fused = (
        ("TimeSplitNeuron", "TimeSplitBatchNormNeuron") if engine else ("TimeSplitLIF", "TimeSplitBatchNormLIF")
    )
    if kinds.count(neuron) != 2 or kinds.count("TimeSplitBatchNorm") != 2:
        failures.append(f"convert_timesplit gave {kinds}")
    if lean and kinds.count(fused) != 2:
        failures.append(f"convert_timesplit of the lean network gave {kinds}")
    what = ("lean network" if lean else "network") + (" of CubaLIF and ALIF" if engine else "")
    xl = split_time(x, group).clone().requires_grad_()
    out_l = net(xl)
    (time_reduce(out_l, group, op="mean") * w).sum().backward()
    allreduce_gradients(net, group)

    _equal(gather_time(out_l, group), ref_out.detach(), f"{what}: output spikes", failures)
    _close(gather_time(xl.grad, group), xr.grad, f"{what}: grad input", failures)
    ref_params, params = list(ref_net.named_parameters()), list(net.named_parameters())
    if len(ref_params) != len(params):
        failures.append(f"{what}: {len(params)} parameters, the reference has {len(ref_params)}")
    for (name, p), (_, q) in zip(ref_params, params):
        _close(q.grad, p.grad, f"{what}: grad {name}", failures)
    ref_buffers, buffers = list(ref_net.named_buffers()), list(net.named_buffers())
    for (name, b), (_, c) in zip(ref_buffers, buffers):
        _close(c.double(), b.double(), f"{what}: buffer {name}", failures, rtol=1e-12)
    # eval mode: running statistics, no communication in BN
    ref_net.eval(), net.eval()
    with torch.no_grad():
        _equal(gather_time(net(split_time(x, group)), group), ref_net(x), f"{what} eval: spikes", failures)


def _check_batchnorm_float32(group, failures):
    """TimeSplitBatchNorm in float32 (no spikes after it) against nn.BatchNorm on all T*B samples."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 3, 4, 2, 2, generator=g) * 3 + 1
    gy = torch.randn(6, 3, 4, 2, 2, generator=g)
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
    tbn = TimeSplitBatchNorm(4, group=group)
    tbn.load_state_dict(bn.state_dict())
    xr = x.clone().requires_grad_()
    y = snn.SeqToBatch(bn)(xr)
    (y * gy).sum().backward()
    xl = split_time(x, group).clone().requires_grad_()
    yl = tbn(xl)
    (yl * split_time(gy, group)).sum().backward()
    allreduce_gradients(tbn, group)
    _close(gather_time(yl, group), y, "bn fp32: output", failures)
    _close(gather_time(xl.grad, group), xr.grad, "bn fp32: grad input", failures, rtol=1e-4)
    _close(tbn.weight.grad, bn.weight.grad, "bn fp32: grad weight", failures)
    _close(tbn.bias.grad, bn.bias.grad, "bn fp32: grad bias", failures)
    _close(tbn.running_var, bn.running_var, "bn fp32: running_var", failures)


def _check_timeout(failures):
    """A rank waiting on a peer that never sends fails with a timeout error, on a group with a short timeout."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            dist.recv(torch.empty(3), src=1, group=group)
            failures.append("recv from a silent peer returned")
        except RuntimeError as err:
            elapsed = time.monotonic() - start
            if elapsed > 15:
                failures.append(f"timeout took {elapsed:.1f} s")
            return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return None


def _worker(rank, world):
    from .test_ddp import ddp_check

    reports = {}
    pair = dist.new_group([0, 1])  # every rank must take part in new_group
    for label, group, members in (("world", None, range(world)), ("pair", pair, (0, 1))):
        failures = []
        if rank in members:
            try:
                _check_lif_layer(group, failures)
                _check_module_stateful(group, failures)
                _check_any_neuron(group, failures)
                _check_neuron_module_stateful(group, failures)
                _check_lif_as_neuron(group, failures)
                _check_network(group, failures)
                _check_network(group, failures, lean=True)
                _check_network(group, failures, engine=True)
                _check_network(group, failures, lean=True, engine=True)
                _check_batchnorm_float32(group, failures)
            except Exception:  # report instead of raising: a raise would kill the other checks' ranks
                failures.append(traceback.format_exc())
                raise
            reports[label] = failures
        dist.barrier()
    reports["ddp"] = ddp_check(pair) if rank in (0, 1) else None
    dist.barrier()
    reports["bench"] = bench_timesplit._worker(
        rank, world, bench_timesplit.config(bench_timesplit.prepare(_bench_args("-")))
    )
    reports["timeout"] = _check_timeout(failures := [])  # last: leaves a group with an abandoned receive
    reports["timeout-failures"] = failures
    return reports


@functools.cache
def shared_reports() -> list:
    """Every rank's reports of :func:`_worker`, from one spawned group of 3 ranks per test session."""
    start = time.monotonic()
    # the fused backends compile their kernels in every rank first (numba): allow for it
    timeout, pg_timeout = (180, 30) if BACKEND == "reference" else (1200, 600)
    out = launch(_worker, 3, timeout=timeout, pg_timeout=timedelta(seconds=pg_timeout), threads=1)
    print(f"shared group of 3 ranks: {time.monotonic() - start:.1f} s")
    return out


@pytest.fixture
def reports():
    return shared_reports()


@pytest.mark.parametrize("label,ranks", [("world", 3), ("pair", 2)])
def test_timesplit_equals_single_process(reports, label, ranks):
    for rank in range(ranks):
        assert reports[rank][label] == [], f"rank {rank} of {ranks}: " + "\n".join(reports[rank][label])


def test_silent_peer_times_out_instead_of_hanging(reports):
    assert reports[0]["timeout-failures"] == []
    assert reports[0]["timeout"] and "imeout" in reports[0]["timeout"] or "timed out" in reports[0]["timeout"].lower()


def test_bench_quick_writes_markdown_csv_png(reports, tmp_path, monkeypatch):
    """``spikefuse bench timesplit --quick`` end to end, with the ranks' work taken from the shared group."""
    from spikefuse.distributed import ddp

    args = _bench_args(tmp_path)
    want_cfg = bench_timesplit.config(bench_timesplit.prepare(_bench_args(tmp_path)))

    def fake_launch(fn, nproc, cfg, **kwargs):
        assert fn is bench_timesplit._worker and nproc == 3 and cfg == want_cfg
        return [reports[0]["bench"], None, None]

    monkeypatch.setattr(ddp, "launch", fake_launch)
    args.func(args)
    stem = tmp_path / "timesplit_quick"
    with open(stem.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "T",
        "N",
        "ranks",
        "chunks",
        "backend",
        "threads_per_rank",
        "t_single_ms",
        "t_split_ms",
        "t_comm_ms",
        "speedup_measured",
        "speedup_eq5",
        "best_k_eq5",
    ]
    assert [(r["T"], r["ranks"]) for r in rows] == [(t, k) for t in ("3", "6") for k in ("1", "2", "3")]
    assert all(float(r["t_split_ms"]) > 0 and float(r["t_comm_ms"]) > 0 for r in rows)
    for r in rows:  # the Eq. (5) column is Eq. (5) of the measured T_s and T_c
        k, ts, tc = int(r["ranks"]), float(r["t_single_ms"]), float(r["t_comm_ms"])
        assert float(r["speedup_eq5"]) == pytest.approx(k * ts / (k * (k - 1) * tc + ts), abs=1e-3)
    md = stem.with_suffix(".md").read_text()
    assert "Machine: " in md and "Command: `spikefuse bench timesplit --neurons 600 --T 3 6 --ranks 1 2 3" in md
    assert "| T | ranks k |" in md
    assert stem.with_suffix(".png").stat().st_size > 1000


def test_eq5():
    assert bench_timesplit.eq5_speedup(1, 10.0, 1.0) == 1.0
    assert bench_timesplit.eq5_speedup(2, 10.0, 1.0) == pytest.approx(20 / 12)
    assert bench_timesplit.eq5_best_k(16.0, 1.0) == 4.0


def test_time_partition():
    assert time_partition(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert time_partition(2, 2) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError):
        time_partition(4, 0)


def test_single_process_without_process_group_is_plain_lif():
    x = torch.rand(6, 3, 4, requires_grad=True)
    s = timesplit_lif(x, decay=0.5, threshold=0.6, backend=BACKEND, chunks=3)
    assert torch.equal(s, spikefuse.lif(x, decay=0.5, threshold=0.6, backend=BACKEND))
    s.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_single_process_without_process_group_is_plain_neuron():
    """One rank: timesplit_neuron is spikefuse.neuron (chunks only cut the neurons), states and gradients too."""
    x = (torch.rand(6, 3, 4) * 2).requires_grad_()
    alpha = torch.full((4,), 0.6, requires_grad=True)
    kw = dict(alpha=alpha, beta=0.8, threshold=0.5, return_state=True, backend=BACKEND)
    spikes, (_, v) = timesplit_neuron(x, CUBA_LIF, chunks=3, **kw)
    ref_spikes, (_, ref_v) = spikefuse.neuron(x, CUBA_LIF, **kw)
    assert torch.equal(spikes, ref_spikes) and torch.equal(v, ref_v)
    grads = torch.autograd.grad(spikes.sum() + v.sum(), [x, alpha])
    ref_grads = torch.autograd.grad(ref_spikes.sum() + ref_v.sum(), [x, alpha])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-7)


def test_timesplit_neuron_module_shares_the_layer_and_its_names():
    layer = snn.CubaLIF(0.5, 0.8, learnable=("beta",), channels=3, backend=BACKEND)
    split = TimeSplitNeuron.from_neuron(layer, chunks=2)
    assert split.beta is layer.beta and split.state_dict().keys() == layer.state_dict().keys()
    x = torch.rand(5, 2, 3) * 2
    assert torch.equal(split(x), layer(x))
    built = TimeSplitNeuron(ALIF_MODEL, decay=0.9, rho=0.8, learnable=("decay",), backend=BACKEND, chunks=2)
    assert torch.equal(built(x), spikefuse.neuron(x, ALIF_MODEL, decay=0.9, rho=0.8, backend=BACKEND))
    net = convert_timesplit(nn.Sequential(snn.SeqToBatch(nn.Linear(3, 3)), snn.ALIF(0.9, 0.8), snn.LIF()))
    assert [type(m).__name__ for m in net] == ["SeqToBatch", "TimeSplitNeuron", "TimeSplitLIF"]


@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda: timesplit_neuron(torch.rand(4, 3), CUBA_LIF, alpha=0.5, beta=0.8, chunks=0),
            "chunks must be an int >= 1",
        ),
        (lambda: timesplit_neuron(torch.rand(0, 3), CUBA_LIF, alpha=0.5, beta=0.8), "holds no time steps"),
        (lambda: timesplit_neuron(torch.rand(4, 3), snn.CubaLIF(0.5, 0.8)), "must be a spikefuse.neurons.NeuronModel"),
        (lambda: timesplit_neuron(torch.rand(4, 3), CUBA_LIF, beta=0.8), "needs the parameter 'alpha'"),
        (
            lambda: timesplit_neuron(torch.rand(4, 3), CUBA_LIF, alpha=0.5, beta=0.8, state=(torch.zeros(3),)),
            "state must be a tuple of 2 tensors",
        ),
        (lambda: TimeSplitNeuron.from_neuron(nn.ReLU()), "layer must be a spikefuse.nn.EngineNeuron"),
        (lambda: TimeSplitNeuron(CUBA_LIF, alpha=0.5, beta=0.8, chunks=1.5), "chunks must be an int >= 1"),
        (
            lambda: convert_timesplit(nn.Sequential(snn.RecurrentCubaLIF(3, 0.5, 0.8))),
            "a recurrent layer cannot be time-split",
        ),
    ],
)
def test_bad_input_says_what_is_wrong(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()
