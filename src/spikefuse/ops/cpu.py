"""The fused CPU backend: numba kernels that run all T time steps of a block of neurons in one pass.

Layout of the work: the ``N`` neurons are cut into blocks; blocks run in parallel (``prange``), and each block
loops over time with its membrane potentials in a small local array (cache-resident), the inner loop running over
the block's neurons contiguously so that LLVM vectorizes it (AVX2/AVX-512 on x86). The parallel kernels are
tiny (``prange`` over blocks calling a per-block function), so numba's parfor passes stay cheap.

Mode switches are integer flags. LLVM does *not* reliably unswitch many invariant branches out of one loop (a
generic loop was 3-4x slower than a specialized one in measurements, and a libm ``exp`` anywhere in a loop body
keeps the whole loop scalar), so the loops are specialized where it matters. The parallel kernels
(:func:`_forward_kernel`, :func:`_backward_kernel`) are made per forward family, or per surrogate and backward mode
(recompute or not, grad_x in place or not), with the leak and the backward's coefficients as scalars (one leak for
the layer) or per-neuron arrays (per-channel leak, see :func:`_at`). They pass these as literal arguments to the
block loops, numba compiles one specialization per literal, and an overload on a literal gives numba only the code
that runs to compile (the recompute's loops only in recompute mode). So a first call compiles the loops it runs
and no others, and each kernel is cached on disk. The loops and the scalar building blocks are plain numba functions,
compiled once per signature and linked into every kernel that calls them (LLVM inlines them): a process that runs
many configurations, as the tests do, compiles each loop once. The remaining differences, the leak gradient among
them, are branch-free or loop-invariant (LLVM unswitches the loop on them).
Other things that keep the loops vectorized: ``error_model="numpy"`` (the default Python error model puts a
ZeroDivisionError branch on every division), constants read into scalars before a loop (loads of a constants
array inside it may alias the stores, as far as LLVM knows), and a polynomial ``exp2`` for the sigmoid surrogate.

Floating point: the step formulas follow :mod:`spikefuse.params` operation by operation, with every constant in
the compute dtype (the constants travel in a small array of that dtype, never as Python floats, which numba
would treat as float64 and silently promote float32 arithmetic with). No ``fastmath``: LLVM neither contracts
``a*b + c`` into an FMA nor reassociates, so spikes and states are bit-identical with :mod:`.reference`. The
exceptions are in the backward only, written with explicit ``llvm.fmuladd`` (fused where the CPU has FMA): the
polynomial ``exp2`` of the sigmoid surrogate (an approximation of our own) and the reverse recursion's ``A`` and
``G`` (:func:`_reverse_factor`, :func:`_bwd_row`). They feed only gradients, which agree with the reference to 1e-5.

Memory traffic per neuron and step (float32): forward 12 bytes with ``SAVE_POTENTIAL`` (read x, write spikes and
h), 8 without; backward 12 bytes (read grad_spikes and h, write grad_x). In recompute mode (``SAVE_INPUT``) the
backward first recomputes ``h`` of a block into the block's columns of the ``grad_x`` buffer (small blocks, so the
``T x block`` tile stays in L2), then runs the reverse loop over it, overwriting it with ``grad_x``. When the caller
frees the saved ``h`` after backward (``overwrite_saved``: eager autograd without ``retain_graph``), ``grad_x`` is
written over ``h`` the same way, so backward allocates nothing of size ``[T, N]``. The ``[T, N]`` outputs come
from :mod:`.buffers`, which reuses freed ones instead of page-faulting fresh memory on every call.

In backward a block's input rows are ``x`` itself, or a ``T x block`` tile the block fills first
(:func:`spikefuse.ops.batchnorm_cpu.source_tile`): with a fused BatchNorm (``batch_norm``, the fused BatchNorm+LIF
op's backward) the normalized raw input, and when the recompute writes over its own input (``overwrite_x``) a copy
of its rows, as rows that alias the outputs keep LLVM from vectorizing the loop.

Half-precision inputs (float16 / bfloat16) are upcast to float32 here, the spikes are written straight into the
half-precision output through its 16-bit integer view (0 or the bit pattern of 1.0), and state / h stay float32.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from .. import params as P
from ..threads import match_numba_threads
from . import batchnorm_cpu, buffers
from .batchnorm_cpu import source_tile
from .common import SpecArgs, check_per_neuron, compute_dtype, reduce_leak_grad
from .numba_common import (EXP2_DEGREE, block_for, channel_row, exp2_polynomial, horner, load_row, muladd,
                           pow2, prefer_wide_vectors)

__all__ = ["forward", "backward"]

# Loop families. Forward: one branch-free formula for the paper / snnTorch neurons (flags select the reset), and
# one per SpikingJelly charge form (IF runs as MUL with k = 0, which is exact). Each family's loop is compiled
# for its literal family code, so the family switch folds away and the loop holds only that family's arithmetic
# plus a few loop-invariant selects.
_FAM_LIF, _FAM_DIV_INPUT, _FAM_MUL_INPUT, _FAM_DIV, _FAM_MUL = 0, 1, 2, 3, 4

# Layout of the constants array ``fp`` (compute dtype): scalars, then the constants of the vectorizable exp2.
_F_TH, _F_THF, _F_VR, _F_SG_A, _F_SG_B, _F_ZERO, _F_ONE, _F_RVAL = range(8)  # _F_THF: see :func:`_fire`
_F_ZMAX, _F_MAGIC = 8, 9  # largest n for a normal 2^-n; 1.5 * 2^(mantissa bits): (t + M) - M rounds t
_F_EXPC = 10  # the coefficients of :func:`exp2_polynomial`, highest power first
_NF = 19

# Layout of the integer flags array ``fl`` (int64).
(_I_FAM, _I_HARD, _I_PSOFT, _I_SSOFT, _I_RON, _I_RHARD, _I_SPR, _I_DETACH, _I_SJ, _I_CHARGE, _I_RESET) = range(11)
_NI = 11

# Bit patterns of 1.0 for spikes written through a 16-bit integer view of a half-precision output.
_ONE_BITS = {torch.float16: 0x3C00, torch.bfloat16: 0x3F80}

# Neurons per block: long rows (64 KiB of each [T, N] stream per time step) keep the hardware prefetcher streaming
# between the jumps from one time step's row to the next; the block's scratch arrays still fit in L2. 16384 was
# the fastest of 2048..32768 at T = 4, 32 and 128 (N = 1M, 2 threads), by 5-20% over 2048 in the backward.
_FORWARD_BLOCK = 16384
_BACKWARD_BLOCK = 16384


# ----------------------------------------------------------------------------------------------------------------
# Scalar building blocks (inlined by LLVM into the loops below).


@njit(error_model="numpy")
def _fire(h, thf):
    """``h - threshold > 0`` (strict, snnTorch) or ``>= 0`` as one comparison ``h >= thf``.

    A float difference is zero exactly when its operands are equal and has their order's sign otherwise, so
    ``h - th >= 0`` is ``h >= th`` and ``h - th > 0`` is ``h >= nextafter(th, +inf)`` (NaN fires in neither). One
    compare instead of two and a flag: the pair of them, packed into a vector of bools, cost ten instructions
    per vector in every loop."""
    return h >= thf


@njit(error_model="numpy")
def _step(fam, hp, s, xv, k, th, vr, rval, hard, psoft, ssoft, ron, rhard, zero):
    """One step ``h = step(h_prev, s_prev, x)`` with the exact operation order of :mod:`spikefuse.params`.

    LIF family: ``((R if s&hard else k*((h-th) if s&psoft else h)) + x) - (th if s&ssoft else 0)``, which is
    PAPER hard (R = v_reset), snnTorch zero-reset (R = 0), PAPER soft (psoft), snnTorch subtract (ssoft) and the
    no-reset ``k*h + x`` (no flag) bit for bit (``+ 0`` / ``- 0`` are exact). SpikingJelly: post-reset ``u``, then
    the charge of the family.
    """
    if fam == _FAM_LIF:
        y = (rval if s & hard else k * ((hp - th) if s & psoft else hp)) + xv
        return y - (th if s & ssoft else zero)
    u = ((vr if rhard else hp - th) if s & ron else hp)
    if fam == _FAM_DIV_INPUT:
        return u + (xv - (u - vr)) / k
    elif fam == _FAM_MUL_INPUT:
        return u + (xv - (u - vr)) * k
    elif fam == _FAM_DIV:
        return u - (u - vr) / k + xv
    return u - (u - vr) * k + xv


def _at(c, i):
    """``c[i]`` of a per-neuron coefficient array; a scalar coefficient, shared by every neuron, as it is.

    The loops take the leak and the backward's coefficients either way: scalars when the leak is one number (the
    common case), which spares the loop a load per coefficient and neuron from a block-sized array in L2."""


@overload(_at, inline="always")
def _at_overload(c, i):
    if isinstance(c, types.Array):
        return lambda c, i: c[i]
    return lambda c, i: c


def _exp_consts(fp):
    """The constants of :func:`_exp2_neg` as scalars, read once before a loop (loads from ``fp`` inside the loop
    might alias its stores as far as LLVM knows, which stops it from vectorizing): ``(zmax, magic, coefficients)``,
    with as many coefficients as the dtype's degree needs."""


