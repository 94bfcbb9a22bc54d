"""BatchNorm fused with LIF neurons: the memory-lean ``Conv/FC -> BN -> LIF`` of Liang et al. (Alg. 1-4).

``BatchNormLIF2d(C, ...)`` on ``[T, B, C, H, W]`` gives the same spikes, gradients and running statistics as
``SeqToBatch(nn.BatchNorm2d(C))`` followed by :class:`spikefuse.nn.LIF`, but saves only its input (the conv
output) and per-channel statistics for backward; the normalized input, membrane potentials and spikes are
recomputed there. ``module(x, residual)`` adds a residual after the BatchNorm, the last neuron of a residual block
(``LIF(BN(conv(x)) + shortcut)``), saving ``x`` and the residual (as bits with ``residual_binary=True``). See
:func:`spikefuse.bn_functional.batchnorm_lif`. :class:`BatchNormNeuron` does the same for a BatchNorm and an engine
neuron (:class:`~spikefuse.nn.CubaLIF`, :class:`~spikefuse.nn.ALIF`, ...), :func:`spikefuse.batchnorm_neuron`;
:class:`ConvBatchNormNeuron` a convolution before them, :class:`ConvBatchNormLIF` its LIF preset.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _NormBase

from ..bn_functional import batchnorm_lif, batchnorm_neuron, conv_batchnorm_lif, conv_batchnorm_neuron
from ..nn.engine_neurons import EngineNeuron
from ..nn.neurons import LIFSettings
from ..nn.spike_layers import check_binary, debug_enabled

__all__ = [
    "BatchNormLIFBase",
    "BatchNormLIF1d",
    "BatchNormLIF2d",
    "BatchNormNeuron",
    "ConvBatchNormLIF",
    "ConvBatchNormNeuron",
    "batchnorm_call_args",
    "running_average_factor",
]


def running_average_factor(bn: _NormBase) -> float:
    """The running-statistics factor of a BatchNorm's forward, counting the batch in training: what
    ``torch.nn.modules.batchnorm._BatchNorm.forward`` computes (``momentum=None`` is the cumulative average)."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    return factor


def batchnorm_call_args(bn: _NormBase) -> tuple:
    """``(running_mean, running_var, weight, bias, training, momentum, eps)`` of a call of ``bn`` (a BatchNorm, or a
    fused module that is one) in its mode, as ``nn.BatchNorm`` decides them (counting the batch in training)."""
    factor = running_average_factor(bn)
    bn_training = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = not bn.training or bn.track_running_stats
    return (
        bn.running_mean if track else None,
        bn.running_var if track else None,
        bn.weight,
        bn.bias,
        bn_training,
        factor,
        bn.eps,
    )


class BatchNormLIFBase(LIFSettings, _NormBase):
    """BatchNorm over the T*B samples (and spatial positions) per channel, then LIF neurons, in one fused op.

    BatchNorm arguments as :class:`torch.nn.BatchNorm2d` (same parameters, buffers and ``state_dict`` keys, so a
    BatchNorm's state dict loads; ``momentum=None`` is the cumulative average). ``**lif``: the LIF's arguments as
    :class:`spikefuse.nn.LIF` takes them, by keyword, with its defaults (``learnable_decay=True`` with ``channels``
    set gives a per-channel decay), but ``memory``: the module keeps only its input.
    """

    _spatial_dims: tuple[int, ...] = ()

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        device=None,
        dtype=None,
        **lif,
    ):
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features (the channels) must be a positive int, got {num_features!r}")
        if "memory" in lif:
            raise TypeError(
                f"{type(self).__name__} keeps only its input for backward and recomputes the rest: it takes no memory"
            )
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self._set_lif(**lif, device=device)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() not in self._ndims:
            raise ValueError(
                f"{self._get_name()} expects multi-step input {self._layout} ({' or '.join(map(str, self._ndims))} "
                f"dims), got shape {tuple(x.shape)}"
            )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, residual_binary: bool = False
    ) -> torch.Tensor:
        """Spikes of ``LIF(BN(x) + residual)`` (``residual`` optional, shaped like ``x``). ``residual_binary=True``:
        the residual is spikes (only 0 and 1) and is saved as bits; checked in debug mode
        (:func:`spikefuse.nn.set_debug`), since a non-binary one would give wrong gradients."""
        self._check_input_dim(x)
        if residual_binary and residual is not None and debug_enabled():
            check_binary(self, residual, "residual")
        spikes, state = batchnorm_lif(
            x,
            *self._batchnorm_args(),
            residual=residual,
            residual_binary=residual_binary,
            **self.lif_arguments(x),
        )
        self.keep_state((state,))
        return spikes

    def _batchnorm_args(self) -> tuple:
        return batchnorm_call_args(self)

    def extra_repr(self) -> str:
        return f"{_NormBase.extra_repr(self)}, {self._settings_repr()}"


