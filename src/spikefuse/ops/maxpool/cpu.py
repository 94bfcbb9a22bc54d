"""Max-pooling of spikes on the CPU: the forward as torch computes it, the backward from the input's bits.

torch's ``max_pool{1,2,3}d_with_indices`` keeps an int64 index per output for its backward; the spike layer
(:class:`spikefuse.nn.SpikeMaxPool2d`) keeps only its input as bits (:mod:`.bitpack`). These numba kernels serve it
on contiguous float32/float64 CPU input, every case as 3-D pooling (1-D and 2-D with unit leading extents):

- :func:`forward` is torch's CPU kernel, window by window: the maximum with the index of its first occurrence in
  the window's row-major scan (``val > max or isnan(val)``, from ``-inf``, padding excluded), so the output is
  torch's bit for bit on any input, with the windows' bounds computed once per call instead of per plane.
- :func:`backward` finds each window's index again from the bits: the first set bit in scan order, or the window's
  first element when none is set -- the index torch picks on a binary input (0/1; ``-0.0`` counts as 0) -- and
  adds the output's gradient there, outputs in row-major order, as torch's backward adds them (bit-identical
  where windows overlap).
- :func:`forward_with_indices` is torch's forward with ``return_indices`` (2-D, float32, int32 indices) for real
  values (:class:`spikefuse.nn.MaxPool2d`), :func:`backward_from_indices` its backward.
- :func:`forward_from_bits` is the forward of spikes given as their bits (a neuron kernel's, see
  :func:`spikefuse.ops.bitpack.spike_bits`): a window's maximum is 1 where any of its bits is set, else 0, which is
  torch's output on such input; it also packs the output, itself spikes.

Where a row of the input holds at most :data:`WORD_ROW_MAX` elements, the backward and :func:`forward_from_bits`
read each row's bits as one 64-bit word and a window's columns as a mask of it: one AND per row of a window, not a
load and compare (forward) or bit test (backward) per element.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from ...threads import match_numba_threads
from .. import buffers

__all__ = [
    "forward",
    "forward_with_indices",
    "backward_from_indices",
    "forward_from_bits",
    "backward",
    "reads_rows_as_words",
    "SUPPORTED_DTYPES",
    "WORD_ROW_MAX",
]

SUPPORTED_DTYPES = (torch.float32, torch.float64)

# Below this many input elements a call runs on one thread (waking the pool costs more than it saves).
_SERIAL_WORK = 1 << 15

_NO_AUX = np.empty(0, dtype=np.float32)  # the forward's unused second input
_NO_BITS = np.empty(0, dtype=np.uint8)  # forward_from_bits' output bits where it packs none

_INT32_MAX = np.int64(2**31 - 1)
_FLOAT32_INF = np.int64(0x7F800000)  # its bits; a float32 whose magnitude's bits exceed them is a NaN

# The longest input row read as one 64-bit word of bits: a row may start at any bit of its first byte (57 + 7 = 64).
WORD_ROW_MAX = 57

# x & -x isolates the lowest set bit of a word; times this de Bruijn constant, its top six bits index its position.
_DE_BRUIJN = 0x03F79D71B4CB0A89
_LOWEST_BIT = np.zeros(64, dtype=np.int64)
_LOWEST_BIT[[((1 << i) * _DE_BRUIJN & (2**64 - 1)) >> 58 for i in range(64)]] = np.arange(64)


def _bounds(in_size: int, out_size: int, kernel: int, stride: int, padding: int, dilation: int) -> np.ndarray:
    """``[2, out_size]``: the first input index of each output's window along one dim, moved past the padding
    (torch's ``while (start < 0) start += dilation``), and the number of input elements it covers (a loop over a
    count: numba's loops with a run-time step are slower)."""
    starts = np.arange(out_size, dtype=np.int64) * stride - padding
    ends = np.minimum(starts + (kernel - 1) * dilation + 1, in_size)
    starts = np.where(starts < 0, starts + (-starts + dilation - 1) // dilation * dilation, starts)
    return np.stack([starts, (ends - starts + dilation - 1) // dilation])


@njit(inline="always")
def _window_max(x, base, h_in, w_in, d0, nd, h0, nh, w0, nw, dilation):
    """The maximum of a window in torch's row-major scan: the first of equal maxima, NaN over anything."""
    sd, sh, sw = dilation
    best = x.dtype.type(-np.inf)
    for ii in range(nd):
        for jj in range(nh):
            row = base + ((d0 + ii * sd) * h_in + h0 + jj * sh) * w_in + w0
            for kk in range(nw):
                v = x[row + kk * sw]
                if v > best or np.isnan(v):
                    best = v
    return best


@njit(inline="always")
def _first_set(bits, base, h_in, w_in, d0, nd, h0, nh, w0, nw, dilation):
    """Index of the first set bit of a window in row-major scan order, or of its first element when none is: the
    scan runs backwards keeping the last set bit seen, without a branch (an early exit on spikes mispredicts)."""
    sd, sh, sw = dilation
    first = base + (d0 * h_in + h0) * w_in + w0
    for ii in range(nd - 1, -1, -1):
        for jj in range(nh - 1, -1, -1):
            row = base + ((d0 + ii * sd) * h_in + h0 + jj * sh) * w_in + w0
            for kk in range(nw - 1, -1, -1):
                e = row + kk * sw
                first = e if (bits[e >> 3] >> (e & 7)) & 1 else first
    return first


def _visit(src, aux, dst, base, o, h_in, w_in, d0, nd, h0, nh, w0, nw, dilation):
    """One window: the forward's (``src`` the input: ``dst[o]`` = its maximum) or the backward's (``src`` the bits:
    ``dst`` (grad_x) += ``aux[o]`` (grad_y) at the window's index), chosen when numba types the call."""


@overload(_visit, inline="always")
def _visit_typed(src, aux, dst, base, o, h_in, w_in, d0, nd, h0, nh, w0, nw, dilation):
    if src.dtype == types.uint8:

        def unpool(src, aux, dst, base, o, h_in, w_in, d0, nd, h0, nh, w0, nw, dilation):
            dst[_first_set(src, base, h_in, w_in, d0, nd, h0, nh, w0, nw, dilation)] += aux[o]

        return unpool

    def pool(src, aux, dst, base, o, h_in, w_in, d0, nd, h0, nh, w0, nw, dilation):
        dst[o] = _window_max(src, base, h_in, w_in, d0, nd, h0, nh, w0, nw, dilation)

    return pool


@njit(parallel=True, cache=True)
def _windows_kernel(src, aux, planes, isize, osize, bd, bh, bw, dilation, dst):
    """:func:`_visit` on every window, planes in parallel, the outputs of a plane in order. ``src`` is ``x`` (forward)
    or the bits (backward) ``[planes * D*H*W]``, ``aux`` unused or ``grad_y``, ``dst`` the output or ``grad_x``;
    ``isize``/``osize`` (D, H, W), ``bd``/``bh``/``bw`` the windows' bounds per dim (:func:`_bounds`). One function,
    typed per direction by its arguments: made twice from a closure over the window function, as it was, numba's
    disk cache keyed it by its cells, which differ from process to process, so every process compiled both again
    (2.5 s of a lean ResNet's first step)."""
    plane_in, plane_out = isize[0] * isize[1] * isize[2], osize[0] * osize[1] * osize[2]
    for p in prange(planes):
        o = p * plane_out
        for od in range(osize[0]):
            for oh in range(osize[1]):
                for ow in range(osize[2]):
                    _visit(
                        src,
                        aux,
                        dst,
                        p * plane_in,
                        o,
                        isize[1],
                        isize[2],
                        bd[0, od],
                        bd[1, od],
                        bh[0, oh],
                        bh[1, oh],
                        bw[0, ow],
                        bw[1, ow],
                        dilation,
                    )
                    o += 1


@njit(inline="always")
def _argmax_key(bits, e):
    """An int64 key of the float32 of int32 ``bits`` at position ``e`` of its plane, whose maximum over a window is
    torch's choice there (:func:`_window_max`: the first of equal maxima, the last NaN): the value's order-preserving
    integer (``-0.0`` as ``0.0``) above the position inverted, or for a NaN a key above every number's above the
    position."""
    magnitude = bits & _INT32_MAX
    order = 0 if magnitude == 0 else bits ^ ((bits >> 31) & _INT32_MAX)
    return (_INT32_MAX << 32) | e if magnitude > _FLOAT32_INF else (order << 32) | (_INT32_MAX - e)


@njit(cache=True)
def _argmax_2d_kernel(bits, planes, h_in, w_in, bh, bw, dilation_h, dilation_w, out, indices):
    """:func:`forward_with_indices`, plane after plane on the calling thread (numba's threads beside torch's spinning
    ones ran it 2x slower inside a model): every element's :func:`_argmax_key` once, each row's maximum key over
    every window's columns, then each window's over its rows -- a window's largest key, as the keys order the
    elements in torch's row-major scan -- written as the maximum's bits and its index."""
    h_out, w_out = bh.shape[1], bw.shape[1]
    plane_in = h_in * w_in
    keys = np.empty(plane_in, dtype=np.int64)
    rows = np.empty((h_in, w_out), dtype=np.int64)
    o = 0
    for p in range(planes):
        base = p * plane_in
        for e in range(plane_in):
            keys[e] = _argmax_key(np.int64(bits[base + e]), e)
        for h in range(h_in):
            for ow in range(w_out):
                best = np.int64(-(2**63))
                for kk in range(bw[1, ow]):
                    key = keys[h * w_in + bw[0, ow] + kk * dilation_w]
                    best = key if key > best else best
                rows[h, ow] = best
        for oh in range(h_out):
            for ow in range(w_out):
                best = np.int64(-(2**63))
                for jj in range(bh[1, oh]):
                    key = rows[bh[0, oh] + jj * dilation_h, ow]
                    best = key if key > best else best
                position = best & 0xFFFFFFFF
                index = position if best >> 32 == _INT32_MAX else _INT32_MAX - position
                out[o], indices[o] = bits[base + index], index
                o += 1


@njit(cache=True)
def _indices_backward_kernel(indices, grad_y, plane_in, plane_out, grad_x):
    """:func:`backward_from_indices` on the calling thread: per plane, the gradient zeroed (in cache), then each
    output's gradient added at its index, the outputs in order, as torch's backward adds them."""
    zero = grad_x.dtype.type(0.0)
    for p in range(grad_x.size // plane_in):
        g_plane = grad_x[p * plane_in : (p + 1) * plane_in]
        for e in range(plane_in):
            g_plane[e] = zero
        for o in range(p * plane_out, (p + 1) * plane_out):
            g_plane[indices[o]] += grad_y[o]


@njit(inline="always")
def _row_word(bits, start, n):
    """Bits ``start .. start + n - 1`` of ``bits`` (``n`` <= :data:`WORD_ROW_MAX`) as the low bits of a uint64."""
    b0 = start >> 3
    word = np.uint64(0)
    for i in range(min(((start & 7) + n + 7) >> 3, bits.size - b0)):
        word |= np.uint64(bits[b0 + i]) << np.uint64(8 * i)
    return (word >> np.uint64(start & 7)) & ((np.uint64(1) << np.uint64(n)) - np.uint64(1))


@njit(inline="always")
def _plane_words(bits, base, rows, w_in):
    """Each of a plane's ``rows`` rows of ``w_in`` elements, from bit ``base``, as a word (:func:`_row_word`)."""
    words = np.empty(rows, np.uint64)
    for r in range(rows):
        words[r] = _row_word(bits, base + r * w_in, w_in)
    return words


@njit(parallel=True, cache=True)
def _bits_forward_kernel(bits, planes, isize, osize, bd, bh, masks, dilation, dst, dst_bits):
    """:func:`forward_from_bits` on every window, planes in parallel: a window's rows ORed, then each output's
    columns as a mask of that word (``masks`` [W_out], uint64); the outputs' bits into ``dst_bits`` unless it is
    empty (only where a plane's outputs fill whole bytes, so no two tasks write one byte)."""
    plane_in, plane_out = isize[0] * isize[1] * isize[2], osize[0] * osize[1] * osize[2]
    h_in, w_in = isize[1], isize[2]
    one = dst.dtype.type(1.0)
    pack_out = dst_bits.size > 0
    for p in prange(planes):
        words = _plane_words(bits, p * plane_in, isize[0] * h_in, w_in)
        o = p * plane_out
        byte = 0
        for od in range(osize[0]):
            for oh in range(osize[1]):
                rows = np.uint64(0)
                for ii in range(bd[1, od]):
                    for jj in range(bh[1, oh]):
                        rows |= words[(bd[0, od] + ii * dilation[0]) * h_in + bh[0, oh] + jj * dilation[1]]
                for ow in range(osize[2]):
                    spike = (rows & masks[ow]) != np.uint64(0)
                    dst[o] = one * spike
                    byte |= spike << (o & 7)
                    if pack_out and o & 7 == 7:
                        dst_bits[o >> 3] = byte
                        byte = 0
                    o += 1


@njit(parallel=True, cache=True)
def _bits_backward_kernel(bits, grad_y, planes, isize, osize, bd, bh, bw, masks, dilation, lowest_bit, grad_x):
    """:func:`backward` with the rows read as words: a plane's gradient zeroed (in cache), then each window's first
    set bit -- the first of its rows with a set bit in the window's columns, scanned without a branch, and that row's
    lowest such bit -- gets the output's gradient, the outputs in row-major order."""
    plane_in, plane_out = isize[0] * isize[1] * isize[2], osize[0] * osize[1] * osize[2]
    h_in, w_in = isize[1], isize[2]
    zero = grad_x.dtype.type(0.0)
    for p in prange(planes):
        words = _plane_words(bits, p * plane_in, isize[0] * h_in, w_in)
        g_plane = grad_x[p * plane_in : (p + 1) * plane_in]
        for e in range(plane_in):
            g_plane[e] = zero
        o = p * plane_out
        for od in range(osize[0]):
            d0, nd = bd[0, od], bd[1, od]
            for oh in range(osize[1]):
                h0, nh = bh[0, oh], bh[1, oh]
                for ow in range(osize[2]):
                    # none set: the window's first element
                    row, found = d0 * h_in + h0, np.uint64(1) << np.uint64(bw[0, ow])
                    for ii in range(nd - 1, -1, -1):
                        for jj in range(nh - 1, -1, -1):
                            r = (d0 + ii * dilation[0]) * h_in + h0 + jj * dilation[1]
                            set_bits = words[r] & masks[ow]
                            hit = set_bits != np.uint64(0)
                            row = r if hit else row
                            found = set_bits if hit else found
                    lowest = found & (~found + np.uint64(1))
                    g_plane[row * w_in + lowest_bit[(lowest * np.uint64(_DE_BRUIJN)) >> np.uint64(58)]] += grad_y[o]
                    o += 1


def _window_masks(bw: np.ndarray, dilation: int) -> np.ndarray:
    """``[W_out]`` uint64: bit ``w`` of entry ``ow`` set for each input column ``w`` of output ``ow``'s window."""
    masks = np.zeros(bw.shape[1], dtype=np.uint64)
    for ow in range(bw.shape[1]):
        for kk in range(bw[1, ow]):
            masks[ow] |= np.uint64(1) << np.uint64(bw[0, ow] + kk * dilation)
    return masks


def reads_rows_as_words(in_shape) -> bool:
    """Whether a pooling of input ``[N, C, *spatial]`` runs the word kernels (rows of at most :data:`WORD_ROW_MAX`
    elements): :func:`forward_from_bits` needs them."""
    return in_shape[-1] <= WORD_ROW_MAX


def _launch_args(in_shape, out_shape, kernel, stride, padding, dilation):
    """``[N, C, *spatial]`` in and out shapes (1-3 spatial dims) and per-dim parameters as 3-D pooling."""
    lead = 3 - (len(in_shape) - 2)
    isize = (1,) * lead + tuple(in_shape[2:])
    osize = (1,) * lead + tuple(out_shape[2:])
    kernel, stride, padding = (1,) * lead + tuple(kernel), (1,) * lead + tuple(stride), (0,) * lead + tuple(padding)
    dilation = (1,) * lead + tuple(dilation)
    bounds = [_bounds(*dims) for dims in zip(isize, osize, kernel, stride, padding, dilation)]
    return (math.prod(in_shape[:2]), isize, osize, *bounds, dilation)


def forward(x: torch.Tensor, out_shape, kernel, stride, padding, dilation) -> torch.Tensor:
    """Max-pooling of contiguous ``x [N, C, *spatial]`` into ``out_shape``, with per-dim ``kernel``, ``stride``,
    ``padding`` and ``dilation`` of the spatial dims' length, all as torch resolved and checked them (the caller
    gets ``out_shape`` from torch's pooling on a meta tensor): ``F.max_poolNd``'s output bit for bit."""
    out = buffers.empty(tuple(out_shape), x.dtype)
    if out.numel():
        match_numba_threads(x.numel(), _SERIAL_WORK)
        args = _launch_args(x.shape, out_shape, kernel, stride, padding, dilation)
        _windows_kernel(x.reshape(-1).numpy(), _NO_AUX, *args, out.reshape(-1).numpy())
    return out


def forward_with_indices(
    x: torch.Tensor, out_shape, kernel, stride, padding, dilation
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` of contiguous float32 ``x [N, C, H, W]`` (planes of fewer than ``2**31`` elements) and the
    int32 index of every maximum in its plane, torch's ``return_indices``: ``(output, indices)`` for
    :func:`backward_from_indices`. Runs on the calling thread."""
    out = torch.empty(tuple(out_shape), dtype=x.dtype)
    indices = torch.empty(tuple(out_shape), dtype=torch.int32)
    if out.numel():
        bh = _bounds(x.shape[2], out_shape[2], kernel[0], stride[0], padding[0], dilation[0])
        bw = _bounds(x.shape[3], out_shape[3], kernel[1], stride[1], padding[1], dilation[1])
        _argmax_2d_kernel(
            x.reshape(-1).view(torch.int32).numpy(),
            x.shape[0] * x.shape[1],
            x.shape[2],
            x.shape[3],
            bh,
            bw,
            dilation[0],
            dilation[1],
            out.reshape(-1).view(torch.int32).numpy(),
            indices.reshape(-1).numpy(),
        )
    return out, indices


def backward_from_indices(grad_y: torch.Tensor, indices: torch.Tensor, in_shape) -> torch.Tensor:
    """The input gradient of :func:`forward_with_indices` for an input of ``in_shape``: torch's
    ``max_pool2d_with_indices_backward`` bit for bit (the same additions in the same order)."""
    grad_x = buffers.empty(tuple(in_shape), grad_y.dtype)  # cached: fresh pages would fault in
    plane_in = math.prod(in_shape[2:])
    if not grad_y.numel() or not plane_in:
        return grad_x.zero_()
    _indices_backward_kernel(
        indices.reshape(-1).numpy(),
        grad_y.contiguous().reshape(-1).numpy(),
        plane_in,
        math.prod(grad_y.shape[2:]),
        grad_x.reshape(-1).numpy(),
    )
    return grad_x


def forward_from_bits(
    bits: torch.Tensor, in_shape, out_shape, kernel, stride, padding, dilation, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward` of spikes (every element 0 or 1, ``-0.0`` not among them) of ``in_shape`` given as their
    ``bits`` (:func:`.bitpack.pack`'s layout), rows of at most :data:`WORD_ROW_MAX` elements
    (:func:`reads_rows_as_words`): ``(output of dtype, its bits)``, torch's output bit for bit; the bits None where an
    output plane does not fill whole bytes."""
    if not reads_rows_as_words(in_shape):
        raise ValueError(f"maxpool.cpu.forward_from_bits: rows of {in_shape[-1]} elements, at most {WORD_ROW_MAX}")
    out = buffers.empty(tuple(out_shape), dtype)
    plane_out = math.prod(out_shape[2:])
    out_bits = torch.empty(out.numel() // 8, dtype=torch.uint8) if plane_out % 8 == 0 else None
    if out.numel():
        match_numba_threads(math.prod(in_shape), _SERIAL_WORK)
        planes, isize, osize, bd, bh, bw, dil = _launch_args(in_shape, out_shape, kernel, stride, padding, dilation)
        _bits_forward_kernel(
            bits.numpy(),
            planes,
            isize,
            osize,
            bd,
            bh,
            _window_masks(bw, dil[2]),
            dil,
            out.reshape(-1).numpy(),
            _NO_BITS if out_bits is None else out_bits.numpy(),
        )
    return out, out_bits


def backward(grad_y: torch.Tensor, bits: torch.Tensor, in_shape, kernel, stride, padding, dilation) -> torch.Tensor:
    """The input gradient of :func:`forward` for an input of ``in_shape`` saved as ``bits``
    (:func:`.bitpack.pack`)."""
    words = reads_rows_as_words(in_shape)
    grad_x = buffers.empty(tuple(in_shape), grad_y.dtype)  # cached: fresh pages would fault in
    if not words or not grad_y.numel():
        grad_x.zero_()  # the word kernel zeroes each plane itself, while it is in cache
    if grad_y.numel():
        match_numba_threads(grad_x.numel(), _SERIAL_WORK)
        args = _launch_args(in_shape, grad_y.shape, kernel, stride, padding, dilation)
        gy = grad_y.contiguous().reshape(-1).numpy()
        if words:
            planes, isize, osize, bd, bh, bw, dil = args
            _bits_backward_kernel(
                bits.numpy(),
                gy,
                planes,
                isize,
                osize,
                bd,
                bh,
                bw,
                _window_masks(bw, dil[2]),
                dil,
                _LOWEST_BIT,
                grad_x.reshape(-1).numpy(),
            )
        else:
            _windows_kernel(bits.numpy(), gy, *args, grad_x.reshape(-1).numpy())
    return grad_x
