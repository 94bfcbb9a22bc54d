"""The fused Triton backend (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1`` for testing).

One forward and one backward ``@triton.jit`` kernel per layer, as in the temporal-fusion paper: each program owns
``BLOCK`` neurons and loops over all ``T`` time steps inside the kernel with the membrane potential in registers.
Every mode switch of :class:`spikefuse.ops.common.SpecArgs` (dynamics, reset, charge, state_post_reset, fire_strict,
detach_reset, surrogate) and of the call (memory mode, leak gradient, per-channel leak) is a ``tl.constexpr``, so
each specialization compiles to straight-line code; threshold, v_reset and the surrogate parameters are runtime
floats.

Numerics. The forward recursion performs exactly the floating-point operations of :mod:`spikefuse.params` in the
same order, so spikes and states are bit-identical to :mod:`spikefuse.ops.reference`: kernels are launched with
``enable_fp_fusion=False`` (no mul+add contraction into FMA) and divide with ``div_rn`` (Triton's plain fp32 ``/``
may be approximate on NVIDIA GPUs). A reset is a select (``tl.where``) as :mod:`spikefuse.params` writes it; the
reference multiplies by the 0/1 spike instead, which gives the same bits for finite values. Float16 / bfloat16 inputs are upcast to float32 per step (state, ``h`` and all
arithmetic in float32), spikes are written in the input's dtype. Float64 is computed in float64; since Triton
passes Python floats to kernels as float32, every runtime constant travels as three float32 parts whose float64
sum is exact (:func:`_split3`).

Backward is one reverse loop over T with ``dL/dh`` carried in registers (the derivation in the kernel contract):
in memory mode ``potential`` it reads the saved ``h``; in ``recompute`` it first re-runs the forward recursion for
its own neurons, writing ``h`` into the ``grad_x`` buffer (or a float32 scratch for half inputs), then overwrites it
with ``grad_x`` as the reverse loop consumes it.

Entry points: ``forward`` and ``backward`` as documented in :mod:`spikefuse.ops.reference`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import struct

import torch
import triton
import triton.language as tl

from .. import params as P
from ..surrogate import ATan, FastSigmoid, Rectangle, Sigmoid, Triangle
from .common import SpecArgs, check_per_neuron, compute_dtype, reduce_leak_grad, unknown_surrogate

__all__ = ["forward", "backward", "SUPPORTED_DTYPES", "BLOCK_SIZES", "block_size"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
BLOCK_SIZES = (128, 256, 512, 1024)
NUM_WARPS = 4  # 128 threads: with BLOCK >= 128 every neuron is owned by exactly one thread (see backward)
#: The options every kernel is compiled with (:mod:`spikefuse.ops.triton_aot` compiles with the same). No FMA
#: contraction: bit-identical forward (see above). ``maxnreg``: without an explicit register budget ptxas picks a
#: register target for the occupancy it hopes to reach and spills a few registers to local memory to meet it (it did
#: in some BLOCK 1024 specializations); with the hardware's 255 it spills only what cannot fit. These kernels are
#: bound by DRAM bandwidth and keep enough loads in flight at the lower occupancy (see ``spikefuse bench
#: gpu-static``).
COMPILE_OPTIONS = dict(num_warps=NUM_WARPS, maxnreg=255, enable_fp_fusion=False)

# Codes as constexprs (Triton kernels may only read constexpr globals).
_PAPER = tl.constexpr(P.PAPER)
_SNNTORCH = tl.constexpr(P.SNNTORCH)
_SPIKINGJELLY = tl.constexpr(P.SPIKINGJELLY)
_HARD = tl.constexpr(P.HARD)
_SOFT = tl.constexpr(P.SOFT)
_MUL = tl.constexpr(P.CHARGE_MUL)
_IF = tl.constexpr(P.CHARGE_IF)
_DIV_INPUT = tl.constexpr(P.CHARGE_DIV_INPUT)
_DIV = tl.constexpr(P.CHARGE_DIV)
_MUL_INPUT = tl.constexpr(P.CHARGE_MUL_INPUT)
_SG_SIGMOID = tl.constexpr(Sigmoid.code)
_SG_ATAN = tl.constexpr(ATan.code)
_SG_RECT = tl.constexpr(Rectangle.code)
_SG_TRI = tl.constexpr(Triangle.code)


# ----------------------------------------------------------------------------------------------------------------
# Device helpers (inlined when compiled). They are few and coarse on purpose: every call of a device function
# costs milliseconds under TRITON_INTERPRET=1, so each time step calls at most one of them.
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _consts(a_hi, a_mid, a_lo, b_hi, b_mid, b_lo, F64: tl.constexpr):
    """Two runtime constants in the compute dtype: the float32 ``hi`` parts, or the exact float64 sums."""
    if F64:
        a = (tl.cast(a_hi, tl.float64) + tl.cast(a_mid, tl.float64)) + tl.cast(a_lo, tl.float64)
        b = (tl.cast(b_hi, tl.float64) + tl.cast(b_mid, tl.float64)) + tl.cast(b_lo, tl.float64)
    else:
        a = tl.cast(a_hi, tl.float32)
        b = tl.cast(b_hi, tl.float32)
    return a, b


@triton.jit
def _fire(u, STRICT: tl.constexpr):
    """The spike of potential-minus-threshold ``u``: ``u > 0`` (strict, snnTorch / Norse) or ``u >= 0`` (Eq. 2)."""
    if STRICT:
        f = u > 0
    else:
        f = u >= 0
    return f


@triton.jit
def _step(h, t, x, k, th, vr, DYN: tl.constexpr, RESET: tl.constexpr, CHARGE: tl.constexpr, SPR: tl.constexpr,
          STRICT: tl.constexpr, F64: tl.constexpr):
    """``h[t] = step(h[t-1], s[t-1], x[t])`` with ``h = h[t-1]`` (``v_init`` at t = 0): the formulas of
    :mod:`spikefuse.params`, in their operation order. Divisions are IEEE round-to-nearest (``div_rn``; float64
    ``/`` already is).

    The spike ``s[t-1]`` is recomputed here from ``h[t-1]`` rather than carried from the previous step: a carried
    flag is one predicate per neuron live across the time loop, and with BLOCK / 128 = 8 neurons per thread those
    flags and the masks outnumber the 7 predicate registers, so ptxas moved them into general registers (``P2R``)
    and some on to local memory. With ``state_post_reset`` there is no spike before the first step.
    """
    f = _fire(h - th, STRICT)
    if SPR:
        f = f & (t > 0)
    if DYN == _PAPER:
        if RESET == _HARD:
            hn = tl.where(f, vr, k * h) + x
        elif RESET == _SOFT:
            hn = k * tl.where(f, h - th, h) + x
        else:
            hn = k * h + x
    elif DYN == _SNNTORCH:
        if RESET == _SOFT:
            q = k * h + x
            hn = tl.where(f, q - th, q)
        elif RESET == _HARD:
            hn = tl.where(f, x, k * h + x)
        else:
            hn = k * h + x
    else:
        if RESET == _HARD:
            u = tl.where(f, vr, h)
        elif RESET == _SOFT:
            u = tl.where(f, h - th, h)
        else:
            u = h
        if CHARGE == _IF:
            hn = u + x
        elif CHARGE == _DIV_INPUT:
            if F64:
                hn = u + (x - (u - vr)) / k
            else:
                hn = u + tl.math.div_rn(x - (u - vr), k)
        elif CHARGE == _DIV:
            if F64:
                hn = u - (u - vr) / k + x
            else:
                hn = u - tl.math.div_rn(u - vr, k) + x
        elif CHARGE == _MUL_INPUT:
            hn = u + (x - (u - vr)) * k
        else:
            hn = u - (u - vr) * k + x
    return hn


@triton.jit
def _surrogate_and_dpost(h, th, vr, c1, c2, STRICT: tl.constexpr, RESET: tl.constexpr, DETACH: tl.constexpr,
                         SG: tl.constexpr):
    """At potential ``h``: ``surrogate'(h - th)`` and ``d post_reset(h, s(h)) / dh`` (the last step's state path)."""
    u = h - th
    f = _fire(u, STRICT)
    if SG == _SG_SIGMOID:  # c1 = alpha
        sg = 1.0 / (1.0 + tl.exp(-(c1 * u)))
        d = (1.0 - sg) * sg * c1
    elif SG == _SG_ATAN:  # c1 = pi/2 * alpha, c2 = alpha / 2
        z = u * c1
        d = c2 / (1.0 + z * z)
    elif SG == _SG_RECT:  # c1 = width / 2, c2 = height
        d = tl.where(tl.abs(u) < c1, c2, 0.0 * c2)
    elif SG == _SG_TRI:  # c1 = alpha, c2 = alpha^2
        d = tl.maximum(c1 - c2 * tl.abs(u), 0.0 * c2)
    else:  # fast sigmoid: c1 = slope
        z = c1 * tl.abs(u) + 1.0
        d = 1.0 / (z * z)
    if RESET == _HARD:
        g = tl.where(f, 0.0 * h, 1.0 + 0.0 * h)
        if not DETACH:
            g = g + (vr - h) * d
    elif RESET == _SOFT:
        if DETACH:
            g = 1.0 + 0.0 * h
        else:
            g = 1.0 - th * d
    else:
        g = 1.0 + 0.0 * h
    return d, g


@triton.jit
def _local_grads(hp, t, x, h, k, inv_k2, dcharge, th, vr, c1, c2,
                 DYN: tl.constexpr, RESET: tl.constexpr, CHARGE: tl.constexpr, SPR: tl.constexpr,
                 STRICT: tl.constexpr, DETACH: tl.constexpr, SG: tl.constexpr, USE_X: tl.constexpr,
                 NEED_LEAK: tl.constexpr, F64: tl.constexpr):
    """The local derivatives of step ``t``, ``h = h[t] = step(hp, s(hp), x)`` with ``hp = h[t-1]``
    (``v_init`` at t = 0): returns ``(d, a, c)`` with ``d = surrogate'(hp - th)``, ``a = dh[t]/dhp`` (through the
    spike of ``hp`` too unless ``detach_reset``) and ``c = dh[t]/dk`` (0 unless ``NEED_LEAK``).

    ``dcharge`` is SpikingJelly's ``dC/du`` (1, 1 - 1/k or 1 - k), ``inv_k2 = 1/k^2``; without ``x`` (potential
    mode of a decay-input charge) ``x - (u - r)`` is recovered from ``h - u``. With ``state_post_reset`` the
    potential before the first step is already post-reset: no spike and no surrogate path at t = 0.
    """
    up = hp - th
    fp = _fire(up, STRICT)
    if SG == _SG_SIGMOID:
        sg = 1.0 / (1.0 + tl.exp(-(c1 * up)))
        d = (1.0 - sg) * sg * c1
    elif SG == _SG_ATAN:
        z = up * c1
        d = c2 / (1.0 + z * z)
    elif SG == _SG_RECT:
        d = tl.where(tl.abs(up) < c1, c2, 0.0 * c2)
    elif SG == _SG_TRI:
        d = tl.maximum(c1 - c2 * tl.abs(up), 0.0 * c2)
    else:
        z = c1 * tl.abs(up) + 1.0
        d = 1.0 / (z * z)
    if SPR:
        fp = fp & (t > 0)
        d = tl.where(t > 0, d, 0.0 * d)

    # a = dh[t] / dh[t-1]
    if DYN == _PAPER:
        if RESET == _HARD:
            a = tl.where(fp, 0.0 * hp, k + 0.0 * hp)
            if not DETACH:
                a = a + (vr - k * hp) * d
        elif RESET == _SOFT:
            if DETACH:
                a = k + 0.0 * hp
            else:
                a = k * (1.0 - th * d)
        else:
            a = k + 0.0 * hp
    elif DYN == _SNNTORCH:
        if RESET == _SOFT:
            if DETACH:
                a = k + 0.0 * hp
            else:
                a = k - th * d
        elif RESET == _HARD:
            a = tl.where(fp, 0.0 * hp, k + 0.0 * hp)
            if not DETACH:
                a = a - k * hp * d
        else:
            a = k + 0.0 * hp
    else:
        if RESET == _HARD:
            a = tl.where(fp, 0.0 * hp, 1.0 + 0.0 * hp)
            if not DETACH:
                a = a + (vr - hp) * d
        elif RESET == _SOFT:
            if DETACH:
                a = 1.0 + 0.0 * hp
            else:
                a = 1.0 - th * d
        else:
            a = 1.0 + 0.0 * hp
        a = a * dcharge

    # c = dh[t] / dk
    c = 0.0 * hp
    if NEED_LEAK:
        if DYN == _PAPER:
            if RESET == _HARD:
                c = tl.where(fp, 0.0 * hp, hp)
            elif RESET == _SOFT:
                c = tl.where(fp, hp - th, hp)
            else:
                c = hp
        elif DYN == _SNNTORCH:
            if RESET == _HARD:
                c = tl.where(fp, 0.0 * hp, hp)
            else:
                c = hp
        else:
            if RESET == _HARD:
                u = tl.where(fp, vr, hp)
            elif RESET == _SOFT:
                u = tl.where(fp, hp - th, hp)
            else:
                u = hp
            if CHARGE == _DIV_INPUT:
                if USE_X:
                    c = -(x - (u - vr)) * inv_k2
                elif F64:
                    c = -((h - u) / k)
                else:
                    c = -tl.math.div_rn(h - u, k)
            elif CHARGE == _DIV:
                c = (u - vr) * inv_k2
            elif CHARGE == _MUL_INPUT:
                if USE_X:
                    c = x - (u - vr)
                elif F64:
                    c = (h - u) / k
                else:
                    c = tl.math.div_rn(h - u, k)
            elif CHARGE == _MUL:
                c = -(u - vr)
    return d, a, c


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _forward_kernel(
    x_ptr, leak_ptr, v0_ptr, spikes_ptr, state_ptr, saved_ptr,
    T, N, inner, C,
    th_hi, th_mid, th_lo, vr_hi, vr_mid, vr_lo,
    DYN: tl.constexpr, RESET: tl.constexpr, CHARGE: tl.constexpr, SPR: tl.constexpr, STRICT: tl.constexpr,
    SAVE_H: tl.constexpr, PER_CHANNEL: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    CDT: tl.constexpr = tl.float64 if F64 else tl.float32
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    th, vr = _consts(th_hi, th_mid, th_lo, vr_hi, vr_mid, vr_lo, F64)
    if PER_CHANNEL:
        k = tl.load(leak_ptr + (offs // inner) % C, mask=mask, other=1.0).to(CDT)
    else:
        k = tl.load(leak_ptr).to(CDT)

    # Only h is carried across the time loop; each step derives the spikes it needs from it (see _step).
    h = tl.load(v0_ptr + offs, mask=mask, other=0.0).to(CDT)
    for t in range(0, T):
        row = tl.cast(t, tl.int64) * N + offs
        x = tl.load(x_ptr + row, mask=mask, other=0.0).to(CDT)
        h = _step(h, t, x, k, th, vr, DYN, RESET, CHARGE, SPR, STRICT, F64)
        spike = _fire(h - th, STRICT)
        tl.store(spikes_ptr + row, tl.where(spike, 1.0, 0.0).to(spikes_ptr.dtype.element_ty), mask=mask)
        if SAVE_H:
            tl.store(saved_ptr + row, h, mask=mask)
    if SPR:
        spike = _fire(h - th, STRICT)
        if RESET == _HARD:
            h = tl.where(spike, vr, h)
        elif RESET == _SOFT:
            h = tl.where(spike, h - th, h)
    tl.store(state_ptr + offs, h, mask=mask)


@triton.jit
def _backward_kernel(
    gs_ptr, gstate_ptr, x_ptr, h_ptr, gx_ptr, leak_ptr, v0_ptr, gv_ptr, gleak_ptr,
    T, N, inner, C,
    th_hi, th_mid, th_lo, vr_hi, vr_mid, vr_lo, c1_hi, c1_mid, c1_lo, c2_hi, c2_mid, c2_lo,
    DYN: tl.constexpr, RESET: tl.constexpr, CHARGE: tl.constexpr, SPR: tl.constexpr, STRICT: tl.constexpr,
    DETACH: tl.constexpr, SG: tl.constexpr, RECOMPUTE: tl.constexpr, GX_IN_H: tl.constexpr, USE_X: tl.constexpr,
    NEED_LEAK: tl.constexpr, PER_CHANNEL: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """BPTT over all T steps of BLOCK neurons.

    ``h_ptr`` holds the pre-reset potentials ``h [T, N]``: the forward's saved tensor, or (``RECOMPUTE``) a buffer
    this kernel first fills by re-running the forward recursion, which is the ``grad_x`` buffer itself when
    ``GX_IN_H`` (then ``grad_x[t]`` overwrites ``h[t]`` after ``h[t]`` and ``h[t+1]`` have been read).
    """
    CDT: tl.constexpr = tl.float64 if F64 else tl.float32
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    th, vr = _consts(th_hi, th_mid, th_lo, vr_hi, vr_mid, vr_lo, F64)
    c1, c2 = _consts(c1_hi, c1_mid, c1_lo, c2_hi, c2_mid, c2_lo, F64)
    if PER_CHANNEL:
        k = tl.load(leak_ptr + (offs // inner) % C, mask=mask, other=1.0).to(CDT)
    else:
        k = tl.load(leak_ptr).to(CDT)
    # Per-neuron constants of SpikingJelly's charge: dC/du, dh/dx (dxfac) and 1/k^2. Where a charge does not need
    # one it is the literal 1.0, whose multiplications fold away; a tensor of ones (1 + 0 * k) would occupy
    # registers across the reverse loop with a per-channel leak.
    dcharge = 1.0
    dxfac = 1.0
    inv_k2 = 1.0
    if DYN == _SPIKINGJELLY:
        if CHARGE == _DIV_INPUT or CHARGE == _DIV:
            one = 1.0 + 0.0 * k
            if F64:
                inv_k = one / k
                inv_k2 = one / (k * k)
            else:
                inv_k = tl.math.div_rn(one, k)
                inv_k2 = tl.math.div_rn(one, k * k)
            dcharge = 1.0 - inv_k
            if CHARGE == _DIV_INPUT:
                dxfac = inv_k
        elif CHARGE == _MUL_INPUT or CHARGE == _MUL:
            dcharge = 1.0 - k
            if CHARGE == _MUL_INPUT:
                dxfac = k

    v0 = tl.load(v0_ptr + offs, mask=mask, other=0.0).to(CDT)
    if RECOMPUTE:
        # Re-run the forward recursion, writing h[t] into this program's own columns of h_ptr.
        h = v0
        for t in range(0, T):
            row = tl.cast(t, tl.int64) * N + offs
            x = tl.load(x_ptr + row, mask=mask, other=0.0).to(CDT)
            h = _step(h, t, x, k, th, vr, DYN, RESET, CHARGE, SPR, STRICT, F64)
            tl.store(h_ptr + row, h, mask=mask)
        # Each neuron's column is written and read back by the one thread that owns it (BLOCK >= 32 * num_warps
        # gives every neuron exactly one owner), so program order suffices; the barrier makes the
        # write-before-read explicit for the whole block.
        tl.debug_barrier()
    else:
        h = tl.load(h_ptr + tl.cast(T - 1, tl.int64) * N + offs, mask=mask, other=0.0).to(CDT)

    # Reverse loop. Invariant at step t: h = h[t], d = surrogate'(h[t] - th), carry = the part of dL/dh[t] that
    # flows back from later steps and from the final state.
    d, dpost = _surrogate_and_dpost(h, th, vr, c1, c2, STRICT, RESET, DETACH, SG)
    carry = tl.load(gstate_ptr + offs, mask=mask, other=0.0).to(CDT)
    if SPR:
        carry = carry * dpost
    acc = 0.0 * v0
    for i in range(0, T):
        t = T - 1 - i
        tp = tl.cast(t, tl.int64)
        row = tp * N + offs
        g = tl.load(gs_ptr + row, mask=mask, other=0.0).to(CDT) * d + carry
        # h[t-1], or v_init at t = 0 (row 0 is then loaded and discarded: no out-of-range address).
        prev_row = tl.maximum(tp - 1, 0) * N + offs
        hp = tl.where(t == 0, v0, tl.load(h_ptr + prev_row, mask=mask, other=0.0).to(CDT))
        if USE_X:
            x = tl.load(x_ptr + row, mask=mask, other=0.0).to(CDT)
        else:
            x = h
        d, a, c = _local_grads(hp, t, x, h, k, inv_k2, dcharge, th, vr, c1, c2, DYN, RESET, CHARGE, SPR, STRICT,
                               DETACH, SG, USE_X, NEED_LEAK, F64)
        if NEED_LEAK:
            acc += g * c
        gx = g * dxfac
        if GX_IN_H:
            tl.store(h_ptr + row, gx, mask=mask)
        else:
            tl.store(gx_ptr + row, gx.to(gx_ptr.dtype.element_ty), mask=mask)
        carry = g * a
        h = hp
    tl.store(gv_ptr + offs, carry, mask=mask)
    if NEED_LEAK:
        tl.store(gleak_ptr + offs, acc, mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def block_size(n: int) -> int:
    """Neurons per program: large blocks when there are enough of them to fill a GPU, else smaller ones.

    Never below ``32 * NUM_WARPS``: then every neuron is owned by exactly one thread, which the in-place
    recompute of ``backward`` relies on.
    """
    for block in (1024, 512, 256):
        if triton.cdiv(n, block) >= 512:
            return block
    return 128


def _check_block(block: int | None, n: int) -> int:
    if block is None:
        return block_size(n)
    if block not in BLOCK_SIZES:
        raise ValueError(f"spikefuse Triton backend: block must be one of {BLOCK_SIZES}, got {block}")
    return block


def _to_f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (to +-inf on overflow), as PyTorch rounds a scalar."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _split3(value: float, name: str, f64: bool) -> tuple[float, float, float]:
    """Three float32-representable parts whose float64 sum is exactly ``value``.

    Triton passes Python floats to kernels as float32. Float32 / half kernels use the first part, which is
    ``value`` rounded to float32 exactly as PyTorch rounds a Python scalar in float32 arithmetic; float64 kernels
    add the three parts back up in float64 (24 + 24 + 24 bits cover the 53 of a double).
    """
    value = float(value)
    hi = _to_f32(value)
    if not math.isfinite(hi) or not math.isfinite(value):
        if f64 and hi != value:
            raise ValueError(f"{name}={value!r} cannot be passed to the Triton kernels in float64 (beyond float32)")
        return hi, 0.0, 0.0
    mid = _to_f32(value - hi)
    lo = _to_f32(value - hi - mid)
    if f64 and (hi + mid) + lo != value:
        raise ValueError(f"{name}={value!r} cannot be passed exactly to the Triton kernels in float64 (underflow)")
    return hi, mid, lo


def _surrogate_consts(spec: SpecArgs) -> tuple[float, float]:
    """The surrogate's derived constants, computed in double as :mod:`spikefuse.surrogate` does."""
    code, p1, p2 = spec.surrogate_code, spec.sg_p1, spec.sg_p2
    if code == Sigmoid.code:
        return p1, 0.0
    if code == ATan.code:
        return p1 * (math.pi / 2), p1 / 2  # u * (pi/2 * alpha) in surrogate.py: the same double product
    if code == Rectangle.code:
        return p1, p2
    if code == Triangle.code:
        return p1, p1 * p1
    if code == FastSigmoid.code:
        return p1, 0.0
    raise unknown_surrogate(code)


