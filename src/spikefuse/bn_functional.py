"""``batchnorm_lif``: BatchNorm (plus an optional residual) fused with the LIF neuron, saving only the BN input (and
the residual) for backward; ``batchnorm_neuron`` the same for any neuron of the engine.

Exported as :func:`spikefuse.batchnorm_lif` / ``batchnorm_neuron``; the op itself is
:mod:`spikefuse.batchnorm.autograd`.
"""

from __future__ import annotations

import numbers

import torch

from . import ops
from .validation import (
    channel_layout,
    check_decay,
    check_input,
    check_no_functorch,
    check_v_init,
    leak_tensor,
    paper_lif,
    resolve_neuron,
)
from .neurons import NeuronModel
from .batchnorm import autograd as _bn_autograd
from .surrogate import Sigmoid

__all__ = ["batchnorm_lif", "batchnorm_neuron", "conv_batchnorm_lif"]


def _check_param(t, name: str, channels: int, x: torch.Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor or None")
    if t.shape != (channels,):
        raise ValueError(f"{name} must have shape ({channels},) (the channels, dim 2 of x), got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}: put both on the same device")


def _check_batchnorm(
    x, running_mean, running_var, weight, bias, training, momentum, residual, residual_binary, op: str
) -> None:
    """The checks of the BatchNorm and residual arguments of :func:`batchnorm_lif` and :func:`batchnorm_neuron`."""
    if x.ndim < 3:
        raise ValueError(f"{op} expects x of shape [T, B, C, ...], got {tuple(x.shape)}")
    channels = x.shape[2]
    if channels == 0:
        raise ValueError(f"{op} needs at least one channel (dim 2), got x of shape {tuple(x.shape)}")
    for t, name in ((running_mean, "running_mean"), (running_var, "running_var"), (weight, "weight"), (bias, "bias")):
        _check_param(t, name, channels, x)
    if (running_mean is None) != (running_var is None):
        raise ValueError("pass both running_mean and running_var, or neither")
    if not training and running_mean is None:
        raise ValueError("training=False normalizes with the running statistics: pass running_mean and running_var")
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise TypeError(f"momentum must be a number (the module handles momentum=None), got {momentum!r}")
    if training and x.numel() // channels <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a tensor shaped like x or None, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}: they are added")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual is {residual.dtype} but x is {x.dtype}: pass both in one dtype")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}: put both on the same device")
    elif residual_binary:
        raise ValueError("residual_binary=True describes a residual, but residual is None")


def _checked(
    x,
    running_mean,
    running_var,
    weight,
    bias,
    training,
    momentum,
    decay,
    *,
    threshold,
    v_reset,
    surrogate,
    detach_reset,
    backend,
    v_init=None,
    residual=None,
    residual_binary=False,
):
    """The checks of :func:`batchnorm_lif`'s arguments; returns ``(backend, leak, neuron)`` resolved for the op."""
    check_input(x)
    _check_batchnorm(
        x, running_mean, running_var, weight, bias, training, momentum, residual, residual_binary, "batchnorm_lif"
    )
    concrete = ops.resolve_backend(backend, x.device)
    check_no_functorch(
        "the fused BatchNorm+LIF op", "use torch.nn.BatchNorm and spikefuse.lif(..., backend='reference')"
    )
    neuron = paper_lif(threshold, v_reset, surrogate, detach_reset)
    check_decay(decay)
    k = leak_tensor(decay, x, "decay")
    channel_layout(x.shape, k.numel())  # validates a per-channel decay against dim 2
    if v_init is not None:
        check_v_init(v_init, x)
    return concrete, k, neuron


def batchnorm_lif(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    decay,
    threshold: float,
    v_reset: float | None = 0.0,
    surrogate=Sigmoid(4.0),
    detach_reset: bool = False,
    v_init: torch.Tensor | None = None,
    return_state: bool = False,
    backend: str = "auto",
    residual: torch.Tensor | None = None,
    residual_binary: bool = False,
):
    """BatchNorm then multi-step LIF neurons (:func:`spikefuse.lif`) on ``x`` of shape ``[T, B, C, ...]``.

    Same results as ``spikefuse.lif(F.batch_norm(x.flatten(0, 1), running_mean, running_var, weight, bias,
    training, momentum, eps).unflatten(0, x.shape[:2]), ...)``: the statistics are per channel (dim 2) over the
    T, B and spatial dims (biased variance to normalize, unbiased for ``running_var``), the running statistics
    are updated in place exactly as :func:`torch.nn.functional.batch_norm` does (``training=True`` and running
    statistics given), and ``training=False`` normalizes with them. The difference is memory: backward gets only
    ``x`` and per-channel statistics, and recomputes the normalized input, membrane potentials and spikes
    (Liang et al., Alg. 1-4). ``decay`` is a number or a learnable scalar / per-channel tensor; the LIF
    arguments are those of :func:`spikefuse.lif`. Differentiable in ``x``, ``weight``, ``bias``, ``decay``,
    ``v_init`` and ``residual``.

    ``residual`` (shape, dtype and device of ``x``) is added to the normalized input before the neuron: the last
    neuron of a residual block, ``LIF(BN(conv(x)) + shortcut)``, in one op that saves ``x`` and the residual.
    ``residual_binary=True`` promises that the residual holds only 0 and 1 (the spikes of an identity shortcut):
    it is then saved as bits (32x less than float32). Nothing checks the promise here (a check costs a pass over
    the residual): a non-binary residual with ``residual_binary=True`` gives the right spikes but **wrong
    gradients**. :class:`spikefuse.nn.BatchNormLIF2d` checks it in debug mode (:func:`spikefuse.nn.set_debug`).

    Returns the spikes (shape and dtype of ``x``), and with ``return_state=True`` also the state ``[B, C, ...]``.
    """
    concrete, k, neuron = _checked(
        x,
        running_mean,
        running_var,
        weight,
        bias,
        training,
        momentum,
        decay,
        threshold=threshold,
        v_reset=v_reset,
        surrogate=surrogate,
        detach_reset=detach_reset,
        backend=backend,
        v_init=v_init,
        residual=residual,
        residual_binary=residual_binary,
    )
    spikes, state = _bn_autograd.bn_lif(
        x,
        running_mean,
        running_var,
        weight,
        bias,
        bool(training),
        float(momentum),
        float(eps),
        k,
        neuron,
        v_init,
        concrete,
        residual,
        bool(residual_binary),
    )
    return (spikes, state) if return_state else spikes


def batchnorm_neuron(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    model: NeuronModel,
    surrogate="atan",
    detach_reset: bool = False,
    state=None,
    return_state: bool = False,
    backend: str = "auto",
    residual: torch.Tensor | None = None,
    residual_binary: bool = False,
    **params,
):
    """BatchNorm, plus an optional residual, then the neurons of any :class:`~spikefuse.neurons.NeuronModel`
    (:class:`~spikefuse.nn.CubaLIF`'s, :class:`~spikefuse.nn.ALIF`'s, one of the user's) on ``x [T, B, C, ...]``,
    in one op that keeps only ``x`` (and the residual) for backward, as :func:`batchnorm_lif` does for LIF.

    BatchNorm arguments, ``residual`` and ``residual_binary`` as :func:`batchnorm_lif`; the neuron's (``model``,
    ``surrogate``, ``detach_reset``, ``state``, ``backend`` and its parameters as keywords, per channel along dim 2)
    as :func:`spikefuse.neuron`. Returns the spikes, and with ``return_state=True`` also the tuple of final states.
    """
    check_input(x)
    _check_batchnorm(
        x, running_mean, running_var, weight, bias, training, momentum, residual, residual_binary, "batchnorm_neuron"
    )
    concrete, surrogate, tensors, inner, init = resolve_neuron(x, model, surrogate, state, backend, params)
    check_no_functorch(
        "the fused BatchNorm+neuron op", "use torch.nn.BatchNorm and spikefuse.neuron(..., backend='reference')"
    )
    spikes, final = _bn_autograd.bn_neuron(
        x,
        running_mean,
        running_var,
        weight,
        bias,
        bool(training),
        float(momentum),
        float(eps),
        _bn_autograd.bound_neuron_key(model, surrogate, detach_reset),
        tensors,
        init,
        inner,
        concrete,
        residual,
        bool(residual_binary),
    )
    return (spikes, tuple(final)) if return_state else spikes


def _conv(x: torch.Tensor, weight: torch.Tensor, bias, conv: tuple) -> torch.Tensor:
    stride, padding, dilation, groups = conv
    zeros = [0] * (weight.ndim - 2)
    return torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, False, zeros, groups)