@overload(_exp_consts, inline="always")
def _exp_consts_for_dtype(fp):
    c = _F_EXPC
    if fp.dtype == types.float32:  # EXP2_DEGREE[np.float32] == 6
        return lambda fp: (fp[_F_ZMAX], fp[_F_MAGIC], (fp[c], fp[c + 1], fp[c + 2], fp[c + 3], fp[c + 4], fp[c + 5],
                                                       fp[c + 6]))
    return lambda fp: (fp[_F_ZMAX], fp[_F_MAGIC], (fp[c], fp[c + 1], fp[c + 2], fp[c + 3], fp[c + 4], fp[c + 5],
                                                   fp[c + 6], fp[c + 7], fp[c + 8]))


@njit(error_model="numpy")
def _exp2_neg(z, ec):
    """``2^-z`` for ``z >= 0`` in plain arithmetic that LLVM vectorizes (libm's exp is a scalar call).

    ``z = n - f`` with ``n`` the nearest integer (``(z + M) - M``, exact) and ``f = n - z`` in [-1/2, 1/2] (exact),
    ``2^f`` by :func:`exp2_polynomial` in Horner form with FMAs (the backward is bound by floating-point operations)
    and ``2^-n`` from its exponent bits. Base 2 instead of e: the caller folds log2(e) into its constant, and
    the reduction needs no two-part ln2 (3 operations fewer than a Cody-Waite exp). ``z`` is clamped where
    ``2^-n`` would leave the normal range (2^-126 in float32, 2^-1022 in float64), far below anything that
    matters next to the other terms. All constants come in ``ec`` (:func:`_exp_consts`) in the compute dtype,
    so float32 stays float32.
    """
    zmax, magic, coefficients = ec
    zc = min(z, zmax)
    n = (zc + magic) - magic
    return horner(n - zc, coefficients) * pow2(-n)


