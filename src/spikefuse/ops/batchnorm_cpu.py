"""The recomputation of the fused BatchNorm+LIF op's backward on the CPU backend, as one numba kernel.

The op's backward (:mod:`spikefuse.ops.bn_lif`) recomputes the normalized input from the saved conv output and
statistics, then runs the neuron's backward and BatchNorm's. With torch's ops the recomputation is a statistics
pass and a normalization pass (``native_batch_norm`` in training mode), then an unpack and an add for a residual,
each into fresh memory. :func:`normalize` is one pass from the saved ``mean``/``invstd``:
``y = fma(x, a, fma(-mean, a, bias)) [+ residual]`` with ``a = invstd * weight``. That is the formula of torch's
CPU BatchNorm kernel for contiguous input (``x * alpha + beta`` with ``alpha = invstd * weight``, ``beta = bias -
mean * alpha``, both compiled to FMAs), so ``y`` is bit-identical to ``native_batch_norm``'s
(tests/ops/test_batchnorm_cpu.py checks it against torch, so a torch that changes its kernel fails there, not
silently in a spike). The residual is added as the composition adds it (``y + r``, one rounding), read from its
bits when it was saved as bits. The output comes from :mod:`.buffers` (no fresh pages to fault in).

BatchNorm's own backward stays torch's ``native_batch_norm_backward``: a numba version accumulating in float64
was 4x slower on ``[128, 64, 8, 8]``.

Inputs are contiguous ``[B', C, ...]`` tensors (``B' = T*B``), float32 or float64.
"""

from __future__ import annotations

import llvmlite.ir as llvmir
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import intrinsic

from ..threads import match_numba_threads
from . import buffers

__all__ = ["normalize", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float64)

# Below this many elements a call runs on one thread (waking the pool costs more than it saves).
_SERIAL_WORK = 1 << 15

_NO_RESIDUAL, _FLOAT_RESIDUAL, _BIT_RESIDUAL = 0, 1, 2


@intrinsic
def _fma(typingctx, a, b, c):
    """``a*b + c`` with one rounding (``llvm.fma``: always fused, unlike ``llvm.fmuladd``), as torch's kernel."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        ty = args[0].type
        fn = builder.module.declare_intrinsic("llvm.fma", [ty], llvmir.FunctionType(ty, [ty, ty, ty]))
        return builder.call(fn, args)

    return a(a, a, a), codegen


@njit(parallel=True, cache=True, error_model="numpy")
def _normalize_kernel(x, mean, invstd, weight, bias, has_weight, has_bias, residual, bits, mode, channels, size, out):
    """Flat arrays, one parallel iteration per sample row ``[C, ...]`` (views or a division per plane cost more
    than a plane of 1-16 elements, as in a late ResNet layer)."""
    one = x.dtype.type(1.0)
    zero = x.dtype.type(0.0)
    alpha = np.empty(channels, dtype=x.dtype)
    beta = np.empty(channels, dtype=x.dtype)
    for c in range(channels):
        a = invstd[c] * weight[c] if has_weight else invstd[c]
        alpha[c] = a
        beta[c] = _fma(-mean[c], a, bias[c] if has_bias else zero)
    row = channels * size
    for i in prange(x.shape[0] // row):
        for c in range(channels):
            a = alpha[c]
            b = beta[c]
            base = i * row + c * size
            if mode == _NO_RESIDUAL:
                for k in range(base, base + size):
                    out[k] = _fma(x[k], a, b)
            elif mode == _FLOAT_RESIDUAL:
                for k in range(base, base + size):
                    out[k] = _fma(x[k], a, b) + residual[k]
            else:
                for k in range(base, base + size):
                    r = one if (bits[k >> 3] >> (k & 7)) & 1 else zero
                    out[k] = _fma(x[k], a, b) + r


def _flat(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).numpy()


def _per_channel(t: torch.Tensor | None, dtype: torch.dtype) -> np.ndarray:
    if t is None:
        return np.empty(0, dtype=np.float32 if dtype == torch.float32 else np.float64)
    return t.detach().to(dtype).contiguous().numpy()


def normalize(
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    residual_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """BatchNorm's output from saved statistics, plus ``residual`` (a tensor shaped like ``x``, or its bits from
    :func:`spikefuse.ops.bitpack.pack`), in a buffer from :mod:`.buffers`; bit-identical to
    ``native_batch_norm(x, weight, bias, training=True)[0] + residual`` (see the module docstring)."""
    _check(x, mean, invstd)
    out = buffers.empty(x.shape, x.dtype)
    xf = _flat(x)
    none = np.empty(0, dtype=xf.dtype)
    if residual is not None:
        mode, res, bits = _FLOAT_RESIDUAL, _flat(residual.contiguous()), np.empty(0, dtype=np.uint8)
    elif residual_bits is not None and residual_bits.numel():
        mode, res, bits = _BIT_RESIDUAL, none, residual_bits.numpy()
    else:
        mode, res, bits = _NO_RESIDUAL, none, np.empty(0, dtype=np.uint8)
    match_numba_threads(x.numel(), _SERIAL_WORK)
    _normalize_kernel(
        xf, _per_channel(mean, x.dtype), _per_channel(invstd, x.dtype), _per_channel(weight, x.dtype),
        _per_channel(bias, x.dtype), weight is not None, bias is not None, res, bits, mode, x.shape[1],
        x.numel() // (x.shape[0] * x.shape[1]), _flat(out),
    )  # fmt: skip
    return out


def _check(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> None:
    if x.device.type != "cpu" or x.dtype not in SUPPORTED_DTYPES or not x.is_contiguous() or x.dim() < 2:
        raise ValueError(
            f"batchnorm_cpu: x must be a contiguous float32/float64 CPU tensor [B, C, ...], got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    if mean.shape != (x.shape[1],) or invstd.shape != (x.shape[1],):
        raise ValueError(f"batchnorm_cpu: mean and invstd must have shape ({x.shape[1]},) (the channels)")
