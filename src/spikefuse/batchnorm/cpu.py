"""Training-mode BatchNorm for the fused BatchNorm+LIF op on the CPU backend (:mod:`spikefuse.batchnorm.autograd`), in
pieces that the engine's CPU neuron kernels (:mod:`spikefuse.ops.engine.cpu`) fuse.

The op's backward recomputes the normalized input from the saved conv output and statistics. With torch's ops that
is a statistics pass and a normalization pass (``native_batch_norm``) into fresh memory, then the neuron's
recompute over it. Instead :class:`Normalization` hands the saved ``mean``/``invstd`` to the neuron kernel, where
each block of neurons normalizes its own rows into a tile in cache right before its recompute reads them:
``y = fma(x, alpha, beta) [+ residual]`` with :func:`affine_factors` ``alpha = invstd * weight``,
``beta = fma(-mean, alpha, bias)``. That is the formula of torch's CPU BatchNorm kernel for contiguous input
(``x * alpha + beta``, compiled to FMAs), so ``y`` is bit-identical to ``native_batch_norm``'s
(tests/batchnorm/test_cpu.py checks it against torch, so a torch that changes its kernel fails there, not
silently in a spike). The residual is added as the composition adds it (``y + r``, one rounding), read from its
bits when it was saved as bits.

The forward normalizes the same way inside the neuron's forward kernel, from :func:`statistics`: torch's training
statistics of float32 input (``native_batch_norm``'s ``mean``/``invstd`` and running-statistics update) bit for
bit, its serial double-precision sums per channel in the same order, but eight channels' sums side by side (eight
independent chains of additions where torch runs one; its normalized output, which the neuron would only read once,
is not written at all). float64 input, and maps of one element per channel (torch takes its channels-last path
there, with per-thread partial sums), keep ``native_batch_norm``.

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

from ..ops import buffers
from ..ops.numba_common import channel_row, fma, rows_apart, unpack_bits
from ..threads import match_numba_threads

__all__ = [
    "Normalization",
    "affine_factors",
    "backward",
    "source_args",
    "source_factors",
    "source_row",
    "source_tile",
    "statistics",
    "statistics_supported",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = (torch.float32, torch.float64)

# Below this many elements a call runs on one thread (waking the pool costs more than it saves).
_SERIAL_WORK = 1 << 15

# BatchNorm's backward runs one channel at a time (its elements read twice while in cache) when a sample's plane
# has at least this many elements; below, a loop per plane is too short, and chunks of channels run as columns of
# the [samples, C*size] matrix instead.
_CHANNEL_LOOP_MIN_SIZE = 256


# Channels whose statistics one task sums side by side: eight chains of double additions keep the floating-point
# units busy where torch's one chain per channel waits on each addition.
_STATISTICS_GROUP = 8


@njit(cache=True, error_model="numpy")
def _group_statistics(x, c0, channels, size, mean, var_sum):
    """Mean and sum of squared deviations of channels ``c0 .. c0 + 7`` of ``x`` (flat ``[samples, C, size]``), each in
    torch's order (samples, then positions; double accumulators; the mean rounded to the input's dtype before the
    deviations), the eight channels' sums interleaved."""
    F = x.dtype.type
    samples = x.shape[0] // (channels * size)
    count = np.float64(samples * size)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    for i in range(samples):
        r = x[(i * channels + c0) * size : (i * channels + c0 + 8) * size]
        for k in range(size):
            a0 += np.float64(r[k])
            a1 += np.float64(r[size + k])
            a2 += np.float64(r[2 * size + k])
            a3 += np.float64(r[3 * size + k])
            a4 += np.float64(r[4 * size + k])
            a5 += np.float64(r[5 * size + k])
            a6 += np.float64(r[6 * size + k])
            a7 += np.float64(r[7 * size + k])
    m0, m1, m2, m3 = F(a0 / count), F(a1 / count), F(a2 / count), F(a3 / count)
    m4, m5, m6, m7 = F(a4 / count), F(a5 / count), F(a6 / count), F(a7 / count)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    for i in range(samples):
        r = x[(i * channels + c0) * size : (i * channels + c0 + 8) * size]
        for k in range(size):  # the deviation and its square in the input's dtype, as torch's `(x - mean) * (x - mean)`
            d0 = r[k] - m0
            d1 = r[size + k] - m1
            d2 = r[2 * size + k] - m2
            d3 = r[3 * size + k] - m3
            d4 = r[4 * size + k] - m4
            d5 = r[5 * size + k] - m5
            d6 = r[6 * size + k] - m6
            d7 = r[7 * size + k] - m7
            a0 += np.float64(d0 * d0)
            a1 += np.float64(d1 * d1)
            a2 += np.float64(d2 * d2)
            a3 += np.float64(d3 * d3)
            a4 += np.float64(d4 * d4)
            a5 += np.float64(d5 * d5)
            a6 += np.float64(d6 * d6)
            a7 += np.float64(d7 * d7)
    mean[c0], mean[c0 + 1], mean[c0 + 2], mean[c0 + 3] = m0, m1, m2, m3
    mean[c0 + 4], mean[c0 + 5], mean[c0 + 6], mean[c0 + 7] = m4, m5, m6, m7
    var_sum[c0], var_sum[c0 + 1], var_sum[c0 + 2], var_sum[c0 + 3] = F(a0), F(a1), F(a2), F(a3)
    var_sum[c0 + 4], var_sum[c0 + 5], var_sum[c0 + 6], var_sum[c0 + 7] = F(a4), F(a5), F(a6), F(a7)


