"""Training-mode BatchNorm for the fused BatchNorm+LIF op on the CPU backend (:mod:`spikefuse.ops.bn_lif`), in
pieces that the engine's CPU neuron kernels (:mod:`spikefuse.ops.engine.cpu`) fuse.

The op's backward recomputes the normalized input from the saved conv output and statistics. With torch's ops that
is a statistics pass and a normalization pass (``native_batch_norm``) into fresh memory, then the neuron's
recompute over it. Instead :class:`Normalization` hands the saved ``mean``/``invstd`` to the neuron kernel, where
each block of neurons normalizes its own rows into a tile in cache right before its recompute reads them:
``y = fma(x, alpha, beta) [+ residual]`` with :func:`affine_factors` ``alpha = invstd * weight``,
``beta = fma(-mean, alpha, bias)``. That is the formula of torch's CPU BatchNorm kernel for contiguous input
(``x * alpha + beta``, compiled to FMAs), so ``y`` is bit-identical to ``native_batch_norm``'s
(tests/ops/test_batchnorm_cpu.py checks it against torch, so a torch that changes its kernel fails there, not
silently in a spike). The residual is added as the composition adds it (``y + r``, one rounding), read from its
bits when it was saved as bits. (The forward keeps ``native_batch_norm``: its statistics pass, torch's serial
double-precision sums that the saved statistics must equal bit for bit, costs more than the normalization a fused
forward would spare.)

:func:`backward` is BatchNorm's training-mode backward, torch's formula (``grad_weight = dotp*invstd``,
``grad_bias = sum``, ``grad_x = (gy - sum/N - (x - mean)*dotp*invstd^2/N) * invstd*weight`` with ``sum`` and
``dotp`` the per-channel sums of ``gy`` and ``(x - mean)*gy``) written over ``gy`` when the caller is done with
it: ``native_batch_norm_backward`` returns ``grad_x`` in fresh memory, one more tensor of the input's size alive
at the step's memory peak (the first layer's backward) and fresh pages to fault in. The sums are in another order
than torch's (one accumulator per sample and channel, then a sum over samples), so gradients agree with torch's
to rounding, not bit for bit.

Inputs are contiguous ``[B', C, ...]`` tensors (``B' = T*B``), float32 or float64.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
from numba import njit, prange

from ..threads import match_numba_threads
from . import buffers
from .numba_common import channel_row, fma, unpack_bits

__all__ = ["Normalization", "affine_factors", "backward", "source_args", "source_tile", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float64)

# Below this many elements a call runs on one thread (waking the pool costs more than it saves).
_SERIAL_WORK = 1 << 15

# BatchNorm's backward runs one channel at a time (its elements read twice while in cache) when a sample's plane
# has at least this many elements; below, a loop per plane costs more than a second pass over the input (planes of
# 64 and fewer elements were faster per sample, of 256 per channel).
_CHANNEL_LOOP_MIN_SIZE = 256


@njit(cache=True, error_model="numpy")
def _affine_kernel(mean, invstd, weight, bias, has_weight, has_bias, alpha, beta):
    zero = alpha.dtype.type(0.0)
    for c in range(alpha.shape[0]):
        a = invstd[c] * weight[c] if has_weight else invstd[c]
        alpha[c] = a
        beta[c] = fma(-mean[c], a, bias[c] if has_bias else zero)


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _row_sums(x, gy, base, size, m):
    """``sum(gy)`` and ``sum((x - m) * gy)`` over ``size`` elements from ``base`` (reassociated: vectorized)."""
    s = gy.dtype.type(0.0)
    d = gy.dtype.type(0.0)
    xs = x[base : base + size]  # views indexed from 0: no negative-index wraparound in the loop, so it vectorizes
    gs = gy[base : base + size]
    for k in range(size):
        g = gs[k]
        s += g
        d += (xs[k] - m) * g
    return s, d


@njit(inline="always", error_model="numpy")
def _factors(s, d, inv, w, n):
    """``(k, grad_mean, a)`` of a channel from its sums ``s`` of ``gy`` and ``d`` of ``(x - mean)*gy``, its
    ``invstd`` and weight (1 without one) over ``n`` elements: ``grad_x = (gy - grad_mean - (x - mean)*k) * a``."""
    return d * inv * inv / n, s / n, inv * w


@njit(inline="always", error_model="numpy")
def _grad_x_row(x, gy, out, base, size, m, k, gm, a):
    """``grad_x`` over ``size`` elements from ``base`` of one channel (see :func:`_factors`); ``out`` may be ``gy``."""
    xs = x[base : base + size]
    gs = gy[base : base + size]
    if out is gy:  # one array read and written at the same index: LLVM vectorizes it (two that overlap, it cannot)
        for j in range(size):
            gs[j] = (gs[j] - gm - (xs[j] - m) * k) * a
    else:
        os = out[base : base + size]
        for j in range(size):
            os[j] = (gs[j] - gm - (xs[j] - m) * k) * a


@njit(parallel=True, cache=True, error_model="numpy")
def _per_channel_kernel(x, gy, mean, invstd, weight, has_weight, channels, size, sums, dots, out):
    """Parallel over channels: a channel's sums, then its ``grad_x`` while its ``[samples, size]`` elements are
    still in cache (two passes over all of ``x`` cost 2x); ``sums``/``dots`` ``[C]`` receive the totals."""
    samples = x.shape[0] // (channels * size)
    n = x.dtype.type(samples * size)
    one = x.dtype.type(1.0)
    for c in prange(channels):
        m = mean[c]
        s = x.dtype.type(0.0)
        d = x.dtype.type(0.0)
        for i in range(samples):
            si, di = _row_sums(x, gy, (i * channels + c) * size, size, m)
            s += si
            d += di
        sums[c] = s
        dots[c] = d
        k, gm, a = _factors(s, d, invstd[c], weight[c] if has_weight else one, n)
        for i in range(samples):
            _grad_x_row(x, gy, out, (i * channels + c) * size, size, m, k, gm, a)


@njit(parallel=True, cache=True, error_model="numpy")
def _partial_sums_kernel(x, gy, mean, channels, size, sums, dots):
    """Flat arrays; ``sums``/``dots`` ``[samples, C]``: the sums of each sample and channel (parallel over
    samples: for planes too small to run a channel's elements as one loop, see :func:`backward`)."""
    for i in prange(x.shape[0] // (channels * size)):
        if size == 1:  # [B', C] (BatchNorm1d, a 1x1 map): a loop over channels, not one call per element
            for c in range(channels):
                g = gy[i * channels + c]
                sums[i, c] = g
                dots[i, c] = (x[i * channels + c] - mean[c]) * g
        else:
            for c in range(channels):
                sums[i, c], dots[i, c] = _row_sums(x, gy, (i * channels + c) * size, size, mean[c])


@njit(parallel=True, cache=True, error_model="numpy")
def _grad_x_kernel(x, gy, mean, invstd, weight, has_weight, channels, size, sums, dots, out):
    """``grad_x`` from the channels' total sums ``sums``/``dots`` ``[C]``, parallel over samples."""
    n = x.dtype.type(x.shape[0] // channels)
    one = x.dtype.type(1.0)
    k = np.empty(channels, dtype=x.dtype)
    grad_mean = np.empty(channels, dtype=x.dtype)
    a = np.empty(channels, dtype=x.dtype)
    for c in range(channels):
        k[c], grad_mean[c], a[c] = _factors(sums[c], dots[c], invstd[c], weight[c] if has_weight else one, n)
    for i in prange(x.shape[0] // (channels * size)):
        if size == 1:  # [B', C] (BatchNorm1d, a 1x1 map): one loop over the channels, not a row per element
            _grad_x_row_over_channels(x, gy, out, i * channels, mean, k, grad_mean, a)
        else:
            for c in range(channels):
                _grad_x_row(x, gy, out, (i * channels + c) * size, size, mean[c], k[c], grad_mean[c], a[c])


@njit(inline="always", error_model="numpy")
def _grad_x_row_over_channels(x, gy, out, base, mean, k, gm, a):
    """:func:`_grad_x_row` of one sample of a ``[B', C]`` input, the factors per channel."""
    channels = mean.shape[0]
    xs = x[base : base + channels]
    gs = gy[base : base + channels]
    if out is gy:
        for c in range(channels):
            gs[c] = (gs[c] - gm[c] - (xs[c] - mean[c]) * k[c]) * a[c]
    else:
        os = out[base : base + channels]
        for c in range(channels):
            os[c] = (gs[c] - gm[c] - (xs[c] - mean[c]) * k[c]) * a[c]


def backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    need_affine: bool,
    overwrite_grad_y: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(grad_x, grad_weight, grad_bias)`` of training-mode BatchNorm from its input ``x`` and saved ``mean`` /
    ``invstd``, as ``native_batch_norm_backward`` (the affine gradients None without ``need_affine``);
    ``overwrite_grad_y``: ``grad_x`` goes over ``grad_y`` (the caller's own transient), else into a buffer."""
    _check(x, mean, invstd)
    if grad_y.shape != x.shape or grad_y.dtype != x.dtype or not grad_y.is_contiguous():
        raise ValueError(f"batchnorm_cpu: grad_y must be contiguous, of x's shape {tuple(x.shape)} and dtype")
    samples, channels = x.shape[:2]
    size = x.numel() // (samples * channels)
    out = grad_y if overwrite_grad_y else buffers.empty(x.shape, x.dtype)
    inv = invstd.detach().to(x.dtype)
    xf, gyf, mean_np, outf = _flat(x), _flat(grad_y), _per_channel(mean, x.dtype), _flat(out)
    scale = (inv.numpy(), _per_channel(weight, x.dtype), weight is not None)  # invstd * weight, per channel
    match_numba_threads(x.numel(), _SERIAL_WORK)
    if size >= _CHANNEL_LOOP_MIN_SIZE:
        total = torch.empty(channels, dtype=x.dtype)
        dotp = torch.empty(channels, dtype=x.dtype)
        _per_channel_kernel(xf, gyf, mean_np, *scale, channels, size, total.numpy(), dotp.numpy(), outf)
    else:
        sums = torch.empty((samples, channels), dtype=x.dtype)
        dots = torch.empty((samples, channels), dtype=x.dtype)
        _partial_sums_kernel(xf, gyf, mean_np, channels, size, sums.numpy(), dots.numpy())
        total, dotp = sums.sum(0), dots.sum(0)
        _grad_x_kernel(xf, gyf, mean_np, *scale, channels, size, total.numpy(), dotp.numpy(), outf)
    if not (need_affine and weight is not None):
        return out, None, None
    return out, (dotp * inv).to(weight.dtype), total.to(weight.dtype)


def _flat(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).numpy()


def _per_channel(t: torch.Tensor | None, dtype: torch.dtype) -> np.ndarray:
    if t is None:
        return np.empty(0, dtype=np.float32 if dtype == torch.float32 else np.float64)
    return t.detach().to(dtype).contiguous().numpy()


class Normalization(NamedTuple):
    """Training-mode BatchNorm fused into the cpu backend's neuron backward (``spikefuse.ops.engine.cpu.backward``'s
    ``batch_norm``), whose ``x [T, N]`` is then the raw input ``[T*B, C, *spatial]`` merged: each block of neurons
    normalizes its own rows with torch's formula (see the module docstring) and adds ``residual`` (``[T, N]``,
    floats) or ``residual_bits`` (:func:`spikefuse.ops.bitpack.pack` of it) when given."""

    mean: torch.Tensor
    invstd: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    spatial: int
    residual: torch.Tensor | None = None
    residual_bits: torch.Tensor | None = None


def affine_factors(norm: Normalization, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Per channel ``alpha = invstd * weight`` and ``beta = fma(-mean, alpha, bias)`` in ``dtype``: torch's CPU
    kernel's ``y = fma(x, alpha, beta)``."""
    mean = _per_channel(norm.mean, dtype)
    alpha, beta = np.empty_like(mean), np.empty_like(mean)
    _affine_kernel(
        mean, _per_channel(norm.invstd, dtype), _per_channel(norm.weight, dtype), _per_channel(norm.bias, dtype),
        norm.weight is not None, norm.bias is not None, alpha, beta,
    )  # fmt: skip
    return alpha, beta


def _check(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> None:
    if x.device.type != "cpu" or x.dtype not in SUPPORTED_DTYPES or not x.is_contiguous() or x.dim() < 2:
        raise ValueError(
            f"batchnorm_cpu: x must be a contiguous float32/float64 CPU tensor [B, C, ...], got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    if mean.shape != (x.shape[1],) or invstd.shape != (x.shape[1],):
        raise ValueError(f"batchnorm_cpu: mean and invstd must have shape ({x.shape[1]},) (the channels)")


# Where a block's input rows come from when not from ``x`` itself (``src`` None): a copy of them (``x`` is also the
# rows the block writes, as the backward's recompute writing h over its own transient: rows that alias the outputs
# keep LLVM from vectorizing the loop); or BatchNorm of ``x`` fused in, plus a residual as floats or bits.
SOURCE_COPY, SOURCE_BN, SOURCE_BN_RESIDUAL, SOURCE_BN_RESIDUAL_BITS = range(4)


@njit(cache=True, error_model="numpy")  # not inlined: compiled once for every kernel that calls it, once a block
def source_tile(x, n0, m, src):
    """The ``[T, m]`` tile that a block of neurons ``[n0, n0 + m)`` reads its input from (see ``SOURCE_*``).
    ``src = (mode, alpha, beta, spatial, residual, bits)``; for BatchNorm ``alpha``/``beta`` are per channel
    (:func:`spikefuse.ops.batchnorm_cpu.affine_factors`), neuron ``j`` of ``x [T, N]`` is in channel
    ``(j // spatial) % C`` (``x`` is ``[T*B, C, spatial...]`` merged), and the tile holds ``fma(x, alpha, beta)
    [+ residual]``, torch's CPU BatchNorm bit for bit. The tile is the block's own ``[T, m]``: it stays in cache
    between its writing and the neuron's reading."""
    mode, alpha, beta, spatial, residual, bits = src
    t_steps, n = x.shape
    tile = np.empty((t_steps, m), x.dtype)
    if mode == SOURCE_COPY:
        for t in range(t_steps):  # a loop, not a slice assignment: numba would compile its shape-error formatting
            tr, xr = tile[t], x[t, n0 : n0 + m]
            for i in range(m):
                tr[i] = xr[i]
        return tile
    na = np.empty(m, x.dtype)
    nb = np.empty(m, x.dtype)
    channel_row(na, alpha, n0, spatial)
    channel_row(nb, beta, n0, spatial)
    one = x.dtype.type(1.0)
    for t in range(t_steps):
        xr = x[t, n0 : n0 + m]
        tr = tile[t]
        if mode == SOURCE_BN:
            for i in range(m):
                tr[i] = fma(xr[i], na[i], nb[i])
        elif mode == SOURCE_BN_RESIDUAL:
            rr = residual[t, n0 : n0 + m]
            for i in range(m):
                tr[i] = fma(xr[i], na[i], nb[i]) + rr[i]
        else:  # the residual's bits unpacked into the tile's row first: both loops vectorize
            unpack_bits(bits, t * n + n0, tr, one)
            for i in range(m):
                tr[i] = fma(xr[i], na[i], nb[i]) + tr[i]
    return tile


@functools.lru_cache(maxsize=None)
def _empty_arrays(dtype: np.dtype) -> tuple:
    """Placeholders for the unused arrays of a ``src`` tuple: ``(no alpha/beta, no residual, no bits)``."""
    return np.empty(0, dtype=dtype), np.empty((0, 0), dtype=dtype), np.empty(0, dtype=np.uint8)


def source_args(x: torch.Tensor | None, batch_norm: Normalization | None, copy: bool) -> tuple | None:
    """The ``src`` argument of the backward kernels (see :func:`source_tile`) for the input ``x [T, N]``: None
    for ``x`` itself."""
    if batch_norm is None:
        if not copy:
            return None
        no_factors, no_residual, no_bits = _empty_arrays(x.numpy().dtype)
        return SOURCE_COPY, no_factors, no_factors, 1, no_residual, no_bits
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"cpu backend: a fused BatchNorm needs float32 or float64 input, got {x.dtype}")
    t_steps, n = x.shape
    channels = batch_norm.mean.shape[0]
    if batch_norm.spatial < 1 or n % (channels * batch_norm.spatial):
        raise ValueError(
            f"cpu backend: x of {n} neurons per step is not [B, {channels} channels, {batch_norm.spatial}] merged"
        )
    alpha, beta = affine_factors(batch_norm, x.dtype)
    _, no_residual, no_bits = _empty_arrays(alpha.dtype)
    spatial = int(batch_norm.spatial)
    if batch_norm.residual is not None:
        residual = batch_norm.residual.reshape(t_steps, n)
        if residual.dtype != x.dtype or residual.device.type != "cpu" or not residual.is_contiguous():
            raise ValueError(f"cpu backend: the residual must be a contiguous {x.dtype} CPU tensor like x")
        return SOURCE_BN_RESIDUAL, alpha, beta, spatial, residual.numpy(), no_bits
    if batch_norm.residual_bits is not None:
        bits = batch_norm.residual_bits
        if bits.dtype != torch.uint8 or bits.numel() != (x.numel() + 7) // 8:
            raise ValueError(f"cpu backend: residual_bits must be {(x.numel() + 7) // 8} packed uint8 bytes")
        return SOURCE_BN_RESIDUAL_BITS, alpha, beta, spatial, no_residual, bits.numpy()
    return SOURCE_BN, alpha, beta, spatial, no_residual, no_bits
