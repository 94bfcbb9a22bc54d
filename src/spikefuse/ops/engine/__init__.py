"""The neuron engine's backends: every :class:`~spikefuse.neurons.NeuronModel` runs on each, from its one definition.

- :mod:`.reference`: the serial PyTorch loop, differentiated by autograd (the oracle);
- :mod:`.cpu`: fused numba kernels generated from the definition (forward; backward from sympy's derivatives);
- :mod:`.triton`: fused Triton kernels generated from the same definition (CUDA; the interpreter on the CPU);
- :mod:`.step`: one time step on the CPU in one autograd node, numba loops generated from the same definition (the
  calls of a step loop, where there is no time to fuse).

Each exposes ``forward`` and ``backward`` with the same arguments (see :mod:`.reference`): the neuron with its
settings (:class:`~spikefuse.neurons.NeuronSpec`) and one call's tensors (:class:`NeuronInputs`); and ``READS_HALF``:
whether it takes float16 / bfloat16 ``[T, N]`` streams (the input, the spikes' gradient) as they are, converting
each value as it reads it, or needs them in float32 first (:func:`stream`). The generated backends are imported on
first use: numba and Triton load only when a call needs them.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

from ..numerics import compute_dtype

__all__ = ["DTYPES", "NeuronInputs", "module", "stream", "stream_dtype"]

#: The input dtypes the engine takes: float32 and float64 compute in their own dtype, float16 and bfloat16 in float32
#: (parameters and states in float32; the input converted for a backend that does not read half precision).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class NeuronInputs(NamedTuple):
    """One call's tensors, as every backend takes them: ``x`` the input stream ``[T, N]`` (:func:`stream`);
    ``params`` one tensor per parameter of the model (its order), ``[1]`` or ``[C]`` with ``inner`` neurons per
    channel run; ``init`` one tensor per state, ``[N]``, or ``[1]``: one value shared by every neuron."""

    x: torch.Tensor
    params: list
    init: list
    inner: int = 1


def module(backend: str):
    """The module of a concrete backend; raises with an install hint when its compiler is missing."""
    try:
        return importlib.import_module(f"{__name__}.{backend}")
    except ImportError as err:
        requirement = {"cpu": "numba", "triton": "triton"}.get(backend, str(err.name))
        raise RuntimeError(
            f"backend={backend!r} cannot run: {err}. Install it with `pip install {requirement}`"
            + (" or pick backend='reference'" if backend != "reference" else "")
        ) from err


def stream_dtype(backend_module, dtype: torch.dtype) -> torch.dtype:
    """The dtype in which ``backend_module`` takes a ``[T, N]`` input stream of ``dtype``: a half precision as it is
    where the backend reads it (``READS_HALF``), else the compute dtype."""
    return dtype if backend_module.READS_HALF else compute_dtype(dtype)


def stream(backend_module, t: torch.Tensor) -> torch.Tensor:
    """``t``, a ``[T, N]`` input stream, in :func:`stream_dtype` (converted only where that differs)."""
    return t.to(stream_dtype(backend_module, t.dtype))
