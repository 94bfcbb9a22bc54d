"""One time step of a :class:`~spikefuse.neurons.NeuronModel` on the CPU as one autograd node: the call a peer's
users make in their step loops (``spk, mem = lif(x_t, mem)``), where a fused kernel over time has no time to fuse,
and the sequence path's launch and bookkeeping, or a peer's five to ten autograd nodes, cost more than the step.

The forward and backward of one step are generated from the model's definition as the fused kernels are (the step
and fire expressions emitted in the reference's order of floating-point operations, the backward from the same
sympy derivatives and chain rule), each as one numba loop over the neurons: the spikes and states equal the
reference's and the fused kernels' bit for bit. The node keeps the step's old and new states (alive anyway as the
caller's) and its input only where a derivative reads it; the backward recomputes the rest.

Arrays: the input ``x`` and every state ``[N]`` (one step of N neurons, flattened), a recurrent layer's recurrent
current ``x_rec`` (its step, :attr:`NeuronModel.recurrent_step`) too; each parameter ``[1]`` or ``[C]``, neuron
``n`` using ``(n // inner) % C``. Steps of more than :data:`MAX_NEURONS` neurons run the fused kernels instead (see
:func:`takes`), whose threads pay there.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import torch

from .. import numba_common
from ..autograd_guards import refuse_double_backward, saved_tensors
from ..nonfinite import refuse_non_finite
from ..numerics import compute_dtype, reduce_leak_grad
from . import DTYPES, emit
from ...surrogate import refuse_active

__all__ = ["step", "takes", "kernels", "MAX_NEURONS"]

#: The largest step this path runs: beyond it the fused kernels' threads win over one thread's loop (a snnTorch
#: ``Leaky`` drop-in's step, forward and backward, 2 threads, AMD EPYC: 0.55x the fused call's time at 8,192 neurons,
#: 0.89x at 65,536, 1.2x at 262,144).
MAX_NEURONS = 1 << 16

# The generator's version: this file, the emitters, the numba helpers and the CPU kernels' dialect (cpu.py, read
# as a file: importing it is for calls that run the fused kernels)
_GENERATOR = hashlib.sha256(
    b"".join(Path(m.__file__).read_bytes() for m in (emit, numba_common))
    + Path(__file__).read_bytes()
    + Path(__file__).with_name("cpu.py").read_bytes()
).hexdigest()[:12]
_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def takes(backend: str, x: torch.Tensor) -> bool:
    """Whether a one-step call of ``x`` with ``backend`` runs here: eager calls on the CPU with the fused backend
    ("auto" or "cpu", whose one step this equals) of at most :data:`MAX_NEURONS` neurons. Compiled graphs trace
    the engine's custom op; functorch transforms get its refusal; the reference and Triton backends run as asked."""
    return (
        backend in ("auto", "cpu")
        and x.device.type == "cpu"
        and x.dtype in DTYPES
        and x.numel() <= MAX_NEURONS
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
    )


# ----------------------------------------------------------------------------------------------------- generation


def _live(lines: list[str]) -> list[str]:
    """A loop body's ``lines`` without the assignments whose value nothing reads (derivatives the chain left out, a
    spike no derivative reads): LLVM would drop them, but numba types and lowers them first, and compiling is most
    of a first call's time. An assignment in a nested block (deeper indented: the ``if``) may not run, so it leaves
    the value before it live."""
    live: set[str] = set()
    kept: list[str] = []
    for line in reversed(lines):
        assignment = re.match(r"( *)(\w+) = (.*)", line)
        if assignment:
            indent, target, value = assignment.groups()
            if target not in live:
                continue
            if len(indent) <= 8:
                live.discard(target)
            reads = value
        else:
            reads = line
        live |= set(re.findall(r"\b[A-Za-z_]\w*\b", reads))
        kept.append(line)
    return kept[::-1]


def _nested(lines: list[str]) -> list[str]:
    """A loop body written at one loop's depth, moved into the innermost of :func:`_source`'s three."""
    return ["        " + line.replace("\n", "\n        ") for line in lines]


