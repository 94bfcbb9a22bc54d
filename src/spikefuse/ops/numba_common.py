"""What the numba CPU code shares (the neuron engine's generated kernels, :mod:`.engine.cpu`, and the fused BatchNorm
pieces, :mod:`spikefuse.batchnorm.cpu`): arithmetic that LLVM can vectorize, the loads of a block's per-neuron rows,
and the blocks' size.

numba lowers ``np.exp`` to a call into libm, and a call keeps the whole loop around it scalar; :func:`exp` is the
same function in plain arithmetic. It and :func:`muladd` feed gradients only: the neuron steps keep separate
multiplications and additions (and libm's exp), as the reference does, for bit-identical spikes; :func:`fma` is
torch's own rounding in its BatchNorm kernel.
"""

from __future__ import annotations

import math

import llvmlite.ir as llvmir
import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = [
    "EXP2_DEGREE",
    "block_for",
    "channel_row",
    "exp",
    "exp2_polynomial",
    "fma",
    "horner",
    "load_row",
    "muladd",
    "pack_rows",
    "pow2",
    "prefer_wide_vectors",
    "rows_apart",
    "unpack_bits",
]

#: Degree of :func:`exp2_polynomial` per compute dtype: its relative error (1.9e-9 at degree 6, 7.9e-13 at degree 8)
#: stays below the dtype's own rounding in float32 and ~1e-12 in float64.
EXP2_DEGREE = {np.float32: 6, np.float64: 8}


def exp2_polynomial(degree: int) -> np.ndarray:
    """``2^f`` for ``|f| <= 1/2`` as a polynomial of ``degree``, coefficients highest power first: least squares on
    Chebyshev nodes weighted to relative error, within a few percent of the minimax error."""
    nodes = 0.5 * np.cos(np.pi * (np.arange(4000) + 0.5) / 4000)
    cheb = np.polynomial.chebyshev.chebfit(nodes, 2.0**nodes, degree, w=2.0**-nodes)
    return np.polynomial.chebyshev.cheb2poly(cheb)[::-1]


def _float_ternary(name: str, llvm_name: str, doc: str):
    """A numba intrinsic ``name(a, b, c)`` of three floats of one type, lowered to the LLVM intrinsic ``llvm_name``."""

    def typer(typingctx, a, b, c):
        if not (isinstance(a, types.Float) and a == b == c):
            return None

        def codegen(context, builder, signature, args):
            ty = args[0].type
            fn = builder.module.declare_intrinsic(llvm_name, [ty], llvmir.FunctionType(ty, [ty, ty, ty]))
            return builder.call(fn, args)

        return a(a, a, a), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


muladd = _float_ternary("muladd", "llvm.fmuladd", "``a*b + c``, fused into one FMA where the machine has one.")
fma = _float_ternary(
    "fma",
    "llvm.fma",
    "``a*b + c`` with one rounding (always fused, unlike :func:`muladd`), as torch's CPU BatchNorm kernel computes it.",
)


@intrinsic
def pow2(typingctx, n):
    """``2^n`` for an integer-valued float ``n`` in the normal exponent range, built from its exponent bits."""
    if not isinstance(n, types.Float):
        return None

    def codegen(context, builder, signature, args):
        (v,) = args
        bits, bias, shift = (32, 127, 23) if n.bitwidth == 32 else (64, 1023, 52)
        ity = llvmir.IntType(bits)
        e = builder.add(builder.fptosi(v, ity), llvmir.Constant(ity, bias))
        return builder.bitcast(builder.shl(e, llvmir.Constant(ity, shift)), v.type)

    return n(n), codegen


