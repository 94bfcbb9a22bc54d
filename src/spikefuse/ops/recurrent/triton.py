"""A recurrent layer's neuron steps as Triton kernels generated from a :class:`~spikefuse.neurons.NeuronModel`
(CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1`` for testing).

The twins of :mod:`.cpu`'s kernels, with the same arrays and meaning, each program owning ``BLOCK`` of the ``B*H``
neurons of a step: ``forward_step``, ``replay`` (every step, the currents given), ``backward_step``, ``initial``
and, for a neuron with a handoff, ``handoff`` / ``handoff_grad``. The step is emitted as in
:mod:`spikefuse.ops.engine.triton` (correctly rounded, no FMA contraction), so spikes and states equal the
reference's bit for bit when the currents do; the derivatives use the fast dialect.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..launch import ceil_div, device_guard, surrogate_params

from ..numerics import compute_dtype
from ..engine import emit, triton as engine_triton
from ...surrogate import Active
from . import source
from .source import kept_states, step_source

_GENERATOR = hashlib.sha256(
    b"".join(Path(f).read_bytes() for f in (__file__, source.__file__, emit.__file__))
).hexdigest()[:12]
COMPILE_OPTIONS = engine_triton.COMPILE_OPTIONS


#: Why the Triton backend refuses :class:`~spikefuse.surrogate.Active`.
ACTIVE_REFUSED = (
    "the recurrent layer's triton backend does not implement spikefuse.surrogate.Active (Perez-Nieves & Goodman's "
    "sparse gradient): run the layer with backend='cpu' on CPU tensors (or backend='reference')"
)


def kernel_source(model, surrogate_type, dtype: torch.dtype) -> str:
    S, P = model.states, model.params
    kept = kept_states(model)
    exact, fast = engine_triton.dialects(dtype)
    dt = f"tl.{engine_triton._TAGS[dtype]}"
    fire, step, handoff, sym, fire_d, step_d, handoff_d = parts = step_source(model, surrogate_type, exact)
    zero, one = exact.number(0.0), exact.number(1.0)
    spike = f"s_ = tl.where(u_ {'>' if model.strict else '>='} {zero}, {one}, {zero})"
    derivs = parts.derivs
    zeros = f"tl.zeros([BLOCK], {dt})"

    def chain(pairs, base=None):
        return emit.chain_sum(pairs, derivs, zeros, base)

    def load(ptr: str, index: str) -> str:
        return f"tl.load({ptr} + {index}, mask=mask, other=0.0)"

    def kernel(signature: str, body: list[str]) -> list[str]:
        """A kernel over the program's neurons ``offs`` of ``N``, its parameters (``par`` ``[P, H]``) loaded."""
        return [
            "@triton.jit",
            f"def {signature}:",
            "    pid = tl.program_id(0)",
            "    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
            "    mask = offs < N",
            "    h = offs % H",
            *[f"    p_{p} = {load('par', f'{i} * H + h')}" for i, p in enumerate(P)],
            *[f"    {line}" for line in body],
            "",
            "",
        ]

    def row(t: str, k: str, rows: str = "hist", width: int = len(kept)) -> str:
        return f"(({t}) * {width} + {kept.index(k)}) * N + offs" if rows == "hist" else f"{S.index(k)} * N + offs"

    save = "".join(f"\n        tl.store(hist + {row('t64', k)}, v_{k}, mask=mask)" for k in kept)
    forward = kernel(
        "forward_step(t, x, r, flags, cur, spikes, hist, par, N, H, SAVE: tl.constexpr, BLOCK: tl.constexpr)",
        [
            "t64 = tl.cast(t, tl.int64)",  # row offsets in 64 bits: T * N may pass 2^31
            *[f"v_{k} = {load('cur', f'{i} * N + offs')}" for i, k in enumerate(S)],
            fire,
            spike,
            *([f"s_ = tl.where(t == 0, {zero}, s_)"] if model.handoff else []),
            f"x_ = {load('x', 't64 * N + offs')}.to({dt})",
            f"r_ = {load('r', 'offs')}",
            # 0, or NaN where the neuron reads a NaN or an inf (its states, which keep a NaN, its input or its
            # current): then its spike is NaN (see the engine's forward) and the program flags it
            "c_ = " + " + ".join(f"(v_{k} - v_{k})" for k in S) + " + ((x_ - x_) + (r_ - r_))",
            "bad = tl.max(tl.where(c_ == 0, 0, 1), axis=0)",
            "tl.store(flags + pid, bad, mask=bad > 0)",
            *step,
            fire,
            spike,
            *[f"tl.store(cur + {i} * N + offs, v_{k}, mask=mask)" for i, k in enumerate(S)],
            f"if SAVE:{save}",
            "tl.store(spikes + t64 * N + offs, tl.where(c_ == 0, s_, c_), mask=mask)",
        ],
    )
    replay = kernel(
        "replay(x, r, cur, spikes, hist, par, T, N, H, BLOCK: tl.constexpr)",
        [
            *[f"v_{k} = {load('cur', f'{i} * N + offs')}" for i, k in enumerate(S)],
            "for t in range(0, T):",
            "    t64 = tl.cast(t, tl.int64)",
            f"    {fire}",
            f"    {spike}",
            *([f"    s_ = tl.where(t == 0, {zero}, s_)"] if model.handoff else []),
            f"    x_ = {load('x', 't64 * N + offs')}.to({dt})",
            f"    r_ = {load('r', 't64 * N + offs')}",
            *[f"    {line}" for line in step],
            *[f"    tl.store(hist + {row('t64', k)}, v_{k}, mask=mask)" for k in kept],
            *[f"tl.store(cur + {i} * N + offs, v_{k}, mask=mask)" for i, k in enumerate(S)],
        ],
    )

    needs = "".join(f"NEED_{p}: tl.constexpr, " for p in P)
    accumulate = [
        f"if NEED_{p}:\n        tl.store(acc + {j} * N + offs, {load('acc', f'{j} * N + offs')} + "
        + chain([("g_s * sg_", f"dF_{p}")] + [(f"g_{k}", f"dP_{k}_{p}") for k in S])
        + ", mask=mask)"
        for j, p in enumerate(P)
    ]
    backward = kernel(
        f"backward_step(t, gy, grec, G, gS, gs, hist, init, xin, par, sgp, acc, N, H, "
        f"DETACH: tl.constexpr, {needs}BLOCK: tl.constexpr)",
        [
            "sg_p1 = tl.load(sgp)",
            "sg_p2 = tl.load(sgp + 1)",
            "t64 = tl.cast(t, tl.int64)",
            "prev = tl.maximum(t64 - 1, 0)",
            *[
                f"o_{k} = tl.where(t > 0, {load('hist', row('prev', k))}, {load('init', f'{i} * N + offs')})"
                if k in kept
                else f"o_{k} = {load('init', f'{i} * N + offs')}"
                for i, k in enumerate(S)
            ],
            *[f"v_{k} = o_{k}" for k in S],
            fire,
            spike,
            *([f"s_ = tl.where(t == 0, {zero}, s_)"] if model.handoff else []),
            *[f"v_{k} = {load('hist', row('t64', k))}" if k in kept else f"v_{k} = {zeros}" for k in S],
            fire,
            *([f"x_ = {load('xin', 't64 * N + offs')}"] if model.backward_reads_input else []),
            *emit.assignments({**fire_d, **step_d}, sym, "", fast),
            f"g_s = {load('gy', 't64 * N + offs')}.to({dt}) + {load('grec', 'offs')} + {load('gs', 'offs')}",
            *[
                f"g_{k} = " + chain([("g_s * sg_", f"df_{k}")], base=load("gS", f"{i} * N + offs"))
                for i, k in enumerate(S)
            ],
            "tl.store(G + t64 * N + offs, " + chain([(f"g_{k}", f"dx_{k}") for k in S]) + ", mask=mask)",
            *accumulate,
            *[
                f"tl.store(gS + {i} * N + offs, " + chain([(f"g_{k}", f"dS_{k}_{o}") for k in S]) + ", mask=mask)"
                for i, o in enumerate(S)
            ],
            "if DETACH:",
            f"    tl.store(gs + offs, {zeros}, mask=mask)",
            "else:",
            "    tl.store(gs + offs, " + chain([(f"g_{k}", f"ds_{k}") for k in S]) + ", mask=mask)",
        ],
    )
    if model.handoff:
        initial_body = [
            f"tl.store(ginit + {i} * N + offs, {load('gS', f'{i} * N + offs')}, mask=mask)" for i in range(len(S))
        ]
    else:
        initial_body = [
            *[f"v_{k} = {load('init', f'{i} * N + offs')}" for i, k in enumerate(S)],
            fire,
            *emit.assignments(fire_d, sym, "", fast),
            f"g_ = {load('gs', 'offs')} * sg_",
            *[
                f"tl.store(ginit + {i} * N + offs, {load('gS', f'{i} * N + offs')} + g_ * df_{k}, mask=mask)"
                for i, k in enumerate(S)
            ],
            *[
                f"if NEED_{p}:\n        tl.store(acc + {j} * N + offs, {load('acc', f'{j} * N + offs')} + g_ * dF_{p}, "
                "mask=mask)"
                for j, p in enumerate(P)
            ],
        ]
    initial = kernel(
        f"initial(gS, gs, ginit, init, par, sgp, acc, N, H, {needs}BLOCK: tl.constexpr)",
        ["sg_p1 = tl.load(sgp)", "sg_p2 = tl.load(sgp + 1)", *initial_body],
    )
    parts = [forward, replay, backward, initial]
    if model.handoff:
        parts.append(
            kernel(
                "handoff(cur, par, N, H, BLOCK: tl.constexpr)",
                [
                    *[f"v_{k} = {load('cur', f'{i} * N + offs')}" for i, k in enumerate(S)],
                    fire,
                    spike,
                    *handoff,
                    *[f"tl.store(cur + {i} * N + offs, v_{k}, mask=mask)" for i, k in enumerate(S)],
                ],
            )
        )
        parts.append(
            kernel(
                f"handoff_grad(gS, gs, hist, par, acc, T, N, H, DETACH: tl.constexpr, {needs}BLOCK: tl.constexpr)",
                [
                    "last = tl.cast(T - 1, tl.int64)",
                    *[f"v_{k} = {load('hist', row('last', k))}" for k in S],
                    fire,
                    spike,
                    *emit.assignments(handoff_d, sym, "", fast),
                    *[f"gH_{k} = {load('gS', f'{i} * N + offs')}" for i, k in enumerate(S)],
                    *[
                        f"tl.store(gS + {i} * N + offs, "
                        + chain([(f"gH_{k}", f"dH_{k}_{n}") for k in S])
                        + ", mask=mask)"
                        for i, n in enumerate(S)
                    ],
                    "if DETACH:",
                    f"    tl.store(gs + offs, {zeros}, mask=mask)",
                    "else:",
                    "    tl.store(gs + offs, " + chain([(f"gH_{k}", f"dHs_{k}") for k in S]) + ", mask=mask)",
                    *[
                        f"if NEED_{p}:\n        tl.store(acc + {j} * N + offs, {load('acc', f'{j} * N + offs')} + "
                        + chain([(f"gH_{k}", f"dHP_{k}_{p}") for k in S])
                        + ", mask=mask)"
                        for j, p in enumerate(P)
                    ],
                ],
            )
        )
    header = [
        f'"""Generated by spikefuse.ops.recurrent.triton for the neuron {model.name!r} ({model.key}), surrogate '
        f'{surrogate_type.__name__}, {dtype}. Do not edit: rewritten when the generator changes."""',
        "import triton",
        "import triton.language as tl",
        "",
        "",
        *emit.model_facts(model),
        f"KEPT_STATES = {kept!r}",
        "",
        "",
    ]
    return "\n".join(header + [line for part in parts for line in part]) + "\n"


