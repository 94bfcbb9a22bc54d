"""Pack binary tensors (spikes) into bits, 8 elements per ``uint8``, and unpack them again.

``pack(x)`` stores ``x != 0`` of every element of ``x`` (in its logical, row-major order) as one bit: element
``8*j + k`` of ``x.flatten()`` goes to bit ``k`` (least significant first) of byte ``j``. The last byte is padded
with zero bits when ``x.numel()`` is not a multiple of 8. ``unpack(packed, shape, dtype)`` gives back a tensor of
``shape`` and ``dtype`` holding exactly 0 and 1 (bit patterns of ``+0`` and ``1``), so for a binary input
``unpack(*pack(x), x.dtype)`` equals ``x`` bit for bit (a ``-0.0`` comes back as ``+0.0``, which compares equal).

Speed: CPU tensors go through numba kernels (``njit(parallel=True, cache=True)``) that read the input through an
integer view of the same width (any float dtype incl. float16/bfloat16, integers, bool) and write ``unpack``'s
output as the integer bit pattern of 0/1 (:func:`spikefuse.ops.numba_common.unpack_bits`, each byte unrolled into
its eight elements so that the loop vectorizes), so no dtype conversion pass is needed. CUDA tensors go through one
Triton kernel each way (:mod:`spikefuse.ops.bitpack_triton`; where Triton is not installed, through the torch ops
below: the same bytes, a dozen launches instead of one). Other devices use vectorized torch bit operations, which
run anywhere; :func:`pack_torch` / :func:`unpack_torch` are those, exported for testing and for comparison.
A tensor is packed once: :func:`pack` remembers the bits it made (and :func:`remember` those a neuron kernel made
while writing the spikes) by the tensor owning the memory, and hands them out again for the same, unchanged
content (a residual block's input spikes, saved by its convolution, its shortcut's and the residual add).
``python -m spikefuse.ops.bitpack`` times the CPU forms on a 32x64x128x16x16 float32 spike tensor (67M elements,
268 MB), best of 5; on the 2-core Intel Xeon of 2026-11-26:

=========================  ========  ===============================================================
pack, numba (used)         18 ms     a fifth of a copy: reads the input, writes 1/32 of it
pack, numpy.packbits       34 ms     single-threaded
pack, torch ops            93 ms     eight strided passes plus a bool temporary
unpack, numba (used)       62 ms     as fast as a copy of the input (62 ms)
unpack, torch ops          119 ms
=========================  ========  ===============================================================
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch
from numba import njit, prange
from torch.utils.weak import WeakIdKeyDictionary

from ..threads import match_numba_threads
from . import buffers
from .bit_layout import int_view, packed_numel
from .numba_common import unpack_bits

__all__ = ["pack", "unpack", "pack_torch", "unpack_torch", "packed_numel", "remember", "NotBinaryError"]


# Packed bytes per parallel task of the CPU kernels (32768 elements): small enough that a layer's spikes (a few
# MB) still split over the threads, as prange gives each thread whole tasks.
_BYTES_PER_TASK = 1 << 12
_WORDS_PER_TASK = _BYTES_PER_TASK // 8


# --------------------------------------------------------------------------------------------------- CPU (numba)
@njit(parallel=True, cache=True)
def _pack_kernel(x, mask, one, out, words):
    """``words``: the whole 64-bit words of ``out`` (its first ``8 * (x.size // 64)`` bytes, as uint64), each made from
    64 elements at once (a compare per element and a shift into the word, which LLVM vectorizes: 2-3x faster than
    a byte at a time); the elements after the last whole word go bit by bit into ``out``'s last bytes. Returns how
    many words (and trailing elements) hold a nonzero element other than ``one`` (the bit pattern of 1): whether
    ``x`` was binary, told as it is read, by a second word of the elements equal to ``one``, made as the first is
    (on a 268 MB tensor within 3% of the time without it; 1.55x where ``x`` is in cache, 4 MB: +19 us,
    ``benchmarks/results/issue55_pack_check.md``)."""
    n = x.size
    tasks = (words.size + _WORDS_PER_TASK - 1) // _WORDS_PER_TASK
    others = 0
    for t in prange(tasks):
        task_others = 0
        for w in range(t * _WORDS_PER_TASK, min((t + 1) * _WORDS_PER_TASK, words.size)):
            xs = x[64 * w : 64 * w + 64]
            bits = np.uint64(0)
            ones = np.uint64(0)
            for k in range(64):
                bits |= np.uint64((xs[k] & mask) != 0) << np.uint64(k)
                ones |= np.uint64(xs[k] == one) << np.uint64(k)
            words[w] = bits
            task_others += bits != ones
        others += task_others
    for j in range(8 * words.size, out.size):
        out[j] = 0
    for i in range(64 * words.size, n):
        if (x[i] & mask) != 0:
            out[i >> 3] |= np.uint8(1 << (i & 7))
            others += x[i] != one
    return others


@njit(parallel=True, cache=True)
def _unpack_kernel(packed, one, out):
    n = out.size
    per_task = 8 * _BYTES_PER_TASK
    for t in prange((n + per_task - 1) // per_task):
        e0 = t * per_task
        unpack_bits(packed, e0, out[e0 : min(e0 + per_task, n)], one)


def _pack_cpu(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The bits of ``x`` and whether ``x`` held only 0 and 1."""
    view, mask, one = int_view(x.dtype)
    flat = x.contiguous().view(-1).view(view)
    out = torch.empty(packed_numel(flat.numel()), dtype=torch.uint8)
    others = 0
    if flat.numel():
        match_numba_threads()
        out_np = out.numpy()  # torch's allocations are 64-byte aligned: the whole words view the same bytes
        # bit k of a word is bit k % 8 of its byte k // 8 on a little-endian machine; elsewhere every bit goes singly
        whole = 8 * (flat.numel() // 64) if sys.byteorder == "little" else 0
        others = _pack_kernel(flat.numpy(), mask, one, out_np, out_np[:whole].view(np.uint64))
    return out, others == 0


def _unpack_cpu(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    view, _, one = int_view(dtype)
    out = buffers.empty(tuple(shape), dtype)  # a cached buffer: a fresh one faults its pages in while unpack writes it
    if out.numel():
        match_numba_threads()
        _unpack_kernel(packed.contiguous().numpy(), one, out.view(-1).view(view).numpy())
    return out


# ------------------------------------------------------------------------------------------ any device (torch)
def pack_torch(x: torch.Tensor) -> torch.Tensor:
    """:func:`pack` in plain torch ops (any device): returns the packed ``uint8`` tensor only."""
    int_view(x.dtype)
    n = x.numel()
    bits = (x.reshape(-1) != 0).view(torch.uint8)
    pad = packed_numel(n) * 8 - n
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    bits = bits.view(-1, 8)
    out = bits[:, 0].clone()
    for k in range(1, 8):
        out |= bits[:, k] << k
    return out


def unpack_torch(packed: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """:func:`unpack` in plain torch ops (any device)."""
    int_view(dtype)
    shape = torch.Size(shape)
    n = shape.numel()
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return bits.view(-1)[:n].to(dtype).view(shape)


# ------------------------------------------------------------------------------------------------- CUDA (Triton)
@functools.cache
def _triton_kernels():
    """:mod:`spikefuse.ops.bitpack_triton`, or None where Triton is not installed."""
    try:
        from . import bitpack_triton
    except ImportError:
        return None
    return bitpack_triton


# ------------------------------------------------------------------------------------- bits already made of a tensor
# The bits of a tensor's content, by the tensor that owns its memory (the base of its views): (the owner's version
# then, the bits, the bits' version then, whether the content is known to be spikes). A spike tensor is packed by
# each layer that saves it (a residual block's input by its first convolution, its shortcut's and the residual add),
# and its neuron may have packed it already (:func:`spikefuse.ops.engine.cpu.forward`): every pack after the first
# reads the bits from here. An entry goes with its owner; a change of the owner's content in place (its version
# counter) or of the bits makes it stale.
_known: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _owner_of_all(x: torch.Tensor) -> torch.Tensor | None:
    """The tensor owning ``x``'s memory (the base of its views) when ``x`` is all of its elements in its memory order
    (a contiguous reshape or flatten: then its bits are the owner's) and a change of it can be told (not under
    ``torch.compile``'s tracing; inference tensors have no version counter); else None."""
    if torch.compiler.is_compiling() or x.is_inference():
        return None
    owner = x if x._base is None else x._base
    whole = (
        x.dtype == owner.dtype
        and x.numel() == owner.numel()
        and x.storage_offset() == owner.storage_offset()
        and x.is_contiguous()
        and owner.is_contiguous()
    )
    return owner if whole else None


def _remember_for(owner: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, spikes: bool) -> None:
    _known[owner] = (x._version, packed, packed._version, spikes)


def remember(x: torch.Tensor, packed: torch.Tensor, spikes: bool = False) -> None:
    """Record that ``packed`` holds the bits of ``x``'s current content (as :func:`pack` makes them): until ``x``
    changes in place, :func:`pack` of ``x`` or of a contiguous view of all of it returns ``packed`` without a pass
    over ``x``. ``spikes``: the caller made ``x`` as spikes (every element 0 or 1), so the bits are all of its
    content (:func:`spike_bits`). Changes written around torch (through a numpy view) are not seen: remember only a
    tensor that is final. A view of part of a tensor, or in another order, is not remembered."""
    owner = _owner_of_all(x)
    if owner is not None:
        _remember_for(owner, x, packed, spikes)


def _entry(x: torch.Tensor, owner: torch.Tensor | None) -> tuple | None:
    """``(bits, spikes)`` remembered for ``x`` (``owner``: :func:`_owner_of_all` of it) while ``x`` and the bits
    are unchanged, else None."""
    entry = None if owner is None else _known.get(owner)
    if entry is None:
        return None
    version, packed, packed_version, spikes = entry
    return (packed, spikes) if version == x._version and packed_version == packed._version else None


def _remembered(x: torch.Tensor) -> torch.Tensor | None:
    """The bits :func:`pack` would hand out for ``x`` without packing it, or None."""
    entry = _entry(x, _owner_of_all(x))
    return None if entry is None else entry[0]


def stale(x: torch.Tensor) -> bool:
    """Whether bits remembered for ``x`` no longer hold its content: it was changed where its version counter does
    not see it (through ``.data`` or a numpy view). A pass over ``x``: for debugging (the spike layers' debug mode)."""
    packed = _remembered(x)
    return packed is not None and not torch.equal(packed, pack_torch(x.detach()))


def spike_bits(x: torch.Tensor) -> torch.Tensor | None:
    """The bits of ``x`` when they were remembered as those of spikes (``remember(..., spikes=True)``: a neuron
    kernel's output, or a max-pooling of such spikes; or bits :func:`pack` made on the CPU, whose kernel saw every
    element 0 or 1), which therefore hold all of ``x`` -- a layer may compute from them instead of ``x`` -- else
    None."""
    entry = _entry(x, _owner_of_all(x))
    return entry[0] if entry is not None and entry[1] else None


# ------------------------------------------------------------------------------------------------------ public
class NotBinaryError(ValueError):
    """:func:`pack` with ``binary=True`` read an element that is neither 0 nor 1."""


def _pack_new(x: torch.Tensor, binary: bool) -> tuple[torch.Tensor, bool]:
    """The bits of ``x``, made anew on its device, and whether ``x`` is known to hold only 0 and 1 (the CPU kernel
    tells; elsewhere unknown: False)."""
    if x.device.type == "cpu":
        packed, spikes = _pack_cpu(x)
        if binary and not spikes:
            raise NotBinaryError(
                f"a tensor of shape {tuple(x.shape)} to be kept as bits holds values other than 0 and 1"
            )
        return packed, spikes
    if x.device.type == "cuda" and _triton_kernels() is not None:
        return _triton_kernels().pack(x), False
    return pack_torch(x), False


def _pack_op_impl(x: torch.Tensor, binary: bool) -> torch.Tensor:
    return _pack_new(x, binary)[0]


def _unpack_new(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    if packed.device.type == "cpu":
        return _unpack_cpu(packed, shape, dtype)
    if packed.device.type == "cuda" and _triton_kernels() is not None:
        return _triton_kernels().unpack(packed, shape, dtype)
    return unpack_torch(packed, shape, dtype)


def _unpack_op_impl(packed: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    # a custom op's output may not be an input's or another output's memory: a buffer of the cache is neither
    return _unpack_new(packed, torch.Size(shape), dtype).clone()


# Under torch.compile the kernels are custom ops (traced as one node each, not into numba or Triton's launcher)
pack_op = torch.library.custom_op("spikefuse::pack_bits", mutates_args=())(_pack_op_impl)
unpack_op = torch.library.custom_op("spikefuse::unpack_bits", mutates_args=())(_unpack_op_impl)


@pack_op.register_fake
def _(x, binary):
    return x.new_empty(packed_numel(x.numel()), dtype=torch.uint8)


@unpack_op.register_fake
def _(packed, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)


def pack(x: torch.Tensor, reuse: bool = True, binary: bool = False) -> tuple[torch.Tensor, torch.Size]:
    """Pack ``x != 0`` into bits: returns ``(packed, shape)`` with ``packed`` a 1-D ``uint8`` tensor of
    ``ceil(x.numel() / 8)`` bytes on ``x``'s device and ``shape == x.shape``. Not differentiable. With ``reuse``,
    packing a tensor again (or a contiguous view of all of it) before it changes returns the same ``packed`` (see
    :func:`remember`): do not change ``packed`` in place; ``reuse=False`` packs anew (a custom op's output, which
    must not share memory with another's; or ``x`` changed through a numpy view, which its version does not
    count). ``binary``: the bits must be all of ``x`` (a spike layer keeps them instead of ``x``): on the CPU the
    packing kernel checks, as it reads ``x``, that every element is 0 or 1 and raises :class:`NotBinaryError`
    otherwise (bits known to be spikes are handed out unchecked); on other devices reading the check's result
    would stall the host, and ``x`` is not checked."""
    if torch.compiler.is_compiling():
        return pack_op(x.detach(), binary), x.shape
    owner = _owner_of_all(x)
    entry = _entry(x, owner) if reuse else None
    if entry is not None and (entry[1] or not binary or x.device.type != "cpu"):
        return entry[0], x.shape
    packed, spikes = _pack_new(x.detach(), binary)
    if owner is not None:
        _remember_for(owner, x, packed, spikes)
    return packed, x.shape


def unpack(packed: torch.Tensor, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack`: a new contiguous tensor of ``shape`` and ``dtype`` with 1 where the bit is set and
    0 elsewhere, on ``packed``'s device."""
    shape = torch.Size(shape)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    if packed.numel() != packed_numel(shape.numel()):
        raise ValueError(
            f"packed has {packed.numel()} bytes but shape {tuple(shape)} needs {packed_numel(shape.numel())}"
        )
    if torch.compiler.is_compiling():
        return unpack_op(packed, list(shape), dtype)
    return _unpack_new(packed, shape, dtype)


def _bench(shape=(32, 64, 128, 16, 16), p: float = 0.2, repeat: int = 5) -> dict[str, float]:
    """Best-of-``repeat`` seconds of each implementation on a float32 spike tensor of ``shape``."""
    import time

    g = torch.Generator().manual_seed(0)
    x = (torch.rand(shape, generator=g) < p).float()
    results = {}

    def best(fn):
        fn()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    packed, _ = pack(x)
    results["pack numba"] = best(lambda: _pack_cpu(x)[0])
    results["pack torch"] = best(lambda: pack_torch(x))
    results["pack numpy.packbits"] = best(lambda: np.packbits(x.view(-1).numpy() != 0, bitorder="little"))
    results["unpack numba"] = best(lambda: _unpack_cpu(packed, x.shape, x.dtype))
    results["unpack torch"] = best(lambda: unpack_torch(packed, x.shape, x.dtype))
    results["copy x (memory-bound floor)"] = best(lambda: x.clone())
    assert torch.equal(unpack(packed, x.shape, x.dtype), x)
    assert torch.equal(pack_torch(x), packed)
    return results


if __name__ == "__main__":  # pragma: no cover
    for name, sec in _bench().items():
        print(f"{name:30s} {sec * 1e3:8.1f} ms")