@njit(error_model="numpy")
def _surrogate(code, u, a, b, zero, one, ec):
    """The surrogate derivative of :mod:`spikefuse.surrogate` for ``u = h - threshold``.

    Sigmoid (``a = alpha``, ``b = alpha*log2(e)``): ``alpha*s*(1-s)`` evaluated as ``alpha*e/(1+e)^2`` with
    ``e = exp(-alpha*|u|) = 2^-(b*|u|)``, the same function (it is even in u) with one exp2, one division and no
    cancellation or overflow (within 1e-6 relative of the two-sigmoid form, which itself loses ~eps/(1-s) to
    cancellation for large alpha*u).
    ATan: ``b / (1 + (u*a)^2)`` with ``a = pi/2*alpha``, ``b = alpha/2``. Rectangle: ``b if |u| < a``.
    Triangle: ``max(a - b*|u|, 0)`` with ``b = alpha^2``. FastSigmoid: ``1 / (a*|u| + 1)^2``.
    """
    if code == 0:
        e = _exp2_neg(b * abs(u), ec)
        q = one + e
        return a * e / (q * q)
    elif code == 1:
        z = u * a
        return b / (one + z * z)
    elif code == 2:
        return b if abs(u) < a else zero
    elif code == 3:
        return max(a - b * abs(u), zero)
    z = a * abs(u) + one
    return one / (z * z)


@njit(error_model="numpy")
def _reverse_factor(h, s, d, k1, al, be, zos, zero):
    """``A = dh[t+1]/dh[t] = (0 if s and zos else k1) + (al*h + be)*d``: the reverse step's factor at potential ``h``
    with spike ``s``, for every dynamics (see :func:`_coefficients`), in two FMAs (the loop is bound by
    floating-point operations; gradients are compared with the reference to 1e-5, and the fused form rounds once
    where the reference rounds twice)."""
    return muladd(muladd(al, h, be), d, zero if s & zos else k1)


# ----------------------------------------------------------------------------------------------------------------
# Block loops. Called with literal family / surrogate / flag arguments: numba compiles one specialization per
# literal value, in which the switches are constants, so every loop holds only its own arithmetic.


@njit(error_model="numpy")
def _fwd_block(fam, x, x0, kk, hb, spk, hs, sv, n0, m, fl, fp, write_s, write_h):
    """Run one block of neurons over all time steps; ``hb`` holds v_init on entry and h[T-1] on exit. The block's
    input is ``x[:, x0 : x0 + m]`` (``x0 = n0``, or 0 in a tile of the block's own, see :func:`~spikefuse.ops.batchnorm_cpu.source_tile`).

    Spikes / potentials not wanted (``write_s`` / ``write_h`` false) go to a block-sized scratch row that stays
    in cache, so a single loop per family serves the forward with and without saving h and the backward's recompute.
    """
    th, thf, vr, rval, zero = fp[_F_TH], fp[_F_THF], fp[_F_VR], fp[_F_RVAL], fp[_F_ZERO]
    hard, psoft, ssoft = fl[_I_HARD] != 0, fl[_I_PSOFT] != 0, fl[_I_SSOFT] != 0
    ron, rhard = fl[_I_RON] != 0, fl[_I_RHARD] != 0
    s0, s1 = sv[0], sv[1]
    s_scratch = np.empty(m if not write_s else 0, sv.dtype)
    h_scratch = np.empty(m if not write_h else 0, fp.dtype)
    for t in range(x.shape[0]):
        live = (fl[_I_SPR] == 0) | (t > 0)  # state_post_reset: v_init is already post-reset, s[-1] = 0
        xr = x[t, x0 : x0 + m]
        sr = spk[t, n0 : n0 + m] if write_s else s_scratch
        hr = hs[t, n0 : n0 + m] if write_h else h_scratch
        for i in range(m):
            hp = hb[i]
            sp = live & _fire(hp, thf)
            hn = _step(fam, hp, sp, xr[i], _at(kk, i), th, vr, rval, hard, psoft, ssoft, ron, rhard, zero)
            sr[i] = s1 if _fire(hn, thf) else s0
            hr[i] = hn
            hb[i] = hn


def _shared_or_per_neuron(shared, c):
    """``c[0]`` when ``shared`` (a literal: one leak / one set of coefficients for every neuron), else ``c``; ``c``
    is an array or a tuple of them (see :func:`_at`)."""


@overload(_shared_or_per_neuron, inline="always")
def _shared_or_per_neuron_overload(shared, c):
    if not isinstance(shared, types.Literal):
        return None  # numba retries with the literal
    if not shared.literal_value:
        return lambda shared, c: c
    if isinstance(c, types.Array):
        return lambda shared, c: c[0]
    if isinstance(c, types.BaseTuple) and len(c) == 6:  # the backward's (k1, al, be, bb, c1, c2)
        return lambda shared, c: (c[0][0], c[1][0], c[2][0], c[3][0], c[4][0], c[5][0])
    return None


def _recompute(recompute, rows, x0, kf, hb, out, fp, n0, m, fl):
    """The backward's recompute (a literal ``recompute``): the potentials of the family in ``fl`` from ``rows`` into
    ``out``, no spikes; nothing at all, and no family's loop even compiled, when the potentials were saved."""


