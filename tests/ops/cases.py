"""Backend-agnostic test cases for the fused neuron kernels: the valid spec combinations and well-posed inputs.

Used by ``tests/ops/test_cpu.py`` and ``tests/ops/test_shared_state.py``. Nothing here knows about a backend; the
simulation that keeps inputs away from the threshold uses :func:`tests.lif_spec.step`, the spec's oracle.

- :func:`all_specs` enumerates every valid ``dynamics x reset x charge x detach_reset x surrogate`` combination
  (``(id, LIFCase)`` pairs; :func:`spec_params` wraps them as ``pytest.param`` with those ids).
- :func:`make_inputs` draws ``(x, leak, v_init)`` for a shape, spec and dtype such that every pre-reset potential
  ``h`` of the forward pass (and ``v_init`` where it fires) stays more than ``margin`` away from the threshold and
  from the discontinuities of the Rectangle surrogate, so tiny rounding differences between backends cannot flip a
  spike or a surrogate window and gradients can be compared with a tight tolerance.
- :func:`saved_storages` counts what autograd saves for backward.
- :func:`recurrent_gradcheck` runs ``gradcheck`` of ``spikefuse.recurrent`` (``tests/ops/test_recurrent*.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

import spikefuse
from spikefuse.validation import channel_layout
from spikefuse.ops.numerics import compute_dtype
from tests import lif_spec as P
from spikefuse.surrogate import ATan, FastSigmoid, Rectangle, Sigmoid, Surrogate, Triangle

# Non-default parameters on purpose: a kernel that ignores a surrogate parameter fails.
SURROGATES: tuple[Surrogate, ...] = (
    Sigmoid(3.0),
    ATan(2.5),
    Rectangle(width=0.8, height=1.25),
    Triangle(1.5),
    FastSigmoid(10.0),
)

DYNAMICS_NAMES = {P.PAPER: "paper", P.SNNTORCH: "snntorch", P.SPIKINGJELLY: "sj"}
RESET_NAMES = {P.HARD: "hard", P.SOFT: "soft", P.NONE: "none"}
CHARGE_NAMES = {
    P.CHARGE_MUL: "mul",
    P.CHARGE_IF: "if",
    P.CHARGE_DIV_INPUT: "divin",
    P.CHARGE_DIV: "div",
    P.CHARGE_MUL_INPUT: "mulin",
}
SURROGATE_NAMES = {Sigmoid: "sigmoid", ATan: "atan", Rectangle: "rect", Triangle: "tri", FastSigmoid: "fastsig"}


def dynamics_combos() -> list[tuple[int, int, int, bool]]:
    """The valid ``(dynamics, reset, charge, state_post_reset)`` combinations."""
    combos = [(P.PAPER, r, P.CHARGE_MUL, False) for r in (P.HARD, P.SOFT, P.NONE)]
    combos += [(P.SNNTORCH, r, P.CHARGE_MUL, False) for r in (P.HARD, P.SOFT, P.NONE)]
    combos += [
        (P.SPIKINGJELLY, r, c, True)
        for r in (P.HARD, P.SOFT)
        for c in (P.CHARGE_IF, P.CHARGE_DIV_INPUT, P.CHARGE_DIV, P.CHARGE_MUL_INPUT, P.CHARGE_MUL)
    ]
    return combos


def make_spec(
    dynamics: int,
    reset: int,
    charge: int,
    state_post_reset: bool,
    surrogate: Surrogate,
    detach_reset: bool,
    variant: int = 0,
) -> P.LIFCase:
    """A spec with threshold / v_reset chosen by ``variant`` (so different cases exercise different constants)."""
    threshold = (1.0, 0.75, 1.25)[variant % 3]
    if reset == P.HARD and dynamics == P.PAPER:
        v_reset = (0.0, -0.125, 0.2)[variant % 3]
    elif reset == P.HARD and dynamics == P.SPIKINGJELLY:
        v_reset = (0.0, 0.1, -0.2)[variant % 3]
    else:
        v_reset = 0.0  # snnTorch's reset is to zero; soft / no reset have no v_reset
    return P.LIFCase(
        threshold=threshold,
        v_reset=v_reset,
        reset=reset,
        surrogate=surrogate,
        detach_reset=detach_reset,
        dynamics=dynamics,
        charge=charge,
        state_post_reset=state_post_reset,
    )


def spec_id(spec: P.LIFCase) -> str:
    parts = [DYNAMICS_NAMES[spec.dynamics], RESET_NAMES[spec.reset]]
    if spec.dynamics == P.SPIKINGJELLY:
        parts.append(CHARGE_NAMES[spec.charge])
    parts.append(SURROGATE_NAMES[type(spec.surrogate)])
    if spec.detach_reset:
        parts.append("detach")
    return "-".join(parts)


def all_specs(
    surrogates: Sequence[Surrogate] = SURROGATES, detach: Sequence[bool] = (False, True)
) -> Iterator[tuple[str, P.LIFCase]]:
    """Every valid combination, as ``(id, spec)``; threshold / v_reset vary deterministically across cases."""
    i = 0
    for dyn, reset, charge, spr in dynamics_combos():
        for surrogate in surrogates:
            for det in detach:
                spec = make_spec(dyn, reset, charge, spr, surrogate, det, variant=i)
                i += 1
                yield spec_id(spec), spec


def spec_params(**kwargs) -> list:
    """:func:`all_specs` as a list of ``pytest.param(spec, id=...)`` for ``@pytest.mark.parametrize``."""
    import pytest

    return [pytest.param(spec, id=name) for name, spec in all_specs(**kwargs)]


def leak_range(spec: P.LIFCase) -> tuple[float, float]:
    """A sensible range for the ``leak`` parameter ``k`` of a spec (tau for DIV charges, sigmoid(w) for MUL)."""
    if spec.dynamics == P.SPIKINGJELLY:
        if spec.charge in (P.CHARGE_DIV, P.CHARGE_DIV_INPUT):
            return 1.5, 4.0
        if spec.charge in (P.CHARGE_MUL, P.CHARGE_MUL_INPUT):
            return 0.2, 0.75
        return 0.5, 1.0  # IF: unused
    return 0.4, 0.95


def _input_gain(spec: P.LIFCase, k: torch.Tensor) -> torch.Tensor | float:
    """Scale of x so that the neuron fires now and then (compensates the 1/k or k of decay-input charges)."""
    if spec.dynamics == P.SPIKINGJELLY and spec.charge == P.CHARGE_DIV_INPUT:
        return k
    if spec.dynamics == P.SPIKINGJELLY and spec.charge == P.CHARGE_MUL_INPUT:
        return 1.0 / k
    return 1.0


def num_channels(shape: Sequence[int]) -> int:
    """The channel count a per-channel leak would have on an input of ``shape`` (1 when the rank is too low)."""
    if len(shape) < 2:
        return 1
    return shape[2] if len(shape) >= 3 else shape[1]


def _too_close(h: torch.Tensor, spec: P.LIFCase, margin: float) -> torch.Tensor:
    """Potentials within ``margin`` of the threshold or of a Rectangle window edge."""
    u = h.double() - spec.threshold
    bad = u.abs() <= margin
    p1, _ = spec.surrogate.params()
    if isinstance(spec.surrogate, Rectangle):
        bad |= (u.abs() - p1).abs() <= margin
    if isinstance(spec.surrogate, Triangle):  # continuous, but keep the kink away too (cheap)
        bad |= (u.abs() - 1.0 / p1).abs() <= margin
    return bad


def make_inputs(
    shape: Sequence[int],
    spec: P.LIFCase,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    *,
    per_channel: bool = False,
    margin: float = 1e-3,
    zero_v_init: bool = False,
):
    """Draw ``(x, leak, v_init)``: ``x`` of ``shape`` ``[T, *]`` in ``dtype``, ``leak`` ``[C]`` and ``v_init``
    ``shape[1:]`` in the compute dtype (float32 for half inputs).

    ``x`` is drawn step by step while simulating the forward pass with the reference's own ``step`` in the compute
    dtype, redrawing the entries whose pre-reset potential would land within ``margin`` of the threshold (or of a
    Rectangle window edge), so every backend sees the same spikes and surrogate windows. ``per_channel`` gives the
    leak ``C = shape[2]`` (rank >= 3) or ``shape[1]`` (rank 2) entries; otherwise ``C = 1``.
    """
    shape = tuple(int(s) for s in shape)
    gen = torch.Generator().manual_seed(seed)
    cdt = compute_dtype(dtype)
    t_steps = shape[0]
    n = math.prod(shape[1:])
    channels = num_channels(shape) if per_channel else 1
    lo, hi = leak_range(spec)
    leak = (lo + (hi - lo) * torch.rand(channels, generator=gen, dtype=torch.float64)).to(cdt)
    inner = channel_layout(torch.Size(shape), channels)
    k = leak.reshape(1, channels, 1).expand(n // (channels * inner), channels, inner).reshape(n)
    gain = _input_gain(spec, k)
    th = spec.threshold

    def draw(count_shape):
        z = torch.randn(count_shape, generator=gen, dtype=torch.float64).to(cdt)
        return z

    # v_init: around the reset / rest value, away from the threshold when it is fired on (not state_post_reset).
    if zero_v_init:
        v = torch.full((n,), spec.v_reset if spec.reset == P.HARD else 0.0, dtype=cdt)
    else:
        v = (th * (0.4 + 0.5 * draw(n))).to(cdt)
        for _ in range(50):
            bad = _too_close(v, spec, margin)
            if not spec.state_post_reset and bad.any():
                v = torch.where(bad, (th * (0.4 + 0.5 * draw(n))).to(cdt), v)
            else:
                break
        bad = _too_close(v, spec, margin)
        if bad.any():  # deterministic nudge as a last resort
            v = torch.where(bad, v - 4 * margin, v)

    h = v.clone()
    s = torch.zeros_like(h) if spec.state_post_reset else (h - th >= 0 if not spec.fire_strict else h - th > 0).to(cdt)
    xs = []
    for _ in range(t_steps):
        x_t = (th * gain * (0.45 + 0.7 * draw(n))).to(dtype)
        for _ in range(50):
            h_new = P.step(h, s, x_t.to(cdt), k, spec)
            bad = _too_close(h_new, spec, margin)
            if not bad.any():
                break
            x_t = torch.where(bad, (th * gain * (0.45 + 0.7 * draw(n))).to(dtype), x_t)
        else:
            h_new = P.step(h, s, x_t.to(cdt), k, spec)
        xs.append(x_t)
        h = h_new
        s = (h - th > 0 if spec.fire_strict else h - th >= 0).to(cdt)
    x = torch.stack(xs).reshape(shape) if t_steps else torch.empty(shape, dtype=dtype)
    return x, leak, v.reshape(shape[1:])


def kernel_inputs(x: torch.Tensor, leak: torch.Tensor, v_init: torch.Tensor):
    """The ``(x2, leak, inner, v_init)`` a backend module's ``forward`` takes, from :func:`make_inputs`' output."""
    n = math.prod(x.shape[1:])
    inner = channel_layout(x.shape, leak.numel())
    return x.reshape(x.shape[0], n).contiguous(), leak, inner, v_init.reshape(n).contiguous()


def default_tolerance(dtype: torch.dtype) -> dict:
    """Tolerances for gradient comparisons: tight in float64, float32-rounding-sized otherwise."""
    if dtype == torch.float64:
        return dict(rtol=1e-5, atol=1e-9)
    return dict(rtol=1e-4, atol=1e-5)


def saved_storages(fn):
    """Run ``fn`` and return ``({storage pointer: bytes} of every non-empty tensor autograd saved, fn's result)``;
    one entry per storage, so views of one buffer count once."""
    storages = {}

    def pack(t):
        if t.numel():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return storages, out


def recurrent_gradcheck(model, params: dict, x, weight, bias, backend: str, **options) -> None:
    """``gradcheck`` of ``spikefuse.recurrent`` in float64 against finite differences, through the input, the
    recurrent weight (spikes present), the bias and the model's parameters (``params``, as tensors): with a narrow
    rectangle surrogate and no membrane near the threshold the spikes are locally constant and their surrogate
    derivative 0, so the outputs (spikes, final states) are smooth in every input. ``options``: the layer's own
    (``sparse``, ``sparse_grad``)."""
    tensors = [torch.tensor(params[p], dtype=torch.float64, requires_grad=True) for p in model.params]

    def outputs(x, weight, bias, *tensors):
        spikes, final = spikefuse.recurrent(
            x,
            model,
            weight,
            bias,
            surrogate=Rectangle(width=1e-3),
            detach_reset=True,
            return_state=True,
            backend=backend,
            **options,
            **dict(zip(model.params, tensors)),
        )
        return (spikes, *final[:-1])

    assert outputs(x, weight, bias, *tensors)[0].sum() > 0
    inputs = (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), *tensors)
    assert torch.autograd.gradcheck(outputs, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
