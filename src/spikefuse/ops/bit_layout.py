"""The bit layout shared by the CPU (:mod:`spikefuse.ops.bitpack`) and Triton (:mod:`spikefuse.ops.bitpack_triton`)
packers: bytes per packed tensor, and each dtype's same-width integer view."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["packed_numel", "int_view"]

# Same-width integer views of each supported dtype; the mask keeps the bits that make an element nonzero (for
# floats every bit but the sign, so -0.0 packs to 0); ONE is the bit pattern of 1 in the dtype.
_INT_VIEW = {
    torch.float64: (torch.int64, np.int64(0x7FFFFFFFFFFFFFFF), np.int64(0x3FF0000000000000)),
    torch.float32: (torch.int32, np.int32(0x7FFFFFFF), np.int32(0x3F800000)),
    torch.float16: (torch.int16, np.int16(0x7FFF), np.int16(0x3C00)),
    torch.bfloat16: (torch.int16, np.int16(0x7FFF), np.int16(0x3F80)),
    torch.int64: (torch.int64, np.int64(-1), np.int64(1)),
    torch.int32: (torch.int32, np.int32(-1), np.int32(1)),
    torch.int16: (torch.int16, np.int16(-1), np.int16(1)),
    torch.int8: (torch.int8, np.int8(-1), np.int8(1)),
    torch.uint8: (torch.uint8, np.uint8(0xFF), np.uint8(1)),
    torch.bool: (torch.uint8, np.uint8(0xFF), np.uint8(1)),
}


def packed_numel(numel: int) -> int:
    """Bytes that :func:`spikefuse.ops.bitpack.pack` uses for ``numel`` elements: ``ceil(numel / 8)``."""
    return (int(numel) + 7) // 8


def int_view(dtype: torch.dtype):
    """``(integer dtype, mask of the bits that make an element nonzero, bit pattern of 1)`` of ``dtype``."""
    try:
        return _INT_VIEW[dtype]
    except KeyError:
        supported = ", ".join(map(str, _INT_VIEW))
        raise TypeError(f"bitpack does not support dtype {dtype}; supported: {supported}") from None
