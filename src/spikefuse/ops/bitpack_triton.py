"""Triton kernels of :mod:`spikefuse.ops.bitpack` for CUDA tensors: one launch each way.

The layout is :mod:`~spikefuse.ops.bitpack`'s: element ``8*j + k`` of the flattened input is bit ``k`` (least
significant first) of byte ``j``, the last byte padded with zero bits. ``pack`` reads each element once and writes
one byte per eight; ``unpack`` writes each element once as the dtype's 0 or 1. The torch-op forms
(:func:`~spikefuse.ops.bitpack.pack_torch`) take about a dozen launches and temporaries for the same work, which a lean
model on a GPU pays for every spike-fed layer.

Imported on the first CUDA call (Triton is optional on a CPU-only install). Under Triton's interpreter
(``TRITON_INTERPRET=1``) the kernels run on CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bit_layout import int_view, packed_numel
from .launch import ceil_div, device_guard

# Bytes per program of pack (8 elements each) and elements per program of unpack.
_PACK_BYTES = 1024
_UNPACK_ELEMENTS = 4096


@triton.jit
def _pack_kernel(x_ptr, out_ptr, n, n_bytes, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    index = byte[:, None] * 8 + k[None, :]
    x = tl.load(x_ptr + index, mask=index < n, other=0)
    bits = (x != 0).to(tl.int32) << k[None, :]
    tl.store(out_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte < n_bytes)


@triton.jit
def _unpack_kernel(packed_ptr, out_ptr, one, n, BLOCK: tl.constexpr):
    # out_ptr: an integer view of the output; one: the bit pattern of 1 in the output's dtype
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < n
    byte = tl.load(packed_ptr + (index >> 3), mask=inside, other=0).to(tl.int32)
    bit = ((byte >> (index & 7).to(tl.int32)) & 1).to(tl.int64)
    tl.store(out_ptr + index, (bit * one).to(out_ptr.dtype.element_ty), mask=inside)


def pack(x: torch.Tensor) -> torch.Tensor:
    """The packed ``uint8`` bytes of ``x != 0`` (``ceil(x.numel() / 8)`` of them, on ``x``'s device)."""
    int_view(x.dtype)
    flat = x.contiguous().view(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    n_bytes = packed_numel(flat.numel())
    out = torch.empty(n_bytes, dtype=torch.uint8, device=x.device)
    if n_bytes:
        with device_guard(x.device):
            _pack_kernel[(ceil_div(n_bytes, _PACK_BYTES),)](flat, out, flat.numel(), n_bytes, BLOCK=_PACK_BYTES)
    return out


def unpack(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor of ``shape`` and ``dtype``: 1 where the bit of ``packed`` is set, 0 elsewhere,
    written as the integer bit patterns of 0 and 1 (exact in every dtype, as the CPU kernel writes them)."""
    view, _, one = int_view(dtype)
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    flat = out.view(-1).view(view)
    if flat.numel():
        with device_guard(packed.device):
            _unpack_kernel[(ceil_div(flat.numel(), _UNPACK_ELEMENTS),)](
                packed.contiguous(), flat, int(one), flat.numel(), BLOCK=_UNPACK_ELEMENTS
            )
    return out