def kernels(model, surrogate_type, dtype: torch.dtype):
    """The imported module of ``model``'s recurrent step kernels for the compute dtype ``dtype``."""
    if issubclass(surrogate_type, Active):  # (the caller's check, spikefuse.recurrent)
        raise ValueError(ACTIVE_REFUSED)
    cdt = compute_dtype(dtype)
    return emit.load_generated(
        "triton_recurrent",
        model,
        surrogate_type,
        engine_triton._TAGS[cdt],
        _GENERATOR,
        lambda: kernel_source(model, surrogate_type, cdt),
    )


# --------------------------------------------------------------------------------------------------- entry points
def _launch(neuron, dtype, name: str, n: int, h: int):
    """``launch(*args, **flags)`` of kernel ``name`` of the record's model and surrogate over ``n`` neurons of rows
    of ``h``."""
    kernel = getattr(kernels(neuron.model, type(neuron.surrogate), dtype), name)
    block = engine_triton.engine_block(n, len(neuron.model.states), dtype)
    grid = (ceil_div(max(n, 1), block),)

    def launch(*args, **flags):
        with device_guard(args[1].device):
            kernel[grid](*args, n, h, **flags, BLOCK=block, **COMPILE_OPTIONS)

    return launch


def bind_forward(neuron, buf):
    """``(step, flags)``: ``step(t)`` the forward of step t of ``buf`` (a
    :class:`~spikefuse.ops.recurrent.StepBuffers`); ``flags`` per program, not 0 where a neuron read a NaN or an inf
    (see :func:`spikefuse.ops.nonfinite.refuse_flagged`)."""
    x, r, cur, spikes, hist, par = buf
    n = x.shape[1] * x.shape[2]
    launch = _launch(neuron, cur.dtype, "forward_step", n, x.shape[2])
    flags = torch.zeros(
        ceil_div(max(n, 1), engine_triton.engine_block(n, len(neuron.model.states), cur.dtype)),
        dtype=torch.int32,
        device=x.device,
    )
    save = hist is not None
    hist = hist if save else cur
    return (lambda t: launch(t, x, r, flags, cur, spikes, hist, par, SAVE=save)), flags