@overload(_recompute, inline="always")
def _recompute_overload(recompute, rows, x0, kf, hb, out, fp, n0, m, fl):
    if not isinstance(recompute, types.Literal):
        return None
    if not recompute.literal_value:
        return lambda recompute, rows, x0, kf, hb, out, fp, n0, m, fl: None

    def impl(recompute, rows, x0, kf, hb, out, fp, n0, m, fl):
        # write_s / write_h as run-time bools (False, True): the same compiled loops as the forward's
        fam = fl[_I_FAM]
        if fam == _FAM_LIF:
            _fwd_block(_FAM_LIF, rows, x0, kf, hb, out, out, fp[:2], n0, m, fl, fp, m < 0, m >= 0)
        elif fam == _FAM_DIV_INPUT:
            _fwd_block(_FAM_DIV_INPUT, rows, x0, kf, hb, out, out, fp[:2], n0, m, fl, fp, m < 0, m >= 0)
        elif fam == _FAM_MUL_INPUT:
            _fwd_block(_FAM_MUL_INPUT, rows, x0, kf, hb, out, out, fp[:2], n0, m, fl, fp, m < 0, m >= 0)
        elif fam == _FAM_DIV:
            _fwd_block(_FAM_DIV, rows, x0, kf, hb, out, out, fp[:2], n0, m, fl, fp, m < 0, m >= 0)
        else:
            _fwd_block(_FAM_MUL, rows, x0, kf, hb, out, out, fp[:2], n0, m, fl, fp, m < 0, m >= 0)

    return impl


@njit(error_model="numpy")
def _fill_leak(kk, leak, n0, inner, fl, zero):
    if fl[_I_SJ] != 0 and fl[_I_CHARGE] == P.CHARGE_IF:
        for i in range(kk.shape[0]):
            kk[i] = zero  # IF runs as the MUL form with k = 0
    else:
        channel_row(kk, leak, n0, inner)


@njit(error_model="numpy")
def _post_reset(h, s, th, vr, ron, rhard):
    return ((vr if rhard else h - th) if s & ron else h)


@njit(error_model="numpy")
def _forward_block(fam, shared_leak, b, x, leak, inner, v_init, fl, fp, sv, spk, state, hs, save_h, block):
    n = x.shape[1]
    th, thf, vr, zero = fp[_F_TH], fp[_F_THF], fp[_F_VR], fp[_F_ZERO]
    ron, rhard = fl[_I_RON] != 0, fl[_I_RHARD] != 0
    n0 = b * block
    m = min(block, n - n0)
    kk = np.empty(1 if shared_leak else m, fp.dtype)
    hb = np.empty(m, fp.dtype)
    _fill_leak(kk, leak, n0, inner, fl, zero)
    load_row(hb, v_init, n0, m)
    # write_s: a run-time True, so that this and the backward's recompute share the compiled loop
    _fwd_block(fam, x, n0, _shared_or_per_neuron(shared_leak, kk), hb, spk, hs, sv, n0, m, fl, fp, m >= 0, save_h)
    for i in range(m):
        h = hb[i]
        if fl[_I_SPR] != 0:
            state[n0 + i] = _post_reset(h, _fire(h, thf), th, vr, ron, rhard)
        else:
            state[n0 + i] = h


@functools.lru_cache(maxsize=None)
def _forward_kernel(fam: int, shared_leak: bool):
    """The parallel forward of family ``fam``, with one leak for all neurons or one per neuron: constants of the
    compiled code, so a call compiles only the loop it runs (cached on disk, like every kernel here: a closure's
    constants are part of numba's cache key)."""

    @njit(parallel=True, cache=True, error_model="numpy")
    def forward_kernel(x, leak, inner, v_init, fl, fp, sv, spk, state, hs, save_h, block):
        nblocks = (x.shape[1] + block - 1) // block
        for b in prange(nblocks):
            _forward_block(fam, shared_leak, np.int64(b), x, leak, inner, v_init, fl, fp, sv, spk, state, hs, save_h,
                           block)

    return forward_kernel


@njit(error_model="numpy")
def _bwd_row(code, need_leak, inplace, rows, coef, m, zos, pfire, fl, fp, c3):
    """One reverse step over a block: ``G = gs*d + G_next*A``, ``grad_x = G*B``, leak partial ``+= G*Cleak``.

    ``d`` is the surrogate derivative of ``code`` at ``h - threshold``, computed in the loop (a separate pass that
    stored ``d`` cost 2x the whole backward). ``A`` is :func:`_reverse_factor`; ``Cleak = c1*(u - r) + c2*(h - u) +
    c3*x`` with ``u`` the post-reset previous potential. ``inplace`` (recompute mode, or a saved h nobody reads again):
    grad_x overwrites h in ``hrow``; one pointer, so LLVM sees a same-index read-then-write it can vectorize
    instead of two arrays that overlap at run time. ``rows`` / ``coef`` are tuples so the call stays short.
    """
    prefer_wide_vectors()
    hrow, gsrow, gxrow, prow, xrow, g, la = rows
    k1, al, be, bb, c1, c2 = coef
    th, thf, vr, zero, one = fp[_F_TH], fp[_F_THF], fp[_F_VR], fp[_F_ZERO], fp[_F_ONE]
    a_sg, b_sg = fp[_F_SG_A], fp[_F_SG_B]
    ec = _exp_consts(fp)
    ron, rhard = fl[_I_RON] != 0, fl[_I_RHARD] != 0
    rp = vr if fl[_I_SJ] != 0 else zero
    out = hrow if inplace else gxrow
    for i in range(m):
        h = hrow[i]
        s = _fire(h, thf)
        d = _surrogate(code, h - th, a_sg, b_sg, zero, one, ec)
        a = _reverse_factor(h, s, d, _at(k1, i), _at(al, i), _at(be, i), zos, zero)
        gt = muladd(g[i], a, gsrow[i] * d)
        if need_leak:
            hp = prow[i]
            sp = pfire & _fire(hp, thf)
            u = ((rp if rhard else hp - th) if sp & ron else hp)  # Cleak's reset value: 0, or v_reset (sj)
            la[i] += gt * (_at(c1, i) * (u - rp) + _at(c2, i) * (h - u) + c3 * xrow[i])
        out[i] = gt * _at(bb, i)
        g[i] = gt


