"""``batchnorm_lif``: BatchNorm (plus an optional residual) fused with the LIF neuron, saving only the BN input (and
the residual) for backward; ``batchnorm_neuron`` the same for any neuron of the engine.

Exported as :func:`spikefuse.batchnorm_lif` / ``batchnorm_neuron``; the op itself is
:mod:`spikefuse.batchnorm.autograd`.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from . import ops
from .validation import (
    channel_layout,
    check_decay,
    check_input,
    check_no_functorch,
    check_v_init,
    leak_tensor,
    resolve_neuron,
)
from .neurons import NeuronModel
from .neurons.lif import DEFAULT_DECAY, DEFAULT_THRESHOLD, paper_lif
from .neurons.spec import neuron_spec
from .batchnorm import autograd as _bn_autograd
from .batchnorm.autograd import BatchNormArgs
from .ops.engine import NeuronInputs
from .surrogate import DEFAULT as DEFAULT_SURROGATE

__all__ = ["batchnorm_lif", "batchnorm_neuron", "conv_batchnorm_lif", "conv_batchnorm_neuron"]


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
    """The checks of :func:`batchnorm_lif`'s arguments; returns ``(backend, leak, neuron, inner)`` resolved for the
    op (``inner``: the neurons per entry of a per-channel leak)."""
    check_input(x)
    _check_batchnorm(
        x, running_mean, running_var, weight, bias, training, momentum, residual, residual_binary, "batchnorm_lif"
    )
    concrete = ops.resolve_backend(backend, x.device)
    check_no_functorch(
        "the fused BatchNorm+LIF op", "use torch.nn.BatchNorm and spikefuse.lif(..., backend='reference')"
    )
    neuron = paper_lif(threshold, v_reset, surrogate, detach_reset, backend=backend)
    check_decay(decay)
    k = leak_tensor(decay, x, "decay")
    inner = channel_layout(x.shape, k.numel())  # validates a per-channel decay against dim 2
    if v_init is not None:
        check_v_init(v_init, x)
    return concrete, k, neuron, inner


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
    decay=DEFAULT_DECAY,
    threshold: float = DEFAULT_THRESHOLD,
    v_reset: float | None = 0.0,
    surrogate=DEFAULT_SURROGATE,
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
    concrete, k, neuron, _ = _checked(
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
    batchnorm = _batchnorm_args(running_mean, running_var, weight, bias, training, momentum, eps)
    spikes, state = _bn_autograd.bn_lif(x, batchnorm, neuron, k, v_init, concrete, residual, bool(residual_binary))
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
    surrogate=DEFAULT_SURROGATE,
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
        NeuronInputs(x, tensors, init, inner),
        _batchnorm_args(running_mean, running_var, weight, bias, training, momentum, eps),
        neuron_spec(model, surrogate, detach_reset).op_key,
        concrete,
        residual,
        bool(residual_binary),
    )
    return (spikes, tuple(final)) if return_state else spikes


def _conv(x: torch.Tensor, weight: torch.Tensor, bias, conv: tuple) -> torch.Tensor:
    stride, padding, dilation, groups = conv
    zeros = [0] * (weight.ndim - 2)
    return torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, False, zeros, groups)


class _ConvCall(NamedTuple):
    """What :class:`_ConvThenBatchNormNeuron` takes besides the tensors that may need gradients: the convolution's
    output ``z`` (computed by the caller without autograd), the ``(stride, padding, dilation, groups)`` of
    :func:`_conv`, the BatchNorm's arguments, and the neurons' ``(key, init, inner, backend)`` of
    :func:`spikefuse.batchnorm.autograd.bn_neuron`."""

    z: torch.Tensor | None
    conv: tuple
    batchnorm: BatchNormArgs
    neuron: tuple


class _ConvThenBatchNormNeuron(torch.autograd.Function):
    """``batchnorm_neuron(conv(x))`` saving ``x`` (which the convolution saves anyway) and the per-channel batch
    statistics, not the conv output ``z`` (handed in by ``call``, a :class:`_ConvCall`, to be normalized): backward
    recomputes the convolution, runs the fused op's backward on it (which recomputes the normalized input and the
    states), then the convolution's backward. The tensors that may need gradients come flat after ``call`` (the
    BatchNorm's weight and bias those of ``call.batchnorm``), the neuron's parameters last, so that autograd sees
    them."""

    @staticmethod
    def forward(ctx, call, x, conv_weight, conv_bias, bn_weight, bn_bias, *params):
        key, init, inner, backend = call.neuron
        spikes, final, (mean, invstd) = _bn_autograd.bn_neuron(
            NeuronInputs(call.z, list(params), init, inner), call.batchnorm, key, backend, return_stats=True
        )
        optional = (conv_bias, bn_weight, bn_bias)
        ctx.present = [t is not None for t in optional]
        empty = x.new_empty(0)
        ctx.save_for_backward(x, conv_weight, *(empty if t is None else t for t in optional), mean, invstd, *params)
        ctx.call = call._replace(z=None, batchnorm=call.batchnorm._replace(weight=None, bias=None))
        return (spikes, *final)

    @staticmethod
    def backward(ctx, grad_spikes, *grad_final):
        x, conv_weight, conv_bias, bn_weight, bn_bias, mean, invstd, *params = ctx.saved_tensors
        conv_bias, bn_weight, bn_bias = (
            t if keep else None for t, keep in zip((conv_bias, bn_weight, bn_bias), ctx.present)
        )
        _, conv, batchnorm, (key, init, inner, backend) = ctx.call
        # as the inputs: (call, x, conv_weight, conv_bias, bn_weight, bn_bias, *params)
        need = ctx.needs_input_grad
        t_steps = x.shape[0]
        xb = x.flatten(0, 1)
        z = _conv(xb, conv_weight, conv_bias, conv).unflatten(0, (t_steps, -1))
        grad_z, grad_bn_w, grad_bn_b, grad_params = _bn_autograd.bn_neuron_backward_from_stats(
            (grad_spikes, list(grad_final)),
            NeuronInputs(z, params, init, inner),
            (mean, invstd),
            batchnorm._replace(weight=bn_weight, bias=bn_bias),
            key,
            backend,
            (bool(need[4] or need[5]), need[_PARAMS_INPUT:]),
        )
        del z
        has_bias = conv_bias is not None
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_z.flatten(0, 1),
            xb,
            conv_weight,
            list(conv_bias.shape) if has_bias else None,
            *conv[:3],
            False,
            [0] * (conv_weight.ndim - 2),
            conv[3],
            [bool(need[1]), bool(need[2]), bool(need[3]) and has_bias],
        )
        return (
            None,
            grad_x.unflatten(0, (t_steps, -1)) if need[1] else None,
            grad_w if need[2] else None,
            grad_b if need[3] and has_bias else None,
            grad_bn_w if need[4] else None,
            grad_bn_b if need[5] else None,
            *grad_params,
        )


_PARAMS_INPUT = 6  # the position of the first parameter among _ConvThenBatchNormNeuron.forward's inputs


def _checked_conv(x, conv_weight, conv_bias, stride, padding, dilation, groups) -> tuple:
    """The checks of a convolution's arguments of :func:`conv_batchnorm_neuron`; returns ``(x, conv_weight,
    conv_bias, conv)``, in autocast's dtype under ``torch.autocast``, ``conv`` the ``(stride, padding, dilation,
    groups)`` of :func:`_conv`."""
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
    return x, conv_weight, conv_bias, conv


def _conv_output(x: torch.Tensor, conv_weight: torch.Tensor, conv_bias, conv: tuple) -> torch.Tensor:
    """The convolution's output ``[T, B, C_out, ...]``, outside autograd: the op keeps ``x``, not this."""
    with torch.no_grad():
        return _conv(x.flatten(0, 1), conv_weight, conv_bias, conv).unflatten(0, x.shape[:2])


