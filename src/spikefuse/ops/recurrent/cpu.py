"""A recurrent layer's neuron steps as numba kernels generated from a :class:`~spikefuse.neurons.NeuronModel`.

The recurrent current of a step needs every neuron's previous spike, so a recurrent layer cannot run its T steps per
neuron in one pass as the feed-forward kernels do: :mod:`.autograd` runs the time loop, a matrix product per step
between the kernels of this module, which do everything else of a step for all ``[B, H]`` neurons at once:

- ``forward_rows``: one step (:attr:`NeuronModel.recurrent_step`) from the states in ``cur`` (updated in place), the
  input row ``x[t]`` and the recurrent current ``r``, writing the spikes of step t and, with ``save``, the states the
  backward reads into ``hist[t]``; ``replay``: every step from ``x`` and all currents ``r[t]`` at once (a
  recomputing backward: the currents of the saved spikes are one product, so no product runs between the steps);
- ``forward_sparse_rows`` (``sparse=True``): every step of its rows in one call, each step's current summed from
  the weight rows of the previous step's spikes, read from the bits the kernel packed as it wrote them (so no torch
  product runs between the steps, and a row's steps need no other row);
- ``backward_rows``: one reverse step, from the gradients of the states after step t (``gS``, in place), of the
  spike of step t (the output's, the recurrent current's of step t+1 in ``grec``, the reset's of step t+1 in
  ``gs``), writing the gradient of the step's input into ``G[t]`` (the input's and the recurrent current's) and
  adding to per-neuron parameter gradients;
- ``backward_sparse_rows`` (``sparse_grad``): every reverse step of its rows in one call, each followed by the
  product that carries the gradient back to the previous spikes, ``G[t] @ W``, from the nonzero entries of ``G[t]``
  only (a compact-support surrogate leaves most of them zero);
- ``initial_rows`` the initial states' gradients after the reverse loop, ``handoff_rows`` / ``handoff_grad_rows``
  the states handed out by a neuron with a handoff and their gradients.

Each ``*_rows`` function runs batch rows ``b0`` to ``b1``; ``*_step`` (``parallel``) splits the rows over the
threads, for layers where that pays. Arrays: ``x``, ``spikes``, ``G`` ``[T, B, H]``; ``cur``, ``gS``, ``init``
``[S, B, H]``; ``hist`` ``[T, K, B, H]`` for the K states the backward reads (:func:`kept_states`); ``par``
``[P, H]``: every parameter per neuron of a row. The step is emitted as written, like the engine's kernels, so the
spikes and states equal the reference's (:func:`spikefuse.ops.engine.reference.run` with ``recurrent``) bit for
bit when the currents do.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from ...threads import match_numba_threads
from .. import numba_common
from ..engine import cpu as engine_cpu, emit
from ..spike_layers import cpu as sparse_cpu
from ...surrogate import Active
from . import source
from .source import kept_states, step_source

# The generator's version: this file, the parts shared with the Triton generator, the emitters and the numba helpers
# the kernels call (numba's cache of a kernel does not notice a change in a function it calls).
_GENERATOR = hashlib.sha256(
    b"".join(
        Path(f).read_bytes()
        for f in (__file__, source.__file__, emit.__file__, numba_common.__file__, sparse_cpu.__file__)
    )
).hexdigest()[:12]


def kernel_source(model, surrogate_type, dtype: torch.dtype) -> str:
    """The kernels' source; an :class:`~spikefuse.surrogate.Active` ``surrogate_type`` zeroes the gradients of the
    states after step t (``g_<state>``) where the step's fire value ``u_`` is outside the window ``|u_| <= sg_p2``,
    before anything is computed from them."""
    S, P = model.states, model.params
    active = issubclass(surrogate_type, Active)
    kept = kept_states(model)
    dialect, grad_dialect = engine_cpu.NUMBA, engine_cpu.NUMBA_GRAD
    fire, step, handoff, sym, fire_d, step_d, handoff_d = parts = step_source(model, surrogate_type, dialect)
    spike = f"s_ = F(1.0) if u_ {'>' if model.strict else '>='} F(0.0) else F(0.0)"
    derivs = parts.derivs

    def chain(pairs, base=None):
        return emit.chain_sum(pairs, derivs, "F(0.0)", base)

    def indented(lines: list[str], by: str = "    ") -> list[str]:
        return [by + line.replace("\n", "\n" + by) for line in lines]

    def loop(head: str, body: list[str]) -> list[str]:
        """``body`` for every neuron of rows b0..b1, its parameters loaded."""
        return [
            head,
            "    H = par.shape[1]",
            "    for b in range(b0, b1):",
            "        for h in range(H):",
            *[f"            p_{p} = par[{i}, h]" for i, p in enumerate(P)],
            *indented(body, " " * 12),
        ]

    def parallel(name: str, args: str) -> list[str]:
        """``<name>_step``: ``<name>_rows`` over batch rows 0..rows in parallel chunks of ``chunk`` rows."""
        return [
            "",
            "",
            "@njit(parallel=True, cache=True, error_model='numpy')",
            f"def {name}_step({args}, rows, chunk):",
            "    for c in prange((rows + chunk - 1) // chunk):",
            f"        {name}_rows({args}, c * chunk, min(rows, c * chunk + chunk))",
        ]

    jit = "@njit(cache=True, error_model='numpy')"
    # Row functions: one batch row of H neurons, every array a row of its own (rows_apart: LLVM vectorizes their
    # loops without run-time overlap checks); the callers pass each row a function writes in one argument only.
    rows = lambda prefix, names: "".join(f"{prefix}{n}, " for n in names)  # noqa: E731
    prow = rows("pv_", P)
    params = [f"        p_{p} = pv_{p}[h]" for p in P]
    fwd_row = [
        jit,
        f"def _forward_row(xr, rr, kr, {rows('c_', S)}sr, {rows('h_', kept)}{prow}save, fresh, H):",
        "    rows_apart()",
        "    for h in range(H):",
        *params,
        *indented(
            [
                *[f"v_{k} = c_{k}[h]" for k in S],
                fire,
                spike,
                *(["if fresh:", "    s_ = F(0.0)"] if model.handoff else []),
                "x_ = xr[h]",
                "r_ = rr[h]",
                "kr[h] |= non_finite(x_) | non_finite(r_)",  # 1 once the neuron read a NaN or an inf
                *step,
                fire,
                spike,
                *[f"c_{k}[h] = v_{k}" for k in S],
                "if save:",
                *[f"    h_{k}[h] = v_{k}" for k in kept],
                "sr[h] = s_",
            ],
            " " * 8,
        ),
    ]
    fwd_args = "t, x, r, ck, cur, spikes, hist, par, save"
    forward = [
        *fwd_row,
        "",
        "",
        jit,
        f"def forward_rows({fwd_args}, b0, b1):",
        "    H = x.shape[2]",
        "    spare = np.empty(H, x.dtype)",  # the kept rows' stand-in without save
        "    for b in range(b0, b1):",
        # the conditional rows as statements: numba's bytecode reader refuses long calls holding them
        *[f"        h_{j} = hist[t, {j}, b] if save else spare" for j in range(len(kept))],
        f"        _forward_row(x[t, b], r[b], ck[b], {rows('', [f'cur[{i}, b]' for i in range(len(S))])}spikes[t, b], "
        + rows("h_", range(len(kept)))
        + rows("", [f"par[{i}]" for i in range(len(P))])
        + "save, t == 0, H)",
    ]
    forward += parallel("forward", fwd_args)
    # The sparse forward: every step of a row in one call, the step's current summed from the weight rows of the
    # previous step's spikes, read from the bits the previous step wrote (no product between the steps, so a row
    # runs all its steps while its states stay in cache, and the threads split the rows for the whole sequence).
    sparse_args = "x, weight_t, bias, words, rec, record, ck, cur, spikes, hist, par, save"
    forward += [
        "",
        "",
        jit,
        f"def forward_sparse_rows({sparse_args}, b0, b1):",
        "    H = x.shape[2]",
        "    spare = np.empty(H, x.dtype)",
        "    current = np.empty(H, x.dtype)",
        "    active = np.empty(H, np.int64)",
        "    for b in range(b0, b1):",
        "        for t in range(x.shape[0]):",
        "            rr = rec[t, b] if record else current",
        "            count = active_inputs(words[t, b], 0, H, active)",
        "            summed_weight_rows(weight_t, active, count, bias, rr)",
        *[f"            h_{j} = hist[t, {j}, b] if save else spare" for j in range(len(kept))],
        f"            _forward_row(x[t, b], rr, ck[b], {rows('', [f'cur[{i}, b]' for i in range(len(S))])}"
        "spikes[t, b], "
        + rows("h_", range(len(kept)))
        + rows("", [f"par[{i}]" for i in range(len(P))])
        + "save, t == 0, H)",
        "            pack_row(spikes[t, b], words[t + 1, b])",
    ]
    forward += parallel("forward_sparse", sparse_args)
    replay_args = "x, r, cur, spikes, hist, par"
    replay = [
        jit,
        f"def replay_rows({replay_args}, b0, b1):",
        "    ck = np.zeros(cur.shape[1:], np.uint8)",  # the replay reads inputs the forward checked
        "    for t in range(x.shape[0]):",
        "        forward_rows(t, x, r[t], ck, cur, spikes, hist, par, True, b0, b1)",
    ]
    replay += parallel("replay", replay_args)

    need = "".join(f"need_{j}, " for j in range(len(P)))
    bwd_row = [
        jit,
        f"def _backward_row(gyr, grecr, Gr, {rows('gS_', S)}gsr, {rows('nr_', kept)}{rows('or_', S)}xr, {prow}"
        f"{rows('acc_', P)}sg_p1, sg_p2, detach, {need}fresh, H):",
        "    rows_apart()",
        "    for h in range(H):",
        *params,
        *indented(
            [
                *[f"o_{k} = or_{k}[h]" for k in S],
                *[f"v_{k} = o_{k}" for k in S],
                fire,
                spike,
                *(["if fresh:", "    s_ = F(0.0)"] if model.handoff else []),
                *[f"v_{k} = nr_{k}[h]" if k in kept else f"v_{k} = F(0.0)" for k in S],
                fire,
                *(["x_ = xr[h]"] if model.backward_reads_input else []),
                *emit.assignments({**fire_d, **step_d}, sym, "", grad_dialect),
                "g_s = gyr[h] + grecr[h] + gsr[h]",
                *[f"g_{k} = " + chain([("g_s * sg_", f"df_{k}")], base=f"gS_{k}[h]") for k in S],
                *(["if not abs(u_) <= sg_p2:", *[f"    g_{k} = F(0.0)" for k in S]] if active else []),
                "Gr[h] = " + chain([(f"g_{k}", f"dx_{k}") for k in S]),
                *[
                    f"if need_{j}:\n    acc_{p}[h] += "
                    + chain([("g_s * sg_", f"dF_{p}")] + [(f"g_{k}", f"dP_{k}_{p}") for k in S])
                    for j, p in enumerate(P)
                ],
                *[f"gS_{o}[h] = " + chain([(f"g_{k}", f"dS_{k}_{o}") for k in S]) for o in S],
                "gsr[h] = F(0.0) if detach else " + chain([(f"g_{k}", f"ds_{k}") for k in S]),
            ],
            " " * 8,
        ),
    ]

    bwd_args = "t, gy, grec, G, gS, gs, hist, init, xin, par, sgp, acc, detach, need"

    def old_row(k: str) -> str:
        """The row of state ``k`` before step t: the previous step's kept one, else the initial one (a state that is
        not kept is not read)."""
        i = S.index(k)
        if k not in kept:
            return f"init[{i}, b]"
        return f"hist[t - 1, {kept.index(k)}, b] if t > 0 else init[{i}, b]"

    backward = [
        *bwd_row,
        "",
        "",
        jit,
        f"def backward_rows({bwd_args}, b0, b1):",
        "    H = G.shape[2]",
        "    for b in range(b0, b1):",
        *[f"        o_{i} = {old_row(k)}" for i, k in enumerate(S)],
        *[f"        a_{j} = acc[{j} if need[{j}] else 0, b]" for j in range(len(P))],
        f"        _backward_row(gy[t, b], grec[b], G[t, b], {rows('', [f'gS[{i}, b]' for i in range(len(S))])}"
        f"gs[b], {rows('', [f'hist[t, {j}, b]' for j in range(len(kept))])}"
        + rows("o_", range(len(S)))
        + "xin[t, b], "
        + rows("", [f"par[{i}]" for i in range(len(P))])
        + rows("a_", range(len(P)))
        + "sgp[0], sgp[1], detach, "
        + "".join(f"need[{j}], " for j in range(len(P)))
        + "t == 0, H)",
    ]
    backward += parallel("backward", bwd_args)
    # sparse_grad: every reverse step of rows b0..b1 in one call, each step's product G[t] @ W (the gradient of the
    # previous spikes through the recurrent current) summed from the nonzero entries of G[t]'s rows only: a row's
    # product reads its own row of G, so the rows need no other row, and no torch product runs between the steps.
    bwd_sparse_args = "gy, grec, G, gS, gs, hist, init, xin, par, sgp, acc, detach, need, weight"
    backward += [
        "",
        "",
        jit,
        f"def backward_sparse_rows({bwd_sparse_args}, b0, b1):",
        "    active = np.empty(G.shape[2], np.int64)",
        "    for t in range(G.shape[0] - 1, -1, -1):",
        "        backward_rows(t, gy, grec, G, gS, gs, hist, init, xin, par, sgp, acc, detach, need, b0, b1)",
        "        for b in range(b0, b1):",
        "            weighted_rows_of_nonzeros(G[t, b], weight, active, grec[b])",
    ]
    backward += parallel("backward_sparse", bwd_sparse_args)

    # after the reverse loop: the initial states' gradients, through the first step's reset spike (no handoff)
    if model.handoff:
        initial_body = [f"ginit[{i}, b, h] = gS[{i}, b, h]" for i in range(len(S))]
    else:
        initial_body = [
            *[f"v_{k} = init[{i}, b, h]" for i, k in enumerate(S)],
            fire,
            *emit.assignments(fire_d, sym, "", grad_dialect),
            *[f"ginit[{i}, b, h] = gS[{i}, b, h] + gs[b, h] * sg_ * df_{k}" for i, k in enumerate(S)],
            *[f"if need[{j}]:\n    acc[{j}, b, h] += gs[b, h] * sg_ * dF_{p}" for j, p in enumerate(P)],
        ]
    initial = [
        jit,
        *loop(
            "def initial_rows(gS, gs, ginit, init, par, sgp, acc, need, b0, b1):",
            ["sg_p1 = sgp[0]", "sg_p2 = sgp[1]", *initial_body],
        ),
    ]
    parts = [forward, replay, backward, initial]
    if model.handoff:
        last = "hist.shape[0] - 1"
        parts.append(
            [
                jit,
                *loop(
                    "def handoff_rows(cur, par, b0, b1):",
                    [
                        *[f"v_{k} = cur[{i}, b, h]" for i, k in enumerate(S)],
                        fire,
                        spike,
                        *handoff,
                        *[f"cur[{i}, b, h] = v_{k}" for i, k in enumerate(S)],
                    ],
                ),
            ]
        )
        parts.append(
            [
                jit,
                *loop(
                    "def handoff_grad_rows(gS, gs, hist, par, acc, detach, need, b0, b1):",
                    [
                        *[f"v_{k} = hist[{last}, {kept.index(k)}, b, h]" for k in S],
                        fire,
                        spike,
                        *emit.assignments(handoff_d, sym, "", grad_dialect),
                        *[f"gH_{k} = gS[{i}, b, h]" for i, k in enumerate(S)],
                        *[
                            f"gS[{i}, b, h] = " + chain([(f"gH_{k}", f"dH_{k}_{n}") for k in S])
                            for i, n in enumerate(S)
                        ],
                        "gs[b, h] = F(0.0) if detach else " + chain([(f"gH_{k}", f"dHs_{k}") for k in S]),
                        *[
                            f"if need[{j}]:\n    acc[{j}, b, h] += " + chain([(f"gH_{k}", f"dHP_{k}_{p}") for k in S])
                            for j, p in enumerate(P)
                        ],
                    ],
                ),
            ]
        )
    header = [
        f'"""Generated by spikefuse.ops.recurrent.cpu for the neuron {model.name!r} ({model.key}), surrogate '
        f'{surrogate_type.__name__}, {dtype}. Do not edit: rewritten when the generator changes."""',
        "import numpy as np",
        "from numba import njit, prange",
        "from spikefuse.ops.numba_common import exp as vexp, non_finite, rows_apart",
        "from spikefuse.ops.spike_layers.cpu import active_inputs, pack_row, summed_weight_rows, weighted_rows_of_nonzeros",
        f"F = np.{engine_cpu._NP_DTYPES[dtype].__name__}",
        "",
        *emit.model_facts(model),
        f"KEPT_STATES = {kept!r}",
        "",
    ]
    body = [line for part in parts for line in (*part, "", "")]
    return "\n".join(header + body) + "\n"