class BatchNormLIF1d(BatchNormLIFBase):
    """:class:`torch.nn.BatchNorm1d` over ``[T, B, C]`` or ``[T, B, C, L]`` (T*B merged) fused with LIF neurons."""

    _ndims = (3, 4)
    _layout = "[T, B, C] or [T, B, C, L]"


class BatchNormLIF2d(BatchNormLIFBase):
    """:class:`torch.nn.BatchNorm2d` over ``[T, B, C, H, W]`` (T*B merged) fused with LIF neurons."""

    _ndims = (5,)
    _layout = "[T, B, C, H, W]"


def _check_conv_then(conv: torch.nn.Module, name: str, channels: int, stateful: bool) -> None:
    """The checks of a convolution fused with the BatchNorm+neuron module after it (the argument ``name``, of
    ``channels`` channels)."""
    if not isinstance(conv, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
        raise TypeError(f"conv must be an nn.Conv1d, Conv2d or Conv3d, got {type(conv).__name__}")
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError(
            f"conv must have zero padding given as numbers, got padding={conv.padding!r}, "
            f"padding_mode={conv.padding_mode!r}"
        )
    if channels != conv.out_channels:
        raise ValueError(f"{name} has {channels} channels but conv gives {conv.out_channels}")
    if stateful:
        raise ValueError(
            f"{name} is stateful: it keeps its state between calls, but the fused convolution starts every call "
            "from the initial state: use the two modules in sequence"
        )


def _conv_arguments(conv: torch.nn.modules.conv._ConvNd) -> tuple:
    """``(weight, bias, stride, padding, dilation, groups)``: a convolution's arguments of the fused op."""
    return conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups


class ConvBatchNormLIF(torch.nn.Module):
    """``conv`` (an ``nn.Conv1d/2d/3d`` over ``[T, B, C, ...]``, T*B merged) then ``bn_lif`` (a
    :class:`BatchNormLIF1d`/``2d``), in one call whose backward recomputes the convolution's output instead of
    keeping it (:func:`spikefuse.bn_functional.conv_batchnorm_lif`): the LIF preset of :class:`ConvBatchNormNeuron`
    (see there). Same spikes, gradients and running statistics as ``bn_lif(SeqToBatch(conv)(x))``. ``conv`` and
    ``bn_lif`` stay the modules holding the parameters and buffers."""

    def __init__(self, conv: torch.nn.modules.conv._ConvNd, bn_lif: BatchNormLIFBase):
        super().__init__()
        if not isinstance(bn_lif, BatchNormLIFBase):
            raise TypeError(f"bn_lif must be a BatchNormLIF1d or BatchNormLIF2d, got {type(bn_lif).__name__}")
        _check_conv_then(conv, "bn_lif", bn_lif.num_features, bn_lif.stateful)
        self.conv = conv
        self.bn_lif = bn_lif
        self.training = bn_lif.training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        neuron = self.bn_lif.lif_arguments(x)
        for key in ("v_init", "return_state"):
            del neuron[key]
        return conv_batchnorm_lif(x, *_conv_arguments(self.conv), *self.bn_lif._batchnorm_args(), **neuron)


class BatchNormNeuron(torch.nn.Module):
    """``bn`` (an ``nn.BatchNorm1d``/``2d`` over ``[T, B, C, ...]``, T*B merged) then ``neuron`` (a
    :class:`~spikefuse.nn.EngineNeuron`: :class:`~spikefuse.nn.CubaLIF`, :class:`~spikefuse.nn.ALIF`, a layer of
    the user's model) in one fused op (:func:`spikefuse.batchnorm_neuron`) that keeps only its input (and the
    residual) for backward, as :class:`BatchNormLIF2d` does for LIF. Same spikes, gradients and running statistics as
    ``neuron(SeqToBatch(bn)(x) + residual)``. ``bn`` and ``neuron`` stay the modules holding the parameters, buffers
    and (``stateful``) the state. ``module(x, residual, residual_binary)`` as :meth:`BatchNormLIF2d.forward`."""

    def __init__(self, bn: _NormBase, neuron: EngineNeuron):
        super().__init__()
        if not isinstance(bn, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)):
            raise TypeError(f"bn must be an nn.BatchNorm1d or BatchNorm2d, got {type(bn).__name__}")
        if not isinstance(neuron, EngineNeuron):
            raise TypeError(
                f"neuron must be a spikefuse.nn.EngineNeuron (LIF, CubaLIF, ALIF, ...), got {type(neuron).__name__}"
            )
        self.bn = bn
        self.neuron = neuron

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, residual_binary: bool = False
    ) -> torch.Tensor:
        ndims = (BatchNormLIF2d if isinstance(self.bn, torch.nn.BatchNorm2d) else BatchNormLIF1d)._ndims
        if x.dim() not in ndims:
            raise ValueError(
                f"{type(self).__name__} with {type(self.bn).__name__} expects multi-step input "
                f"[T, B, C, ...] of {' or '.join(map(str, ndims))} dims, got shape {tuple(x.shape)}"
            )
        if residual_binary and residual is not None and debug_enabled():
            check_binary(self, residual, "residual")
        spikes, final = batchnorm_neuron(
            x,
            *batchnorm_call_args(self.bn),
            model=self.neuron.model,
            return_state=True,
            residual=residual,
            residual_binary=residual_binary,
            **self.neuron.call_arguments(x),
        )
        self.neuron.keep_state(final)
        return spikes


