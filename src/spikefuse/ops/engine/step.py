"""One time step of a :class:`~spikefuse.neurons.NeuronModel` as PyTorch operations in one autograd node: the call
a peer's users make in their step loops (``spk, mem = lif(x_t, mem)``), where a fused kernel over time has no time
to fuse and its launch and bookkeeping would cost more than the step.

The forward and backward are generated from the model's definition, as the numba and Triton kernels are: the step
and fire expressions emitted in the reference's order of floating-point operations (so the spikes and states equal
the reference's and the kernels' bit for bit), the backward from the same sympy derivatives and chain rule as the
kernels'. Autograd sees one node per step (the peers' step is five to ten), whose backward recomputes the reset's
spike and the surrogate's argument from the states it keeps: the step's old and new states (alive anyway as the
caller's states) and its input only where a derivative reads it.

Tensors keep their shapes: the input ``[B, ...]``, each state of the input's shape, each parameter broadcastable
against it (one value, or one per neuron); a parameter's gradient is summed back to its shape. A recurrent layer's
step takes its recurrent current ``x_rec`` beside the input (:attr:`NeuronModel.recurrent_step`), whose gradient is
the input's.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import torch

from . import emit
from .emit import Dialect
from ..common import compute_dtype, refuse_non_finite, saved_tensors

__all__ = ["step", "kernels"]

_GENERATOR = hashlib.sha256(Path(emit.__file__).read_bytes() + Path(__file__).read_bytes()).hexdigest()[:12]


def _is_number(source: str) -> bool:
    try:
        float(source)
    except ValueError:
        return False
    return True


def _select(condition: str, a: str, b: str) -> str:
    # a 0/1 selection is the condition's value; of two numbers one becomes a tensor (torch.where takes one scalar)
    if condition == "(s_ != 0.0)":  # the spike's own comparison (see _source)
        condition = "c_"
    if (a, b) == ("1.0", "0.0"):
        return f"({condition}).to(DTYPE)"
    if _is_number(a) and _is_number(b):
        return f"torch.where({condition}, _tensor({a}, x_), {b})"
    return f"torch.where({condition}, {a}, {b})"


def _chain(pairs, derivatives: dict, zero: str, base: str | None = None) -> str:
    """:func:`~spikefuse.ops.engine.emit.chain_sum` without the tensor operations of a derivative that is 1 or -1
    (each a pass over the step's tensors; the gradients are not bitwise promises)."""
    terms = [base] if base else []
    for g, d in pairs:
        value = derivatives[d]
        if value == 0:
            continue
        terms.append(g if value == 1 else f"(-{g})" if value == -1 else f"{g} * {d}")
    return " + ".join(terms) if terms else zero


def _live(lines: list[str]) -> list[str]:
    """``lines`` (a function's body) without the assignments whose value nothing reads (derivatives the chain left
    out, a spike no derivative reads): each would be a pass over the tensors for nothing. An assignment inside a
    block (deeper indented: the ``if``) may not run, so it leaves the value before it live."""
    live: set[str] = set()
    kept: list[str] = []
    for line in reversed(lines):
        assignment = re.match(r"( *)(\w+) = (.*)", line)
        if assignment:
            indent, target, value = assignment.groups()
            if target not in live:
                continue
            if len(indent) <= 4:
                live.discard(target)
            line_reads = value
        else:
            line_reads = line
        live |= set(re.findall(r"\b[A-Za-z_]\w*\b", line_reads))
        kept.append(line)
    return kept[::-1]


#: How the generated step spells a neuron's expressions: Python numbers (which torch applies in the tensors'
#: dtype, as the reference's do) and torch functions.
TORCH = Dialect(
    number=lambda v: repr(float(v)),
    functions={"exp": "torch.exp", "log": "torch.log", "sqrt": "torch.sqrt"},
    divide=lambda a, b: f"({a} / {b})",
    select=_select,
    abs="torch.abs",
    maximum="_maximum",
    minimum="_minimum",
    power="torch.pow",
)


def _source(model, surrogate_type, recurrent: bool, grads: bool) -> list[str]:
    """``forward`` and ``backward`` of one step of ``model`` (``recurrent``: of its recurrent step, suffix
    ``_recurrent``); ``grads``: the backward with the parameters' gradients (suffix ``_grads``; the forward is
    left out)."""
    S, P = model.states, model.params
    sfx = ("_recurrent" if recurrent else "") + ("_grads" if grads else "")
    params = "".join(f"p_{p}, " for p in P)
    names = {**{k: f"v_{k}" for k in S}, **{p: f"p_{p}" for p in P}, "x": "x_", "s": "s_", "x_rec": "xr_"}
    old_names = {**names, **{k: f"o_{k}" for k in S}}
    fired = "(u_ > 0.0)" if model.strict else "(u_ >= 0.0)"
    xr = "xr_, " if recurrent else ""

    def spike(indent: str) -> list[str]:
        """The spike of ``u_``: ``c_`` (bool: what a selection on it reads) and ``s_``, each made where read. The
        comparison writes the spike's floats itself (a bool tensor converted would take two passes, twice as long)."""
        compare = "torch.gt" if model.strict else "torch.ge"
        return [f"{indent}c_ = {fired}", f"{indent}s_ = {compare}(u_, 0.0, out=torch.empty_like(u_))"]

    def fire(state_names) -> str:
        return f"u_ = {emit.step_source(model.fire, state_names, TORCH)}"

    step = model.recurrent_step if recurrent else model.step
    forward = [
        f"def forward{sfx}(x_, {xr}{params}{''.join(f'o_{k}, ' for k in S)}):",
        '    """``(spike, *new states, u)`` of one step from the old states ``o_*``."""',
        *(["    c_ = _false(x_)", "    s_ = _zero(x_)"] if model.handoff else [f"    {fire(old_names)}", *spike("    ")]),
        *[f"    v_{k} = o_{k}" for k in S],
        *[f"    v_{t} = {emit.step_source(e, names, TORCH)}" for t, e in step],
        f"    {fire(names)}",
        *spike("    "),
        *[f"    v_{t} = {emit.step_source(e, names, TORCH)}" for t, e in model.handoff],
        f"    return (s_, {''.join(f'v_{k}, ' for k in S)}u_)",
    ]

    sym_names, fire_derivs, step_derivs = emit.backward_expressions(model, surrogate_type)
    handoff_derivs = emit.handoff_expressions(model)
    derivs = {**fire_derivs, **step_derivs, **handoff_derivs}
    chain = lambda pairs, base=None: _chain(pairs, derivs, "0.0", base)  # noqa: E731
    ind = "    "
    if recurrent:  # the derivatives read the step's input, which is x + x_rec (NeuronModel.recurrent_step)
        sym_names = {**sym_names, "x": "(x_ + xr_)"}
    step_syms = {**sym_names, **{f"old_{k}": f"o_{k}" for k in S}}
    # the fire's derivatives at the old states (the reset spike's): the new-state symbols read the old values
    old_fire_syms = {**sym_names, **{f"new_{k}": f"o_{k}" for k in S}}
    if model.handoff:
        # w_* are the states handed out: the step's own new states are recomputed (its first step sees no spike),
        # and the gradients of the handed-out states carried back to them (in gS_*)
        handoff = [
            f"{ind}c_ = _false(x_)",
            f"{ind}s_ = _zero(x_)",
            *[f"{ind}v_{k} = o_{k}" for k in S],
            *[f"{ind}v_{t} = {emit.step_source(e, names, TORCH)}" for t, e in step],
            *[f"{ind}w_{k} = v_{k}" for k in S],
            f"{ind}{fire(names)}",
            *spike(ind),
            *emit.assignments(handoff_derivs, sym_names, ind, TORCH),
            *[f"{ind}gH_{k} = gS_{k}" for k in S],
            *[f"{ind}gS_{i} = " + chain([(f"gH_{k}", f"dH_{k}_{i}") for k in S]) for i in S],
            f"{ind}gs = 0.0 if detach else " + chain([(f"gH_{k}", f"dHs_{k}") for k in S]),
            *([f"{ind}acc_{p} = " + chain([(f"gH_{k}", f"dHP_{k}_{p}") for k in S]) for p in P] if grads else []),
            f"{ind}c_ = _false(x_)",
            f"{ind}s_ = _zero(x_)",
        ]
    else:
        handoff = []
    backward = [
        f"def backward{sfx}(g, {''.join(f'gS_{k}, ' for k in S)}x_, {xr}{params}"
        f"{''.join(f'o_{k}, ' for k in S)}{''.join(f'w_{k}, ' for k in S)}sg_p1, sg_p2, detach):",
        '    """``(grad_x, *grad per old state, *grad per parameter)`` of one step, from the gradients of its spike'
        ' ``g`` and new states ``gS_*``, its old states ``o_*`` and new ones ``w_*``."""',
        *handoff,
        *([] if model.handoff else [f"{ind}{fire(old_names)}", *spike(ind)]),
        *[f"{ind}v_{k} = w_{k}" for k in S],
        f"{ind}{fire(names)}",
        *emit.assignments({**fire_derivs, **step_derivs}, step_syms, ind, TORCH),
        f"{ind}g_s = g + gs" if model.handoff else f"{ind}g_s = g",
        *[f"{ind}g_{k} = " + chain([("g_s * sg_", f"df_{k}")], base=f"gS_{k}") for k in S],
        f"{ind}gx = " + chain([(f"g_{k}", f"dx_{k}") for k in S]),
        *[
            f"{ind}gp_{p} = "
            + chain(
                [("g_s * sg_", f"dF_{p}")] + [(f"g_{k}", f"dP_{k}_{p}") for k in S],
                f"acc_{p}" if model.handoff else None,
            )
            for p in (P if grads else ())
        ],
        *[f"{ind}gO_{old} = " + chain([(f"g_{k}", f"dS_{k}_{old}") for k in S]) for old in S],
    ]
    if not model.handoff:  # the reset's spike is that of the old states: its gradient flows into them
        backward += [
            f"{ind}if not detach:",
            f"{ind}    gso = " + chain([(f"g_{k}", f"ds_{k}") for k in S]),
            f"{ind}    {fire(old_names)}",
            *emit.assignments(fire_derivs, old_fire_syms, ind + "    ", TORCH),
            *[f"{ind}    gO_{k} = " + chain([("gso * sg_", f"df_{k}")], base=f"gO_{k}") for k in S],
            *[f"{ind}    gp_{p} = " + chain([("gso * sg_", f"dF_{p}")], base=f"gp_{p}") for p in (P if grads else ())],
        ]
    backward.append(f"{ind}return (gx, {''.join(f'gO_{k}, ' for k in S)}{''.join(f'gp_{p}, ' for p in P if grads)})")
    forward = forward[:2] + _live(forward[2:])
    backward = backward[:3] + _live(backward[3:])
    return backward if grads else forward + ["", ""] + backward


def kernel_source(model, surrogate_type, dtype: torch.dtype) -> str:
    """The Python source of ``model``'s one-step forward and backward (and those of its recurrent step)."""
    header = [
        f'"""Generated by spikefuse.ops.engine.step for the neuron {model.name!r} ({model.key}), surrogate '
        f'{surrogate_type.__name__}, {dtype}. Do not edit: rewritten when the generator changes."""',
        "import torch",
        "",
        f"DTYPE = {dtype}",
        *emit.model_facts(model),
        "",
        "def _tensor(value, like):",
        "    return torch.tensor(value, dtype=DTYPE, device=like.device)",
        "",
        "",
        "def _zero(like):",
        "    return torch.zeros((), dtype=DTYPE, device=like.device)",
        "",
        "",
        "def _false(like):",
        "    return torch.zeros((), dtype=torch.bool, device=like.device)",
        "",
        "",
        "def _maximum(a, b):",
        "    if not isinstance(a, torch.Tensor):",
        "        a, b = b, a",
        "    return torch.maximum(a, b) if isinstance(b, torch.Tensor) else torch.clamp_min(a, b)",
        "",
        "",
        "def _minimum(a, b):",
        "    if not isinstance(a, torch.Tensor):",
        "        a, b = b, a",
        "    return torch.minimum(a, b) if isinstance(b, torch.Tensor) else torch.clamp_max(a, b)",
        "",
        "",
    ]
    parts = [_source(model, surrogate_type, recurrent, grads) for recurrent in (False, True) for grads in (False, True)]
    return "\n".join(header + [line for part in parts for line in (*part, "", "")]).rstrip("\n") + "\n"


def kernels(model, surrogate_type, dtype: torch.dtype):
    """The imported module of ``model``'s generated step (made on first use, then cached on disk)."""
    return emit.load_generated(
        "step",
        model,
        surrogate_type,
        str(dtype).removeprefix("torch."),
        _GENERATOR,
        lambda: kernel_source(model, surrogate_type, dtype),
    )


class _Step(torch.autograd.Function):
    """One step of a model (``x_rec``: its recurrent step) as one autograd node: see the module docstring."""

    @staticmethod
    def forward(ctx, x, x_rec, model, surrogate, detach_reset, n_params, *tensors):
        generated = kernels(model, type(surrogate), x.dtype)
        params, old = tensors[:n_params], tensors[n_params:]
        if x_rec is None:
            spike, *new, u = generated.forward(x, *params, *old)
        else:
            spike, *new, u = generated.forward_recurrent(x, x_rec, *params, *old)
        # A NaN or an inf gives no spike (u >= 0 is false): refused where reading it costs no GPU sync. The sum is
        # finite where every value is (a pass of a third of isfinite's), unless it overflows: then the full check.
        if x.device.type == "cpu" and not math.isfinite(u.sum()) and not bool(torch.isfinite(u).all()):
            refuse_non_finite(x.unsqueeze(0), [*old, *([] if x_rec is None else [x_rec])])
        # every state a tensor of its own (autograd's outputs): not an old one left as it was, nor a constant (a
        # handoff's ``r = 0``)
        new = [
            v.clone() if v is o else v if isinstance(v, torch.Tensor) else torch.full_like(x, v)
            for v, o in zip(new, old)
        ]
        reads_input = generated.BACKWARD_READS_INPUT or bool(model.handoff)
        ctx.save_for_backward(x if reads_input else None, x_rec if reads_input else None, *params, *old, *new)
        ctx.generated, ctx.surrogate, ctx.detach_reset, ctx.n_params = generated, surrogate, detach_reset, n_params
        ctx.recurrent, ctx.model_name = x_rec is not None, model.name
        return (spike, *new)

    @staticmethod
    def backward(ctx, grad_spike, *grad_new):
        generated, n_params = ctx.generated, ctx.n_params
        x, x_rec, *tensors = saved_tensors(ctx, f"the {ctx.model_name} neurons")
        params, rest = tensors[:n_params], tensors[n_params:]
        old, new = rest[: len(rest) // 2], rest[len(rest) // 2 :]
        need_params = any(ctx.needs_input_grad[6 : 6 + n_params])
        name = "backward" + ("_recurrent" if ctx.recurrent else "") + ("_grads" if need_params else "")
        inputs = (x, x_rec) if ctx.recurrent else (x,)
        grads = getattr(generated, name)(
            grad_spike, *grad_new, *inputs, *params, *old, *new, *ctx.surrogate.params(), ctx.detach_reset
        )
        grad_x, grads = grads[0], grads[1:]
        grad_old, grad_params = grads[: len(old)], grads[len(old) :]
        grad_params = [_fit(g, p) for g, p in zip(grad_params, params)] if need_params else [None] * n_params
        grad_rec = grad_x if ctx.recurrent else None  # the step's input is x + x_rec
        return (grad_x, grad_rec, None, None, None, None, *grad_params, *(_fit(g, o) for g, o in zip(grad_old, old)))


def _fit(grad, like: torch.Tensor):
    """``grad`` summed to the shape of the tensor ``like`` it is the gradient of (broadcast in the step); None for
    a number (a parameter the step does not read)."""
    if not isinstance(grad, torch.Tensor):
        return None
    return grad if grad.shape == like.shape else grad.sum_to_size(like.shape)


def step(model, x, params, states, surrogate, detach_reset: bool, x_rec=None) -> list:
    """One step of ``model`` with autograd: ``[spike, *new states]``. ``x`` ``[B, ...]`` (float16 / bfloat16 run in
    float32, the spike coming back in ``x``'s dtype), ``states`` of ``x``'s shape, ``params`` in ``model.params``
    order broadcastable against ``x``, ``x_rec``: a recurrent layer's recurrent current (its step). The caller has
    checked them (:func:`spikefuse.neuron`'s checks)."""
    cdt = compute_dtype(x.dtype)
    to = lambda t: t if t.dtype == cdt else t.to(cdt)  # noqa: E731  (a conversion call costs as much as a small op)
    out = _Step.apply(
        to(x),
        None if x_rec is None else to(x_rec),
        model,
        surrogate,
        bool(detach_reset),
        len(params),
        *map(to, params),
        *map(to, states),
    )
    return [out[0] if x.dtype == cdt else out[0].to(x.dtype), *out[1:]]