@intrinsic
def non_finite(typingctx, x):
    """1 if the float ``x`` is NaN or infinite (its exponent bits all set), else 0, as an int64: an integer OR of
    these over a loop vectorizes (a float sum would not, without reassociating it)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        (v,) = args
        bits, mask = (32, 0x7F800000) if x.bitwidth == 32 else (64, 0x7FF0000000000000)
        ity = llvmir.IntType(bits)
        e = builder.and_(builder.bitcast(v, ity), llvmir.Constant(ity, mask))
        return builder.zext(builder.icmp_unsigned("==", e, llvmir.Constant(ity, mask)), llvmir.IntType(64))

    return types.int64(x), codegen


@njit(error_model="numpy")
def horner(x, coefficients):
    """The polynomial with ``coefficients`` (highest power first) at ``x``, one FMA per coefficient."""
    p = coefficients[0]
    for c in coefficients[1:]:
        p = muladd(p, x, c)
    return p


@intrinsic
def prefer_wide_vectors(typingctx):
    """Mark the calling function ``"prefer-vector-width"="512"``.

    LLVM vectorizes for 256-bit registers on Intel's AVX-512 cores by default (wide instructions used to lower
    the clock); loops bound by floating-point instructions need half as many with 512-bit ones. Elementwise
    arithmetic is the same at any width, so results do not change; machines without AVX-512 ignore the attribute.
    llvmlite validates function attributes against a fixed list without string attributes, hence ``set.add``.
    """

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def rows_apart(typingctx):
    """Mark the data of every array argument of the calling function ``noalias``: a promise that no element one
    argument writes is read or written through another while the function runs.

    A row function of the engine takes a row per state and step; without the promise LLVM vectorizes its loop behind a
    run-time check of every pair of rows for overlap, and past its limit on pairs (a forward of four steps of two
    states keeping its states, or a recompute of four steps of three) keeps the loop scalar. The generated callers pass
    each row a function writes once, in no other argument (read-only rows may repeat). numba passes an array as its
    fields, the data a pointer to the element type; the other pointers (the array's owner, the return slot) are
    ``i8*`` or structs and are left as they are.
    """

    def codegen(context, builder, signature, args):
        for arg in builder.function.args:
            pointee = getattr(arg.type, "pointee", None)
            if isinstance(pointee, (llvmir.HalfType, llvmir.FloatType, llvmir.DoubleType)) or (
                isinstance(pointee, llvmir.IntType) and pointee.width > 8
            ):
                arg.add_attribute("noalias")
        return context.get_dummy_value()

    return types.none(), codegen


def exp(y):
    """``e^y`` for a float32 or float64 ``y`` inside numba code, vectorizable; within 4e-6 (float32; 1e-6 for
    ``|y| < 20``) / 1e-12 (float64) relative of the exact value.

    ``2^t`` with ``t = y log2(e)``: ``n`` the nearest integer to ``t`` (``(t + M) - M``, exact), ``2^(t-n)`` by
    :func:`exp2_polynomial`, ``2^n`` from the exponent bits (the sigmoid surrogate's reduction in :mod:`.cpu`, for
    both signs). Results below twice the smallest normal number are 0, those that overflow inf; NaN stays NaN.
    """
    return math.exp(y)


@overload(exp)
def _exp_overload(y):
    if not isinstance(y, types.Float) or y.bitwidth not in (32, 64):
        return None
    F = np.float32 if y.bitwidth == 32 else np.float64
    finfo = np.finfo(F)
    log2e, magic = F(1.0 / math.log(2.0)), F(1.5 * 2.0**finfo.nmant)
    # n - 1 stays in the normal exponents (2^n itself would overflow at n = maxexp, where 2^t may not yet)
    low, high = F(finfo.minexp + 1), F(finfo.maxexp)
    coefficients = tuple(F(c) for c in exp2_polynomial(EXP2_DEGREE[F]))
    zero, one, two, inf = F(0.0), F(1.0), F(2.0), F(np.inf)

    def impl(y):
        t = y * log2e
        tc = low if t < low else (high if t > high else t)
        n = (tc + magic) - magic
        e = horner(tc - n, coefficients) * pow2(n - one) * two
        e = inf if t > high else e
        e = zero if t < low else e
        return y if y != y else e

    return impl


@njit(error_model="numpy")
def channel_row(dst, values, n0, inner):
    """``dst[i] = values[((n0 + i) // inner) % C]`` (a per-channel value for each neuron of a block from ``n0``), a
    run of one value per channel: no division per neuron (two 64-bit integer divisions per neuron cost as much as a
    tenth of a whole kernel), and each run's fill vectorizes (a per-neuron count with a branch stays scalar)."""
    c = values.shape[0]
    m = dst.shape[0]
    if c == 1:
        k = values[0]
        for i in range(m):
            dst[i] = k
        return
    q = n0 // inner
    i = 0
    run = min(inner - (n0 - q * inner), m)  # the rest of the first channel's run of ``inner`` neurons
    ch = q % c
    while i < m:
        v = values[ch]
        for k in range(i, i + run):
            dst[k] = v
        i += run
        run = min(inner, m - i)
        ch = ch + 1 if ch + 1 < c else 0


@njit(error_model="numpy")
def load_row(dst, src, n0, m):
    """``dst[:m] = src[n0 : n0 + m]``, or ``src[0]`` everywhere when ``src`` has one entry for all neurons (an
    initial state or state gradient that is the same for every neuron: nothing of size N to read)."""
    if src.shape[0] == 1:
        c = src[0]
        for i in range(m):
            dst[i] = c
    else:
        for i in range(m):
            dst[i] = src[n0 + i]


@njit(error_model="numpy")
def unpack_bits(bits, start, out, one):
    """``out[i] = one`` where bit ``start + i`` of ``bits`` is set, else 0 (bit ``k`` of byte ``j`` is element
    ``8*j + k``, as :func:`spikefuse.ops.bitpack.pack` stores them). From a byte boundary the bytes are unrolled into
    their eight elements, which LLVM vectorizes (a loop over the bits, or over the elements indexing a byte each,
    stays scalar: 10-18x slower); the elements before the first byte boundary and after the last full byte, one at a
    time."""
    m = out.shape[0]
    zero = one - one
    head = min((8 - start % 8) % 8, m)
    for i in range(head):
        e = start + i
        out[i] = one if (bits[e >> 3] >> (e & 7)) & 1 else zero
    full = (m - head) >> 3
    src = bits[(start + head) >> 3 : ((start + head) >> 3) + full]
    dst = out[head : head + 8 * full]  # views indexed from 0: no negative-index wraparound, so the loop vectorizes
    for j in range(full):
        b = src[j]
        k = 8 * j
        dst[k] = one * (b & 1)
        dst[k + 1] = one * ((b >> 1) & 1)
        dst[k + 2] = one * ((b >> 2) & 1)
        dst[k + 3] = one * ((b >> 3) & 1)
        dst[k + 4] = one * ((b >> 4) & 1)
        dst[k + 5] = one * ((b >> 5) & 1)
        dst[k + 6] = one * ((b >> 6) & 1)
        dst[k + 7] = one * ((b >> 7) & 1)
    for i in range(head + 8 * full, m):
        e = start + i
        out[i] = one if (bits[e >> 3] >> (e & 7)) & 1 else zero


@njit(error_model="numpy")
def pack_rows(spikes, t0, steps, n0, m, bits):
    """The bits of rows ``t0 .. t0 + steps - 1`` of a block ``spikes[:, n0:n0 + m]`` into ``bits [T, N / 8]``, as
    :func:`spikefuse.ops.bitpack.pack` stores them (bit ``k`` of byte ``j`` is element ``8*j + k``, set where the
    element is nonzero); nothing when ``bits`` is empty. ``n0`` and ``m`` are multiples of 8. A block calls it right
    after writing the rows, while they are in cache: no pass of its own over the spikes, which a separate
    :func:`~spikefuse.ops.bitpack.pack` reads back from memory. Each 64 elements make a 64-bit word first (a compare
    and a shift per element, which LLVM vectorizes: 1.5x faster than a byte at a time), stored a byte at a time."""
    if bits.shape[0] == 0:
        return
    whole = m >> 6
    for t in range(t0, t0 + steps):
        row = spikes[t, n0 : n0 + m]
        out = bits[t, n0 >> 3 : (n0 + m) >> 3]
        for c in range(whole):
            xs = row[64 * c : 64 * c + 64]
            word = np.uint64(0)
            for k in range(64):
                word |= np.uint64(xs[k] != 0) << np.uint64(k)
            for b in range(8):
                out[8 * c + b] = np.uint8((word >> np.uint64(8 * b)) & np.uint64(0xFF))
        for j in range(8 * whole, m >> 3):
            byte = np.uint8(0)
            for k in range(8):
                byte |= np.uint8(row[8 * j + k] != 0) << np.uint8(k)
            out[j] = byte


def block_for(n: int, threads: int, block: int) -> int:
    """At most ``block`` neurons per task (a multiple of 64), as evenly split as that allows: as many tasks as a
    multiple of ``threads``, so that no thread runs one task more than another (nine blocks on two threads take as
    long as ten), and every thread gets work when N is small."""
    tasks = max(1, -(-n // max(64, block)))
    tasks = -(-tasks // threads) * threads
    per_task = -(-n // tasks)
    return max(64, -(-per_task // 64) * 64)
