"""The CPU backend of every LIF form against the LIF spec's serial loop (:mod:`tests.lif_spec`, the oracle the LIF
definitions were written from).

What is checked, and how:

- The library's runner with autograd (``spikefuse.functional.run_lif`` / ``lif``, ``backend="cpu"`` against the
  spec's loop; on the CPU it runs the LIF definitions of :mod:`spikefuse.neurons.lif` on the neuron engine, whose
  kernels ``tests/neurons/test_engine.py`` tests over its models, surrogates and dtypes; here every LIF form, on a
  subset: see ``_api_cases`` and ``_combo_cases``) for the valid dynamics x reset x charge x detach_reset x surrogate
  (``cases.all_specs``), scalar and per-channel learnable leak, both memory modes, float32 and float64: spikes and
  states bit-identical; gradients of x, v_init and leak within ``rtol=1e-5`` (float64) / float32-rounding
  tolerance (float32). Inputs keep every potential > 1e-3 away from the threshold and the Rectangle window edges
  (``cases``).
- ``torch.autograd.gradcheck`` in float64. Spikes are piecewise constant: their true derivative is 0 almost
  everywhere and the backward returns the *surrogate* derivative by design, so gradcheck cannot check anything
  that flows through a spike. What it can check honestly is the state output with the reset detached
  (``detach_reset=True``): the spikes then enter only as constants, finite differences (eps 1e-6 against a
  1e-3 margin) never flip one, and the analytic gradient must equal the numerical one exactly. That covers the
  hand-derived parts of the backward -- the leak/charge factor of ``A``, ``B = dh/dx``, ``dh/dk`` of every
  dynamics, ``dC/du`` for ``v_init``, per-channel reduction -- independently of the reference. The surrogate
  terms are covered by the reference comparison and by the grid test of each surrogate's formula.
- Hypothesis over shapes (T = 1, N = 1, odd sizes, trailing dims), specs and dtypes (incl. float16 / bfloat16).
- Continuation: T steps at once equals two chunks with the state passed back as v_init.
- SpikingJelly's forms handing on the membrane before the reset (``state_post_reset=False``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numba
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spikefuse
from spikefuse.neurons import SPIKINGJELLY_PRE_RESET_MODELS
from spikefuse.surrogate import Rectangle, Sigmoid
from tests import lif_spec as P
from tests.ops.cases import SURROGATES, dynamics_combos, make_inputs, make_spec, spec_id, spec_params

SHAPE = (6, 2, 3, 4)  # [T, B, C, inner]: per-channel leak has 3 entries, inner = 4
SPECS = spec_params()


def _api_cases() -> list:
    """``(spec, per_channel, dtype, memory modes)`` of the runner's tests. The LIF forms run on the neuron engine, whose
    kernels are generated and compiled per (definition, surrogate type, dtype) and again for a per-channel leak, and
    per memory mode: every form with the sigmoid surrogate and a per-channel leak in float64 (the kernels
    ``test_gradcheck_state_detached_reset`` runs too), ``detach_reset`` and the memory mode by turns
    (:func:`_memory_of`); and one form of each family (the paper's, snnTorch's, SpikingJelly's) with a scalar leak in
    float32, in both memory modes. Every form runs in float32 in ``test_potential_exactly_at_the_threshold``; every
    surrogate in ``test_lif_matches_reference``; ``tests/neurons/test_engine.py`` tests the engine's kernels over
    its models, surrogates and dtypes."""
    cases = []
    for i, combo in enumerate(dynamics_combos()):
        spec = make_spec(*combo, Sigmoid(3.0), i % 2 == 1, variant=i)
        memory = _memory_of(combo)
        cases.append(pytest.param(spec, True, torch.float64, (memory,), id=f"{spec_id(spec)}-channel-f64-{memory}"))
        if combo[:3] in _FAMILY_FORMS:
            spec = make_spec(*combo, Sigmoid(3.0), False, variant=i + 1)
            both = ("potential", "recompute")
            cases.append(pytest.param(spec, False, torch.float32, both, id=f"{spec_id(spec)}-scalar-f32"))
    return cases


def _memory_of(combo) -> str:
    """The memory mode a form's float64 per-channel kernels are tested in, by turns over the forms (both modes in
    each family): each mode compiles kernels of its own, and what differs between them is the same for all forms."""
    return ("potential", "recompute")[dynamics_combos().index(combo) % 2]


_FAMILY_FORMS = {
    (P.PAPER, P.HARD, P.CHARGE_MUL),
    (P.SNNTORCH, P.SOFT, P.CHARGE_MUL),
    (P.SPIKINGJELLY, P.HARD, P.CHARGE_DIV_INPUT),
}
API_CASES = _api_cases()


def _tol(dtype, leak=False):
    # float32: both sides round every op to float32 in a different order (and the sigmoid by a different formula);
    # the leak gradient is a sum over all neurons and steps with cancellation, hence its larger atol.
    if dtype == torch.float64:
        return dict(rtol=1e-5, atol=1e-10)
    return dict(rtol=1e-5, atol=1e-5 if leak else 1e-6)


@functools.lru_cache(maxsize=None)
def _inputs(shape, spec, dtype, seed, per_channel):
    return make_inputs(shape, spec, dtype, seed, per_channel=per_channel)


def _assert_close(actual, expected, name, **tol):
    if expected is None:  # the reference returns None for a leak that does not enter the dynamics (IF)
        expected = torch.zeros_like(actual)
    torch.testing.assert_close(actual, expected.to(actual.dtype), msg=lambda m: f"{name}: {m}", **tol)


# ---------------------------------------------------------------------------------------------------------------
# Public API with autograd.


def _api_run(spec, x, leak, v, backend, memory):
    x = x.clone().requires_grad_(True)
    leak = leak.clone().requires_grad_(True)
    v = v.clone().requires_grad_(True)
    spikes, state = P.run(x, leak, spec, v_init=v, backend=backend, memory=memory)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(spikes.shape, generator=gen, dtype=torch.float64).to(spikes.dtype)
    w2 = torch.randn(state.shape, generator=gen, dtype=torch.float64).to(state.dtype)
    ((spikes * w).sum() + (state * w2).sum()).backward()
    return spikes.detach(), state.detach(), x.grad, v.grad, leak.grad


@pytest.mark.parametrize("spec, per_channel, dtype, memories", API_CASES)
def test_api_autograd_matches_reference(spec, per_channel, dtype, memories):
    x, leak, v = _inputs(SHAPE, spec, dtype, 4, per_channel)
    ref = _api_run(spec, x, leak, v, "spec", "potential")
    for memory in memories:
        got = _api_run(spec, x, leak, v, "cpu", memory)
        assert torch.equal(got[0], ref[0]), "spikes differ"
        assert torch.equal(got[1], ref[1]), "state differs"
        for name, a, b in zip(("x.grad", "v_init.grad", "leak.grad"), got[2:], ref[2:]):
            _assert_close(a, b, f"{memory} {name}", **_tol(dtype, leak=name == "leak.grad"))


# every surrogate with the hard reset, the soft reset with the sigmoid (see _api_cases)
_LIF_CASES = [
    pytest.param(sg, v_reset, id=f"{type(sg).__name__}-{name}")
    for sg in SURROGATES
    for v_reset, name in ((0.0, "hard0"), (-0.1, "hard-0.1"))
]
_LIF_CASES.append(pytest.param(Sigmoid(3.0), None, id="Sigmoid-soft"))


@pytest.mark.parametrize("memory", ["potential", "recompute"])
@pytest.mark.parametrize("surrogate, v_reset", _LIF_CASES)
@pytest.mark.parametrize("detach", [False, True], ids=["attached", "detached"])
def test_lif_matches_reference(surrogate, v_reset, detach, memory):
    spec = P.LIFCase(
        threshold=0.9,
        v_reset=v_reset or 0.0,
        reset=P.SOFT if v_reset is None else P.HARD,
        surrogate=surrogate,
        detach_reset=detach,
    )
    x, decay, v = _inputs((5, 2, 3, 2, 2), spec, torch.float64, 5, True)
    outs = {}
    for backend in ("reference", "cpu"):
        xr = x.clone().requires_grad_(True)
        dr = decay.clone().requires_grad_(True)
        vr = v.clone().requires_grad_(True)
        spikes, state = spikefuse.lif(
            xr,
            decay=dr,
            threshold=0.9,
            v_reset=v_reset,
            surrogate=surrogate,
            detach_reset=detach,
            v_init=vr,
            return_state=True,
            backend=backend,
            memory=memory,
        )
        (spikes * torch.linspace(-1, 1, spikes.numel(), dtype=x.dtype).reshape(spikes.shape)).sum().add(
            state.square().sum()
        ).backward()
        outs[backend] = (spikes, state, xr.grad, vr.grad, dr.grad)
    ref, got = outs["reference"], outs["cpu"]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for a, b in zip(got[2:], ref[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------------
# gradcheck (float64): the state with a detached reset, where the exact derivative exists (see module docstring).


def _combo_id(combo) -> str:
    return spec_id(make_spec(*combo, Sigmoid(), False)).removesuffix("-sigmoid")


def _combo_cases(values: dict, jelly: list, paper_hard: dict | None = None) -> list:
    """``(combo, value)`` params over :func:`dynamics_combos` and ``values`` (value -> id): every value for the
    paper's and snnTorch's LIF, the ``jelly`` ones for SpikingJelly's ten forms (each a definition of its own on the
    engine, compiled per dtype and leak layout; the engine's tests cover the rest), and ``paper_hard``'s values
    for the paper's hard reset besides."""
    cases = [
        pytest.param(c, value, id=f"{_combo_id(c)}-{name}")
        for c in dynamics_combos()
        for value, name in values.items()
        if c[0] != P.SPIKINGJELLY or value in jelly
    ]
    hard = next(c for c in dynamics_combos() if c[:2] == (P.PAPER, P.HARD))
    return cases + [
        pytest.param(hard, value, id=f"{_combo_id(hard)}-{name}") for value, name in (paper_hard or {}).items()
    ]


