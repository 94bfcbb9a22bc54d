"""Fused Triton kernels generated from a :class:`~spikefuse.neurons.NeuronModel` (CUDA tensors; CPU tensors under
``TRITON_INTERPRET=1`` for testing).

For each (neuron, surrogate type, dtype) this module writes the source of two ``@triton.jit`` kernels into the
kernel cache folder (:func:`.emit.cache_dir`) and imports it; Triton compiles each specialization once and caches
it. Each program owns ``BLOCK`` neurons and loops over all T steps with the states in registers:

- ``forward`` writes the spikes and the final states; nothing is saved for backward (``SAVE``, memory="potential":
  every step's states too, ``[T, N]`` each);
- ``backward`` first re-runs the recursion, writing every step's states: the first state's into the rows of
  grad_x, the others' into a scratch ``[T, states - 1, N]`` (none for one state; a program writes and reads back
  only its own neurons' columns), then runs back through time with the derivatives of
  :attr:`NeuronModel.derivatives`, reading each step's states once (the earlier step's carry over), writing the
  input gradient over the row just read, the initial states' gradients and per-neuron parameter gradients (reduced
  per channel afterwards); with ``SAVED`` it reads the states ``forward`` saved instead of re-running the
  recursion, and writes grad_x over the first of them where the caller will not read them again. x is read back
  only where a derivative reads it.

Half-precision inputs (float16, bfloat16) are read and written in their own dtype: the kernels load x and the
spikes' gradient and convert each value to float32, the compute dtype, and store the spikes and grad_x converted
back, so no float32 copy of a ``[T, N]`` tensor is made; states, parameters and the recomputed history (all of it,
grad_x being half) are float32.

Numerics. The step is emitted as written, numbers as constants of the compute dtype, divisions and square roots
correctly rounded (``div_rn``, ``sqrt_rn``; Triton's plain float32 ``/`` and ``sqrt`` may be approximate on NVIDIA
GPUs), and kernels launch with ``enable_fp_fusion=False`` (no FMA contraction): spikes and states equal the
reference's bit for bit, except through ``exp`` and ``log``, which each math library rounds its own way. Parameters
and the surrogate's two values are read from tensors of the compute dtype, so float64 loses nothing in transit.
What changes the code (detach_reset, which parameter and initial-state gradients are needed, scalar vs per-channel
parameters, the memory mode) is a ``tl.constexpr``.

Entry points as :mod:`spikefuse.ops.engine.reference`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..launch import ceil_div, device_guard, surrogate_params

from ..nonfinite import refuse_flagged

from ..numerics import compute_dtype, reduce_leak_grad
from . import emit
from .emit import Dialect

READS_HALF = True  # see the module docstring
# The input dtypes the kernels are made for, each with its kernels' tag; half precision computes in float32.
_TAGS = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# The generator's version: this file and the emitters.
_GENERATOR = hashlib.sha256(Path(__file__).read_bytes() + Path(emit.__file__).read_bytes()).hexdigest()[:12]
NUM_WARPS = 4  # 128 threads; a block of at least 128 neurons gives each neuron one thread
#: The options every kernel is compiled with (:mod:`spikefuse.bench.triton_aot` compiles with the same). No FMA
#: contraction: bit-identical forward (see above). ``maxnreg``: without an explicit register budget ptxas picks a
#: register target for the occupancy it hopes to reach and spills a few registers to local memory to meet it; with
#: the hardware's 255 it spills only what cannot fit. These kernels are bound by DRAM bandwidth and keep enough loads
#: in flight at the lower occupancy (see ``spikefuse bench gpu-static``).
COMPILE_OPTIONS = dict(num_warps=NUM_WARPS, maxnreg=255, enable_fp_fusion=False)


def dialects(dtype: torch.dtype) -> tuple[Dialect, Dialect]:
    """``(exact, fast)`` spellings for the compute dtype: the step (forward and its recomputation) is correctly
    rounded; the derivatives, which only feed gradients, use Triton's fast division and square root."""
    dt = f"tl.{_TAGS[dtype]}"
    f64 = dtype == torch.float64
    common = dict(
        number=lambda v: f"tl.full((), {v!r}, {dt})",
        select=lambda c, a, b: f"tl.where({c}, {a}, {b})",
        abs="tl.abs",
        maximum="tl.maximum",
        minimum="tl.minimum",
    )
    exact = Dialect(
        functions={"exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt_rn"},
        divide=(lambda a, b: f"({a} / {b})") if f64 else (lambda a, b: f"tl.math.div_rn({a}, {b})"),
        **common,
    )
    fast = Dialect(
        functions={"exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt"}, divide=lambda a, b: f"({a} / {b})", **common
    )
    return exact, fast


