"""The memory-lean form of a spiking network (Liang et al.): ``to_lean(model)`` converts a model in place.

Training a spiking network by BPTT keeps, for every layer and time step, what backward reads. The lean form keeps
only the conv/FC outputs (and per-channel statistics) and recomputes the rest in backward: the normalized input,
the membrane potentials and the spikes. Spikes that a conv/linear layer reads are saved as bits. Outputs and
gradients stay those of the model before the conversion (spikes equal, gradients to rounding); only memory and
time change.

The contract, for any model made of torch layers, :class:`~spikefuse.nn.SeqToBatch` wrappers and spikefuse
neurons (:class:`~spikefuse.nn.LIF`, :class:`~spikefuse.nn.IF`, and the engine's :class:`~spikefuse.nn.CubaLIF`,
:class:`~spikefuse.nn.ALIF` and any :class:`~spikefuse.nn.EngineNeuron`):

1. **Modules that know their structure convert themselves first.** A module with a ``convert_to_lean(counts)``
   method (the :mod:`spikefuse.models` ResNet blocks and the ResNet stem, whose conv, BatchNorm and neuron become
   one :class:`~spikefuse.nn.ConvBatchNormLIF` or :class:`~spikefuse.nn.ConvBatchNormNeuron`) replaces its own
   children and adds what it changed to ``counts``. That is how the last neuron of a residual block,
   ``LIF(BN(conv(x)) + shortcut)``, becomes one :class:`~spikefuse.nn.BatchNormLIF2d` call with a residual (the
   shortcut saved as bits when it is the block's input spikes; a :class:`~spikefuse.nn.BatchNormNeuron` call for
   an engine neuron). A user block with a residual add can do the same.
2. **In every** ``nn.Sequential``, by position:

   - ``SeqToBatch(nn.ConvNd / nn.Linear)`` after a spikefuse neuron (directly, or through ``Flatten``,
     ``nn.Identity`` and max-pooling, which keep spikes spikes) reads spikes: it becomes
     :class:`~spikefuse.nn.SpikeConv1d`/``2d``/``3d`` / :class:`~spikefuse.nn.SpikeLinear` (same weights; the
     input saved as bits);
   - ``SeqToBatch(nn.BatchNorm1d/2d)`` directly followed by a spikefuse neuron becomes one
     :class:`~spikefuse.nn.BatchNormLIF1d`/``2d`` (the BatchNorm's parameters and running statistics, the neuron's
     options and learnable decay) and the neuron becomes ``nn.Identity``; followed by an engine neuron, one
     :class:`~spikefuse.nn.BatchNormNeuron` holding both modules (counted as ``bn_lif`` too);
   - a ``SeqToBatch(nn.ConvNd)`` that reads real values (not spikes: the first layer on images) directly followed
     by such a fused BatchNorm+neuron becomes one :class:`~spikefuse.nn.ConvBatchNormLIF` (for an engine neuron
     :class:`~spikefuse.nn.ConvBatchNormNeuron`, counted as ``conv_bn_lif`` too), which keeps only the
     convolution's input (the convolution keeps it anyway) and recomputes the convolution in backward, instead of
     keeping its output -- where that is cheap: at most :data:`RECOMPUTE_MAX_MACS` multiply-adds per output
     element (input channels per group x kernel volume: a first layer on 2-3 channels, not a convolution of
     pooled spikes over many channels);
   - ``SeqToBatch(nn.MaxPool1d/2d/3d)`` (or :class:`~spikefuse.nn.MaxPool2d`) after a spikefuse neuron
     (likewise) becomes a ``SeqToBatch`` of :class:`~spikefuse.nn.SpikeMaxPool1d`/``2d``/``3d``: the input
     saved as bits and no indices (torch's layer keeps its input and an int64 index per output);
   - ``SeqToBatch(nn.AvgPool2d)`` becomes :class:`ShapeOnlyAvgPool2d` (its backward needs only the input's shape;
     torch's saves the input).
3. **Every other spikefuse neuron** recomputes its states in backward (``memory="recompute"``).

What is not listed stays as it is (a conv reading real values, a BatchNorm feeding something else than a neuron,
max-pooling of real values, other pooling). Convert before creating the optimizer or move the new parameters
there: the fused modules are new modules holding copies of the old parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.containers import Flatten, SeqToBatch
from ..nn.engine_neurons import EngineNeuron
from ..nn.neurons import LIF
from ..nn.pooling import MaxPool2d
from ..nn.spike_layers import (
    SpikeConv1d,
    SpikeConv2d,
    SpikeConv3d,
    SpikeLinear,
    SpikeMaxPool1d,
    SpikeMaxPool2d,
    SpikeMaxPool3d,
)
from .modules import (
    BatchNormLIF1d,
    BatchNormLIF2d,
    BatchNormLIFBase,
    BatchNormNeuron,
    ConvBatchNormLIF,
    ConvBatchNormNeuron,
)

__all__ = [
    "to_lean",
    "ShapeOnlyAvgPool2d",
    "spike_layer_from",
    "spike_max_pool_from",
    "batchnorm_lif_from",
    "fused_batchnorm_from",
    "conv_batchnorm_neuron_from",
    "LEAN_COUNTS",
    "RECOMPUTE_MAX_MACS",
]

#: The keys of the report :func:`to_lean` returns.
LEAN_COUNTS = ("bn_lif", "bn_add_lif", "conv_bn_lif", "spike_layers", "recompute_neurons", "pools")

#: The most multiply-adds per output element of a convolution that the lean form recomputes in backward rather
#: than keep its output: the time it costs grows with them, the memory it saves does not.
RECOMPUTE_MAX_MACS = 256

_SPIKE_LAYERS = {nn.Conv1d: SpikeConv1d, nn.Conv2d: SpikeConv2d, nn.Conv3d: SpikeConv3d, nn.Linear: SpikeLinear}
_BN_LIF = {nn.BatchNorm1d: BatchNormLIF1d, nn.BatchNorm2d: BatchNormLIF2d}
_SPIKE_POOLS = {
    nn.MaxPool1d: SpikeMaxPool1d,
    nn.MaxPool2d: SpikeMaxPool2d,
    MaxPool2d: SpikeMaxPool2d,
    nn.MaxPool3d: SpikeMaxPool3d,
}


def _unwrap(layer: nn.Module) -> nn.Module:
    return layer.module if isinstance(layer, SeqToBatch) else layer


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` with ``old``'s state, on ``old``'s device and in its dtype."""
    tensors = list(old.parameters()) + [b for b in old.buffers() if b.is_floating_point()]
    if tensors:
        new.to(device=tensors[0].device, dtype=tensors[0].dtype)
    new.train(old.training)
    return new


