"""Drop-in replacements for the neuron modules of the peer libraries, backed by spikefuse's fused kernels.

- :mod:`spikefuse.compat.spikingjelly`: ``LIFNode``, ``ParametricLIFNode``, ``IFNode`` (SpikingJelly 2.0)
- :mod:`spikefuse.compat.snntorch`: ``Leaky``, ``Synaptic``, ``RLeaky``, ``RSynaptic`` (snnTorch 1.0)
- :mod:`spikefuse.compat.norse`: ``LIF``, ``LIFCell``, ``LSNN``, ``LSNNCell``, ``LIFRecurrent``, ``LSNNRecurrent`` and
  Norse's neurons as definitions (Norse 1.1)

Each layer reproduces the peer's spikes and membrane potentials bit for bit in float32 (the definitions of
:mod:`spikefuse.neurons` keep the peers' order of floating-point operations) and its gradients up to rounding.
The peers themselves are not needed: their surrogate objects are recognised by class name and module when given.
``tests/compat`` checks every claim against the installed peers. The submodules are imported on first use.
"""

from __future__ import annotations

import importlib

__all__ = ["spikingjelly", "snntorch", "norse"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
