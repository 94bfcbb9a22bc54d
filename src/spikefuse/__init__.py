"""spikefuse: fast, memory-lean training of spiking neural networks.

Time-fused multi-step spiking neurons (forward and backward over all T steps in one kernel per layer) for the
CPU (numba) and GPU (Triton), checked against a plain PyTorch reference.
"""

from . import neurons, surrogate
from .bn_functional import batchnorm_lif, batchnorm_neuron
from .functional import if_neuron, lif
from .neuron_functional import neuron
from .recurrent_functional import recurrent
from .ops.nonfinite import NonFiniteError
from .ops.buffers import cpu_cache_bytes, cpu_cache_limit, empty_cpu_cache, set_cpu_cache_limit

# spikefuse.nn re-exports the modules of spikefuse.batchnorm, which build on nn's neurons. Imported here, nn is always
# initialized before them: a first import of spikefuse.batchnorm.modules would otherwise start nn's, which would find
# that module half made.
from . import nn  # noqa: F401

__all__ = [
    "lif",
    "if_neuron",
    "batchnorm_lif",
    "batchnorm_neuron",
    "neuron",
    "recurrent",
    "neurons",
    "surrogate",
    "set_cpu_cache_limit",
    "cpu_cache_limit",
    "empty_cpu_cache",
    "cpu_cache_bytes",
    "NonFiniteError",
]
__version__ = "0.1.0"