def kernel_source(model, surrogate_type, dtype: torch.dtype) -> str:
    """The source of the forward and backward Triton kernels of ``model`` with ``surrogate_type``'s derivative, for
    inputs of ``dtype``."""
    S, P = model.states, model.params
    cdt = compute_dtype(dtype)
    exact, fast = dialects(cdt)
    dt = f"tl.{_TAGS[cdt]}"
    # the states' history kept by a recomputing backward: the first state's in grad_x's rows unless grad_x is half
    kept = S if cdt != dtype else S[1:]
    names = {**{k: f"v_{k}" for k in S}, **{p: f"p_{p}" for p in P}, "x": "x_", "s": "s_"}
    fire = f"u_ = {emit.step_source(model.fire, names, exact)}"
    zero, one = exact.number(0.0), exact.number(1.0)
    spike = f"s_ = tl.where(u_ {'>' if model.strict else '>='} {zero}, {one}, {zero})"
    step = [f"v_{k} = {emit.step_source(e, names, exact)}" for k, e in model.step]
    handoff = [f"v_{k} = {emit.step_source(e, names, exact)}" for k, e in model.handoff]
    par_args = "".join(f"par_{p}, size_{p}, " for p in P)
    init_args = "".join(f"init_{k}, isize_{k}, " for k in S)

    def head(indent="    ") -> list[str]:
        """The program's neurons, its parameters (one scalar each, or a gather per neuron) and initial states."""
        lines = [
            "pid = tl.program_id(0)",
            "offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
            "mask = offs < N",
            "N64 = tl.cast(N, tl.int64)",
            "if SCALAR:",
            *[f"    p_{p} = tl.load(par_{p})" for p in P],
            "else:",
            "    channel = offs // inner",
            *[f"    p_{p} = tl.load(par_{p} + channel % size_{p}, mask=mask, other=1.0)" for p in P],
            *[f"v_{k} = tl.load(init_{k} + offs % isize_{k}, mask=mask, other=0.0)" for k in S],
            fire,
            f"s_ = tl.zeros([BLOCK], {dt})" if model.handoff else spike,  # post-reset initial states: no spike
        ]
        return [indent + line for line in lines]

    saved_args = "".join(f"saved_{k}, " for k in S)  # memory="potential": every step's states, [T, N] each
    # ck: each neuron's sum of v - v over its initial states and x - x over its inputs: 0, or NaN once it read a NaN
    # or an inf; from then on its spikes are NaN (a host-side error would cost a sync per call), and each program
    # flags whether any of its neurons did
    forward = [
        "@triton.jit",
        f"def forward(x_ptr, {par_args}{init_args}spikes_ptr, {''.join(f'final_{k}, ' for k in S)}{saved_args}flags,",
        "            T, N, inner, SCALAR: tl.constexpr, SAVE: tl.constexpr, BLOCK: tl.constexpr):",
        *head(),
        "    ck = " + " + ".join(f"(v_{k} - v_{k})" for k in S),
        "    for t in range(0, T):",
        "        row = tl.cast(t, tl.int64) * N + offs",
        f"        x_ = tl.load(x_ptr + row, mask=mask, other=0.0).to({dt})",
        "        ck += x_ - x_",
        *[f"        {line}" for line in step],
        f"        {fire}",
        f"        {spike}",
        "        s_out = tl.where(ck == 0, s_, ck)",
        "        tl.store(spikes_ptr + row, s_out.to(spikes_ptr.dtype.element_ty), mask=mask)",
        "        if SAVE:",
        *[f"            tl.store(saved_{k} + row, v_{k}, mask=mask)" for k in S],
        *[f"    {line}" for line in handoff],
        *[f"    tl.store(final_{k} + offs, v_{k}, mask=mask)" for k in S],
        "    tl.store(flags + pid, tl.sum(tl.where(ck == 0, 0, 1), axis=0))",
    ]

    names_d, fire_d, step_d = emit.backward_expressions(model, surrogate_type)
    handoff_d = emit.handoff_expressions(model)
    derivs = {**fire_d, **step_d, **handoff_d}
    zeros = f"tl.zeros([BLOCK], {dt})"

    def chain(pairs, base: str | None = None) -> str:
        return emit.chain_sum(pairs, derivs, zeros, base)

    def history(k: str, t: str) -> str:
        """The load of state ``k`` after step ``t`` recomputed by the backward: the first state's rows are grad_x's
        (each overwritten by its gradient once read) unless grad_x is half, the others' in ``hist``
        ``[T, len(kept), N]``."""
        if k not in kept:
            return f"tl.load(gx_ptr + {t} * N + offs, mask=mask, other=0.0)"
        return f"tl.load(hist_ptr + ({t} * {len(kept)} + {kept.index(k)}) * N64 + offs, mask=mask, other=0.0)"

    def store_history(k: str, t: str) -> str:
        if k not in kept:
            return f"tl.store(gx_ptr + {t} * N + offs, v_{k}, mask=mask)"
        return f"tl.store(hist_ptr + ({t} * {len(kept)} + {kept.index(k)}) * N64 + offs, v_{k}, mask=mask)"

    def handoff_grads() -> list[str]:
        """The gradients of the states handed out (in ``gS_*``) carried back through the handoff: into the states
        after the last step (``gS_*``), its spike (``gs``) and the parameters (``acc_*``)."""
        if not model.handoff:
            return []
        last = "tl.cast(T - 1, tl.int64) * N + offs"
        return [
            "    if SAVED:",
            *[f"        v_{k} = tl.load(saved_{k} + {last}, mask=mask, other=0.0)" for k in S],
            "    else:",
            *[f"        v_{k} = {history(k, 'tl.cast(T - 1, tl.int64)')}" for k in S],
            f"    {fire}",
            f"    {spike}",
            *emit.assignments(handoff_d, names_d, "    ", fast),
            *[f"    gH_{k} = gS_{k}" for k in S],
            *[f"    gS_{i} = " + chain([(f"gH_{k}", f"dH_{k}_{i}") for k in S]) for i in S],
            "    if not DETACH:",
            "        gs = " + chain([(f"gH_{k}", f"dHs_{k}") for k in S]),
            *[f"    if NEED_{p}:\n        acc_{p} = " + chain([(f"gH_{k}", f"dHP_{k}_{p}") for k in S]) for p in P],
        ]

    def initial_grads() -> list[str]:
        """The initial states' (and the parameters') gradients, where the first step's spike is that of the initial
        states and its gradient flows into them; with a handoff the first step sees no spike."""
        if model.handoff:
            return [
                *[f"    if GRAD_INIT_{k}:\n        tl.store(ginit_{k} + offs, gS_{k}, mask=mask)" for k in S],
                *[f"    if NEED_{p}:\n        tl.store(gpar_{p} + offs, acc_{p}, mask=mask)" for p in P],
            ]
        return [
            *[f"    v_{k} = i_{k}" for k in S],
            f"    {fire}",
            *emit.assignments(fire_d, names_d, "    ", fast),
            *[
                f"    if GRAD_INIT_{k}:\n        tl.store(ginit_{k} + offs, gS_{k} + gs * sg_ * df_{k}, mask=mask)"
                for k in S
            ],
            *[
                f"    if NEED_{p}:\n        tl.store(gpar_{p} + offs, acc_{p} + gs * sg_ * dF_{p}, mask=mask)"
                for p in P
            ],
        ]

    flags = "".join(f"NEED_{p}: tl.constexpr, " for p in P) + "".join(f"GRAD_INIT_{k}: tl.constexpr, " for k in S)
    ind = "        "
    backward = [
        "@triton.jit",
        f"def backward(gs_ptr, {''.join(f'gfinal_{k}, gsize_{k}, ' for k in S)}x_ptr, {par_args}{init_args}sg_ptr,",
        f"             hist_ptr, {saved_args}gx_ptr, {''.join(f'ginit_{k}, ' for k in S)}"
        f"{''.join(f'gpar_{p}, ' for p in P)}T, N, inner,",
        f"             SCALAR: tl.constexpr, SAVED: tl.constexpr, DETACH: tl.constexpr, {flags}BLOCK: tl.constexpr):",
        *head(),
        *[f"    i_{k} = v_{k}" for k in S],  # the initial states
        "    sg_p1 = tl.load(sg_ptr)",
        "    sg_p2 = tl.load(sg_ptr + 1)",
        # without SAVED, recompute every step's states into grad_x (the first state, unless half) and hist
        "    if not SAVED:",
        "        for t in range(0, T):",
        f"            x_ = tl.load(x_ptr + tl.cast(t, tl.int64) * N + offs, mask=mask, other=0.0).to({dt})",
        *[f"    {ind}{line}" for line in step],
        f"    {ind}{fire}",
        f"    {ind}{spike}",
        *[f"    {ind}{store_history(k, 'tl.cast(t, tl.int64)')}" for k in S],
        # each neuron's column is read back by the thread that wrote it; the barrier makes that explicit
        "        tl.debug_barrier()",
        *[f"    gS_{k} = tl.load(gfinal_{k} + offs % gsize_{k}, mask=mask, other=0.0)" for k in S],
        f"    gs = tl.zeros([BLOCK], {dt})",
        *[f"    acc_{p} = tl.zeros([BLOCK], {dt})" for p in P],
        *handoff_grads(),
        # the states after the step: those after the last one, then each step's predecessor, carried over
        "    last = tl.cast(T - 1, tl.int64)",
        "    if SAVED:",
        *[f"        n_{k} = tl.load(saved_{k} + last * N + offs, mask=mask, other=0.0)" for k in S],
        "    else:",
        *[f"        n_{k} = {history(k, 'last')}" for k in S],
        "    for i in range(0, T):",
        "        tr = tl.cast(T - 1 - i, tl.int64)",  # a new name: the recompute loop's t is an int32
        "        row = tr * N + offs",
        "        prev = tl.maximum(tr - 1, 0)",
        f"{ind}if SAVED:",  # the states before the step: the initial ones, or the previous step's
        *[
            f"{ind}    o_{k} = tl.where(tr > 0, tl.load(saved_{k} + prev * N + offs, mask=mask, other=0.0), i_{k})"
            for k in S
        ],
        f"{ind}else:",
        *[f"{ind}    o_{k} = tl.where(tr > 0, {history(k, 'prev')}, i_{k})" for k in S],
        *[f"{ind}v_{k} = o_{k}" for k in S],
        f"{ind}{fire}",
        f"{ind}{spike}",
        *([f"{ind}s_ = tl.where(tr > 0, s_, {zero})"] if model.handoff else []),  # the first step sees none
        *[f"{ind}v_{k} = n_{k}" for k in S],
        f"{ind}{fire}",
        *([f"{ind}x_ = tl.load(x_ptr + row, mask=mask, other=0.0).to({dt})"] if model.backward_reads_input else []),
        *emit.assignments({**fire_d, **step_d}, names_d, ind, fast),
        f"{ind}g_s = tl.load(gs_ptr + row, mask=mask, other=0.0).to({dt}) + gs",
        *[f"{ind}g_{k} = " + chain([("g_s * sg_", f"df_{k}")], base=f"gS_{k}") for k in S],
        f"{ind}gx_ = " + chain([(f"g_{k}", f"dx_{k}") for k in S]),
        *([f"{ind}gx_ = round_to_bfloat16(gx_)"] if dtype == torch.bfloat16 else []),
        f"{ind}tl.store(gx_ptr + row, gx_.to(gx_ptr.dtype.element_ty), mask=mask)",
        *[
            f"{ind}if NEED_{p}:\n{ind}    acc_{p} += "
            + chain([("g_s * sg_", f"dF_{p}")] + [(f"g_{k}", f"dP_{k}_{p}") for k in S])
            for p in P
        ],
        *[f"{ind}gS_{old} = " + chain([(f"g_{k}", f"dS_{k}_{old}") for k in S]) for old in S],
        f"{ind}if DETACH:",
        f"{ind}    gs = {zeros}",
        f"{ind}else:",
        f"{ind}    gs = " + chain([(f"g_{k}", f"ds_{k}") for k in S]),
        *[f"{ind}n_{k} = o_{k}" for k in S],
        *initial_grads(),
    ]
    header = [
        f'"""Generated by spikefuse.ops.engine.triton for the neuron {model.name!r} ({model.key}), surrogate '
        f'{surrogate_type.__name__}, {dtype}. Do not edit: rewritten when the generator changes."""',
        "import triton",
        "import triton.language as tl",
        "",
        "",
        *emit.model_facts(model),
        *(_ROUND_TO_BFLOAT16 if dtype == torch.bfloat16 else []),
    ]
    return "\n".join(header + forward + ["", ""] + backward) + "\n"


