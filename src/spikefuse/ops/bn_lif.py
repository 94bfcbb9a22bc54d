"""BatchNorm (plus an optional residual) fused with a spiking neuron, saving only the BN input ``x`` (and the
residual) for backward (Liang et al., Alg. 1-4).

Forward (``[T, B, C, ...]`` input ``x``, the conv/FC output), one custom op ``spikefuse::bn_lif_forward``:

1. ``y, mean, invstd = aten.native_batch_norm(x merged to [T*B, C, ...])``: the very op ``nn.BatchNorm`` runs on
   the CPU, so the statistics, the running-statistics update and ``y`` are bit-identical to the reference
   composition ``SeqToBatch(nn.BatchNorm) -> LIF`` (torch's CPU kernel computes ``y = fma(x, a, fma(-mean, a, b))``
   with ``a = weight*invstd``, which plain tensor ops cannot reproduce bit for bit, hence the call). The op
   updates copies of the running statistics and returns them (it stays functional, as registered autograd
   needs); the caller copies them into the buffers. Being inside the opaque op, ``y`` is torch's eager result
   under ``torch.compile`` too (inductor would otherwise decompose the BatchNorm with another rounding), so the
   backward's recomputation matches it.
2. ``y += residual`` when a residual is given (the shortcut of a residual block: ``LIF(BN(conv(x)) + shortcut)``,
   the same float add as the composition); with ``pack_residual`` (a binary residual: the spikes of an identity
   shortcut) it is also packed to bits (:mod:`spikefuse.ops.bitpack`) and saved as those, otherwise saved as is;
3. the backend's neuron ``forward`` on ``y`` with ``save=SAVE_INPUT`` (nothing but the spikes and the final state
   is written); ``y`` dies here. The autograd context saves ``x`` and the per-channel ``mean``/``invstd``
   (training) or the snapshot of the running statistics (eval), plus ``weight``, ``bias`` and the leak. With the
   default ``v_init`` nothing of size ``N`` is saved (an empty tensor stands for "start from the reset value").

Backward (``spikefuse::bn_lif_backward``):

1. recompute ``y`` plus the residual (unpacked from bits when packed) and from it the membrane potentials, and run
   the neuron's ``backward`` with ``save=SAVE_INPUT``, which returns ``grad_y`` (and the leak / ``v_init``
   gradients). The cpu backend in training mode does all of it in its neuron kernel (``batch_norm``: each block of
   neurons normalizes its rows from the saved ``mean``/``invstd`` with torch's formula into a tile in cache, see
   :mod:`spikefuse.ops.batchnorm_cpu`, bit-identical), so backward holds one tensor of ``x``'s size, ``grad_y``.
   Elsewhere the same ``native_batch_norm`` call runs again into a transient (training: the statistics again from
   ``x``, which torch computes deterministically, so ``y`` is bit-identical to the forward's; eval: from the saved
   running statistics) that the backend's ``backward`` overwrites with ``grad_y`` (``overwrite_x``);
2. BatchNorm's backward -- the per-channel reduction torch's ``aten.native_batch_norm_backward`` runs:
   ``grad_gamma = sum(gy*xhat)``, ``grad_beta = sum(gy)``, ``grad_x = a*(gy - mean(gy) - xhat*mean(gy*xhat))``
   in training mode, ``grad_x = a*gy`` in eval mode; the residual's gradient is ``grad_y`` itself. The cpu
   backend in training mode runs it with :func:`spikefuse.ops.batchnorm_cpu.backward`, writing ``grad_x`` over
   ``grad_y`` (when that is not also the residual's gradient); elsewhere torch's op.

Every backend works, since only the common ``forward``/``backward`` entry points are used. Both ops are
``torch.library`` custom ops with fake kernels, so ``torch.compile(fullgraph=True)`` traces through them; eager
calls run the same functions through a plain ``autograd.Function``, without the custom-op dispatch.

On CUDA ``nn.BatchNorm`` goes through cuDNN, whose ``y`` may differ from ``native_batch_norm``'s in the last ulp;
spikes then agree with the composition except where ``y`` lands within an ulp of the threshold.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import params as P
from . import batchnorm_cpu, module
from .bitpack import pack, packed_numel, unpack
from .common import compute_dtype, refuse_double_backward

__all__ = ["bn_spiking_neuron", "bn_spiking_neuron_backward", "bn_lif_forward", "bn_lif_backward"]


def _spec(ints: list[int], floats: list[float]) -> tuple:
    return (*ints, *floats)


def _v0(v_init: Tensor, floats: list[float], ints: list[int], cdt, device) -> Tensor:
    """``v_init`` or, when it is empty, the default start ``v_reset`` (hard reset) / 0, one value shared by every
    neuron (see :mod:`spikefuse.ops.reference`)."""
    if v_init.numel():
        return v_init
    fill = floats[3] if ints[1] == P.HARD else 0.0  # floats = (p1, p2, threshold, v_reset)
    return torch.full((1,), fill, dtype=cdt, device=device)


def _batch_norm(xb: Tensor, weight, bias, running_mean, running_var, training: bool, eps: float) -> Tensor:
    """``y`` of BatchNorm on ``xb [T*B, C, ...]`` (no running-statistics update)."""
    if training:
        return torch.native_batch_norm(xb, weight, bias, None, None, True, 0.0, eps)[0]
    return torch.native_batch_norm(xb, weight, bias, running_mean, running_var, False, 0.0, eps)[0]


def _forward_impl(
    xb: Tensor,
    residual: Tensor | None,
    pack_residual: bool,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    leak: Tensor,
    v_init: Tensor,
    training: bool,
    momentum: float,
    eps: float,
    t_steps: int,
    inner: int,
    ints: list[int],
    floats: list[float],
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """BatchNorm of ``xb [T*B, C, ...]``, plus ``residual`` (shaped like ``xb``) when given, then the neuron;
    returns ``(spikes [T, N], state [N], mean, invstd, new_running_mean, new_running_var, residual_bits)``. The
    running statistics are updated on copies (the op stays functional; the caller copies them back); in eval mode
    the copies are the snapshot backward normalizes with. ``residual_bits`` is the residual packed to bits with
    ``pack_residual``, else empty."""
    rm = running_mean.clone() if running_mean is not None else None
    rv = running_var.clone() if running_var is not None else None
    y, mean, invstd = torch.native_batch_norm(xb, weight, bias, rm, rv, training, momentum, eps)
    bits = xb.new_empty(0, dtype=torch.uint8)
    if residual is not None:
        y += residual
        if pack_residual:
            bits = pack(residual)[0]
    y2 = y.reshape(t_steps, -1)
    v0 = _v0(v_init, floats, ints, compute_dtype(xb.dtype), xb.device)
    spikes, state, _ = module(backend).forward(y2, leak, inner, v0, _spec(ints, floats), P.SAVE_INPUT)
    del y, y2
    return (
        spikes,
        state,
        mean,
        invstd,
        rm if rm is not None else xb.new_empty(0),
        rv if rv is not None else xb.new_empty(0),
        bits,
    )


bn_lif_forward = torch.library.custom_op("spikefuse::bn_lif_forward", _forward_impl, mutates_args=())


@bn_lif_forward.register_fake
def _(xb, residual, pack_residual, weight, bias, running_mean, running_var, leak, v_init, training, momentum, eps,
      t_steps, inner, ints, floats, backend):  # fmt: skip
    n = xb.numel() // t_steps
    stat_dtype = weight.dtype if weight is not None else xb.dtype
    channels = xb.shape[1]
    stats = (channels,) if training else (0,)
    bits = packed_numel(xb.numel()) if residual is not None and pack_residual else 0
    return (
        xb.new_empty((t_steps, n)),
        xb.new_empty((n,), dtype=compute_dtype(xb.dtype)),
        xb.new_empty(stats, dtype=stat_dtype),
        xb.new_empty(stats, dtype=stat_dtype),
        torch.empty_like(running_mean) if running_mean is not None else xb.new_empty(0),
        torch.empty_like(running_var) if running_var is not None else xb.new_empty(0),
        xb.new_empty((bits,), dtype=torch.uint8),
    )


def _backward_impl(
    grad_spikes: Tensor,
    grad_state: Tensor,
    xb: Tensor,
    residual: Tensor | None,
    residual_bits: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    leak: Tensor,
    v_init: Tensor,
    inner: int,
    ints: list[int],
    floats: list[float],
    backend: str,
    training: bool,
    eps: float,
    need_leak_grad: bool,
    need_affine_grad: bool,
    need_residual_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(grad_x [T*B, C, ...], grad_weight, grad_bias, grad_leak, grad_v_init, grad_residual)``; unneeded ones
    are empty. The residual is ``residual`` or, when that is None and ``residual_bits`` is not empty, those bits."""
    t_steps, n = grad_spikes.shape
    cdt = compute_dtype(xb.dtype)
    v0 = _v0(v_init, floats, ints, cdt, xb.device)
    fused = _fused_batch_norm(backend, training, xb)
    if fused:
        # BatchNorm inside the neuron kernel's recompute, from the saved statistics (bit-identical to the forward's)
        bits = residual_bits if residual is None and residual_bits.numel() else None
        norm = batchnorm_cpu.Normalization(mean, invstd, weight, bias, math.prod(xb.shape[2:]), residual, bits)
        neuron_input, input_kw = xb.reshape(t_steps, n), {"batch_norm": norm}
    else:
        y = _batch_norm(xb, weight, bias, running_mean, running_var, training, eps)
        if residual is None and residual_bits.numel():
            residual = unpack(residual_bits, xb.shape, xb.dtype)
        if residual is not None:
            y += residual
        neuron_input, input_kw = y.reshape(t_steps, n), {"overwrite_x": True}  # y is this function's own transient
        del y
    del residual
    grad_y, grad_v, grad_leak = module(backend).backward(
        grad_spikes, grad_state, neuron_input, leak, inner, v0, None, _spec(ints, floats), P.SAVE_INPUT,
        need_leak_grad, **input_kw,
    )
    del neuron_input, input_kw
    grad_y = grad_y.reshape(xb.shape).to(xb.dtype)
    affine = weight is not None and need_affine_grad
    if fused:
        # grad_x over grad_y, unless grad_y is also the residual's gradient: no fresh tensor at the memory peak
        grad_x, grad_w, grad_b = batchnorm_cpu.backward(grad_y, xb, mean, invstd, weight, affine,
                                                        overwrite_grad_y=not need_residual_grad)  # fmt: skip
    else:
        grad_x, grad_w, grad_b = torch.ops.aten.native_batch_norm_backward(
            grad_y,
            xb,
            weight,
            None if training else running_mean,
            None if training else running_var,
            mean if training else None,
            invstd if training else None,
            training,
            eps,
            [True, affine, affine],
        )

    def empty():  # a fresh one each time: outputs of a custom op must not alias each other
        return xb.new_empty(0)

    if need_leak_grad and grad_leak is None:  # an IF charge does not use the leak: zero, not missing
        grad_leak = torch.zeros_like(leak)
    return (
        grad_x,
        grad_w if affine else empty(),
        grad_b if affine else empty(),
        grad_leak if need_leak_grad else empty(),
        grad_v if v_init.numel() else empty(),
        grad_y if need_residual_grad else empty(),
    )


