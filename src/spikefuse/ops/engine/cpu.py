"""Fused CPU kernels (numba) generated from a :class:`~spikefuse.neurons.NeuronModel`.

For each (neuron, surrogate type, dtype) this module writes the Python source of two parallel numba kernels into
the kernel cache folder (:func:`.emit.cache_dir`) and imports it, so numba compiles each once per machine and caches
the machine code beside it:

- ``forward``: each parallel task takes a block of neurons and runs all T steps over it (neurons innermost, so the
  step vectorizes), writing the spikes and the final states; nothing is saved for backward;
- ``backward``: each task recomputes its block's states over the T steps into a block-sized scratch (it stays in
  cache), then runs back through time with the derivatives of :attr:`NeuronModel.derivatives`, writing the input
  gradient, the initial states' gradients and per-neuron parameter gradients (reduced per channel afterwards).

The step's expressions are emitted as written, with every number cast to the compute dtype, so the spikes and
states equal the reference's bit for bit; the derivatives are emitted from sympy after common-subexpression
elimination. Entry points as :mod:`spikefuse.ops.engine.reference`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from ...threads import match_numba_threads
from .. import buffers
from ..common import reduce_leak_grad
from . import emit
from .emit import Dialect

BLOCK = 2048  # neurons per parallel task (the backward's scratch, (T+1) x states x BLOCK, stays in cache)
_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}  # the compute dtypes the kernels are made for
# The generator's version: this file and the emitters.
_GENERATOR = hashlib.sha256(Path(__file__).read_bytes() + Path(emit.__file__).read_bytes()).hexdigest()[:12]


#: How the numba kernels spell a neuron's expressions (numbers cast to the compute dtype ``F``).
NUMBA = Dialect(
    number=lambda v: f"F({v!r})",
    functions={"exp": "np.exp", "log": "np.log", "sqrt": "np.sqrt"},
    divide=lambda a, b: f"({a} / {b})",
    select=lambda c, a, b: f"({a} if {c} else {b})",
    abs="abs",
    maximum="max",
    minimum="min",
    power="np.power",
)


# --------------------------------------------------------------------------------------------- kernel sources


def kernel_source(model, surrogate_type, dtype: torch.dtype) -> str:
    """The Python source of the forward and backward kernels of ``model`` with ``surrogate_type``'s derivative."""
    S, P = model.states, model.params
    np_dtype = f"np.{_NP_DTYPES[dtype].__name__}"
    step_names = {**{k: f"v_{k}" for k in S}, **{p: f"p_{p}" for p in P}, "x": "x_", "s": "s_"}
    fire_names = {**{k: f"v_{k}" for k in S}, **{p: f"p_{p}" for p in P}}
    params_arg = "".join(f"par_{p}, " for p in P)
    init_arg = "".join(f"init_{k}, " for k in S)
    fire = emit.step_source(model.fire, fire_names, NUMBA)
    fired = "(u_ > F(0.0))" if model.strict else "(u_ >= F(0.0))"  # a constant of the code: no branch

    def variant(scalar: bool) -> list[str]:
        """The kernels with parameters as per-neuron arrays, or (``scalar``, suffix ``_scalar``) as scalars: when
        every parameter has one value, nothing is gathered or loaded per neuron."""
        sfx = "_scalar" if scalar else ""
        def load_block(indent: str) -> list[str]:
            lines = [] if scalar else [f"{indent}pv_{p} = np.empty(m, F)" for p in P]
            lines += [f"{indent}for j in range(m):", f"{indent}    n = n0 + j"]
            lines += [] if scalar else [f"{indent}    pv_{p}[j] = par_{p}[(n // inner) % par_{p}.shape[0]]" for p in P]
            return lines

        def locals_at(j: str, indent: str) -> list[str]:
            return [f"{indent}p_{p} = par_{p}" if scalar else f"{indent}p_{p} = pv_{p}[{j}]" for p in P]

        step_lines = [f"v_{t} = {emit.step_source(e, step_names, NUMBA)}" for t, e in model.step]
        finals_arg = "".join(f"final_{k}, " for k in S)
        gfinal_arg = "".join(f"gfinal_{k}, " for k in S)
        ginit_arg = "".join(f"ginit_{k}, " for k in S)
        gpar_arg = "".join(f"gpar_{p}, " for p in P)

        # Each parallel task calls a plain (non-parallel) block function: LLVM vectorizes its loops over row slices
        # (indices from range(m), provably in bounds), which it does not inside a parfor body.
        fwd = [
            "@njit(cache=True, error_model='numpy')",
            f"def _forward_block{sfx}(x, {params_arg}{init_arg}inner, spikes, {finals_arg}n0, m):",
            *[f"    st_{k} = np.empty(m, F)" for k in S],
            "    sp = np.empty(m, F)",
            *load_block("    "),
            *[f"        st_{k}[j] = init_{k}[n % init_{k}.shape[0]]" for k in S],
            *[f"        v_{k} = st_{k}[j]" for k in S],
            *locals_at("j", "        "),
            f"        u_ = {fire}",
            f"        sp[j] = F(1.0) if {fired} else F(0.0)",
            "    for t in range(x.shape[0]):",
            "        xr = x[t, n0:n0 + m]",
            "        sr = spikes[t, n0:n0 + m]",
            "        for j in range(m):",
            *locals_at("j", "            "),
            "            x_ = xr[j]",
            "            s_ = sp[j]",
            *[f"            v_{k} = st_{k}[j]" for k in S],
            *[f"            {line}" for line in step_lines],
            f"            u_ = {fire}",
            f"            s_ = F(1.0) if {fired} else F(0.0)",
            *[f"            st_{k}[j] = v_{k}" for k in S],
            "            sp[j] = s_",
            "            sr[j] = s_",
            "    for j in range(m):",
            *[f"        final_{k}[n0 + j] = st_{k}[j]" for k in S],
            "",
            "",
            "@njit(parallel=True, cache=True, error_model='numpy')",
            f"def forward{sfx}(x, {params_arg}{init_arg}inner, spikes, {finals_arg}):",
            "    N = x.shape[1]",
            "    for b in prange((N + BLOCK - 1) // BLOCK):",
            "        n0 = b * BLOCK",
            f"        _forward_block{sfx}(x, {params_arg}{init_arg}inner, spikes, {finals_arg}n0, min(BLOCK, N - n0))",
        ]

        sym_names, fire_derivs, step_derivs = emit.backward_expressions(model, surrogate_type)
        ind = "            "
        bwd_args = (f"grad_spikes, {gfinal_arg}x, {params_arg}{init_arg}sg_p1, sg_p2, detach, inner, need_params, "
                    f"grad_x, {ginit_arg}{gpar_arg}")  # fmt: skip
        bwd = [
            "@njit(cache=True, error_model='numpy')",
            f"def _backward_block{sfx}({bwd_args}n0, m):",
            "    T = x.shape[0]",
            "    N = x.shape[1]",
            f"    hist = np.empty((T + 1, {len(S)}, m), F)",
            *load_block("    "),
            *[f"        hist[0, {i}, j] = init_{k}[n % init_{k}.shape[0]]" for i, k in enumerate(S)],
            "    for t in range(T):",
            "        xr = x[t, n0:n0 + m]",
            "        for j in range(m):",
            *locals_at("j", "            "),
            *[f"            v_{k} = hist[t, {i}, j]" for i, k in enumerate(S)],
            f"            u_ = {fire}",
            f"            s_ = F(1.0) if {fired} else F(0.0)",
            "            x_ = xr[j]",
            *[f"            {line}" for line in step_lines],
            *[f"            hist[t + 1, {i}, j] = v_{k}" for i, k in enumerate(S)],
            f"    gS = np.empty(({len(S)}, m), F)",
            "    gs = np.zeros(m, F)",
            f"    acc = np.zeros(({max(len(P), 1)}, m), F)",
            # loop-invariant flags: LLVM unswitches the loop on them, so unneeded parameter gradients cost nothing
            *[f"    need_{p} = need_params[{pi}]" for pi, p in enumerate(P)],
            "    for j in range(m):",
            *[f"        gS[{i}, j] = gfinal_{k}[(n0 + j) % gfinal_{k}.shape[0]]" for i, k in enumerate(S)],
            "    for t in range(T - 1, -1, -1):",
            "        xr = x[t, n0:n0 + m]",
            "        gr = grad_spikes[t, n0:n0 + m]",
            "        gxr = grad_x[t, n0:n0 + m]",
            "        for j in range(m):",
            *locals_at("j", ind),
            *[f"{ind}o_{k} = hist[t, {i}, j]" for i, k in enumerate(S)],
            *[f"{ind}v_{k} = o_{k}" for k in S],
            f"{ind}u_ = {fire}",
            f"{ind}s_ = F(1.0) if {fired} else F(0.0)",
            *[f"{ind}v_{k} = hist[t + 1, {i}, j]" for i, k in enumerate(S)],
            f"{ind}u_ = {fire}",
            f"{ind}x_ = xr[j]",
            *emit.assignments({**fire_derivs, **step_derivs}, sym_names, ind, NUMBA),
            f"{ind}g_s = gr[j] + gs[j]",
            *[f"{ind}g_{k} = gS[{i}, j] + g_s * sg_ * df_{k}" for i, k in enumerate(S)],
            f"{ind}gxr[j] = " + " + ".join(f"g_{k} * dx_{k}" for k in S),
            *[f"{ind}if need_{p}:\n{ind}    acc[{pi}, j] += g_s * sg_ * dF_{p} + "
              + " + ".join(f"g_{k} * dP_{k}_{p}" for k in S) for pi, p in enumerate(P)],
            *[f"{ind}gS[{i}, j] = " + " + ".join(f"g_{k} * dS_{k}_{old}" for k in S) for i, old in enumerate(S)],
            f"{ind}gs[j] = F(0.0) if detach else " + " + ".join(f"g_{k} * ds_{k}" for k in S),
            # the first step's s is the spike of the initial state: its gradient flows into that state
            "    for j in range(m):",
            "        n = n0 + j",
            *locals_at("j", "        "),
            *[f"        v_{k} = hist[0, {i}, j]" for i, k in enumerate(S)],
            f"        u_ = {fire}",
            *emit.assignments(fire_derivs, sym_names, "        ", NUMBA),
            *[f"        if ginit_{k}.shape[0] == N:\n            ginit_{k}[n] = gS[{i}, j] + gs[j] * sg_ * df_{k}"
              for i, k in enumerate(S)],
            *[f"        if need_params[{pi}]:\n            gpar_{p}[n] = acc[{pi}, j] + gs[j] * sg_ * dF_{p}"
              for pi, p in enumerate(P)],
            "",
            "",
            "@njit(parallel=True, cache=True, error_model='numpy')",
            f"def backward{sfx}({bwd_args}):",
            "    N = x.shape[1]",
            "    for b in prange((N + BLOCK - 1) // BLOCK):",
            "        n0 = b * BLOCK",
            f"        _backward_block{sfx}({bwd_args}n0, min(BLOCK, N - n0))",
        ]
        return fwd + ["", ""] + bwd

    header = [
        f'"""Generated by spikefuse.ops.engine.cpu for the neuron {model.name!r} ({model.key}), surrogate '
        f'{surrogate_type.__name__}, {dtype}. Do not edit: rewritten when the generator changes."""',
        "import numpy as np",
        "from numba import njit, prange",
        f"F = {np_dtype}",
        f"BLOCK = {BLOCK}",
        "",
    ]
    return "\n".join(header + variant(False) + ["", ""] + variant(True)) + "\n"