@functools.lru_cache(maxsize=256)
def _launch_args(spec_args: tuple, f64: bool) -> tuple[tuple, dict, dict]:
    """Runtime floats and constexprs of one spec: ``(floats, forward constexprs, backward constexprs)``.

    Constexprs that cannot change the computation are normalized (the charge of non-SpikingJelly dynamics,
    detach_reset without a reset) so they do not multiply the compiled specializations.
    """
    spec = SpecArgs(*spec_args)
    charge = spec.charge if spec.dynamics == P.SPIKINGJELLY else P.CHARGE_MUL
    c1, c2 = _surrogate_consts(spec)
    floats = (
        *_split3(spec.threshold, "threshold", f64),
        *_split3(spec.v_reset, "v_reset", f64),
        *_split3(c1, "surrogate parameter", f64),
        *_split3(c2, "surrogate parameter", f64),
    )
    common = dict(
        DYN=int(spec.dynamics), RESET=int(spec.reset), CHARGE=int(charge), SPR=bool(spec.state_post_reset),
        STRICT=bool(spec.fire_strict), F64=f64,
    )  # fmt: skip
    backward_only = dict(DETACH=bool(spec.detach_reset) or spec.reset == P.NONE, SG=int(spec.surrogate_code))
    return floats, common, {**common, **backward_only}