#: A generated bfloat16 module's rounding of grad_x: to nearest, ties to even, as torch converts (the interpreter's
#: conversion truncates); the result is a float32 that the store converts exactly. NaN stays as it is.
_ROUND_TO_BFLOAT16 = [
    "@triton.jit",
    "def round_to_bfloat16(v):",
    "    b = v.to(tl.uint32, bitcast=True)",
    "    b = ((b + ((b >> 16) & 1) + 0x7FFF) >> 16) << 16",
    "    return tl.where(v == v, b.to(tl.float32, bitcast=True), v)",
    "",
    "",
]


def kernels(model, surrogate_type, dtype: torch.dtype):
    """The imported module of ``model``'s Triton kernels (generated on first use, then cached on disk)."""
    return emit.load_generated(
        "triton", model, surrogate_type, _TAGS[dtype], _GENERATOR, lambda: kernel_source(model, surrogate_type, dtype)
    )


# --------------------------------------------------------------------------------------------------- entry points


def _check(x2: torch.Tensor, tensors: list, what: str) -> None:
    """The kernels index raw pointers: every tensor must be contiguous and on x's device, the parameters' and
    states' of x's compute dtype."""
    if x2.dtype not in _TAGS:
        raise TypeError(f"the generated Triton kernels take float32, float64, float16 or bfloat16, got {x2.dtype}")
    cdt = compute_dtype(x2.dtype)
    for t in tensors:
        if not t.is_contiguous() or t.dtype != cdt or t.device != x2.device:
            raise ValueError(
                f"spikefuse engine Triton backend: every {what} tensor must be contiguous, of dtype "
                f"{cdt} and on {x2.device}; got {t.dtype} on {t.device}"
            )