def _source(model, surrogate_type, recurrent: bool) -> list[str]:
    """The forward and the two backwards (without and with the parameters' gradients, suffix ``_grads``) of one step
    of ``model`` (``recurrent``: of its recurrent step, suffix ``_recurrent``)."""
    from .cpu import NUMBA  # the fused kernels' spelling of the expressions

    S, P = model.states, model.params
    sfx = "_recurrent" if recurrent else ""
    names = {**{k: f"v_{k}" for k in S}, **{p: f"p_{p}" for p in P}, "x": "x_", "s": "s_", "x_rec": "xr_"}
    old_names = {**names, **{k: f"o_{k}" for k in S}}
    fired = "(u_ > F(0.0))" if model.strict else "(u_ >= F(0.0))"
    ind = "        "
    xr = "xr, " if recurrent else ""
    params = "".join(f"par_{p}, " for p in P)
    step = model.recurrent_step if recurrent else model.step

    def fire(state_names, indent=ind) -> str:
        return f"{indent}u_ = {emit.step_source(model.fire, state_names, NUMBA)}"

    def spike(indent=ind) -> list[str]:
        return [f"{indent}s_ = F(1.0) if {fired} else F(0.0)"]

    def charge(indent=ind) -> list[str]:
        return [f"{indent}v_{t} = {emit.step_source(e, names, NUMBA)}" for t, e in step]

    # neurons (r * C + c) * inner + q: the parameters' values loaded per c, outside the loop over q (no integer
    # division per neuron; a layer of one value per parameter is one run, inner = N)
    loop = [
        "    for r in range(n // (C * inner)):",
        "        for c in range(C):",
        *[f"            p_{p} = par_{p}[c if par_{p}.shape[0] > 1 else 0]" for p in P],
        "            j0 = (r * C + c) * inner",
        "            for j in range(j0, j0 + inner):",
    ]
    loads = [
        "        x_ = x[j]",
        *(["        xr_ = xr[j]"] if recurrent else []),
        *[f"        o_{k} = old_{k}[j]" for k in S],
    ]
    first = (
        [f"{ind}s_ = F(0.0)"] if model.handoff else [fire(old_names), *spike()]
    )  # the reset's spike: of the old states, none with a handoff (post-reset initial states)
    forward = [
        "@njit(cache=True, error_model='numpy')",
        f"def forward{sfx}(x, {xr}{params}{''.join(f'old_{k}, ' for k in S)}spikes, "
        f"{''.join(f'new_{k}, ' for k in S)}inner, C):",
        "    bad = 0",
        "    n = x.shape[0]",
        *loop,
        *_nested(
            loads
            + _live(
                [
                    f"{ind}bad |= non_finite(x_)"
                    + (" | non_finite(xr_)" if recurrent else "")
                    + "".join(f" | non_finite(o_{k})" for k in S),
                    *first,
                    *[f"{ind}v_{k} = o_{k}" for k in S],
                    *charge(),
                    fire(names),
                    *spike(),
                    *[f"{ind}v_{t} = {emit.step_source(e, names, NUMBA)}" for t, e in model.handoff],
                    f"{ind}spikes[j] = s_",
                    *[f"{ind}new_{k}[j] = v_{k}" for k in S],
                ]
            )
        ),
        "    return bad",
    ]

    sym_names, fire_derivs, step_derivs = emit.backward_expressions(model, surrogate_type)
    handoff_derivs = emit.handoff_expressions(model)
    derivs = {**fire_derivs, **step_derivs, **handoff_derivs}
    if recurrent:  # the derivatives read the step's input, which is x + x_rec (NeuronModel.recurrent_step)
        sym_names = {**sym_names, "x": "(x_ + xr_)"}
    step_syms = {**sym_names, **{f"old_{k}": f"o_{k}" for k in S}}
    old_fire_syms = {**sym_names, **{f"new_{k}": f"o_{k}" for k in S}}  # the reset spike's: at the old states
    sources = []
    for grads in (False, True):
        g = "_grads" if grads else ""
        P_ = P if grads else ()
        chain = lambda pairs, base=None: emit.chain_sum(pairs, derivs, "F(0.0)", base)  # noqa: E731
        if model.handoff:
            # w_* are the states handed out: the step's own new states are recomputed (its first step sees no
            # spike), and the gradients of the handed-out states carried back to them
            body = [
                *first,
                *[f"{ind}v_{k} = o_{k}" for k in S],
                *charge(),
                fire(names),
                *spike(),
                *emit.assignments(handoff_derivs, sym_names, ind, NUMBA),
                *[f"{ind}gH_{k} = gS_{k}" for k in S],
                *[f"{ind}gS_{i} = " + chain([(f"gH_{k}", f"dH_{k}_{i}") for k in S]) for i in S],
                f"{ind}gs = F(0.0) if detach else " + chain([(f"gH_{k}", f"dHs_{k}") for k in S]),
                *[f"{ind}acc_{p} = " + chain([(f"gH_{k}", f"dHP_{k}_{p}") for k in S]) for p in P_],
                f"{ind}s_ = F(0.0)",
            ]
        else:
            body = [*first, *[f"{ind}v_{k} = w_{k}" for k in S]]
        body += [
            fire(names),
            *emit.assignments({**fire_derivs, **step_derivs}, step_syms, ind, NUMBA),
            f"{ind}g_s = g_ + gs" if model.handoff else f"{ind}g_s = g_",
            *[f"{ind}g_{k} = " + chain([("g_s * sg_", f"df_{k}")], base=f"gS_{k}") for k in S],
            f"{ind}gx_ = " + chain([(f"g_{k}", f"dx_{k}") for k in S]),
            *[
                f"{ind}gp_{p} = "
                + chain(
                    [("g_s * sg_", f"dF_{p}")] + [(f"g_{k}", f"dP_{k}_{p}") for k in S],
                    f"acc_{p}" if model.handoff else None,
                )
                for p in P_
            ],
            *[f"{ind}gO_{old} = " + chain([(f"g_{k}", f"dS_{k}_{old}") for k in S]) for old in S],
        ]
        if not model.handoff:  # the reset's spike is that of the old states: its gradient flows into them
            body += [
                f"{ind}if not detach:",
                f"{ind}    gso = " + chain([(f"g_{k}", f"ds_{k}") for k in S]),
                fire(old_names, ind + "    "),
                *emit.assignments(fire_derivs, old_fire_syms, ind + "    ", NUMBA),
                *[f"{ind}    gO_{k} = " + chain([("gso * sg_", f"df_{k}")], base=f"gO_{k}") for k in S],
                *[f"{ind}    gp_{p} = " + chain([("gso * sg_", f"dF_{p}")], base=f"gp_{p}") for p in P_],
            ]
        body += [
            f"{ind}grad_x[j] = gx_",
            *[f"{ind}grad_old_{k}[j] = gO_{k}" for k in S],
            *[f"{ind}grad_par_{p}[j] = gp_{p}" for p in P_],
        ]
        sources.append(
            [
                "@njit(cache=True, error_model='numpy')",
                f"def backward{sfx}{g}(grad_spikes, {''.join(f'grad_new_{k}, ' for k in S)}x, {xr}{params}"
                f"{''.join(f'old_{k}, ' for k in S)}{''.join(f'new_{k}, ' for k in S)}sg_p1, sg_p2, detach, "
                f"grad_x, {''.join(f'grad_old_{k}, ' for k in S)}"
                f"{''.join(f'grad_par_{p}, ' for p in P_)}inner, C):",
                "    n = grad_spikes.shape[0]",
                *loop,
                *_nested(
                    [
                        *loads,
                        "        g_ = grad_spikes[j]",
                        *[f"        gS_{k} = grad_new_{k}[j]" for k in S],
                        *[f"        w_{k} = new_{k}[j]" for k in S],
                        *_live(body),
                    ]
                ),
            ]
        )
    return [line for part in (forward, *sources) for line in (*part, "", "")]


