"""The fused backends wrapped once as ``torch.library`` custom ops with fake kernels and registered autograd,
so that ``torch.compile(fullgraph=True)`` traces through them without graph breaks.

Eager calls take the same implementation through a plain ``autograd.Function`` (:func:`neuron`): the first call of
a custom op imports ``torch._dynamo``, which costs ~2 s in every new process.

``spikefuse::neuron_forward`` returns ``(spikes, state, saved)``: ``saved`` is the pre-reset potential ``h``
(memory mode ``potential``) or an empty tensor (mode ``recompute``, where backward recomputes ``h`` from ``x``).
``saved`` is non-differentiable and gradients are not materialized: a zero gradient for it would be a fresh
``[T, N]`` tensor filled on every backward (45 ms of a 230 ms layer step at T=32, N=1M on the CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import params as P
from . import buffers, module
from .common import compute_dtype, keeps_graph, refuse_double_backward


def _spec(ints: list[int], floats: list[float]) -> tuple:
    return (*ints, *floats)


def _forward_impl(
    x2: Tensor, leak: Tensor, v_init: Tensor, inner: int, ints: list[int], floats: list[float], backend: str, save: int
) -> tuple[Tensor, Tensor, Tensor]:
    spikes, state, saved = module(backend).forward(x2, leak, inner, v_init, _spec(ints, floats), save)
    if saved is None:
        saved = x2.new_empty(0, dtype=compute_dtype(x2.dtype))
    return spikes, state, saved


neuron_forward = torch.library.custom_op("spikefuse::neuron_forward", mutates_args=())(_forward_impl)


@neuron_forward.register_fake
def _(x2, leak, v_init, inner, ints, floats, backend, save):
    cdt = compute_dtype(x2.dtype)
    saved = x2.new_empty(x2.shape, dtype=cdt) if save == P.SAVE_POTENTIAL else x2.new_empty(0, dtype=cdt)
    return torch.empty_like(x2), x2.new_empty(x2.shape[1:], dtype=cdt), saved


def _backward_impl(
    grad_spikes: Tensor,
    grad_state: Tensor,
    x2: Tensor,
    leak: Tensor,
    v_init: Tensor,
    saved: Tensor,
    inner: int,
    ints: list[int],
    floats: list[float],
    backend: str,
    save: int,
    need_leak_grad: bool,
    overwrite_saved: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    grad_x, grad_v, grad_leak = module(backend).backward(
        grad_spikes,
        grad_state,
        x2 if x2.numel() else None,
        leak,
        inner,
        v_init,
        saved if saved.numel() else None,
        _spec(ints, floats),
        save,
        need_leak_grad,
        overwrite_saved=overwrite_saved,
    )
    if grad_leak is None:
        grad_leak = leak.new_empty(0)
    if grad_v is None:  # a v_init shared by every neuron gets no gradient
        grad_v = v_init.new_empty(0)
    return grad_x, grad_v, grad_leak


neuron_backward = torch.library.custom_op("spikefuse::neuron_backward", mutates_args=())(_backward_impl)


@neuron_backward.register_fake
def _(grad_spikes, grad_state, x2, leak, v_init, saved, inner, ints, floats, backend, save, need_leak_grad):
    grad_leak = torch.empty_like(leak) if need_leak_grad else leak.new_empty(0)
    grad_v = torch.empty_like(v_init) if v_init.shape[0] == grad_spikes.shape[1] else v_init.new_empty(0)
    return torch.empty_like(grad_spikes), grad_v, grad_leak


def _setup_context(ctx, inputs, output):
    x2, leak, v_init, inner, ints, floats, backend, save = inputs
    ctx.args = (inner, ints, floats, backend, save)
    ctx.spikes_meta = (x2.shape, x2.dtype)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[2])
    # Backward needs x only to recompute h, or for the leak gradient of a decay-input PLIF charge.
    need_x = save == P.SAVE_INPUT or ints[2] == P.CHARGE_MUL_INPUT
    ctx.save_for_backward(x2 if need_x else x2.new_empty(0), leak, v_init, output[2])


def _backward(ctx, grad_spikes, grad_state, _grad_saved, backward_op=neuron_backward):
    x2, leak, v_init, saved = ctx.saved_tensors
    inner, ints, floats, backend, save = ctx.args
    refuse_double_backward(f"the fused {backend!r} neuron", "use backend='reference' for higher-order gradients")
    need_leak_grad = ctx.needs_input_grad[1]
    if grad_spikes is None:  # only the state was used
        shape, dtype = ctx.spikes_meta
        grad_spikes = buffers.full(shape, 0.0, dtype, v_init.device)
    if grad_state is None:  # the state was not used: one zero shared by every neuron (nothing of size N to read)
        grad_state = torch.zeros(1, dtype=v_init.dtype, device=v_init.device)
    grad_x, grad_v, grad_leak = backward_op(
        grad_spikes.contiguous(),
        grad_state.contiguous(),
        x2,
        leak,
        v_init,
        saved,
        inner,
        ints,
        floats,
        backend,
        save,
        need_leak_grad,
    )
    # One gradient per input of neuron_forward, in its order: (x2, leak, v_init, ...).
    grad_leak = grad_leak if need_leak_grad else None
    grad_v = grad_v if ctx.needs_input_grad[2] else None
    return grad_x, grad_leak, grad_v, None, None, None, None, None


torch.library.register_autograd("spikefuse::neuron_forward", _backward, setup_context=_setup_context)


class _EagerNeuron(torch.autograd.Function):
    """``neuron_forward`` with the same autograd, without the custom-op dispatch (see the module docstring)."""

    @staticmethod
    def forward(x2, leak, v_init, inner, ints, floats, backend, save):
        return _forward_impl(x2, leak, v_init, inner, ints, floats, backend, save)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, grad_spikes, grad_state, grad_saved):
        # Once this graph is freed nobody reads h again, so the fused backends write grad_x over it in place
        # instead of into a fresh [T, N] buffer (on the CPU page faults cost more than the kernel; on a GPU it
        # lowers the backward's peak memory by one [T, N] buffer).
        overwrite_saved = not keeps_graph()
        return _backward(
            ctx,
            grad_spikes,
            grad_state,
            grad_saved,
            backward_op=lambda *args: _backward_impl(*args, overwrite_saved=overwrite_saved),
        )


def neuron(x2, leak, v_init, inner: int, ints: list[int], floats: list[float], backend: str, save: int):
    """Run a fused backend with autograd: the custom op under ``torch.compile``, the plain Function in eager mode."""
    op = neuron_forward if torch.compiler.is_compiling() else _EagerNeuron.apply
    return op(x2, leak, v_init, inner, ints, floats, backend, save)