def _backward_flags(spec: SpecArgs, xdt: torch.dtype, save: int, need_leak_grad: bool, has_x: bool,
                    overwrite_saved: bool = False) -> dict:
    """The call-level constexprs of the backward kernel (a pure function of the call, so that
    :mod:`spikefuse.ops.triton_aot` enumerates exactly what :func:`backward` launches).

    ``grad_x`` shares one buffer with ``h`` (``GX_IN_H``) when it has the compute dtype and either ``recompute``
    (``h`` is recomputed into the ``grad_x`` buffer; else into a float32 scratch) or ``overwrite_saved`` (grad_x
    is written over the saved ``h``); x enters backward only through dh/dk of the decay-input charges (recovered
    from h when x is absent).
    """
    recompute = save == P.SAVE_INPUT
    need_leak_grad = bool(need_leak_grad)
    use_x = (
        need_leak_grad
        and bool(has_x)
        and spec.dynamics == P.SPIKINGJELLY
        and spec.charge in (P.CHARGE_DIV_INPUT, P.CHARGE_MUL_INPUT)
    )
    gx_in_h = (recompute or bool(overwrite_saved)) and xdt == compute_dtype(xdt)
    return dict(RECOMPUTE=recompute, GX_IN_H=gx_in_h, USE_X=use_x, NEED_LEAK=need_leak_grad)