@njit(error_model="numpy")
def _grad_v_init(code, v, g, gv, k1, al, be, zos, fl, fp):
    """``dL/dv_init = G[0] * A`` with the reverse step's factor ``A`` at ``h = v_init`` (see :func:`_bwd_row`);
    a loop of its own per surrogate, like the rows: a scalar libm exp here cost a quarter of the backward."""
    th, thf, zero, one = fp[_F_TH], fp[_F_THF], fp[_F_ZERO], fp[_F_ONE]
    a_sg, b_sg = fp[_F_SG_A], fp[_F_SG_B]
    ec = _exp_consts(fp)
    for i in range(v.shape[0]):
        u = v[i] - th
        s = _fire(v[i], thf)
        d = _surrogate(code, u, a_sg, b_sg, zero, one, ec)
        gv[i] = g[i] * _reverse_factor(v[i], s, d, _at(k1, i), _at(al, i), _at(be, i), zos, zero)


@njit(error_model="numpy")
def _detach(al, be, fl, fp):
    """A detached reset has no surrogate term in ``A``: its ``al`` and ``be`` are multiplied by 0 (the same zeros
    and NaNs as zeroing ``d`` in the loop, one multiplication fewer per neuron and step)."""
    if fl[_I_DETACH] != 0:
        zero = fp[_F_ZERO]
        for i in range(al.shape[0]):
            al[i] *= zero
            be[i] *= zero


@njit(error_model="numpy")
def _state_coefficients(k1, al, be, fl, fp):
    """The coefficients of the grad_state factor that ``A`` takes for ``t = T-1`` (see :func:`_coefficients`):
    dL/dh[T-1] gets grad_state * (1, or d(post-reset u)/dh for state_post_reset); returns zos."""
    th, vr, zero, one = fp[_F_TH], fp[_F_VR], fp[_F_ZERO], fp[_F_ONE]
    hard, soft = fl[_I_RESET] == P.HARD, fl[_I_RESET] == P.SOFT
    spr = fl[_I_SPR] != 0
    for i in range(k1.shape[0]):
        k1[i] = one
        al[i] = -one if (spr and hard) else zero
        be[i] = (vr if hard else (-th if soft else zero)) if spr else zero
    _detach(al, be, fl, fp)
    return spr and hard


@njit(error_model="numpy")
def _coefficients(kk, k1, al, be, bb, c1, c2, fl, fp):
    """Per-neuron coefficients of ``A`` and of B / Cleak (see :func:`_reverse_factor`, :func:`_bwd_row`); returns
    zos."""
    zos = _attached_coefficients(kk, k1, al, be, bb, c1, c2, fl, fp)
    _detach(al, be, fl, fp)
    return zos


@njit(inline="always", error_model="numpy")
def _attached_coefficients(kk, k1, al, be, bb, c1, c2, fl, fp):
    # Every flag and constant is read into a local before the loops: a load from fl / fp inside them might alias
    # the stores (as far as LLVM knows), which kept the branches in the loop and the loop scalar.
    th, vr, zero, one, rval = fp[_F_TH], fp[_F_VR], fp[_F_ZERO], fp[_F_ONE], fp[_F_RVAL]
    sj, charge, reset = fl[_I_SJ] != 0, fl[_I_CHARGE], fl[_I_RESET]
    lif_hard, lif_psoft, lif_ssoft = fl[_I_HARD] != 0, fl[_I_PSOFT] != 0, fl[_I_SSOFT] != 0
    hard = reset == P.HARD
    soft = reset == P.SOFT
    # One loop per branch, each with only selects on loop-invariant flags inside: a loop that branched per neuron
    # stayed scalar and cost more than 4 of the T reverse steps (it runs for every block of every call).
    if sj:
        for i in range(kk.shape[0]):
            k = kk[i]
            dc = one if charge == P.CHARGE_IF else (
                one - one / k if (charge == P.CHARGE_DIV_INPUT or charge == P.CHARGE_DIV) else one - k)
            k1[i] = dc
            al[i] = -dc if hard else zero
            be[i] = dc * vr if hard else (-(dc * th) if soft else zero)
            bb[i] = one / k if charge == P.CHARGE_DIV_INPUT else (k if charge == P.CHARGE_MUL_INPUT else one)
            c2[i] = -(one / k) if charge == P.CHARGE_DIV_INPUT else zero
            c1[i] = one / (k * k) if charge == P.CHARGE_DIV else (
                -one if (charge == P.CHARGE_MUL_INPUT or charge == P.CHARGE_MUL) else zero)
        return hard
    # LIF family: paper hard (R = v_reset) / snnTorch zero-reset (R = 0), paper soft, snnTorch subtract, no reset.
    for i in range(kk.shape[0]):
        k = kk[i]
        k1[i] = k
        al[i] = -k if lif_hard else zero
        be[i] = rval if lif_hard else (-(k * th) if lif_psoft else (-th if lif_ssoft else zero))
        bb[i] = one
        c1[i] = one
        c2[i] = zero
    return lif_hard