def spike_layer_from(layer: nn.Module) -> nn.Module | None:
    """The spike-input layer (input saved as bits) with the weights of ``layer`` (a conv/linear, bare or in
    ``SeqToBatch``), or None when ``layer`` is not one."""
    m = _unwrap(layer)
    cls = _SPIKE_LAYERS.get(type(m))
    if cls is None:
        return None
    if cls is SpikeLinear:
        new = SpikeLinear(m.in_features, m.out_features, m.bias is not None)
    else:
        new = cls(
            m.in_channels,
            m.out_channels,
            m.kernel_size,
            m.stride,
            m.padding,
            m.dilation,
            m.groups,
            m.bias is not None,
            m.padding_mode,
        )
    _like(new, m).load_state_dict(m.state_dict())
    return new


def spike_max_pool_from(pool: nn.Module) -> nn.Module | None:
    """The :class:`~spikefuse.nn.SpikeMaxPool2d` (1d, 3d) of ``pool`` (a torch or spikefuse max-pooling layer in
    ``SeqToBatch``, not returning indices): the same wrapper with the spike layer inside, or None when ``pool`` is
    not one."""
    m = _unwrap(pool)
    cls = _SPIKE_POOLS.get(type(m))
    if not isinstance(pool, SeqToBatch) or cls is None or m.return_indices:
        return None
    return _like(SeqToBatch(cls(m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode)), pool)