def _check_dtype(x2: torch.Tensor) -> None:
    if x2.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the Triton backend supports float32, float16, bfloat16 and float64 inputs, got {x2.dtype}")


def _check_tensor(t: torch.Tensor, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """The kernels index raw pointers: a wrong layout would read out of bounds, not fail."""
    if not t.is_contiguous():
        raise ValueError(f"spikefuse Triton backend: {name} must be contiguous (the public API makes it so)")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"spikefuse Triton backend: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype != dtype:
        raise TypeError(f"spikefuse Triton backend: {name} has dtype {t.dtype}, expected {dtype}")
    if t.device != device:
        raise ValueError(f"spikefuse Triton backend: {name} is on {t.device}, expected {device}")


def _per_neuron(t: torch.Tensor, name: str, n: int, cdt: torch.dtype, device) -> torch.Tensor:
    """``v_init`` / ``grad_state`` as ``[N]``: a value shared by every neuron (``[1]``) is expanded here, so the
    kernels read one value per neuron either way (on a GPU the N extra values cost little next to the ``[T, N]``
    streams)."""
    check_per_neuron("triton", name, t, n)
    _check_tensor(t, name, tuple(t.shape), cdt, device)
    return t if t.shape[0] == n else t.expand(n).contiguous()


def _leak_layout(leak: torch.Tensor, inner: int, n: int, cdt: torch.dtype, device) -> tuple:
    """The leak (made contiguous: it has only C entries) and ``(PER_CHANNEL, inner, C)``."""
    leak = leak.reshape(-1).contiguous()
    _check_tensor(leak, "leak", (leak.numel(),), cdt, device)
    channels = leak.numel()
    if channels < 1:
        raise ValueError("spikefuse Triton backend: leak must have at least one entry")
    if channels == 1:
        return leak, False, 1, 1
    if inner < 1 or n % (channels * inner):
        raise ValueError(
            f"spikefuse Triton backend: {n} neurons do not tile a per-channel leak of {channels} entries x inner {inner}"
        )
    return leak, True, int(inner), channels


def _on_device(device: torch.device):
    """Launch on the tensors' GPU (Triton launches on the current device, on its current stream)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def forward(x2, leak, inner, v_init, spec_args, save, *, block=None):
    """Run the neuron over ``x2 [T, N]``; returns ``(spikes, state, saved)`` (see :mod:`spikefuse.ops.reference`).

    ``block`` overrides the neurons per program (one of :data:`BLOCK_SIZES`; for tests).
    """
    _check_dtype(x2)
    t_steps, n = x2.shape
    cdt = compute_dtype(x2.dtype)
    device = x2.device
    _check_tensor(x2, "x", (t_steps, n), x2.dtype, device)
    v_init = _per_neuron(v_init, "v_init", n, cdt, device)
    leak, per_channel, inner, channels = _leak_layout(leak, inner, n, cdt, device)
    spikes = torch.empty_like(x2)
    state = torch.empty(n, dtype=cdt, device=device)
    saved = torch.empty((t_steps, n), dtype=cdt, device=device) if save == P.SAVE_POTENTIAL else None
    if t_steps == 0 or n == 0:
        state.copy_(v_init)
        return spikes, state, saved
    block = _check_block(block, n)
    floats, constexprs, _ = _launch_args(tuple(spec_args), cdt == torch.float64)
    with _on_device(device):
        _forward_kernel[(triton.cdiv(n, block),)](
            x2, leak, v_init, spikes, state, saved if saved is not None else state,
            t_steps, n, inner, channels, *floats[:6],
            **constexprs, SAVE_H=saved is not None, PER_CHANNEL=per_channel, BLOCK=block, **COMPILE_OPTIONS,
        )  # fmt: skip
    return spikes, state, saved


def backward(grad_spikes, grad_state, x2, leak, inner, v_init, saved, spec_args, save, need_leak_grad, *,
             overwrite_saved=False, overwrite_x=False, block=None):
    """Gradients ``(grad_x, grad_v_init, grad_leak)`` of one fused BPTT pass (see :mod:`spikefuse.ops.reference`).

    ``overwrite_saved``: the caller will not read ``saved`` again, so grad_x may be written over it (when it has
    the compute dtype): backward then allocates nothing of size ``[T, N]``. ``overwrite_x`` (the cpu backend
    writes over a transient ``x``) is accepted and not used here: grad_x gets its own buffer."""
    spec = SpecArgs(*spec_args)
    _check_dtype(grad_spikes)
    t_steps, n = grad_spikes.shape
    xdt = grad_spikes.dtype
    cdt = compute_dtype(xdt)
    device = grad_spikes.device
    _check_tensor(grad_spikes, "grad_spikes", (t_steps, n), xdt, device)
    grad_state = _per_neuron(grad_state, "grad_state", n, cdt, device)
    shared_v_init = v_init.shape[0] != n
    v_init = _per_neuron(v_init, "v_init", n, cdt, device)
    if x2 is not None:
        _check_tensor(x2, "x", (t_steps, n), xdt, device)
    recompute = save == P.SAVE_INPUT
    if recompute:
        if x2 is None:
            raise ValueError("spikefuse Triton backend: memory mode 'recompute' needs x in backward")
    else:
        if saved is None:
            raise ValueError("spikefuse Triton backend: memory mode 'potential' needs the saved potentials")
        _check_tensor(saved, "saved", (t_steps, n), cdt, device)
    leak, per_channel, inner, channels = _leak_layout(leak, inner, n, cdt, device)
    need_leak_grad = bool(need_leak_grad)

    flags = _backward_flags(spec, xdt, save, need_leak_grad, x2 is not None, overwrite_saved)
    over_h = flags["GX_IN_H"] and not recompute
    grad_x = saved if over_h else torch.empty((t_steps, n), dtype=xdt, device=device)
    grad_v = torch.empty(n, dtype=cdt, device=device)
    leak_partial = torch.empty(n, dtype=cdt, device=device) if need_leak_grad else None
    if t_steps == 0 or n == 0:
        grad_x.zero_()
        grad_v.copy_(grad_state)
        return grad_x, (None if shared_v_init else grad_v), torch.zeros_like(leak) if need_leak_grad else None

    # h is recomputed into grad_x when it has the compute dtype, else into a float32 scratch; with over_h grad_x
    # is the saved h
    if flags["GX_IN_H"]:
        h_buf = grad_x
    else:
        h_buf = torch.empty((t_steps, n), dtype=cdt, device=device) if recompute else saved
    block = _check_block(block, n)
    floats, _, constexprs = _launch_args(tuple(spec_args), cdt == torch.float64)
    with _on_device(device):
        _backward_kernel[(triton.cdiv(n, block),)](
            grad_spikes, grad_state, x2 if x2 is not None else grad_spikes, h_buf, grad_x, leak, v_init, grad_v,
            leak_partial if leak_partial is not None else grad_v,
            t_steps, n, inner, channels, *floats,
            **constexprs, **flags, PER_CHANNEL=per_channel, BLOCK=block, **COMPILE_OPTIONS,
        )  # fmt: skip
    grad_leak = reduce_leak_grad(leak_partial, channels, inner) if need_leak_grad else None
    return grad_x, (None if shared_v_init else grad_v), grad_leak