bn_lif_backward = torch.library.custom_op("spikefuse::bn_lif_backward", _backward_impl, mutates_args=())


@bn_lif_backward.register_fake
def _(grad_spikes, grad_state, xb, residual, residual_bits, weight, bias, mean, invstd, running_mean, running_var,
      leak, v_init, inner, ints, floats, backend, training, eps, need_leak_grad, need_affine_grad,
      need_residual_grad):  # fmt: skip
    affine = weight is not None and need_affine_grad
    return (
        torch.empty_like(xb),
        torch.empty_like(weight) if affine else xb.new_empty(0),
        torch.empty_like(weight) if affine else xb.new_empty(0),
        torch.empty_like(leak) if need_leak_grad else xb.new_empty(0),
        torch.empty_like(v_init) if v_init.numel() else xb.new_empty(0),
        torch.empty_like(xb) if need_residual_grad else xb.new_empty(0),
    )


def _backward_for(backend: str):
    """The backward op, or for the reference backend its implementation: the reference differentiates its loop
    with autograd, which a custom op's body cannot use (the dispatcher runs it below autograd)."""
    return _backward_impl if backend == "reference" else bn_lif_backward


# Inputs of bn_lif_forward, by position.
(_X, _RES, _PACK, _W, _B, _RM, _RV, _LEAK, _V, _TRAINING, _MOMENTUM, _EPS, _T, _INNER, _INTS, _FLOATS,
 _BACKEND) = range(17)  # fmt: skip