@njit(error_model="numpy")
def _backward_block(code, recompute, inplace, shared, blk, gs, gst, x, leak, inner, v_init, hsaved, fl, fp, need_leak,
                    has_x, gx, gv, gl, block, src):
    prefer_wide_vectors()  # the reverse loops may be inlined here
    t_steps, n = gx.shape
    zero, one = fp[_F_ZERO], fp[_F_ONE]
    spr = fl[_I_SPR] != 0
    c3 = one if (has_x and fl[_I_SJ] != 0 and fl[_I_CHARGE] == P.CHARGE_MUL_INPUT) else zero
    n0 = blk * block
    m = min(block, n - n0)
    mc = 1 if shared else m  # coefficients per neuron, or one entry for all (see :func:`_at`)
    kk = np.empty(mc, fp.dtype)
    k1 = np.empty(mc, fp.dtype)
    al = np.empty(mc, fp.dtype)
    be = np.empty(mc, fp.dtype)
    bb = np.empty(mc, fp.dtype)
    c1 = np.empty(mc, fp.dtype)
    c2 = np.empty(mc, fp.dtype)
    no_x = np.zeros(m if need_leak and c3 == zero else 0, fp.dtype)  # the x row when Cleak has no x term
    g = np.empty(m, fp.dtype)  # dL/dh[t+1]
    la = np.zeros(m if need_leak else 0, fp.dtype)  # leak-gradient partial sum
    v0 = np.empty(m if need_leak else 0, fp.dtype)  # v_init, the previous potential of t = 0 in Cleak
    load_row(v0, v_init, n0, v0.shape[0])
    channel_row(kk, leak, n0, inner)
    # the input, for the recompute and the x term of Cleak; src None (x itself) is a type of its own, so the kernels
    # of a plain neuron are compiled without source_tile
    if src is None:
        rows, x0 = x, n0
    else:
        rows, x0 = source_tile(x, n0, m, src), 0
    if recompute:
        load_row(g, v_init, n0, m)  # g: scratch for the running potential
        _fill_leak(c1, leak, n0, inner, fl, zero)  # c1: scratch for the forward's k (zero for IF)
    _recompute(recompute, rows, x0, _shared_or_per_neuron(shared, c1), g, gx, fp, n0, m, fl)
    hh = gx if recompute else hsaved
    load_row(g, gst, n0, m)
    zos = _coefficients(kk, k1, al, be, bb, c1, c2, fl, fp)  # A, B and Cleak
    # for t = T-1, the factor that grad_state takes instead of A (B and Cleak as at any step)
    k1_last, al_last, be_last = np.empty(mc, fp.dtype), np.empty(mc, fp.dtype), np.empty(mc, fp.dtype)
    zos_last = _state_coefficients(k1_last, al_last, be_last, fl, fp)
    coef = _shared_or_per_neuron(shared, (k1, al, be, bb, c1, c2))
    coef_last = _shared_or_per_neuron(shared, (k1_last, al_last, be_last, bb, c1, c2))
    for t in range(t_steps - 1, -1, -1):
        last = t == t_steps - 1
        hrow = hh[t, n0 : n0 + m]
        prow = hh[t - 1, n0 : n0 + m] if t > 0 else v0
        pfire = (t > 0) | (not spr)
        xrow = rows[t, x0 : x0 + m] if c3 != zero else no_x
        rows_t = (hrow, gs[t, n0 : n0 + m], gx[t, n0 : n0 + m], prow, xrow, g, la)
        coef_t, zos_t = (coef_last, zos_last) if last else (coef, zos)
        _bwd_row(code, need_leak, inplace, rows_t, coef_t, m, zos_t, pfire, fl, fp, c3)
    if gv.shape[0] > 0:  # (none for a v_init shared by every neuron)
        if spr:  # h[0] = C(v_init, x[0]): dh/dv_init = dC/du (k for the paper / snnTorch forms)
            for i in range(m):
                gv[n0 + i] = g[i] * k1[i if mc > 1 else 0]
        else:
            _grad_v_init(code, v_init[n0 : n0 + m], g, gv[n0 : n0 + m], _shared_or_per_neuron(shared, k1),
                         _shared_or_per_neuron(shared, al), _shared_or_per_neuron(shared, be), zos, fl, fp)
    if need_leak:
        for i in range(m):
            gl[n0 + i] = la[i]


@functools.lru_cache(maxsize=None)
def _backward_kernel(code: int, recompute: bool, inplace: bool, shared: bool):
    """The parallel backward for surrogate ``code``; recomputing the potentials or reading them; grad_x over its
    input rows (``inplace``) or apart; coefficients ``shared`` by every neuron or per neuron. Constants of the
    compiled code, like the forward's: a call compiles the reverse loops of its mode (with and without the leak's
    gradient), and the recompute's loops only in recompute mode."""

    @njit(parallel=True, cache=True, error_model="numpy")
    def backward_kernel(gs, gst, x, leak, inner, v_init, hsaved, fl, fp, need_leak, has_x, gx, gv, gl, block, src):
        nblocks = (gx.shape[1] + block - 1) // block
        for blk in prange(nblocks):
            _backward_block(code, recompute, inplace, shared, np.int64(blk), gs, gst, x, leak, inner, v_init, hsaved,
                            fl, fp, need_leak, has_x, gx, gv, gl, block, src)

    return backward_kernel


# ----------------------------------------------------------------------------------------------------------------
# Wrappers.


# Below this many neuron-steps a call runs on one thread: waking the thread pool costs more than it saves.
_SERIAL_WORK = 1 << 15


def _check(name: str, t: torch.Tensor | None, dtype: torch.dtype | None = None) -> None:
    if t is None:
        return
    if t.device.type != "cpu":
        raise ValueError(f"cpu backend: {name} is on {t.device}; move it to the CPU or use backend='triton'")
    if not t.is_contiguous():
        raise ValueError(f"cpu backend: {name} must be contiguous (call .contiguous())")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"cpu backend: {name} has dtype {t.dtype}, expected {dtype}")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise TypeError(
            f"cpu backend supports float32, float64, float16 and bfloat16 inputs, got {dtype}; "
            "convert x with .float()"
        )