class _ConvThenBatchNormNeuron(torch.autograd.Function):
    """``batchnorm_lif(conv(x))`` saving ``x`` (which the convolution saves anyway) and the per-channel batch
    statistics, not the conv output: backward recomputes the convolution, runs the fused op's backward on it (which
    recomputes the normalized input and the potentials), then the convolution's backward."""

    @staticmethod
    def forward(ctx, x, conv_weight, conv_bias, bn_weight, bn_bias, decay, conv, bn, neuron):
        t_steps = x.shape[0]
        z = _conv(x.flatten(0, 1), conv_weight, conv_bias, conv).unflatten(0, (t_steps, -1))
        running_mean, running_var, training, momentum, eps = bn
        backend, k, lif = _checked(
            z, running_mean, running_var, bn_weight, bn_bias, training, momentum, decay, **neuron
        )
        spikes, state, (mean, invstd) = _bn_autograd.bn_lif(
            z,
            running_mean,
            running_var,
            bn_weight,
            bn_bias,
            training,
            momentum,
            eps,
            k,
            lif,
            None,
            backend,
            return_stats=True,
        )
        optional = (conv_bias, bn_weight, bn_bias)
        ctx.present = [t is not None for t in optional]
        empty = x.new_empty(0)
        ctx.save_for_backward(x, conv_weight, *(empty if t is None else t for t in optional), k, mean, invstd)
        ctx.decay_like = decay if isinstance(decay, torch.Tensor) else None
        ctx.conv, ctx.bn, ctx.lif, ctx.backend = conv, bn, lif, backend
        return spikes, state

    @staticmethod
    def backward(ctx, grad_spikes, grad_state):
        x, conv_weight, *rest, k, mean, invstd = ctx.saved_tensors
        conv_bias, bn_weight, bn_bias = (t if keep else None for t, keep in zip(rest, ctx.present))
        running_mean, running_var, training, _, eps = ctx.bn
        need = ctx.needs_input_grad
        t_steps = x.shape[0]
        xb = x.flatten(0, 1)
        z = _conv(xb, conv_weight, conv_bias, ctx.conv).unflatten(0, (t_steps, -1))
        grad_z, grad_bn_w, grad_bn_b, grad_leak = _bn_autograd.bn_lif_backward_from_stats(
            grad_spikes,
            grad_state,
            z,
            (mean, invstd),
            running_mean,
            running_var,
            bn_weight,
            bn_bias,
            training,
            eps,
            k,
            ctx.lif,
            ctx.backend,
            bool(need[3] or need[4]),
            bool(need[5]),
        )
        del z
        has_bias = conv_bias is not None
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_z.flatten(0, 1),
            xb,
            conv_weight,
            list(conv_bias.shape) if has_bias else None,
            *ctx.conv[:3],
            False,
            [0] * (conv_weight.ndim - 2),
            ctx.conv[3],
            [bool(need[0]), bool(need[1]), bool(need[2]) and has_bias],
        )
        decay = ctx.decay_like
        return (
            grad_x.unflatten(0, (t_steps, -1)) if need[0] else None,
            grad_w if need[1] else None,
            grad_b if need[2] and has_bias else None,
            grad_bn_w if need[3] else None,
            grad_bn_b if need[4] else None,
            grad_leak.reshape(decay.shape).to(decay.dtype) if need[5] else None,
            None,
            None,
            None,
        )