_N_INPUTS = 17


def _setup_context(ctx, inputs, output):
    training = inputs[_TRAINING]
    ctx.args = (inputs[_INNER], inputs[_INTS], inputs[_FLOATS], inputs[_BACKEND], training, inputs[_EPS])
    ctx.set_materialize_grads(True)
    w, b, residual = inputs[_W], inputs[_B], inputs[_RES]
    ctx.has_w, ctx.has_b = w is not None, b is not None
    xb = inputs[_X]
    empty = xb.new_empty(0)
    _, _, mean, invstd, rm, rv, bits = output
    ctx.residual_as_is = residual is not None and not bits.numel()
    ctx.save_for_backward(
        xb,
        residual if ctx.residual_as_is else empty,
        bits,
        w if w is not None else empty,
        b if b is not None else empty,
        mean,
        invstd,
        empty if training else rm,  # eval: the snapshot of the running statistics y was made with
        empty if training else rv,
        inputs[_LEAK],
        inputs[_V],
    )


def _backward(ctx, grad_spikes, grad_state, *_unused, eager: bool = False):
    xb, residual, bits, w, b, mean, invstd, rm, rv, leak, v_init = ctx.saved_tensors
    inner, ints, floats, backend, training, eps = ctx.args
    refuse_double_backward(
        "the fused BatchNorm+LIF op", "use torch.nn.BatchNorm and spikefuse.lif(..., backend='reference') instead"
    )
    need = ctx.needs_input_grad
    need_affine = bool(need[_W] or need[_B])
    backward_op = _backward_impl if eager else _backward_for(backend)
    grad_x, grad_w, grad_b, grad_leak, grad_v, grad_res = backward_op(
        grad_spikes.contiguous(),
        grad_state.contiguous(),
        xb,
        residual if ctx.residual_as_is else None,
        bits,
        w if ctx.has_w else None,
        b if ctx.has_b else None,
        mean,
        invstd,
        rm if rm.numel() else None,
        rv if rv.numel() else None,
        leak,
        v_init,
        inner,
        ints,
        floats,
        backend,
        training,
        eps,
        bool(need[_LEAK]),
        need_affine,
        bool(need[_RES]),
    )
    grads = [None] * _N_INPUTS
    for index, grad in ((_X, grad_x), (_W, grad_w), (_B, grad_b), (_LEAK, grad_leak), (_V, grad_v), (_RES, grad_res)):
        grads[index] = grad if need[index] else None
    return tuple(grads)