def block_size(n: int) -> int:
    """Neurons per program before :func:`engine_block`'s cap: large blocks when there are enough of them to fill a
    GPU, else smaller ones, never below ``32 * NUM_WARPS``."""
    for block in (1024, 512, 256):
        if ceil_div(n, block) >= 512:
            return block
    return 128


def engine_block(n: int, states: int, dtype: torch.dtype) -> int:
    """Neurons per program: :func:`block_size`, capped so that each of the 128 threads holds
    at most 8 words of state (neurons per thread x states x words per value; a float64 is two): the backward keeps
    several values per state live across its reverse loop, and more state per thread spills registers to local
    memory (ALIF in float64 at 1024 neurons did on sm_90). At least 128 (one neuron per thread)."""
    words = states * (2 if dtype == torch.float64 else 1)
    cap = 128
    while cap * 2 * words <= 128 * 8:
        cap *= 2
    return min(block_size(n), cap)


def _param_args(params: list) -> tuple[bool, list]:
    """``(SCALAR, [pointer, size] per parameter)``: SCALAR when every parameter has one value."""
    return all(p.numel() == 1 for p in params), [a for p in params for a in (p, p.numel())]


def forward(neuron, inputs, *, save=False, spike_dtype=None):
    model, (x2, params, init, inner) = neuron.model, inputs
    t_steps, n = x2.shape
    if not x2.is_contiguous():
        raise ValueError("spikefuse engine Triton backend: the input must be contiguous")
    _check(x2, [*params, *init], "parameter and initial-state")
    cdt = compute_dtype(x2.dtype)
    spikes = torch.empty_like(x2, dtype=spike_dtype or x2.dtype)  # the store converts to the output's dtype
    final = [torch.empty(n, dtype=cdt, device=x2.device) for _ in model.states]
    saved = [torch.empty_like(x2, dtype=cdt) for _ in model.states] if save else []
    if n == 0:
        return spikes, final, saved
    module = kernels(model, type(neuron.surrogate), x2.dtype)
    scalar, par = _param_args(params)
    block = engine_block(n, len(model.states), cdt)
    flags = torch.empty(ceil_div(n, block), dtype=torch.int32, device=x2.device)
    with device_guard(x2.device):
        module.forward[(ceil_div(n, block),)](
            x2,
            *par,
            *(a for v in init for a in (v, v.numel())),
            spikes,
            *final,
            *(saved or final),
            flags,
            t_steps,
            n,
            int(inner),
            SCALAR=scalar,
            SAVE=bool(save),
            BLOCK=block,
            **COMPILE_OPTIONS,
        )
    refuse_flagged(flags, x2, init)
    return spikes, final, saved


