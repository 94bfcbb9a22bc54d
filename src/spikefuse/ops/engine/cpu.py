"""Fused CPU kernels (numba) generated from a :class:`~spikefuse.neurons.NeuronModel`.

For each (neuron, surrogate type, dtype) this module writes the Python source of two parallel numba kernels into
the kernel cache folder (:func:`cache_dir`) and imports it, so numba compiles each once per machine and caches
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

import ast
import hashlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import numpy as np
import torch

from ...threads import match_numba_threads
from .. import buffers
from ..common import reduce_leak_grad

BLOCK = 2048  # neurons per parallel task (the backward's scratch, (T+1) x states x BLOCK, stays in cache)
_NP_FUNCTIONS = {"exp": "np.exp", "log": "np.log", "sqrt": "np.sqrt"}
_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}  # the compute dtypes the kernels are made for
_GENERATOR = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]  # this file: the generator's version


def cache_dir() -> Path:
    """Where generated kernel sources (and numba's cache of them) live: ``$SPIKEFUSE_CACHE_DIR``, else
    ``~/.cache/spikefuse/kernels``."""
    base = os.environ.get("SPIKEFUSE_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "spikefuse" / "kernels"


# ----------------------------------------------------------------------------------------------- code emitters


class _Renamer(ast.NodeTransformer):
    """A step expression -> numba source: names to locals, numbers cast to the compute dtype ``F``."""

    def __init__(self, names: dict[str, str]):
        self.names = names

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id=self.names[node.id], ctx=node.ctx), node)

    def visit_Constant(self, node):
        call = ast.Call(func=ast.Name(id="F", ctx=ast.Load()), args=[ast.Constant(float(node.value))], keywords=[])
        return ast.copy_location(call, node)

    def visit_Call(self, node):
        module, function = _NP_FUNCTIONS[node.func.id].split(".")
        func = ast.Attribute(value=ast.Name(id=module, ctx=ast.Load()), attr=function, ctx=ast.Load())
        return ast.copy_location(ast.Call(func=func, args=[self.visit(a) for a in node.args], keywords=[]), node)


def _step_source(expression: str, names: dict[str, str]) -> str:
    tree = _Renamer(names).visit(ast.parse(expression, mode="eval"))
    return ast.unparse(ast.fix_missing_locations(tree))


def _sympy_source(e, names: dict[str, str]) -> str:
    """A sympy expression -> numba source (numbers cast to ``F``, integer powers as products)."""
    import sympy

    def emit(e) -> str:
        if e.is_Symbol:
            return names[e.name]
        if e.is_Number or isinstance(e, sympy.NumberSymbol):
            return f"F({float(e)!r})"
        if e.is_Add:
            return "(" + " + ".join(emit(a) for a in e.args) + ")"
        if e.is_Mul:
            return "(" + " * ".join(emit(a) for a in e.args) + ")"
        if e.is_Pow:
            base, exponent = e.args
            if exponent.is_Integer and 0 < int(exponent) <= 4:
                return "(" + " * ".join([emit(base)] * int(exponent)) + ")"
            if exponent.is_Integer and -4 <= int(exponent) < 0:
                return f"(F(1.0) / ({' * '.join([emit(base)] * -int(exponent))}))"
            if exponent == sympy.Rational(1, 2):
                return f"np.sqrt({emit(base)})"
            return f"np.power({emit(base)}, {emit(exponent)})"
        if isinstance(e, (sympy.exp, sympy.log)):
            return f"np.{type(e).__name__}({emit(e.args[0])})"
        if isinstance(e, sympy.Abs):
            return f"abs({emit(e.args[0])})"
        if isinstance(e, (sympy.Max, sympy.Min)):
            out = emit(e.args[0])
            for a in e.args[1:]:
                out = f"{type(e).__name__.lower()}({out}, {emit(a)})"
            return out
        if isinstance(e, sympy.Piecewise):
            out = "F(0.0)"
            for value, condition in reversed(e.args):
                out = emit(value) if condition == sympy.true else f"({emit(value)} if {emit(condition)} else {out})"
            return out
        if isinstance(e, sympy.core.relational.Relational):
            return f"({emit(e.lhs)} {e.rel_op} {emit(e.rhs)})"
        raise ValueError(f"the CPU kernel generator cannot emit {type(e).__name__} ({e})")

    return emit(e)


def _assignments(exprs: dict[str, object], names: dict[str, str], indent: str) -> list[str]:
    """``name = expression`` lines for sympy expressions, common subexpressions first."""
    import sympy

    keys = list(exprs)
    shared, reduced = sympy.cse([exprs[k] for k in keys], symbols=sympy.numbered_symbols("cse_"))
    names = dict(names)
    lines = []
    for symbol, value in shared:
        names[symbol.name] = symbol.name
        lines.append(f"{indent}{symbol.name} = {_sympy_source(value, names)}")
    lines += [f"{indent}{k} = {_sympy_source(v, names)}" for k, v in zip(keys, reduced)]
    return lines


# --------------------------------------------------------------------------------------------- kernel sources


def kernel_source(model, surrogate_type, dtype: torch.dtype) -> str:
    """The Python source of the forward and backward kernels of ``model`` with ``surrogate_type``'s derivative."""
    import sympy

    S, P = model.states, model.params
    np_dtype = f"np.{_NP_DTYPES[dtype].__name__}"
    step_names = {**{k: f"v_{k}" for k in S}, **{p: f"p_{p}" for p in P}, "x": "x_", "s": "s_"}
    fire_names = {**{k: f"v_{k}" for k in S}, **{p: f"p_{p}" for p in P}}
    params_arg = "".join(f"par_{p}, " for p in P)
    init_arg = "".join(f"init_{k}, " for k in S)
    fire = _step_source(model.fire, fire_names)
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

        step_lines = [f"v_{t} = {_step_source(e, step_names)}" for t, e in model.step]
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

        d = model.derivatives
        sg_u = sympy.Symbol("u_")
        sg_expr = surrogate_type.sympy_derivative(sg_u, sympy.Symbol("sg_p1"), sympy.Symbol("sg_p2"))
        sym_names = {**{f"old_{k}": f"o_{k}" for k in S}, **{f"new_{k}": f"v_{k}" for k in S},
                     **{p: f"p_{p}" for p in P}, "x": "x_", "s": "s_", "u_": "u_", "sg_p1": "sg_p1", "sg_p2": "sg_p2"}
        fire_derivs = {f"df_{k}": d.fire[i] for i, k in enumerate(S)}
        fire_derivs.update({f"dF_{p}": d.fire_param[i] for i, p in enumerate(P)})
        step_derivs = {}
        for i, k in enumerate(S):
            step_derivs[f"dx_{k}"] = d.input[i]
            step_derivs[f"ds_{k}"] = d.spike[i]
            for j, old in enumerate(S):
                step_derivs[f"dS_{k}_{old}"] = d.state[i][j]
            for j, p in enumerate(P):
                step_derivs[f"dP_{k}_{p}"] = d.param[i][j]
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
            *_assignments({"sg_": sg_expr, **fire_derivs, **step_derivs}, sym_names, ind),
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
            *_assignments({"sg_": sg_expr, **fire_derivs}, sym_names, "        "),
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


_MODULES: dict[tuple, object] = {}


def kernels(model, surrogate_type, dtype: torch.dtype):
    """The imported module of ``model``'s kernels (generated on first use, then cached on disk)."""
    key = (model, surrogate_type, dtype)
    if key in _MODULES:
        return _MODULES[key]
    tag = _NP_DTYPES[dtype].__name__
    # The file name holds everything the source depends on (the dynamics, the surrogate's formula, this
    # generator), so an existing file is imported without deriving anything again (sympy costs ~0.5 s).
    inputs = (model.key, inspect.getsource(surrogate_type.sympy_derivative), _GENERATOR, tag)
    digest = hashlib.sha256(repr(inputs).encode()).hexdigest()[:12]
    name = f"spikefuse_{model.name}_{surrogate_type.__name__}_{tag}_{digest}"
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    if not path.exists():
        source = kernel_source(model, surrogate_type, dtype)
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(source)
        os.replace(tmp, path)  # atomic: processes starting together (data-parallel ranks) never read half a file
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _MODULES[key] = module
    return module


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
