"""Numbers as the kernels see them: the compute dtype of an input, a host value rounded to it, finiteness of a
(possibly symbolic) float, and the per-channel sum of a per-neuron parameter gradient."""

from __future__ import annotations

import math
import struct

import torch


def finite(value) -> bool:
    """``math.isfinite(value)`` for a real number, also while torch.compile traces it as a symbolic float: a module's
    float option becomes one once a second module with another value compiles the same code, and ``math.isfinite``
    cannot take it (a comparison can)."""
    return abs(value) < math.inf


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Membrane potentials are kept in float32 for half-precision inputs, in the input's dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def in_compute_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` as the kernels see it in the compute ``dtype`` (float32 or float64; an overflow is inf), rounded on
    the host: checking a parameter in that dtype costs no GPU sync."""
    if dtype == torch.float64:
        return value
    try:  # C's double -> float conversion, round to nearest (numpy's, under np.errstate, costs ~10x more)
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def reduce_leak_grad(per_neuron: torch.Tensor, channels: int, inner: int) -> torch.Tensor:
    """Sum a per-neuron leak gradient ``[N]`` into the leak's ``[C]`` (neuron n uses ``(n // inner) % C``)."""
    return per_neuron.reshape(-1, channels, inner).sum(dim=(0, 2))