@njit(cache=True, error_model="numpy")
def _channel_statistics(x, c, channels, size, mean, var_sum):
    """:func:`_group_statistics` of the one channel ``c``."""
    F = x.dtype.type
    samples = x.shape[0] // (channels * size)
    a = 0.0
    for i in range(samples):
        r = x[(i * channels + c) * size : (i * channels + c + 1) * size]
        for k in range(size):
            a += np.float64(r[k])
    m = F(a / np.float64(samples * size))
    a = 0.0
    for i in range(samples):
        r = x[(i * channels + c) * size : (i * channels + c + 1) * size]
        for k in range(size):
            d = r[k] - m
            a += np.float64(d * d)
    mean[c] = m
    var_sum[c] = F(a)


@njit(parallel=True, cache=True, error_model="numpy")
def _statistics_kernel(x, channels, size, mean, var_sum):
    """Per channel of flat ``[samples, C, size]`` ``x``: the mean and the sum of squared deviations, groups of
    :data:`_STATISTICS_GROUP` channels in parallel, the channels left over one each."""
    groups = channels // _STATISTICS_GROUP
    for g in prange(groups + channels % _STATISTICS_GROUP):
        if g < groups:
            _group_statistics(x, g * _STATISTICS_GROUP, channels, size, mean, var_sum)
        else:
            _channel_statistics(x, groups * _STATISTICS_GROUP + g - groups, channels, size, mean, var_sum)


@njit(cache=True, error_model="numpy")
def _finish_statistics(mean, var_sum, n, momentum, eps, running_mean, running_var, has_running, invstd):
    """torch's ``batch_norm_cpu_update_stats_template`` from the sums: ``invstd = 1 / sqrt(var + eps)`` in double of
    the biased ``var`` (in the input's dtype), and the running statistics' update in place with the unbiased
    variance, each operation in the dtype torch's C++ gives it."""
    F = mean.dtype.type
    keep = F(1.0) - F(momentum)
    for c in range(mean.shape[0]):
        var = var_sum[c] / F(n)
        invstd[c] = F(1.0 / np.sqrt(np.float64(var) + eps))
        if has_running:
            running_mean[c] = F(momentum) * mean[c] + keep * running_mean[c]
            unbiased = np.float64(var_sum[c] / F(n - 1))
            running_var[c] = F(np.float64(F(momentum)) * unbiased + np.float64(keep * running_var[c]))