@pytest.mark.parametrize("combo, per_channel", _combo_cases({True: "channel"}, [True], {False: "scalar"}))
def test_gradcheck_state_detached_reset(combo, per_channel):
    """Against finite differences, in the memory mode of the form's kernels in ``test_api_autograd_matches_reference``
    (:func:`_memory_of`)."""
    spec = make_spec(*combo, Sigmoid(), True, variant=1)
    x, leak, v = make_inputs((4, 2, 3), spec, torch.float64, 7, per_channel=per_channel, margin=1e-2)
    memory = _memory_of(combo)

    def state_of(x, leak, v):
        return P.run(x, leak, spec, v_init=v, backend="cpu", memory=memory)[1]

    inputs = tuple(t.clone().requires_grad_(True) for t in (x, leak, v))
    assert torch.autograd.gradcheck(state_of, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("surrogate", SURROGATES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_surrogate_formula_on_grid(surrogate, dtype):
    """T=1, v_init=0 (no reset yet): grad_x = grad_spikes * surrogate'(x - threshold) -- each formula on a grid, on
    the paper's LIF with a learnable per-channel decay (in float64 the kernels of ``test_lif_matches_reference``)."""
    spec = P.LIFCase(threshold=0.5, reset=P.HARD, surrogate=surrogate)
    u = torch.linspace(-3, 3, 2001, dtype=torch.float64)
    u = u[(u.abs() - surrogate.params()[0]).abs() > 1e-6] if isinstance(surrogate, Rectangle) else u
    x = (u + 0.5).to(dtype).reshape(1, -1).requires_grad_()  # [T=1, C]
    decay = torch.full((x.shape[1],), 0.9, dtype=dtype, requires_grad=True)
    spikes, _ = P.run(x, decay, spec, backend="cpu")
    spikes.backward(torch.ones_like(spikes))
    gx = x.grad
    u = x.detach()[0] - spec.threshold
    expected = surrogate.derivative(u).double()  # the same formula in the same dtype
    # float64: the kernels' exp2 polynomial is good to 8e-13 there (numba_common.EXP2_DEGREE), so 1e-11 holds.
    torch.testing.assert_close(gx[0].double(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-11, atol=1e-30)


def _tie_cases() -> list:
    """Every form in float64 with a per-channel leak (the kernels of the float64 cases above), the forms of
    ``_FAMILY_FORMS`` in float32 with a scalar leak too."""
    cases = []
    for combo in dynamics_combos():
        cases.append(pytest.param(combo, torch.float64, True, id=f"{_combo_id(combo)}-channel-f64"))
        if combo[:3] in _FAMILY_FORMS:
            cases.append(pytest.param(combo, torch.float32, False, id=f"{_combo_id(combo)}-scalar-f32"))
    return cases


@pytest.mark.parametrize("combo, dtype, per_channel", _tie_cases())
def test_potential_exactly_at_the_threshold(combo, dtype, per_channel):
    """Ties: the kernels fire by one comparison with a precomputed threshold (nextafter for snnTorch's ``>``).
    Potentials exactly at the threshold and one ulp either side -- at t = 0 (``h = x`` for the paper / snnTorch
    forms with v_init = 0) and as the previous step of t = 1 (its reset) -- give the reference's spikes, states
    and gradients."""
    spec = make_spec(*combo, Sigmoid(), False, variant=1)
    th = torch.tensor(spec.threshold, dtype=dtype)
    ties = torch.stack([torch.nextafter(th, th - 1), th, torch.nextafter(th, th + 1)])
    x = torch.stack([ties.repeat(3), ties.repeat_interleave(3)])  # [T=2, 9]: every pair of the three
    value = 0.5 if combo[2] in (P.CHARGE_MUL, P.CHARGE_MUL_INPUT) else 2.0
    leak = torch.full((9 if per_channel else 1,), value, dtype=dtype)
    v = torch.zeros(9, dtype=dtype)
    ref = _api_run(spec, x, leak, v, "spec", "potential")
    got = _api_run(spec, x, leak, v, "cpu", "potential")
    assert torch.equal(got[0], ref[0]), "spikes differ"
    assert torch.equal(got[1], ref[1]), "state differs"
    if combo[0] != P.SPIKINGJELLY:  # h[0] = x exactly: both rules are exercised at the tie
        assert got[0][0].tolist() == ([0, 0, 1] if spec.fire_strict else [0, 1, 1]) * 3
    for name, a, b in zip(("x.grad", "v_init.grad", "leak.grad"), got[2:], ref[2:]):
        _assert_close(a, b, name, **_tol(dtype, leak=name == "leak.grad"))


# ---------------------------------------------------------------------------------------------------------------
# Hypothesis: shapes, parameters, dtypes.

# the paper's LIF with the hard reset and the sigmoid (each definition x surrogate compiles kernels of its own; the
# others are covered above and by the engine's tests)
_ALL_SPECS = [
    spec
    for spec in (case.values[0] for case in SPECS)
    if (spec.dynamics, spec.reset, type(spec.surrogate)) == (P.PAPER, P.HARD, Sigmoid)
]
_HALF_TOL = {torch.float16: dict(rtol=4e-3, atol=1e-3), torch.bfloat16: dict(rtol=3e-2, atol=1e-2)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t_steps=st.integers(1, 5),
    trailing=st.lists(st.integers(1, 7), min_size=0, max_size=3),
    spec=st.sampled_from(_ALL_SPECS),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    per_channel=st.booleans(),
    memory=st.sampled_from(["potential", "recompute"]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes_and_dtypes(t_steps, trailing, spec, dtype, per_channel, memory, seed):
    shape = (t_steps, *trailing)
    per_channel = per_channel and len(shape) >= 2
    x, leak, v = make_inputs(shape, spec, dtype, seed, per_channel=per_channel)
    ref = _api_run(spec, x, leak, v, "spec", "potential")
    got = _api_run(spec, x, leak, v, "cpu", memory)
    assert got[0].dtype == dtype and got[0].shape == x.shape
    assert torch.equal(got[0], ref[0]), "spikes differ"
    assert torch.equal(got[1], ref[1]), "state differs"
    for name, a, b in zip(("x.grad", "v_init.grad", "leak.grad"), got[2:], ref[2:]):
        assert b is None or a.dtype == b.dtype, name
        tol = _HALF_TOL.get(dtype) or _tol(dtype, leak=name == "leak.grad")
        _assert_close(a.double(), None if b is None else b.double(), name, **tol)


# ---------------------------------------------------------------------------------------------------------------
# Continuation: one call over T steps == two calls with the state handed over.


@pytest.mark.parametrize("memory", ["potential", "recompute"])
@pytest.mark.parametrize("combo", dynamics_combos(), ids=_combo_id)
def test_continuation(combo, memory):
    spec = make_spec(*combo, Sigmoid(2.0), False, variant=2)  # Sigmoid: see _api_cases
    x, leak, v = make_inputs((8, 3, 4), spec, torch.float64, 11, per_channel=True)

    def run(chunks):
        xr = x.clone().requires_grad_(True)
        lr = leak.clone().requires_grad_(True)
        vr = v.clone().requires_grad_(True)
        state, outs = vr, []
        for part in torch.split(xr, chunks):
            s, state = P.run(part, lr, spec, v_init=state, backend="cpu", memory=memory)
            outs.append(s)
        spikes = torch.cat(outs)
        w = torch.linspace(-1, 1, spikes.numel(), dtype=x.dtype).reshape(spikes.shape)
        ((spikes * w).sum() + state.sum()).backward()
        return spikes, state, xr.grad, vr.grad, lr.grad

    whole, split = run(8), run(3)
    assert torch.equal(whole[0], split[0]) and torch.equal(whole[1], split[1])
    for a, b in zip(whole[2:], split[2:]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Threads; SpikingJelly's state before the reset.


def test_threads_follow_torch():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        spikefuse.lif(torch.randn(4, 100_000), decay=0.9, threshold=1.0, backend="cpu")
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_first_call_keeps_torch_threads():
    """Starting numba's OpenMP layer reset the OpenMP thread count torch shares: a ``torch.set_num_threads(1)``
    made before the first fused call was undone. Needs a fresh process, where numba has not started yet."""
    code = (
        "import torch, numba, spikefuse\n"
        "torch.set_num_threads(1)\n"
        "spikefuse.lif(torch.randn(4, 100_000), decay=0.9, threshold=1.0, backend='cpu')\n"
        "print(torch.get_num_threads(), numba.get_num_threads())\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="2", NUMBA_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["1", "1"]


@pytest.mark.parametrize("memory", ["potential", "recompute"])
@pytest.mark.parametrize("reset", [P.HARD, P.SOFT], ids=["hard", "soft"])
def test_spikingjelly_state_before_the_reset(reset, memory):
    """``state_post_reset=False``: SpikingJelly's charge handing on the membrane before the reset runs the
    definitions without a handoff (:data:`spikefuse.neurons.SPIKINGJELLY_PRE_RESET_MODELS`), whose first step resets
    a firing initial state: the reference's spikes and states, and its gradients; two calls equal one."""
    spec = make_spec(P.SPIKINGJELLY, reset, P.CHARGE_DIV_INPUT, False, Sigmoid(), False, variant=1)
    name = {P.HARD: "hard", P.SOFT: "soft"}[reset]
    assert spec.neuron().model is SPIKINGJELLY_PRE_RESET_MODELS[(name, "div_input")]
    x, leak, v = make_inputs((6, 2, 3, 4), spec, torch.float64, 19, per_channel=True)
    v = v + spec.threshold * (torch.rand(v.shape, generator=torch.Generator().manual_seed(5)) > 0.5)
    ref = _api_run(spec, x, leak, v, "spec", "potential")
    got = _api_run(spec, x, leak, v, "cpu", memory)
    assert torch.equal(got[0], ref[0]), "spikes differ"
    assert torch.equal(got[1], ref[1]), "state differs"
    for name, a, b in zip(("x.grad", "v_init.grad", "leak.grad"), got[2:], ref[2:]):
        _assert_close(a, b, name, **_tol(torch.float64, leak=name == "leak.grad"))
    first, state = P.run(x[:2], leak, spec, v_init=v, backend="cpu", memory=memory)
    second, state = P.run(x[2:], leak, spec, v_init=state, backend="cpu", memory=memory)
    assert torch.equal(torch.cat([first, second]), ref[0]) and torch.equal(state, ref[1])