class ConvBatchNormNeuron(torch.nn.Module):
    """``conv`` (an ``nn.Conv1d/2d/3d`` over ``[T, B, C, ...]``, T*B merged) then ``bn_neuron`` (a
    :class:`BatchNormNeuron`: BatchNorm and any engine neuron, :class:`~spikefuse.nn.CubaLIF`,
    :class:`~spikefuse.nn.ALIF`, a layer of the user's model), in one call whose backward recomputes the
    convolution's output instead of keeping it (:func:`spikefuse.bn_functional.conv_batchnorm_neuron`): it keeps only the
    convolution's input, which the convolution's weight gradient needs anyway. Same spikes, gradients and running
    statistics as ``bn_neuron(SeqToBatch(conv)(x))``. Meant for a convolution that reads real values, e.g. the first
    layer on images (one reading spikes saves them as bits in the lean form instead: see
    :mod:`spikefuse.batchnorm.lean`). ``conv`` and ``bn_neuron`` stay the modules holding the parameters and
    buffers; :class:`ConvBatchNormLIF` is the same for LIF."""

    def __init__(self, conv: torch.nn.modules.conv._ConvNd, bn_neuron: BatchNormNeuron):
        super().__init__()
        if not isinstance(bn_neuron, BatchNormNeuron):
            raise TypeError(f"bn_neuron must be a BatchNormNeuron, got {type(bn_neuron).__name__}")
        _check_conv_then(conv, "bn_neuron", bn_neuron.bn.num_features, bn_neuron.neuron.stateful)
        self.conv = conv
        self.bn_neuron = bn_neuron
        self.training = bn_neuron.training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        neuron = self.bn_neuron.neuron
        arguments = neuron.call_arguments(x)
        del arguments["state"]  # None: a stateful neuron is refused at construction
        return conv_batchnorm_neuron(
            x,
            *_conv_arguments(self.conv),
            *batchnorm_call_args(self.bn_neuron.bn),
            model=neuron.model,
            **arguments,
        )