def _flags(spec: SpecArgs) -> np.ndarray:
    """The integer flags ``fl`` of the kernels (family, reset selectors, ...)."""
    fl = [0] * _NI
    dyn, reset, charge = spec.dynamics, spec.reset, spec.charge
    if dyn in (P.PAPER, P.SNNTORCH):
        fl[_I_FAM] = _FAM_LIF
        fl[_I_HARD] = int(reset == P.HARD)
        fl[_I_PSOFT] = int(dyn == P.PAPER and reset == P.SOFT)
        fl[_I_SSOFT] = int(dyn == P.SNNTORCH and reset == P.SOFT)
        # In the LIF family ron only shapes dh/dk (u = reset(h_prev) inside k*u): not for snnTorch's subtraction.
        fl[_I_RON] = int(reset == P.HARD or fl[_I_PSOFT])
        fl[_I_RHARD] = int(reset == P.HARD)
    elif dyn == P.SPIKINGJELLY:
        fams = {
            P.CHARGE_IF: _FAM_MUL,  # with k = 0
            P.CHARGE_DIV_INPUT: _FAM_DIV_INPUT,
            P.CHARGE_DIV: _FAM_DIV,
            P.CHARGE_MUL_INPUT: _FAM_MUL_INPUT,
            P.CHARGE_MUL: _FAM_MUL,
        }
        if charge not in fams:
            raise ValueError(f"unknown charge code {charge}")
        fl[_I_FAM] = fams[charge]
        fl[_I_SJ] = 1
        fl[_I_RON], fl[_I_RHARD] = int(reset != P.NONE), int(reset == P.HARD)
    else:
        raise ValueError(f"unknown dynamics code {dyn}")
    if reset not in (P.HARD, P.SOFT, P.NONE):
        raise ValueError(f"unknown reset code {reset}")
    if spec.surrogate_code not in range(5):
        raise ValueError(f"unknown surrogate code {spec.surrogate_code}")
    fl[_I_SPR], fl[_I_DETACH] = int(spec.state_post_reset), int(spec.detach_reset)
    fl[_I_CHARGE], fl[_I_RESET] = int(charge), int(reset)
    return np.array(fl, dtype=np.int64)


def _constants(spec: SpecArgs, cdt: torch.dtype) -> np.ndarray:
    """Threshold, v_reset and surrogate constants in the compute dtype, computed in double exactly like
    :mod:`spikefuse.surrogate` computes them before PyTorch casts them to the tensor's dtype."""
    code, p1, p2 = spec.surrogate_code, spec.sg_p1, spec.sg_p2
    if code == 0:  # Sigmoid(alpha): exp(-alpha*|u|) = 2^-(alpha*log2(e)*|u|)
        a, b = p1, p1 / math.log(2.0)
    elif code == 1:  # ATan(alpha)
        a, b = math.pi / 2 * p1, p1 / 2
    elif code == 2:  # Rectangle: half width, height
        a, b = p1, p2
    elif code == 3:  # Triangle(alpha)
        a, b = p1, p1 * p1
    else:  # FastSigmoid(slope)
        a, b = p1, 0.0
    vals = [0.0] * _F_ZMAX
    vals[_F_TH], vals[_F_VR] = spec.threshold, spec.v_reset
    vals[_F_SG_A], vals[_F_SG_B] = a, b
    vals[_F_ZERO], vals[_F_ONE] = 0.0, 1.0
    # The reset value of the LIF family's hard reset: v_reset (paper), 0 (snnTorch's reset-to-zero).
    vals[_F_RVAL] = 0.0 if spec.dynamics == P.SNNTORCH else spec.v_reset
    return _fp_array(tuple(vals), cdt == torch.float32, bool(spec.fire_strict))


@functools.lru_cache(maxsize=64)
def _fp_array(vals: tuple, single: bool, strict: bool) -> np.ndarray:
    dtype = np.float32 if single else np.float64
    fp = np.zeros(_NF, dtype=dtype)
    fp[: len(vals)] = vals
    fp[_F_THF] = np.nextafter(fp[_F_TH], dtype(np.inf)) if strict else fp[_F_TH]
    poly = exp2_polynomial(EXP2_DEGREE[dtype])
    fp[_F_EXPC : _F_EXPC + len(poly)] = poly
    fp[_F_ZMAX] = 126.0 if single else 1022.0
    fp[_F_MAGIC] = 1.5 * 2.0 ** (23 if single else 52)
    return fp  # shared between calls: never written


