"""The neuron engine's backends: every :class:`~spikefuse.neurons.NeuronModel` runs on each, from its one definition.

- :mod:`.reference`: the serial PyTorch loop, differentiated by autograd (the oracle);
- :mod:`.cpu`: fused numba kernels generated from the definition (forward; backward from sympy's derivatives).

Both expose ``forward`` and ``backward`` with the same arguments (see :mod:`.reference`).
"""

from __future__ import annotations

from . import cpu, reference

__all__ = ["BACKENDS", "module"]

BACKENDS = {"reference": reference, "cpu": cpu}


def module(backend: str):
    return BACKENDS[backend]
