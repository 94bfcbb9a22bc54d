"""``batchnorm_lif``: BatchNorm (plus an optional residual) fused with the LIF neuron, saving only the BN input (and
the residual) for backward.

Re-exported as :func:`spikefuse.functional.batchnorm_lif`; the op itself is :mod:`spikefuse.ops.bn_lif`.
"""

from __future__ import annotations

import numbers

import torch

from . import ops
from .functional import _check_input, _check_no_functorch, _leak_tensor, _paper_spec, channel_layout, check_decay
from .ops import bn_lif as _bn_lif
from .surrogate import Sigmoid

__all__ = ["batchnorm_lif"]


def _check_param(t, name: str, channels: int, x: torch.Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor or None")
    if t.shape != (channels,):
        raise ValueError(f"{name} must have shape ({channels},) (the channels, dim 2 of x), got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}: put both on the same device")


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
    _check_input(x)
    if x.ndim < 3:
        raise ValueError(f"batchnorm_lif expects x of shape [T, B, C, ...], got {tuple(x.shape)}")
    concrete = ops.resolve_backend(backend, x.device)
    _check_no_functorch("the fused BatchNorm+LIF op", "use torch.nn.BatchNorm and spikefuse.lif(..., backend='reference')")
    channels = x.shape[2]
    if channels == 0:
        raise ValueError(f"batchnorm_lif needs at least one channel (dim 2), got x of shape {tuple(x.shape)}")
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
    spec = _paper_spec(threshold, v_reset, surrogate, detach_reset)
    check_decay(decay)
    k = _leak_tensor(decay, x, "decay")
    channel_layout(x.shape, k.numel())  # validates a per-channel decay against dim 2
    trailing = x.shape[1:]
    if v_init is not None:
        if not isinstance(v_init, torch.Tensor) or not v_init.is_floating_point():
            raise TypeError("v_init must be a floating-point tensor of shape x.shape[1:]")
        if v_init.shape != trailing:
            raise ValueError(f"v_init has shape {tuple(v_init.shape)} but x.shape[1:] is {tuple(trailing)}")
        if v_init.device != x.device:
            raise ValueError(f"v_init is on {v_init.device} but x is on {x.device}: put both on the same device")
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
    spikes, state = _bn_lif.bn_spiking_neuron(
        x, running_mean, running_var, weight, bias, bool(training), float(momentum), float(eps), k, spec, v_init,
        concrete, residual, bool(residual_binary),
    )  # fmt: skip
    return (spikes, state) if return_state else spikes