def _as_compute(t: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    return t if t.dtype == cdt else t.to(cdt)


def _check_out(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    _check(name, t, dtype)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"cpu backend: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def forward(x2, leak, inner, v_init, spec_args, save, *, out=None):
    """``out``: ``(spikes, state, h)`` buffers to write into instead of fresh ones (``h`` ignored unless ``save`` is
    SAVE_POTENTIAL); what ``spikefuse bench neuron`` times the kernel with, apart from page faults."""
    spec = SpecArgs(*spec_args)
    _check_dtype(x2.dtype)
    _check("x", x2)
    cdt = compute_dtype(x2.dtype)
    _check("leak", leak, cdt)
    _check("v_init", v_init, cdt)
    t_steps, n = x2.shape
    check_per_neuron("cpu", "v_init", v_init, n)
    save_h = save == P.SAVE_POTENTIAL
    if out is not None:
        _check_out("out spikes", out[0], x2.shape, x2.dtype)
        _check_out("out state", out[1], (n,), cdt)
        if save_h:
            _check_out("out h", out[2], x2.shape, cdt)
    threads = match_numba_threads(t_steps * n, _SERIAL_WORK)
    xc = _as_compute(x2, cdt)
    spikes = buffers.empty(x2.shape, x2.dtype) if out is None else out[0]
    if x2.dtype in _ONE_BITS:
        spk_np = spikes.view(torch.int16).numpy()
        sv = np.array([0, _ONE_BITS[x2.dtype]], dtype=np.int16)
    else:
        spk_np = spikes.numpy()
        sv = np.array([0.0, 1.0], dtype=spk_np.dtype)
    state = buffers.empty((n,), cdt) if out is None else out[1]
    hs = out[2] if out is not None and save_h else buffers.empty((t_steps, n) if save_h else (0, 0), cdt)
    fl = _flags(spec)  # validates the codes before one picks the kernel
    _forward_kernel(int(fl[_I_FAM]), leak.numel() == 1)(
        xc.numpy(), leak.numpy(), int(inner), v_init.numpy(), fl, _constants(spec, cdt), sv, spk_np,
        state.numpy(), hs.numpy(), bool(save_h), block_for(n, threads, _FORWARD_BLOCK),
    )
    return spikes, state, (hs if save_h else None)


def backward(grad_spikes, grad_state, x2, leak, inner, v_init, saved, spec_args, save, need_leak_grad, *,
             overwrite_saved=False, overwrite_x=False, out=None, batch_norm=None):
    """``overwrite_saved``: the caller will not read ``saved`` again, so grad_x may be written over it.
    ``overwrite_x``: likewise for ``x`` in recompute mode (a transient of the caller's): the recomputed potentials,
    then grad_x, go over it instead of into a new buffer (each block reads its rows of ``x`` into a tile first).
    ``out``: a ``[T, N]`` compute-dtype buffer for grad_x instead of a fresh one (for kernel-only timing).
    ``batch_norm``: a :class:`spikefuse.ops.batchnorm_cpu.Normalization` (recompute mode only): ``x2`` is the raw
    input, and the neuron's is its BatchNorm (plus residual), computed block by block in cache, never stored."""
    spec = SpecArgs(*spec_args)
    cdt = compute_dtype(grad_spikes.dtype)
    _check_dtype(grad_spikes.dtype)
    for name, t in (("grad_spikes", grad_spikes), ("x", x2), ("saved", saved)):
        _check(name, t)
    _check("grad_state", grad_state, cdt)
    _check("leak", leak, cdt)
    _check("v_init", v_init, cdt)
    t_steps, n = grad_spikes.shape
    check_per_neuron("cpu", "grad_state", grad_state, n)
    check_per_neuron("cpu", "v_init", v_init, n)
    threads = match_numba_threads(t_steps * n, _SERIAL_WORK)
    recompute = save == P.SAVE_INPUT
    if recompute and x2 is None:
        raise ValueError("cpu backend: recompute mode (SAVE_INPUT) needs x in backward")
    if not recompute and saved is None:
        raise ValueError("cpu backend: memory mode 'potential' needs the saved potentials in backward")
    if batch_norm is not None and not recompute:
        raise ValueError("cpu backend: a fused BatchNorm (batch_norm) needs recompute mode (SAVE_INPUT)")
    if spec.dynamics == P.SPIKINGJELLY and spec.charge == P.CHARGE_MUL_INPUT and need_leak_grad and x2 is None:
        raise ValueError("cpu backend: the leak gradient of the MUL_INPUT charge needs x in backward")
    gs = _as_compute(grad_spikes, cdt)
    xc = _as_compute(x2, cdt) if x2 is not None else torch.empty((0, 0), dtype=cdt)
    hsaved = _as_compute(saved, cdt) if saved is not None else torch.empty((0, 0), dtype=cdt)
    if out is not None:
        _check_out("out grad_x", out, (t_steps, n), cdt)
    # grad_x over h (same index read before written): no fresh [T, N] buffer to page in.
    over_h = not recompute and overwrite_saved and out is None and hsaved is saved
    # over x: the recompute reads x[t, i] before it writes h[t, i]; the reverse loop reads x only for a leak
    # gradient with an x term (c3 of the MUL_INPUT charge), so then it keeps its own buffer
    x_term = spec.dynamics == P.SPIKINGJELLY and spec.charge == P.CHARGE_MUL_INPUT and need_leak_grad
    over_x = recompute and overwrite_x and out is None and xc is x2 and not x_term and batch_norm is None
    inplace = recompute or over_h
    if over_h:
        gx = hsaved
    elif over_x:
        gx = xc
    else:
        gx = buffers.empty((t_steps, n), cdt) if out is None else out
    gv = buffers.empty((n,) if v_init.numel() == n else (0,), cdt)  # none for a shared v_init
    gl = torch.empty(n if need_leak_grad else 0, dtype=cdt)
    if recompute:  # the T x block tile of recomputed h stays in L2
        block = min(4096, max(256, 65536 // t_steps))
    else:
        block = _BACKWARD_BLOCK
    fl = _flags(spec)  # validates the codes before one picks the kernel
    src = batchnorm_cpu.source_args(x2, batch_norm, copy=over_x)  # x2 is given whenever a tile is (recompute mode)
    _backward_kernel(spec.surrogate_code, bool(recompute), bool(inplace), leak.numel() == 1)(
        gs.numpy(), grad_state.numpy(), xc.numpy(), leak.numpy(), int(inner), v_init.numpy(), hsaved.numpy(), fl,
        _constants(spec, cdt), bool(need_leak_grad), x2 is not None, gx.numpy(), gv.numpy(), gl.numpy(),
        block_for(n, threads, block), src,
    )
    grad_x = gx if grad_spikes.dtype == cdt else gx.to(grad_spikes.dtype)
    grad_leak = reduce_leak_grad(gl, leak.numel(), inner) if need_leak_grad else None
    return grad_x, (gv if gv.numel() else None), grad_leak