def batchnorm_lif_from(bn_layer: nn.Module, neuron: LIF) -> BatchNormLIFBase | None:
    """One fused BatchNorm+LIF module with the state of ``bn_layer`` (``nn.BatchNorm1d/2d``, bare or in
    ``SeqToBatch``) and the options (and learnable decay) of ``neuron``; None when ``bn_layer`` is not one."""
    bn = _unwrap(bn_layer)
    cls = _BN_LIF.get(type(bn))
    if cls is None or not isinstance(neuron, LIF):
        return None
    learnable = isinstance(neuron.decay, nn.Parameter)
    decay = float(neuron.decay.detach().flatten()[0]) if learnable else neuron.decay
    channels = neuron.decay.numel() if learnable and neuron.decay.dim() == 1 else None
    new = cls(
        bn.num_features,
        bn.eps,
        bn.momentum,
        bn.affine,
        bn.track_running_stats,
        decay=decay,
        threshold=neuron.threshold,
        v_reset=neuron.v_reset,
        surrogate=neuron.surrogate,
        detach_reset=neuron.detach_reset,
        learnable_decay=learnable,
        channels=channels,
        stateful=neuron.stateful,
        backend=neuron.backend,
    )
    _like(new, bn).load_state_dict(bn.state_dict(), strict=False)
    if learnable:
        new.decay = nn.Parameter(neuron.decay.detach().clone(), requires_grad=neuron.decay.requires_grad)
    return new


def fused_batchnorm_from(bn_layer: nn.Module, neuron: nn.Module) -> nn.Module | None:
    """``bn_layer`` (``nn.BatchNorm1d/2d``, bare or in ``SeqToBatch``) and the neuron after it in one fused module:
    :func:`batchnorm_lif_from` for a :class:`~spikefuse.nn.LIF`, a :class:`~spikefuse.nn.BatchNormNeuron` holding
    both modules for an :class:`~spikefuse.nn.EngineNeuron` (CubaLIF, ALIF, ...); None for anything else."""
    if isinstance(neuron, LIF):  # the LIF preset's own fused module, a BatchNorm holding the LIF's settings
        return batchnorm_lif_from(bn_layer, neuron)
    if isinstance(neuron, EngineNeuron):
        bn = _unwrap(bn_layer)
        return BatchNormNeuron(bn, neuron) if type(bn) in _BN_LIF else None
    return None