def conv_batchnorm_lif(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    stride,
    padding,
    dilation,
    groups: int,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    decay,
    threshold: float,
    v_reset: float | None = 0.0,
    surrogate=Sigmoid(4.0),
    detach_reset: bool = False,
    return_state: bool = False,
    backend: str = "auto",
):
    """A convolution (zero padding, integer ``stride``/``padding``/``dilation`` lists) over ``x [T, B, C_in, ...]``
    merged to ``[T*B, ...]``, then :func:`batchnorm_lif`; the same spikes, gradients and running statistics as the
    composition. Backward gets only ``x`` (which the convolution's weight gradient needs anyway) and recomputes
    the convolution's output, where the composition keeps it: worth it where ``x`` is not spikes (those the lean
    form stores as bits), e.g. the first layer reading an image. Costs one more convolution forward in backward.
    The neurons start from their reset value (no ``v_init``); ``return_state=True`` also returns the final state,
    as :func:`batchnorm_lif` does. Under ``torch.autocast`` the convolution runs in autocast's dtype, as
    ``nn.Conv2d`` does there. Not for double backward."""
    check_input(x)
    if not isinstance(conv_weight, torch.Tensor) or conv_weight.ndim not in (3, 4, 5):
        raise TypeError("conv_weight must be the weight tensor of a 1-d, 2-d or 3-d convolution")
    if x.ndim != conv_weight.ndim + 1:
        raise ValueError(
            f"a {conv_weight.ndim - 2}-d convolution expects x of shape [T, B, C, ...] with "
            f"{conv_weight.ndim + 1} dims, got {tuple(x.shape)}"
        )
    if x.shape[2] != conv_weight.shape[1] * groups:
        raise ValueError(
            f"x has {x.shape[2]} channels (dim 2) but the convolution expects {conv_weight.shape[1] * groups}"
        )
    dims = conv_weight.ndim - 2

    def ints(v, name):
        v = [v] * dims if isinstance(v, int) else list(v)
        if len(v) != dims or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise ValueError(f"{name} must be an int or {dims} ints, got {v!r}")
        return v

    conv = (ints(stride, "stride"), ints(padding, "padding"), ints(dilation, "dilation"), int(groups))
    if torch.is_autocast_enabled(x.device.type):
        # what autocast does for a convolution (the op calls aten.convolution, which autocast does not see): input,
        # weight and bias in its dtype; the BatchNorm then reads that output, as nn.BatchNorm reads a conv's
        dtype = torch.get_autocast_dtype(x.device.type)
        x, conv_weight = x.to(dtype), conv_weight.to(dtype)
        conv_bias = None if conv_bias is None else conv_bias.to(dtype)
    neuron = dict(threshold=threshold, v_reset=v_reset, surrogate=surrogate, detach_reset=detach_reset, backend=backend)
    spikes, state = _ConvThenBatchNormNeuron.apply(
        x,
        conv_weight,
        conv_bias,
        weight,
        bias,
        decay,
        conv,
        (running_mean, running_var, bool(training), float(momentum), float(eps)),
        neuron,
    )
    return (spikes, state) if return_state else spikes
