"""Modules: multi-step neurons, layers fed by spikes, helpers for ``[T, B, ...]`` tensors, and the memory-lean
conversion :func:`to_lean`. The BatchNorm fused with the neurons and ``to_lean`` are defined with the fused op in
:mod:`spikefuse.batchnorm`."""

from ..batchnorm.lean import ShapeOnlyAvgPool2d, to_lean
from ..batchnorm.modules import BatchNormLIF1d, BatchNormLIF2d, BatchNormNeuron, ConvBatchNormLIF, ConvBatchNormNeuron
from .containers import Flatten, SeqToBatch
from .engine_neurons import ALIF, CubaLIF, EngineNeuron
from .neurons import IF, LIF, NeuronFactory
from .pooling import MaxPool2d
from .recurrent import Recurrent, RecurrentALIF, RecurrentCubaLIF, RecurrentLIF
from .states import reset_states
from .spike_layers import (
    SpikeConv1d,
    SpikeConv2d,
    SpikeConv3d,
    SpikeLinear,
    SpikeMaxPool1d,
    SpikeMaxPool2d,
    SpikeMaxPool3d,
    debug_enabled,
    set_debug,
)

__all__ = [
    "LIF",
    "IF",
    "NeuronFactory",
    "BatchNormLIF1d",
    "BatchNormLIF2d",
    "ConvBatchNormLIF",
    "ConvBatchNormNeuron",
    "SeqToBatch",
    "Flatten",
    "MaxPool2d",
    "SpikeLinear",
    "SpikeConv1d",
    "SpikeConv2d",
    "SpikeConv3d",
    "SpikeMaxPool1d",
    "SpikeMaxPool2d",
    "SpikeMaxPool3d",
    "set_debug",
    "debug_enabled",
    "to_lean",
    "ShapeOnlyAvgPool2d",
    "CubaLIF",
    "ALIF",
    "EngineNeuron",
    "BatchNormNeuron",
    "reset_states",
    "Recurrent",
    "RecurrentLIF",
    "RecurrentCubaLIF",
    "RecurrentALIF",
]