def conv_batchnorm_neuron_from(conv_layer: nn.Module, fused: nn.Module) -> nn.Module | None:
    """One :class:`~spikefuse.nn.ConvBatchNormLIF` or :class:`~spikefuse.nn.ConvBatchNormNeuron` of ``conv_layer``
    (``SeqToBatch(nn.ConvNd)`` with zero padding, at most :data:`RECOMPUTE_MAX_MACS` multiply-adds per output
    element) and ``fused`` (a non-stateful fused BatchNorm+LIF, or :class:`~spikefuse.nn.BatchNormNeuron`),
    sharing their modules; None when they are not those."""
    conv = conv_layer.module if isinstance(conv_layer, SeqToBatch) else None
    if not isinstance(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or conv.padding_mode != "zeros":
        return None
    if conv.in_channels // conv.groups * math.prod(conv.kernel_size) > RECOMPUTE_MAX_MACS:
        return None
    if isinstance(conv.padding, str):
        return None
    if isinstance(fused, BatchNormLIFBase) and not fused.stateful:
        return ConvBatchNormLIF(conv, fused)
    if isinstance(fused, BatchNormNeuron) and not fused.neuron.stateful:
        return ConvBatchNormNeuron(conv, fused)
    return None


class _ShapeOnlyAvgPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor):
        ctx.pool = (kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        ctx.like = (x.shape, x.dtype, x.device)
        return F.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.like
        probe = torch.empty(shape, dtype=dtype, device=device)  # never written: only its shape is read
        grad_x = torch.ops.aten.avg_pool2d_backward(grad.contiguous(), probe, *ctx.pool)
        return grad_x, None, None, None, None, None, None


class ShapeOnlyAvgPool2d(nn.AvgPool2d):
    """:class:`torch.nn.AvgPool2d` whose autograd saves nothing: average pooling's backward needs only the
    input's shape, while ``torch.nn.functional.avg_pool2d`` saves the whole input. Same output and gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def pair(v):
            return [v, v] if isinstance(v, int) else list(v)

        return _ShapeOnlyAvgPool.apply(
            x,
            pair(self.kernel_size),
            pair(self.stride),
            pair(self.padding),
            self.ceil_mode,
            self.count_include_pad,
            self.divisor_override,
        )


#: The modules whose output is spikes.
_SPIKING = (LIF, EngineNeuron, BatchNormLIFBase, BatchNormNeuron, ConvBatchNormLIF, ConvBatchNormNeuron)


def _keeps_spikes(m: nn.Module) -> bool:
    """Whether ``m`` turns spikes into spikes: reshaping, identity, max-pooling."""
    return isinstance(_unwrap(m), (Flatten, nn.Flatten, nn.Identity, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d))


def _convert_sequential(seq: nn.Sequential, counts: dict) -> None:
    items = list(seq)
    spikes = False  # whether the output of items[i - 1] is spikes
    for i, m in enumerate(items):  # a conv/linear fed by a neuron (through reshapes and max-pools) reads spikes
        if spikes and isinstance(m, SeqToBatch):
            new = spike_layer_from(m)
            if new is not None:
                seq[i] = new
                counts["spike_layers"] += 1
            new = spike_max_pool_from(m)
            if new is not None:
                seq[i] = new
                counts["pools"] += 1
        spikes = isinstance(m, _SPIKING) or (spikes and _keeps_spikes(m))
    for i in range(len(items) - 1):
        if isinstance(items[i], SeqToBatch):
            new = fused_batchnorm_from(items[i], items[i + 1])
            if new is not None:
                seq[i], seq[i + 1] = new, nn.Identity()
                counts["bn_lif"] += 1
    for i in range(len(seq) - 1):  # a conv reading real values, then a fused BatchNorm+neuron
        if isinstance(seq[i], SeqToBatch) and spike_layer_from(seq[i]) is not None:
            new = conv_batchnorm_neuron_from(seq[i], seq[i + 1])
            if new is not None:
                seq[i], seq[i + 1] = new, nn.Identity()
                counts["conv_bn_lif"] += 1
    for m in items:
        if isinstance(m, SeqToBatch) and type(m.module) is nn.AvgPool2d:
            p = m.module
            m.module = ShapeOnlyAvgPool2d(
                p.kernel_size, p.stride, p.padding, p.ceil_mode, p.count_include_pad, p.divisor_override
            )
            counts["pools"] += 1


def to_lean(model: nn.Module) -> dict[str, int]:
    """Convert ``model`` in place to its memory-lean form (see :mod:`spikefuse.batchnorm.lean` for the contract);
    returns how many of each conversion were made (keys :data:`LEAN_COUNTS`). Converting twice changes nothing
    the second time."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_lean converts an nn.Module, got {type(model).__name__}")
    counts = dict.fromkeys(LEAN_COUNTS, 0)
    for m in list(model.modules()):
        convert = getattr(m, "convert_to_lean", None)
        if callable(convert):
            convert(counts)
    for m in list(model.modules()):
        if isinstance(m, nn.Sequential):
            _convert_sequential(m, counts)
    for m in model.modules():
        if isinstance(m, EngineNeuron) and m.memory != "recompute":
            m.memory = "recompute"
            counts["recompute_neurons"] += 1
    return counts