def _conv_then(x, conv_weight, conv_bias, call: _ConvCall, params: list) -> tuple:
    """``(spikes, *final states)`` of :class:`_ConvThenBatchNormNeuron` on checked arguments."""
    batchnorm = call.batchnorm
    return _ConvThenBatchNormNeuron.apply(call, x, conv_weight, conv_bias, batchnorm.weight, batchnorm.bias, *params)


def _batchnorm_args(running_mean, running_var, weight, bias, training, momentum, eps) -> BatchNormArgs:
    """The op's record of a call's BatchNorm arguments (``training`` a bool, ``momentum`` and ``eps`` floats)."""
    return BatchNormArgs(running_mean, running_var, weight, bias, bool(training), float(momentum), float(eps))


def conv_batchnorm_neuron(
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
    model: NeuronModel,
    surrogate=DEFAULT_SURROGATE,
    detach_reset: bool = False,
    return_state: bool = False,
    backend: str = "auto",
    **params,
):
    """A convolution (zero padding, integer ``stride``/``padding``/``dilation`` lists) over ``x [T, B, C_in, ...]``
    merged to ``[T*B, ...]``, then :func:`batchnorm_neuron` (the neurons of any
    :class:`~spikefuse.neurons.NeuronModel`, its arguments as there); the same spikes, gradients and running
    statistics as the composition. Backward gets only ``x`` (which the convolution's weight gradient needs anyway)
    and recomputes the convolution's output, where the composition keeps it: worth it where ``x`` is not spikes
    (those the lean form stores as bits), e.g. the first layer reading an image. Costs one more convolution forward
    in backward. The neurons start from the model's initial values (no ``state``); ``return_state=True`` also
    returns the tuple of final states. Under ``torch.autocast`` the convolution runs in autocast's dtype, as
    ``nn.Conv2d`` does there. Not for double backward. :func:`conv_batchnorm_lif` is its LIF preset."""
    x, conv_weight, conv_bias, conv = _checked_conv(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    z = _conv_output(x, conv_weight, conv_bias, conv)
    check_input(z)
    _check_batchnorm(
        z, running_mean, running_var, weight, bias, training, momentum, None, False, "conv_batchnorm_neuron"
    )
    concrete, surrogate, tensors, inner, init = resolve_neuron(z, model, surrogate, None, backend, params)
    check_no_functorch(
        "the fused conv+BatchNorm+neuron op",
        "use torch.nn.Conv, BatchNorm and spikefuse.neuron(..., backend='reference')",
    )
    key = neuron_spec(model, surrogate, detach_reset).op_key
    batchnorm = _batchnorm_args(running_mean, running_var, weight, bias, training, momentum, eps)
    call = _ConvCall(z, conv, batchnorm, (key, init, inner, concrete))
    spikes, *final = _conv_then(x, conv_weight, conv_bias, call, tensors)
    return (spikes, tuple(final)) if return_state else spikes


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
    decay=DEFAULT_DECAY,
    threshold: float = DEFAULT_THRESHOLD,
    v_reset: float | None = 0.0,
    surrogate=DEFAULT_SURROGATE,
    detach_reset: bool = False,
    return_state: bool = False,
    backend: str = "auto",
):
    """:func:`conv_batchnorm_neuron` with the LIF neurons of :func:`batchnorm_lif` (its LIF arguments): a
    convolution over ``x [T, B, C_in, ...]``, then BatchNorm and LIF, recomputing the convolution's output in
    backward. ``return_state=True`` also returns the final membrane potential."""
    x, conv_weight, conv_bias, conv = _checked_conv(x, conv_weight, conv_bias, stride, padding, dilation, groups)
    z = _conv_output(x, conv_weight, conv_bias, conv)
    concrete, k, lif, inner = _checked(
        z,
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
    )
    key, params, init = _bn_autograd.lif_neuron(lif, k, None, z)
    batchnorm = _batchnorm_args(running_mean, running_var, weight, bias, training, momentum, eps)
    call = _ConvCall(z, conv, batchnorm, (key, init, inner, concrete))
    spikes, state = _conv_then(x, conv_weight, conv_bias, call, params)
    return (spikes, state) if return_state else spikes
