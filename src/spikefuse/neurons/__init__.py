"""Spiking neuron models, each defined once (:class:`NeuronModel`, one file per family) and run by every engine
backend (:mod:`spikefuse.ops.engine`) as a :class:`NeuronSpec` (the model with its settings) through :func:`spikefuse.neuron` and the :mod:`spikefuse.nn` modules.
"""

from .alif import ALIF_MODEL
from .alpha import ALPHA_MODELS
from .cuba_lif import (
    CUBA_LIF,
    CUBA_LIF_EULER,
    CUBA_LIF_HARD,
    CUBA_LIF_MODELS,
    CUBA_LIF_NO_RESET,
    CUBA_LIF_ZERO,
    SYNAPTIC_NO_DELAY_MODELS,
)
from .lif import (
    LAPICQUE_MODELS,
    LIF_MODELS,
    RLEAKY_ZERO,
    SNNTORCH_NO_DELAY_MODELS,
    SPIKINGJELLY_MODELS,
    SPIKINGJELLY_PRE_RESET_MODELS,
)
from .model import FUNCTIONS, HEAVISIDE, WHERE, Derivatives, NeuronModel
from .spec import NeuronSpec, neuron_spec

__all__ = [
    "NeuronModel",
    "NeuronSpec",
    "neuron_spec",
    "FUNCTIONS",
    "HEAVISIDE",
    "WHERE",
    "Derivatives",
    "CUBA_LIF",
    "CUBA_LIF_ZERO",
    "CUBA_LIF_HARD",
    "CUBA_LIF_NO_RESET",
    "CUBA_LIF_EULER",
    "RLEAKY_ZERO",
    "CUBA_LIF_MODELS",
    "SYNAPTIC_NO_DELAY_MODELS",
    "SNNTORCH_NO_DELAY_MODELS",
    "ALIF_MODEL",
    "ALPHA_MODELS",
    "LAPICQUE_MODELS",
    "LIF_MODELS",
    "SPIKINGJELLY_MODELS",
    "SPIKINGJELLY_PRE_RESET_MODELS",
]