def replay(neuron, buf) -> None:
    x = buf.x
    launch = _launch(neuron, buf.cur.dtype, "replay", x.shape[1] * x.shape[2], x.shape[2])
    launch(*buf, x.shape[0])


def _needs(model, need) -> dict:
    return {f"NEED_{p}": bool(n) for p, n in zip(model.params, need)}


def bind_backward(neuron, grads):
    need, gy, grec, G, gS, gs, hist, init, xin, par, acc = grads
    launch = _launch(neuron, G.dtype, "backward_step", G.shape[1] * G.shape[2], G.shape[2])
    sgp = surrogate_params(neuron.surrogate, G.dtype, G.device)
    flags = dict(DETACH=neuron.detach_reset, **_needs(neuron.model, need))
    return lambda t: launch(t, gy, grec, G, gS, gs, hist, init, xin, par, sgp, acc, **flags)


def initial(neuron, grads, ginit) -> None:
    gS = grads.gS
    sgp = surrogate_params(neuron.surrogate, gS.dtype, gS.device)
    launch = _launch(neuron, gS.dtype, "initial", gS.shape[1] * gS.shape[2], gS.shape[2])
    launch(gS, grads.gs, ginit, grads.init, grads.par, sgp, grads.acc, **_needs(neuron.model, grads.need))


def handoff(neuron, cur, par) -> None:
    _launch(neuron, cur.dtype, "handoff", cur.shape[1] * cur.shape[2], cur.shape[2])(cur, par)


def handoff_grad(neuron, grads) -> None:
    gS, hist = grads.gS, grads.hist
    launch = _launch(neuron, gS.dtype, "handoff_grad", gS.shape[1] * gS.shape[2], gS.shape[2])
    launch(
        gS,
        grads.gs,
        hist,
        grads.par,
        grads.acc,
        hist.shape[0],
        DETACH=neuron.detach_reset,
        **_needs(neuron.model, grads.need),
    )