torch.library.register_autograd("spikefuse::bn_lif_forward", _backward, setup_context=_setup_context)


class _EagerBatchNormNeuron(torch.autograd.Function):
    """``bn_lif_forward`` with the same autograd, without the custom-op dispatch, which costs more than the kernels
    of a small layer (as for the neuron op, :func:`spikefuse.ops.autograd.neuron`)."""

    @staticmethod
    def forward(*inputs):
        return _forward_impl(*inputs)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, *grads, eager=True)


def _forward_op(*inputs):
    """The custom op under ``torch.compile``, the plain Function in eager mode."""
    if torch.compiler.is_compiling():
        return bn_lif_forward(*inputs)
    return _EagerBatchNormNeuron.apply(*inputs)


def bn_spiking_neuron(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    leak: Tensor,
    spec: P.NeuronSpec,
    v_init: Tensor | None,
    backend: str,
    residual: Tensor | None = None,
    residual_binary: bool = False,
    return_stats: bool = False,
):
    """BatchNorm (over T, B and the spatial dims of ``x [T, B, C, ...]``), plus ``residual`` when given, then the
    neuron of ``spec``.

    Arguments are already validated and resolved (``backend`` concrete, ``leak`` a 1-D compute-dtype tensor of
    1 or C entries, ``v_init`` of shape ``x.shape[1:]`` or None, ``residual`` of ``x``'s shape, dtype and device
    or None; ``residual_binary``: it holds only 0 and 1 and is saved as bits). Returns ``(spikes, state)``, shaped
    like ``x`` and ``x.shape[1:]``, and with ``return_stats`` also the batch statistics ``(mean, invstd)`` that
    :func:`bn_spiking_neuron_backward` takes (for a caller with its own backward, run without autograd).
    ``training``/``momentum`` as :func:`torch.nn.functional.batch_norm`.
    """
    t_steps, trailing = x.shape[0], x.shape[1:]
    n = math.prod(trailing)
    inner = _inner(x, leak)
    cdt = compute_dtype(x.dtype)
    xb = _merged(x)
    rb = None if residual is None else _merged(residual)
    v0 = x.new_empty(0, dtype=cdt) if v_init is None else v_init.reshape(n).to(cdt).contiguous()
    ints, floats = spec.kernel_lists()
    spikes, state, mean, invstd, new_rm, new_rv, _ = _forward_op(
        xb, rb, bool(residual_binary), weight, bias, running_mean, running_var, leak, v0, bool(training),
        float(momentum), float(eps), t_steps, inner, ints, floats, backend,
    )  # fmt: skip
    if training and running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(new_rm)
            running_var.copy_(new_rv)
    out = spikes.reshape(x.shape), state.reshape(trailing)
    return (*out, (mean, invstd)) if return_stats else out