def backward(
    neuron, inputs, grad_spikes, grad_final, need_param_grads, *, saved=(), overwrite_saved=False, overwrite_x=False
):
    model, surrogate, (x2, params, init, inner) = neuron.model, neuron.surrogate, inputs
    t_steps, n = x2.shape
    if not (x2.is_contiguous() and grad_spikes.is_contiguous()) or grad_spikes.dtype != x2.dtype:
        raise ValueError(
            "spikefuse engine Triton backend: the input and the spikes' gradient must be contiguous "
            f"and of one dtype, got {x2.dtype} and {grad_spikes.dtype}"
        )
    _check(x2, [*grad_final, *params, *init, *saved], "state, gradient and parameter")
    device, cdt = x2.device, compute_dtype(x2.dtype)
    half = cdt != x2.dtype
    # with the states saved and not read again, grad_x goes over the first one (memory="potential"); recomputing,
    # grad_x's rows first hold the first state's history (both where grad_x is of the compute dtype)
    grad_x = saved[0] if saved and overwrite_saved and not half else torch.empty_like(x2)
    grad_init = [torch.empty(n if v.numel() == n else 0, dtype=cdt, device=device) for v in init]
    per_neuron = [torch.empty(n if need else 0, dtype=cdt, device=device) for need in need_param_grads]
    if n > 0:
        module = kernels(model, type(surrogate), x2.dtype)
        scalar, par = _param_args(params)
        block = engine_block(n, len(model.states), cdt)
        kept = len(model.states) - (0 if half else 1)
        hist = torch.empty((0 if saved else t_steps, kept, n), dtype=cdt, device=device)
        sg = surrogate_params(surrogate, cdt, device)
        # a buffer that is not written (its flag is off) still needs a valid pointer of its dtype: sg stands in
        with device_guard(device):
            module.backward[(ceil_div(n, block),)](
                grad_spikes,
                *(a for g in grad_final for a in (g, g.numel())),
                x2,
                *par,
                *(a for v in init for a in (v, v.numel())),
                sg,
                hist if hist.numel() else sg,
                *(saved or [sg] * len(model.states)),
                grad_x,
                *(g if g.numel() else sg for g in grad_init),
                *(g if g.numel() else sg for g in per_neuron),
                t_steps,
                n,
                int(inner),
                SCALAR=scalar,
                SAVED=bool(saved),
                DETACH=neuron.detach_reset,
                **{f"NEED_{p}": bool(need) for p, need in zip(model.params, need_param_grads)},
                **{f"GRAD_INIT_{k}": g.numel() > 0 for k, g in zip(model.states, grad_init)},
                BLOCK=block,
                **COMPILE_OPTIONS,
            )
    grad_params = [
        reduce_leak_grad(g, p.numel(), inner if p.numel() > 1 else 1) if need else None
        for g, p, need in zip(per_neuron, params, need_param_grads)
    ]
    return grad_x, [g if g.numel() else None for g in grad_init], grad_params
