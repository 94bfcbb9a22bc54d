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
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from ..threads import match_numba_threads
from . import buffers

__all__ = ["forward", "backward", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float64)

# Below this many input elements a call runs on one thread (waking the pool costs more than it saves).
_SERIAL_WORK = 1 << 15

_NO_AUX = np.empty(0, dtype=np.float32)  # the forward's unused second input


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
                    _visit(src, aux, dst, p * plane_in, o, isize[1], isize[2], bd[0, od], bd[1, od], bh[0, oh],
                           bh[1, oh], bw[0, ow], bw[1, ow], dilation)  # fmt: skip
                    o += 1


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


def backward(grad_y: torch.Tensor, bits: torch.Tensor, in_shape, kernel, stride, padding, dilation) -> torch.Tensor:
    """The input gradient of :func:`forward` for an input of ``in_shape`` saved as ``bits``
    (:func:`.bitpack.pack`)."""
    grad_x = buffers.empty(tuple(in_shape), grad_y.dtype).zero_()  # cached: fresh pages would fault in
    if grad_y.numel():
        match_numba_threads(grad_x.numel(), _SERIAL_WORK)
        args = _launch_args(in_shape, grad_y.shape, kernel, stride, padding, dilation)
        _windows_kernel(bits.numpy(), grad_y.contiguous().reshape(-1).numpy(), *args, grad_x.reshape(-1).numpy())
    return grad_x