def bn_spiking_neuron_backward(
    grad_spikes: Tensor,
    grad_state: Tensor,
    x: Tensor,
    stats: tuple[Tensor, Tensor],
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    eps: float,
    leak: Tensor,
    spec: P.NeuronSpec,
    backend: str,
    need_affine: bool,
    need_leak: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The backward of :func:`bn_spiking_neuron` (no residual, ``v_init`` None) from its input ``x`` and the
    ``stats`` it returned: ``(grad_x, grad_weight, grad_bias, grad_leak)``, None where not needed. The same op as
    the fused module's backward: recomputes the normalized input and the potentials, nothing of the forward again."""
    t_steps = x.shape[0]
    n = x.numel() // t_steps
    cdt = compute_dtype(x.dtype)
    ints, floats = spec.kernel_lists()
    mean, invstd = stats
    backward_op = _backward_for(backend) if torch.compiler.is_compiling() else _backward_impl
    grad_x, grad_w, grad_b, grad_leak, _, _ = backward_op(
        grad_spikes.reshape(t_steps, n).contiguous(), grad_state.reshape(n).to(cdt).contiguous(), _merged(x), None,
        x.new_empty(0, dtype=torch.uint8), weight, bias, mean, invstd, None if training else running_mean,
        None if training else running_var, leak, x.new_empty(0, dtype=cdt), _inner(x, leak), ints, floats,
        backend, bool(training), float(eps), bool(need_leak), bool(need_affine), False,
    )  # fmt: skip
    affine = weight is not None and need_affine
    return (
        grad_x.reshape(x.shape),
        grad_w if affine else None,
        grad_b if affine and bias is not None else None,
        grad_leak if need_leak else None,
    )


def _fused_batch_norm(backend: str, training: bool, xb: Tensor) -> bool:
    """Whether the neuron kernels normalize the input themselves (:mod:`spikefuse.ops.batchnorm_cpu`)."""
    return backend == "cpu" and training and xb.dtype in batchnorm_cpu.SUPPORTED_DTYPES


def _inner(x: Tensor, leak: Tensor) -> int:
    """Neurons per channel run (the spatial size) for a per-channel leak, else 1 (see :mod:`spikefuse.ops.cpu`)."""
    return math.prod(x.shape[3:]) if leak.numel() > 1 else 1


def _merged(x: Tensor) -> Tensor:
    """``x [T, B, C, ...]`` as the contiguous ``[T*B, C, ...]`` BatchNorm normalizes."""
    xb = x.flatten(0, 1)
    return xb if xb.is_contiguous() else xb.contiguous()