def statistics_supported(
    x: torch.Tensor, running_mean: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> bool:
    """Whether :func:`statistics` (and the forward's fused normalization) takes this training-mode BatchNorm: float32
    CPU input ``[B', C, ...]`` of more than one element per sample and channel, parameters and running statistics
    float32 or None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 3 or x.numel() == 0:
        return False
    if x.numel() // (x.shape[0] * x.shape[1]) < 2:
        return False
    return all(t is None or t.dtype == torch.float32 for t in (running_mean, weight, bias))


def statistics(
    x: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(mean, invstd, new running_mean, new running_var)`` of training-mode BatchNorm over contiguous ``x`` (see
    :func:`statistics_supported`): ``native_batch_norm``'s ``save_mean``/``save_invstd`` and its update of the running
    statistics bit for bit, the update made on copies (None without running statistics)."""
    samples, channels = x.shape[:2]
    size = x.numel() // (samples * channels)
    mean = torch.empty(channels, dtype=x.dtype)
    var_sum = torch.empty(channels, dtype=x.dtype)
    invstd = torch.empty(channels, dtype=x.dtype)
    match_numba_threads()
    _statistics_kernel(_flat(x.detach()), channels, size, mean.numpy(), var_sum.numpy())
    has_running = running_mean is not None
    rm = running_mean.detach().clone() if has_running else mean.new_empty(channels)
    rv = running_var.detach().clone() if has_running else mean.new_empty(channels)
    _finish_statistics(
        mean.numpy(),
        var_sum.numpy(),
        samples * size,
        float(momentum),
        float(eps),
        rm.numpy(),
        rv.numpy(),
        has_running,
        invstd.numpy(),
    )
    return mean, invstd, (rm if has_running else None), (rv if has_running else None)


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


@njit(cache=True, error_model="numpy")
def _column_sums(xr, gr, col_mean, col_sum, col_dot):
    """One sample's row of a chunk: ``col_sum += gy``, ``col_dot += (x - mean)*gy`` (rows apart: vectorized)."""
    rows_apart()
    for j in range(xr.shape[0]):
        g = gr[j]
        col_sum[j] += g
        col_dot[j] += (xr[j] - col_mean[j]) * g


@njit(cache=True, error_model="numpy")
def _column_grad(xr, gr, col_mean, col_k, col_gm, col_a, orow):
    """One sample's row of a chunk's ``grad_x`` into ``orow`` (see :func:`_factors`)."""
    rows_apart()
    for j in range(xr.shape[0]):
        orow[j] = (gr[j] - col_gm[j] - (xr[j] - col_mean[j]) * col_k[j]) * col_a[j]


@njit(cache=True, error_model="numpy")
def _column_grad_in_place(xr, gr, col_mean, col_k, col_gm, col_a):
    """:func:`_column_grad` written over ``gr`` (one argument: the rows-apart promise holds)."""
    rows_apart()
    for j in range(xr.shape[0]):
        gr[j] = (gr[j] - col_gm[j] - (xr[j] - col_mean[j]) * col_k[j]) * col_a[j]


@njit(parallel=True, cache=True, error_model="numpy")
def _column_chunk_kernel(x, gy, mean, invstd, weight, has_weight, channels, size, per_chunk, sums, dots, out):
    """For planes too small to loop over one channel's elements (see :func:`backward`): the input as a matrix
    ``[samples, C*size]``, chunks of ``per_chunk`` whole channels' columns in parallel. A chunk sums ``gy`` and
    ``(x - mean)*gy`` per column down the samples (rows of the chunk's width, which vectorize), adds each channel's
    ``size`` columns, then writes ``grad_x`` while the chunk is still in cache; ``sums``/``dots`` ``[C]`` receive the
    totals."""
    row = channels * size
    samples = x.shape[0] // row
    n = x.dtype.type(samples * size)
    one = x.dtype.type(1.0)
    for chunk in prange((channels + per_chunk - 1) // per_chunk):
        c0 = chunk * per_chunk
        cn = min(per_chunk, channels - c0)
        width = cn * size
        j0 = c0 * size
        col_mean = np.empty(width, x.dtype)
        channel_row(col_mean, mean[c0 : c0 + cn], 0, size)  # a value per column of the chunk's whole channels
        col_sum = np.zeros(width, x.dtype)
        col_dot = np.zeros(width, x.dtype)
        for i in range(samples):
            _column_sums(
                x[i * row + j0 : i * row + j0 + width],
                gy[i * row + j0 : i * row + j0 + width],
                col_mean,
                col_sum,
                col_dot,
            )
        k = np.empty(cn, x.dtype)
        gm = np.empty(cn, x.dtype)
        a = np.empty(cn, x.dtype)
        for c in range(cn):
            total = x.dtype.type(0.0)
            dotp = x.dtype.type(0.0)
            for j in range(c * size, (c + 1) * size):
                total += col_sum[j]
                dotp += col_dot[j]
            sums[c0 + c] = total
            dots[c0 + c] = dotp
            k[c], gm[c], a[c] = _factors(total, dotp, invstd[c0 + c], weight[c0 + c] if has_weight else one, n)
        col_k, col_gm, col_a = col_sum, col_dot, np.empty(width, x.dtype)  # the sums are done: reuse their rows
        channel_row(col_k, k, 0, size)
        channel_row(col_gm, gm, 0, size)
        channel_row(col_a, a, 0, size)
        for i in range(samples):
            xr = x[i * row + j0 : i * row + j0 + width]
            gr = gy[i * row + j0 : i * row + j0 + width]
            if out is gy:
                _column_grad_in_place(xr, gr, col_mean, col_k, col_gm, col_a)
            else:
                _column_grad(xr, gr, col_mean, col_k, col_gm, col_a, out[i * row + j0 : i * row + j0 + width])


# Elements of x (and as many of gy) per chunk of the small-plane kernel: both fit in the L2 cache between its passes.
_CHUNK_ELEMENTS = 1 << 16


def _channels_per_chunk(samples: int, channels: int, size: int, threads: int) -> int:
    """Whole channels per chunk of :func:`_column_chunk_kernel`: about :data:`_CHUNK_ELEMENTS` elements, and at least
    one chunk per thread."""
    per_chunk = max(1, _CHUNK_ELEMENTS // (samples * size))
    return max(1, min(per_chunk, -(-channels // threads)))


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
        raise ValueError(f"batchnorm.cpu: grad_y must be contiguous, of x's shape {tuple(x.shape)} and dtype")
    samples, channels = x.shape[:2]
    size = x.numel() // (samples * channels)
    out = grad_y if overwrite_grad_y else buffers.empty(x.shape, x.dtype)
    inv = invstd.detach().to(x.dtype)
    xf, gyf, mean_np, outf = _flat(x), _flat(grad_y), _per_channel(mean, x.dtype), _flat(out)
    scale = (inv.numpy(), _per_channel(weight, x.dtype), weight is not None)  # invstd * weight, per channel
    threads = match_numba_threads(x.numel(), _SERIAL_WORK)
    total = torch.empty(channels, dtype=x.dtype)
    dotp = torch.empty(channels, dtype=x.dtype)
    if size >= _CHANNEL_LOOP_MIN_SIZE:
        _per_channel_kernel(xf, gyf, mean_np, *scale, channels, size, total.numpy(), dotp.numpy(), outf)
    else:
        _column_chunk_kernel(
            xf,
            gyf,
            mean_np,
            *scale,
            channels,
            size,
            _channels_per_chunk(samples, channels, size, threads),
            total.numpy(),
            dotp.numpy(),
            outf,
        )
    if not (need_affine and weight is not None):
        return out, None, None
    return out, (dotp * inv).to(weight.dtype), total.to(weight.dtype)


def _flat(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).numpy()


def _per_channel(t: torch.Tensor | None, dtype: torch.dtype) -> np.ndarray:
    """A per-channel tensor as an array of ``dtype`` (a view where it already is one: a conversion per call of a
    small layer costs as much as its kernels)."""
    if t is None:
        return _empty_arrays(np.dtype(np.float32 if dtype == torch.float32 else np.float64))[0]
    t = t.detach()
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.numpy() if t.is_contiguous() else t.contiguous().numpy()


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
    alpha, beta = np.empty(mean.shape[0], mean.dtype), np.empty(mean.shape[0], mean.dtype)
    _affine_kernel(
        mean,
        _per_channel(norm.invstd, dtype),
        _per_channel(norm.weight, dtype),
        _per_channel(norm.bias, dtype),
        norm.weight is not None,
        norm.bias is not None,
        alpha,
        beta,
    )
    return alpha, beta


def _check(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> None:
    if x.device.type != "cpu" or x.dtype not in SUPPORTED_DTYPES or not x.is_contiguous() or x.dim() < 2:
        raise ValueError(
            f"batchnorm.cpu: x must be a contiguous float32/float64 CPU tensor [B, C, ...], got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    if mean.shape != (x.shape[1],) or invstd.shape != (x.shape[1],):
        raise ValueError(f"batchnorm.cpu: mean and invstd must have shape ({x.shape[1]},) (the channels)")


# What a block's input rows are, made from ``x`` (the ``src`` argument of the engine's ``_src`` kernels): BatchNorm of
# ``x``, plus a residual as floats or as bits.
SOURCE_BN, SOURCE_BN_RESIDUAL, SOURCE_BN_RESIDUAL_BITS = range(3)


@njit(cache=True, error_model="numpy")
def source_factors(n0, m, src):
    """``(alpha, beta)`` rows of a block of neurons ``[n0, n0 + m)``: each neuron's channel's BatchNorm factors (see
    :func:`source_tile`)."""
    mode, alpha, beta, spatial, residual, bits = src
    na = np.empty(m, alpha.dtype)
    nb = np.empty(m, beta.dtype)
    channel_row(na, alpha, n0, spatial)
    channel_row(nb, beta, n0, spatial)
    return na, nb


@njit(cache=True, error_model="numpy")
def source_row(x, t, n0, src, na, nb, out):
    """Row ``t`` of the input of a block of neurons ``[n0, n0 + len(out))`` into ``out`` (see :func:`source_tile`;
    ``na``/``nb`` from :func:`source_factors`)."""
    mode, alpha, beta, spatial, residual, bits = src
    m = out.shape[0]
    xr = x[t, n0 : n0 + m]
    if mode == SOURCE_BN:
        for i in range(m):
            out[i] = fma(xr[i], na[i], nb[i])
    elif mode == SOURCE_BN_RESIDUAL:
        rr = residual[t, n0 : n0 + m]
        for i in range(m):
            out[i] = fma(xr[i], na[i], nb[i]) + rr[i]
    else:  # the residual's bits unpacked into the row first: both loops vectorize
        unpack_bits(bits, t * x.shape[1] + n0, out, x.dtype.type(1.0))
        for i in range(m):
            out[i] = fma(xr[i], na[i], nb[i]) + out[i]


@njit(cache=True, error_model="numpy")  # not inlined: compiled once for every kernel that calls it, once a block
def source_tile(x, n0, m, src):
    """The ``[T, m]`` tile that a block of neurons ``[n0, n0 + m)`` reads its input from (see ``SOURCE_*``).
    ``src = (mode, alpha, beta, spatial, residual, bits)``; for BatchNorm ``alpha``/``beta`` are per channel
    (:func:`spikefuse.batchnorm.cpu.affine_factors`), neuron ``j`` of ``x [T, N]`` is in channel
    ``(j // spatial) % C`` (``x`` is ``[T*B, C, spatial...]`` merged), and the tile holds ``fma(x, alpha, beta)
    [+ residual]``, torch's CPU BatchNorm bit for bit. The tile is the block's own ``[T, m]``: it stays in cache
    between its writing and the neuron's reading. (A kernel that reads each step's row once, the forward, makes
    the rows one at a time with :func:`source_row` instead.)"""
    tile = np.empty((x.shape[0], m), x.dtype)
    na, nb = source_factors(n0, m, src)
    for t in range(x.shape[0]):
        source_row(x, t, n0, src, na, nb, tile[t])
    return tile


@functools.lru_cache(maxsize=None)
def _empty_arrays(dtype: np.dtype) -> tuple:
    """Placeholders for the arrays a ``src`` tuple or a kernel does not use: ``(no weight or bias, no residual, no
    bits)``."""
    return np.empty(0, dtype=dtype), np.empty((0, 0), dtype=dtype), np.empty(0, dtype=np.uint8)


def source_args(x: torch.Tensor, batch_norm: Normalization) -> tuple:
    """The ``src`` argument of the engine's ``_src`` kernels (see :func:`source_tile`) for the raw input
    ``x [T, N]`` and its BatchNorm ``batch_norm``."""
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
        residual = batch_norm.residual.detach().reshape(t_steps, n)
        if residual.dtype != x.dtype or residual.device.type != "cpu" or not residual.is_contiguous():
            raise ValueError(f"cpu backend: the residual must be a contiguous {x.dtype} CPU tensor like x")
        return SOURCE_BN_RESIDUAL, alpha, beta, spatial, residual.numpy(), no_bits
    if batch_norm.residual_bits is not None:
        bits = batch_norm.residual_bits
        if bits.dtype != torch.uint8 or bits.numel() != (x.numel() + 7) // 8:
            raise ValueError(f"cpu backend: residual_bits must be {(x.numel() + 7) // 8} packed uint8 bytes")
        return SOURCE_BN_RESIDUAL_BITS, alpha, beta, spatial, no_residual, bits.numpy()
    return SOURCE_BN, alpha, beta, spatial, no_residual, no_bits
