"""The neuron engine's backends: every :class:`~spikefuse.neurons.NeuronModel` runs on each, from its one definition.

- :mod:`.reference`: the serial PyTorch loop, differentiated by autograd (the oracle);
- :mod:`.cpu`: fused numba kernels generated from the definition (forward; backward from sympy's derivatives);
- :mod:`.triton`: fused Triton kernels generated from the same definition (CUDA; the interpreter on the CPU).

Each exposes ``forward`` and ``backward`` with the same arguments (see :mod:`.reference`). The generated backends
are imported on first use: numba and Triton load only when a call needs them.
"""

from __future__ import annotations

import torch

from .. import module as _import_backend

__all__ = ["BACKENDS", "DTYPES", "module"]

BACKENDS = ("reference", "cpu", "triton")

#: The input dtypes the engine takes: float32 and float64 compute in their own dtype, float16 and bfloat16 in float32
#: (parameters and states in float32; :mod:`.autograd` converts, the backends see float32 or float64 only).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def module(backend: str):
    """The module of a concrete backend; raises with an install hint when its compiler is missing."""
    return _import_backend(backend, __name__)
