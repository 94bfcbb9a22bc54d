"""spikefuse: fast, memory-lean training of spiking neural networks.

Time-fused multi-step spiking neurons (forward and backward over all T steps in one kernel per layer) for the
CPU (numba) and GPU (Triton), checked against a plain PyTorch reference.
"""

from . import surrogate
from .functional import batchnorm_lif, if_neuron, lif, spiking_neuron
from .params import NeuronSpec

__all__ = ["lif", "if_neuron", "batchnorm_lif", "spiking_neuron", "surrogate", "NeuronSpec"]
__version__ = "0.1.0"
