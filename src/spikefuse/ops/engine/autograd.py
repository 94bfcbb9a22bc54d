"""The neuron engine's backends wrapped once with autograd: ``torch.library`` custom ops with fake kernels (so
``torch.compile(fullgraph=True)`` traces through them), and the same implementation as a plain
``autograd.Function`` for eager calls (the first call of a custom op imports ``torch._dynamo``, ~2 s per process).

Custom ops take tensors, numbers and strings only: the neuron with its settings
(:class:`~spikefuse.neurons.NeuronSpec`) travels as a key into :data:`spikefuse.registry.OBJECTS`.

``spikefuse::engine_forward`` returns ``[spikes, *final states, *saved states]`` (the states of every step with
``save``, memory="potential"; none otherwise); ``spikefuse::engine_backward`` returns ``[grad_x, *grad_init,
*grad_params]``, an empty tensor where a gradient is not needed (a shared initial state, a parameter without
``requires_grad``).

Half-precision inputs (float16 / bfloat16) run in float32, as the LIF kernels run them: a backend sees the input
as it is where it reads half precision, else converted (:func:`spikefuse.ops.engine.stream`; the half-precision
one is what autograd keeps), parameters and states are float32 (:func:`~spikefuse.ops.numerics.compute_dtype`), the
spikes and the input's gradient come back in the input's dtype.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..autograd_guards import keeps_graph, refuse_double_backward, saved_tensors

from ..nonfinite import check_inputs_finite

from ..numerics import compute_dtype
from . import NeuronInputs, module, reference, stream, stream_dtype
from ...registry import OBJECTS
from ...surrogate import refuse_active


def _forward_impl(
    x2: Tensor, params: list[Tensor], init: list[Tensor], inner: int, neuron: str, backend: str
) -> list[Tensor]:
    spec, backend_module = OBJECTS[neuron], module(backend)
    spikes, final, saved = backend_module.forward(
        spec,
        NeuronInputs(stream(backend_module, x2), list(params), list(init), inner),
        save=spec.save,
        spike_dtype=x2.dtype,
    )
    return [spikes, *final, *saved]


engine_forward = torch.library.custom_op("spikefuse::engine_forward", mutates_args=())(_forward_impl)


@engine_forward.register_fake
def _(x2, params, init, inner, neuron, backend):
    cdt = compute_dtype(x2.dtype)
    saved = [torch.empty_like(x2, dtype=cdt) for _ in init] if OBJECTS[neuron].save else []
    return [torch.empty_like(x2)] + [x2.new_empty(x2.shape[1], dtype=cdt) for _ in init] + saved


def _backward_impl(
    grad_spikes: Tensor,
    grad_final: list[Tensor],
    x2: Tensor,
    params: list[Tensor],
    init: list[Tensor],
    inner: int,
    neuron: str,
    backend: str,
    need_param_grads: list[bool],
    saved: list[Tensor],
    overwrite_saved: bool = False,
) -> list[Tensor]:
    cdt = compute_dtype(grad_spikes.dtype)
    backend_module = module(backend)
    grad_spikes_c = stream(backend_module, grad_spikes)
    # x empty: it was not kept (see _save), and the kernels take a [T, N] buffer there that they do not read
    xc = stream(backend_module, x2) if x2.numel() else grad_spikes_c
    grad_x, grad_init, grad_params = backend_module.backward(
        OBJECTS[neuron],
        NeuronInputs(xc, list(params), list(init), inner),
        grad_spikes_c,
        list(grad_final),
        list(need_param_grads),
        saved=list(saved),
        overwrite_saved=overwrite_saved,
    )
    # a custom op's outputs may not alias each other: a fresh empty tensor per missing gradient
    missing = grad_spikes.new_empty(0, dtype=cdt)
    return [
        grad_x.to(grad_spikes.dtype),
        *(torch.empty_like(missing) if g is None else g for g in (*grad_init, *grad_params)),
    ]


engine_backward = torch.library.custom_op("spikefuse::engine_backward", mutates_args=())(_backward_impl)


@engine_backward.register_fake
def _(
    grad_spikes, grad_final, x2, params, init, inner, neuron, backend, need_param_grads, saved, overwrite_saved=False
):
    n, cdt = grad_spikes.shape[1], compute_dtype(grad_spikes.dtype)  # (x2 may be empty: not kept)
    grad_init = [grad_spikes.new_empty(n if v.shape[0] == n else 0, dtype=cdt) for v in init]
    grad_params = [
        torch.empty_like(p) if need else grad_spikes.new_empty(0, dtype=cdt)
        for p, need in zip(params, need_param_grads)
    ]
    return [torch.empty_like(grad_spikes), *grad_init, *grad_params]


def _save(ctx, x2, params, init, inner, neuron, backend, saved):
    ctx.args = (inner, neuron, backend)
    ctx.n_params, ctx.n_init, ctx.x_shape = len(params), len(init), x2.shape
    ctx.set_materialize_grads(False)
    # With the states saved, a generated backward reads x only where a derivative does (the reference recomputes
    # from x): the input is not kept alive for nothing, as a layer's whole [T, N] input would be.
    spec = OBJECTS[neuron]
    needs_x = (
        not saved
        or backend == "reference"
        or module(backend)
        .kernels(spec.model, type(spec.surrogate), stream_dtype(module(backend), x2.dtype))
        .BACKWARD_READS_INPUT
    )
    ctx.save_for_backward(x2 if needs_x else x2.new_empty(0), *params, *init, *saved)


def _gradients(ctx, grads, need_params, need_init, backward_op):
    """``(grad_x, grad per parameter, grad per initial state)``, None where not needed."""
    n_params, n_init = ctx.n_params, ctx.n_init
    grad_spikes, *grad_final = grads[: 1 + n_init]  # (none for the saved states)
    inner, neuron, backend = ctx.args
    name = OBJECTS[neuron].name
    x2, *tensors = saved_tensors(ctx, f"the {name} neurons")
    refuse_double_backward(
        f"the {name} neurons ({backend!r} backend)",
        "the fused kernels compute first-order gradients only; the layers with "
        "backend='reference' run plain PyTorch ops, which autograd differentiates twice",
    )
    params, init = list(tensors[:n_params]), list(tensors[n_params : n_params + n_init])
    saved = list(tensors[n_params + n_init :])
    if grad_spikes is None:  # only the states were used
        grad_spikes = torch.zeros(ctx.x_shape, dtype=x2.dtype, device=x2.device)
    grad_spikes = grad_spikes.contiguous()
    grad_final = [
        grad_spikes.new_zeros(1, dtype=compute_dtype(grad_spikes.dtype)) if g is None else g.contiguous()
        for g in grad_final
    ]
    out = backward_op(
        grad_spikes, grad_final, x2, params, init, inner, neuron, backend, [bool(n) for n in need_params], saved
    )
    grad_x, grad_init, grad_params = out[0], out[1 : 1 + len(init)], out[1 + len(init) :]
    grad_params = [g if need else None for g, need in zip(grad_params, need_params)]
    grad_init = [g if need and g.numel() else None for g, need in zip(grad_init, need_init)]
    return grad_x, grad_params, grad_init


def _setup_context(ctx, inputs, output):
    x2, params, init, inner, neuron, backend = inputs
    _save(ctx, x2, params, init, inner, neuron, backend, output[1 + len(init) :])


def _backward(ctx, grads):
    grad_x, grad_params, grad_init = _gradients(
        ctx, grads, ctx.needs_input_grad[1], ctx.needs_input_grad[2], engine_backward
    )
    return grad_x, grad_params, grad_init, None, None, None


torch.library.register_autograd("spikefuse::engine_forward", _backward, setup_context=_setup_context)


class _EagerEngineNeuron(torch.autograd.Function):
    """``engine_forward`` with the same autograd, without the custom-op dispatch (see the module docstring); the
    parameters and initial states are flat arguments, so that autograd sees them."""

    @staticmethod
    def forward(ctx, x2, inner, neuron, backend, n_params, *tensors):
        params, init = list(tensors[:n_params]), list(tensors[n_params:])
        out = _forward_impl(x2, params, init, inner, neuron, backend)
        saved = out[1 + len(init) :]
        _save(ctx, x2, params, init, inner, neuron, backend, saved)
        ctx.mark_non_differentiable(*saved)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        n_params = ctx.n_params
        need = ctx.needs_input_grad[5:]
        # once this graph is freed nobody reads the saved states again: grad_x may go over them (memory="potential")
        overwrite = not keeps_graph()
        grad_x, grad_params, grad_init = _gradients(
            ctx, grads, need[:n_params], need[n_params:], functools.partial(_backward_impl, overwrite_saved=overwrite)
        )
        return (grad_x, None, None, None, None, *grad_params, *grad_init)


def neuron(x2, params: list, init: list, inner: int, spec, backend: str) -> list:
    """Run the neurons of ``spec`` (a :class:`~spikefuse.neurons.NeuronSpec`; its memory mode says whether forward
    keeps every step's states for backward) on the concrete ``backend`` with autograd: ``[spikes, *final states]``.
    The custom op under ``torch.compile``, the plain Function in eager mode; the reference (and a layer of no
    neurons) as its differentiable loop."""
    refuse_active(
        spec.surrogate, "the {} neuron layer (spikefuse.neuron, spikefuse.lif, the neuron modules)", spec.name
    )
    if backend == "reference" or x2.shape[1] == 0:
        check_inputs_finite(x2, init)
        # the oracle as plain differentiable ops, which autograd differentiates twice and torch.func transforms
        spikes, final = reference.run(
            spec.model,
            x2.to(compute_dtype(x2.dtype)),
            list(params),
            inner,
            list(init),
            spec.surrogate,
            spec.detach_reset,
        )
        return [spikes.to(x2.dtype), *final]
    key = spec.op_key
    if torch.compiler.is_compiling():
        out = engine_forward(x2, list(params), list(init), inner, key, backend)
    else:
        out = _EagerEngineNeuron.apply(x2, inner, key, backend, len(params), *params, *init)
    return list(out[: 1 + len(init)])