def kernels(model, surrogate_type, dtype: torch.dtype):
    """The imported module of ``model``'s kernels (generated on first use, then cached on disk)."""
    tag = _NP_DTYPES[dtype].__name__
    return emit.load_generated("cpu", model, surrogate_type, tag, _GENERATOR,
                               lambda: kernel_source(model, surrogate_type, dtype))  # fmt: skip


# --------------------------------------------------------------------------------------------------- entry points


def _np(t: torch.Tensor):
    return t.detach().contiguous().numpy()


def _params(params: list, dtype: torch.dtype) -> tuple[str, list]:
    """The kernel variant's suffix and its parameter arguments: scalars when every parameter has one value."""
    if all(p.numel() == 1 for p in params):
        return "_scalar", [_NP_DTYPES[dtype](float(p)) for p in params]
    return "", [_np(p) for p in params]


def _surrogate_args(surrogate, dtype) -> tuple:
    """The surrogate's two parameters as scalars of the compute dtype."""
    return tuple(_NP_DTYPES[dtype](v) for v in surrogate.params())


def forward(model, x2, params, inner, init, surrogate, detach_reset):
    t_steps, n = x2.shape
    module = kernels(model, type(surrogate), x2.dtype)
    match_numba_threads(t_steps * n)
    spikes = buffers.empty((t_steps, n), x2.dtype)
    final = [torch.empty(n, dtype=x2.dtype) for _ in model.states]
    suffix, par = _params(params, x2.dtype)
    getattr(module, "forward" + suffix)(_np(x2), *par, *(_np(v) for v in init), int(inner), spikes.numpy(),
                                        *(f.numpy() for f in final))  # fmt: skip
    return spikes, final