def kernels(model, surrogate_type, dtype: torch.dtype):
    """The imported module of ``model``'s recurrent step kernels (generated on first use, then cached on disk)."""
    tag = engine_cpu._NP_DTYPES[dtype].__name__
    return emit.load_generated(
        "cpu_recurrent", model, surrogate_type, tag, _GENERATOR, lambda: kernel_source(model, surrogate_type, dtype)
    )


# --------------------------------------------------------------------------------------------------- entry points
#: Neurons of a step (B*H) from which the step kernels split the batch rows over the threads; below, waking the
#: thread pool costs more than the step.
PARALLEL_NEURONS = 1 << 15


def _np(t: torch.Tensor):
    return t.detach().numpy()


def _runner(module, name: str, rows: int, neurons: int):
    """``<name>_rows`` over all ``rows`` batch rows, or ``<name>_step`` in parallel chunks of them for large steps."""
    threads = match_numba_threads(neurons, serial_below=PARALLEL_NEURONS)
    if threads == 1:
        serial = getattr(module, f"{name}_rows")
        return lambda *args: serial(*args, 0, rows)
    parallel, chunk = getattr(module, f"{name}_step"), -(-rows // threads)
    return lambda *args: parallel(*args, rows, chunk)


def _kernels(neuron, dtype: torch.dtype):
    """The generated module of the record's model and surrogate type."""
    return kernels(neuron.model, type(neuron.surrogate), dtype)


def bind_forward(neuron, buf):
    """``(step, check)``: ``step(t)`` the forward of step t, the current of step t in ``buf.r`` (a
    :class:`~spikefuse.ops.recurrent.StepBuffers`); ``buf.hist`` None keeps no states. ``check`` ``[B, H]``: 1 where
    a neuron's initial states, or the input or current of a step run, held a NaN or an inf
    (:func:`~spikefuse.ops.numba_common.non_finite`, as the engine's forward kernels check), else 0."""
    x, r, cur, spikes, hist, par = buf
    module = _kernels(neuron, x.dtype)
    run = _runner(module, "forward", x.shape[1], x.shape[1] * x.shape[2])
    save = hist is not None
    check = (~torch.isfinite(cur)).any(0).to(torch.uint8)
    arrays = [_np(a) for a in (x, r, check, cur, spikes, hist if save else cur[None], par)]
    return (lambda t: run(t, *arrays, save)), check


def forward_sparse(neuron, buf, weight_t, bias, words, record):
    """Every step of ``buf`` (``r`` unused) at once, each step's current summed from the weight rows (``weight_t
    [H, H]``, the weight transposed) of the previous step's spikes, which the kernel reads from ``words`` ``[T + 1, B,
    W]`` (row-padded bits, :func:`spikefuse.ops.spike_layers.cpu.pack_spike_rows`): ``words[0]`` the initial spikes',
    given; the kernel writes step t's into ``words[t + 1]`` as it makes them. ``record``: a ``[T, B, H]`` tensor to
    keep every step's current in, or None. Returns the check of :func:`bind_forward`."""
    x, _, cur, spikes, hist, par = buf
    module = _kernels(neuron, x.dtype)
    run = _runner(module, "forward_sparse", x.shape[1], x.shape[1] * x.shape[2])
    check = (~torch.isfinite(cur)).any(0).to(torch.uint8)
    save = hist is not None
    no_bias = np.empty(0, _np(x).dtype)
    run(
        _np(x),
        _np(weight_t),
        no_bias if bias is None else _np(bias),
        _np(words).view(np.uint64),
        _np(record if record is not None else x[:0]),
        record is not None,
        *(_np(a) for a in (check, cur, spikes, hist if save else cur[None], par)),
        save,
    )
    return check


def replay(neuron, buf) -> None:
    """Every step from ``buf.x`` and the currents ``buf.r`` ``[T, B, H]``, the states the backward reads into
    ``buf.hist``."""
    module = _kernels(neuron, buf.x.dtype)
    _runner(module, "replay", buf.x.shape[1], buf.x.shape[1] * buf.x.shape[2])(*(_np(a) for a in buf))


def _backward_arrays(neuron, grads) -> tuple:
    """The arrays of a :class:`~spikefuse.ops.recurrent.GradBuffers` in the order of the step kernels' arguments."""
    _, gy, grec, G, gS, gs, hist, init, xin, par, acc = grads
    sgp = np.asarray(neuron.surrogate.params(), dtype=_np(G).dtype)
    return (*(_np(a) for a in (gy, grec, G, gS, gs, hist, init, xin, par)), sgp, _np(acc), neuron.detach_reset)


def bind_backward(neuron, grads):
    """``step(t)``: the reverse of step t, the spikes' gradient through the current of step t+1 in ``grads.grec``
    (a :class:`~spikefuse.ops.recurrent.GradBuffers`)."""
    module = _kernels(neuron, grads.G.dtype)
    run = _runner(module, "backward", grads.G.shape[1], grads.G.shape[1] * grads.G.shape[2])
    arrays, need = _backward_arrays(neuron, grads), np.asarray(grads.need, dtype=np.bool_)
    return lambda t: run(t, *arrays, need)


def backward_sparse(neuron, grads, weight) -> None:
    """Every reverse step at once (``sparse_grad``): :func:`bind_backward`'s steps from T-1 to 0, each followed by
    the product ``grec = G[t] @ weight`` (``weight [H, H]``) from the nonzero entries of ``G[t]``'s rows, summed in
    increasing index (:func:`spikefuse.ops.spike_layers.cpu.weighted_rows_of_nonzeros`); ``grads.grec`` holds the
    initial spikes' gradient after it."""
    module = _kernels(neuron, grads.G.dtype)
    run = _runner(module, "backward_sparse", grads.G.shape[1], grads.G.shape[1] * grads.G.shape[2])
    run(*_backward_arrays(neuron, grads), np.asarray(grads.need, dtype=np.bool_), _np(weight.contiguous()))


def initial(neuron, grads, ginit) -> None:
    """The initial states' gradients into ``ginit`` ``[S, B, H]`` after the reverse loop."""
    module = _kernels(neuron, grads.gS.dtype)
    sgp = np.asarray(neuron.surrogate.params(), dtype=_np(grads.gS).dtype)
    module.initial_rows(
        *(_np(a) for a in (grads.gS, grads.gs, ginit, grads.init, grads.par)),
        sgp,
        _np(grads.acc),
        np.asarray(grads.need, dtype=np.bool_),
        0,
        grads.gS.shape[1],
    )


def handoff(neuron, cur, par) -> None:
    _kernels(neuron, cur.dtype).handoff_rows(_np(cur), _np(par), 0, cur.shape[1])


def handoff_grad(neuron, grads) -> None:
    _kernels(neuron, grads.gS.dtype).handoff_grad_rows(
        *(_np(a) for a in (grads.gS, grads.gs, grads.hist, grads.par, grads.acc)),
        neuron.detach_reset,
        np.asarray(grads.need, dtype=np.bool_),
        0,
        grads.gS.shape[1],
    )