def kernel_source(model, surrogate_type, dtype: torch.dtype) -> str:
    """The Python source of ``model``'s one-step kernels (and those of its recurrent step)."""
    header = [
        f'"""Generated by spikefuse.ops.engine.step for the neuron {model.name!r} ({model.key}), surrogate '
        f'{surrogate_type.__name__}, {dtype}. Do not edit: rewritten when the generator changes."""',
        "import numpy as np",
        "from numba import njit",
        "from spikefuse.ops.numba_common import non_finite",
        f"F = np.{_NP_DTYPES[dtype].__name__}",
        "",
        *emit.model_facts(model),
        "",
    ]
    body = _source(model, surrogate_type, False) + _source(model, surrogate_type, True)
    return "\n".join(header + body).rstrip("\n") + "\n"


def kernels(model, surrogate_type, dtype: torch.dtype):
    """The imported module of ``model``'s one-step kernels (generated on first use, then cached on disk)."""
    return emit.load_generated(
        "step",
        model,
        surrogate_type,
        _NP_DTYPES[dtype].__name__,
        _GENERATOR,
        lambda: kernel_source(model, surrogate_type, dtype),
    )


# ------------------------------------------------------------------------------------------------------ autograd


def _array(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` detached, flattened, contiguous and in ``dtype``, as the kernels read it (each conversion only where it
    changes something: a call costs about a microsecond, and a step of a loop makes a dozen)."""
    t = t.detach().reshape(-1)
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _param_array(p: torch.Tensor, dtype: torch.dtype):
    """A parameter as the kernels read it, an array of ``[1]`` or ``[C]`` values, converted once per tensor and
    version: a module hands the same tensors to every step of a loop (a version counts in-place changes, an
    optimizer's step among them)."""
    key = (id(p), p._version, dtype)
    found = _PARAM_ARRAYS.get(key)
    if found is None or found[0] is not p:
        if len(_PARAM_ARRAYS) > 256:  # old versions and tensors gone: start over rather than grow
            _PARAM_ARRAYS.clear()
        found = _PARAM_ARRAYS[key] = (p, _array(p, dtype).numpy())  # (the entry holds p: its id is not reused)
    return found[1]


_PARAM_ARRAYS: dict[tuple, tuple] = {}


class _Step(torch.autograd.Function):
    """One step as one node. Shapes and dtypes change inside, not as nodes of their own (a view or a conversion in
    the graph costs about what the step's kernel does)."""

    @staticmethod
    def forward(ctx, x, x_rec, neuron, inner, n_params, *tensors):
        model, surrogate = neuron.model, neuron.surrogate
        cdt = compute_dtype(x.dtype)
        module = kernels(model, type(surrogate), cdt)
        params = [_param_array(p, cdt) for p in tensors[:n_params]]
        old = [_array(v, cdt) for v in tensors[n_params:]]
        x1 = _array(x, cdt)
        xr = () if x_rec is None else (_array(x_rec, cdt),)
        spikes = torch.empty(x.shape, dtype=cdt)
        new = [torch.empty(x.shape, dtype=cdt) for _ in model.states]  # tensors of their own: detachable in place
        channels = max(p.shape[0] for p in params) if params else 1
        if channels == 1:  # one value per parameter: the neurons as one run (see _source)
            inner = max(x1.shape[0], 1)
        bad = getattr(module, "forward_recurrent" if xr else "forward")(
            x1.numpy(),
            *(r.numpy() for r in xr),
            *params,
            *(v.numpy() for v in old),
            spikes.view(-1).numpy(),
            *(v.view(-1).numpy() for v in new),
            inner,
            channels,
        )
        if bad:
            refuse_non_finite(x1.unsqueeze(0), [*old, *xr])
        reads_x = module.BACKWARD_READS_INPUT or bool(model.handoff)
        # the parameters saved as given (autograd then refuses one changed in place before backward), read through
        # their arrays
        ctx.save_for_backward(
            x1 if reads_x else None,
            xr[0] if xr and reads_x else None,
            *tensors[:n_params],
            *old,
            *(v.view(-1) for v in new),
        )
        ctx.params = params
        ctx.module, ctx.model, ctx.surrogate, ctx.detach_reset = module, model, surrogate, neuron.detach_reset
        ctx.inner, ctx.channels, ctx.recurrent = inner, channels, bool(xr)
        ctx.shape, ctx.x_dtype, ctx.param_shapes = x.shape, x.dtype, [p.shape for p in tensors[:n_params]]
        ctx.old_dtypes = [v.dtype for v in tensors[n_params:]]
        return (spikes if x.dtype == cdt else spikes.to(x.dtype), *new)

    @staticmethod
    def backward(ctx, grad_spikes, *grad_new):
        model, k = ctx.model, len(ctx.model.states)
        refuse_double_backward(
            f"the {model.name} neurons' step",
            "the fused kernels compute first-order gradients only; backend='reference' runs plain PyTorch ops",
        )
        x1, xr, *tensors = saved_tensors(ctx, f"the {model.name} neurons")
        n_params = len(ctx.param_shapes)
        params, old, new = ctx.params, tensors[n_params:-k], tensors[-k:]
        n, cdt = new[0].shape[0], new[0].dtype
        zeros = lambda: torch.zeros(n, dtype=cdt)  # noqa: E731  (a gradient autograd did not give)
        grad_spikes = zeros() if grad_spikes is None else _array(grad_spikes, cdt)
        grad_new = [zeros() if g is None else _array(g, cdt) for g in grad_new]
        need = ctx.needs_input_grad[5 : 5 + n_params]
        grads = any(need)
        grad_x = torch.empty(n, dtype=cdt)
        grad_old = [torch.empty(n, dtype=cdt) for _ in old]
        per_neuron = [torch.empty(n, dtype=cdt) for _ in params] if grads else []
        x_arg = grad_spikes if x1 is None else x1  # (not read where no derivative reads the input)
        xr_args = ((grad_spikes if xr is None else xr).numpy(),) if ctx.recurrent else ()
        getattr(ctx.module, "backward" + ("_recurrent" if ctx.recurrent else "") + ("_grads" if grads else ""))(
            grad_spikes.numpy(),
            *(g.numpy() for g in grad_new),
            x_arg.numpy(),
            *xr_args,
            *params,
            *(v.numpy() for v in old),
            *(v.numpy() for v in new),
            *(_NP_DTYPES[cdt](v) for v in ctx.surrogate.params()),
            ctx.detach_reset,
            grad_x.numpy(),
            *(g.numpy() for g in grad_old),
            *(g.numpy() for g in per_neuron),
            ctx.inner,
            ctx.channels,
        )
        grad_params = [
            reduce_leak_grad(g, shape.numel(), ctx.inner if shape.numel() > 1 else 1).reshape(shape) if wanted else None
            for g, shape, wanted in zip(per_neuron or [None] * n_params, ctx.param_shapes, need)
        ]
        shape = ctx.shape
        grad_x = grad_x.view(shape) if ctx.x_dtype == cdt else grad_x.view(shape).to(ctx.x_dtype)
        grad_old = [g.view(shape) if dt == cdt else g.view(shape).to(dt) for g, dt in zip(grad_old, ctx.old_dtypes)]
        return (grad_x, grad_x if ctx.recurrent else None, None, None, None, *grad_params, *grad_old)


def step(neuron, x, params, states, x_rec=None, inner: int = 1) -> list:
    """One step of the neurons of ``neuron`` (a :class:`~spikefuse.neurons.NeuronSpec`: the model, its surrogate
    and ``detach_reset``) on the CPU with autograd: ``[spikes, *new states]``, each of ``x``'s shape, the spikes
    in ``x``'s dtype, the states in the compute dtype (float32 for a half-precision ``x``). ``params`` in
    ``model.params`` order, each one value or one per ``inner`` neurons of ``x`` flattened (neuron ``n`` uses value
    ``(n // inner) % C``; one per neuron of a batch row: ``inner=1``, ``C`` the row's size); ``states`` of ``x``'s
    shape; ``x_rec``: a recurrent layer's recurrent current of ``x``'s shape. The caller has checked them (the
    checks of :func:`spikefuse.neuron`)."""
    refuse_active(neuron.surrogate, "the one-step {} neurons (a drop-in's step)", neuron.name)
    return list(_Step.apply(x, x_rec, neuron, int(inner), len(params), *params, *states))