def backward(model, grad_spikes, grad_final, x2, params, inner, init, surrogate, detach_reset, need_param_grads):
    t_steps, n = x2.shape
    module = kernels(model, type(surrogate), x2.dtype)
    match_numba_threads(t_steps * n)
    grad_x = buffers.empty((t_steps, n), x2.dtype)
    grad_init = [torch.empty(n if v.numel() == n else 0, dtype=x2.dtype) for v in init]
    per_neuron = [torch.empty(n if need else 0, dtype=x2.dtype) for need in need_param_grads]
    suffix, par = _params(params, x2.dtype)
    getattr(module, "backward" + suffix)(
        _np(grad_spikes), *(_np(g) for g in grad_final), _np(x2), *par, *(_np(v) for v in init),
        *_surrogate_args(surrogate, x2.dtype), bool(detach_reset), int(inner),
        np.asarray(need_param_grads, dtype=np.bool_), grad_x.numpy(), *(g.numpy() for g in grad_init),
        *(g.numpy() for g in per_neuron),
    )  # fmt: skip
    grad_params = [
        reduce_leak_grad(g, p.numel(), inner if p.numel() > 1 else 1) if need else None
        for g, p, need in zip(per_neuron, params, need_param_grads)
    ]
    return grad_x, [g if g.numel() else None for g in grad_init], grad_params
