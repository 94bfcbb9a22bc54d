"""Recurrent layers (:func:`spikefuse.recurrent`) on every generated backend (numba; Triton through its interpreter)
against the reference: the engine's serial PyTorch loop with the recurrent current, differentiated by autograd.

Spikes and final states bit-identical in float32 and float64; gradients of the input, the recurrent weight and
bias, learnable parameters, the initial states and spikes within 1e-5 relative (float64; float32 for LIF);
gradcheck in float64; all-to-all and one-to-one weights; both memory modes; T=1, H=1, odd sizes; a run split in two
calls through the returned state equals one call; the neurons of LIF, snnTorch's Leaky, CubaLIF, ALIF, a
SpikingJelly form (a handoff) and one defined in this file whose derivatives read the input.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (conftest may have chosen the GPU)

import pytest
import torch

import spikefuse
from spikefuse.neurons import (
    ALIF_MODEL,
    CUBA_LIF,
    LIF_MODELS,
    SNNTORCH_NO_DELAY_MODELS,
    SPIKINGJELLY_MODELS,
    NeuronModel,
)
from spikefuse.ops.recurrent import autograd as recurrent_autograd
from tests.ops.cases import recurrent_gradcheck

# Only here: a LIF whose input passes a learnable gain, so the derivatives read the input (the step's current).
GAIN_LIF = NeuronModel(
    name="test_gain_lif",
    states=("v",),
    params=("decay", "gain", "threshold"),
    step=(("v", "decay*v + gain*x - s*threshold"),),
    fire="v - threshold",
    defaults=(("threshold", 1.0),),
)

MODELS = {
    "lif_hard": (LIF_MODELS[("paper", "hard")], {"decay": 0.8, "threshold": 0.7, "v_reset": -0.1}),
    "leaky": (LIF_MODELS[("snntorch", "soft")], {"decay": 0.9, "threshold": 0.8}),
    "cuba_lif": (CUBA_LIF, {"alpha": 0.8, "beta": 0.7, "threshold": 0.9}),
    "alif": (ALIF_MODEL, {"decay": 0.8, "rho": 0.9, "b0": 0.6, "beta": 0.4}),
    "sj_hard_mul_input": (SPIKINGJELLY_MODELS[("hard", "mul_input")], {"decay": 0.6, "threshold": 0.7}),
    "gain_lif": (GAIN_LIF, {"decay": 0.85, "gain": 1.3, "threshold": 0.9}),
    # heaviside in the step and its derivatives, a constant in the handoff
    "rleaky_zero_no_delay": (SNNTORCH_NO_DELAY_MODELS[("rleaky", "zero")], {"decay": 0.85, "threshold": 0.7}),
}
BACKENDS = ("cpu", "triton")


def _inputs(t_steps, batch, hidden, dtype, all_to_all, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t_steps, batch, hidden, generator=g, dtype=dtype) * 0.8 + 0.3
    shape = (hidden, hidden) if all_to_all else (hidden,)
    weight = torch.randn(shape, generator=g, dtype=dtype) * (0.6 / hidden**0.5 if all_to_all else 0.5)
    bias = torch.randn(hidden, generator=g, dtype=dtype) * 0.1
    return x, weight, bias


def _close(got, want, name):
    scale = max(float(want.abs().max()), 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7 * scale, msg=lambda m: f"{name}: {m}")


def _run_with_grads(model, params, backend, memory, x, weight, bias, learn, state, upstream):
    """Spikes, final state and the gradients of every input of one call."""
    x = x.clone().requires_grad_()
    weight, bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    tensors = {p: torch.tensor(v, dtype=x.dtype, requires_grad=True) if p in learn else v for p, v in params.items()}
    state = None if state is None else tuple(v.clone().requires_grad_() for v in state)
    spikes, final = spikefuse.recurrent(
        x, model, weight, bias, state=state, return_state=True, backend=backend, memory=memory, **tensors
    )
    loss = (spikes * upstream).sum() + sum((v * (i + 1.5)).sum() for i, v in enumerate(final[:-1]))
    leaves = [x, weight, bias, *(tensors[p] for p in learn), *(state or ())]
    return spikes, final, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("memory", ["recompute", "potential"])
@pytest.mark.parametrize("all_to_all", [True, False], ids=["all_to_all", "one_to_one"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_reference_fp64(name, backend, all_to_all, memory):
    model, params = MODELS[name]
    x, weight, bias = _inputs(9, 3, 5, torch.float64, all_to_all)
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(x.shape, generator=g, dtype=x.dtype)
    # a state given as tensors: the gradients of the initial states and spikes too
    state = (
        *(torch.rand(3, 5, generator=g, dtype=x.dtype) * 0.5 for _ in model.states),
        (torch.rand(3, 5, generator=g) < 0.3).to(x.dtype),
    )
    learn = [p for p in params if p != "threshold"]
    want = _run_with_grads(model, params, "reference", memory, x, weight, bias, learn, state, upstream)
    got = _run_with_grads(model, params, backend, memory, x, weight, bias, learn, state, upstream)
    assert want[0].sum() > 0, "no spike: the test would not test the recurrence"
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    names = ["x", "weight", "bias", *learn, *model.states, "spikes"]
    for name_, a, b in zip(names, got[2], want[2]):
        _close(a, b, name_)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_bit_identical_fp32(name, backend):
    model, params = MODELS[name]
    for all_to_all in (True, False):
        x, weight, bias = _inputs(12, 4, 7, torch.float32, all_to_all, seed=3)
        want, want_state = spikefuse.recurrent(x, model, weight, bias, return_state=True, backend="reference", **params)
        got, got_state = spikefuse.recurrent(
            x, model, weight, bias, return_state=True, backend=backend, memory="potential", **params
        )
        assert want.sum() > 0
        assert torch.equal(got, want)
        for a, b in zip(got_state, want_state):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lif_gradients_fp32(backend):
    model, params = MODELS["leaky"]
    x, weight, bias = _inputs(20, 4, 16, torch.float32, True, seed=4)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    want = _run_with_grads(model, params, "reference", "recompute", x, weight, bias, ["decay"], None, upstream)
    got = _run_with_grads(model, params, backend, "recompute", x, weight, bias, ["decay"], None, upstream)
    assert torch.equal(got[0], want[0])
    for name, a, b in zip(["x", "weight", "bias", "decay"], got[2], want[2]):
        _close(a, b, name)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 3, 5), (6, 1, 1), (5, 2, 1), (4, 1, 9)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_small_shapes(backend, shape):
    model, params = MODELS["lif_hard"]
    x, weight, bias = _inputs(*shape, torch.float64, True, seed=6)
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    want = _run_with_grads(model, params, "reference", "recompute", x, weight, bias, ["decay"], None, upstream)
    got = _run_with_grads(model, params, backend, "recompute", x, weight, bias, ["decay"], None, upstream)
    assert torch.equal(got[0], want[0])
    for name, a, b in zip(["x", "weight", "bias", "decay"], got[2], want[2]):
        _close(a, b, name)


@pytest.mark.parametrize("backend", ("reference", *BACKENDS))
def test_gradcheck_fp64(backend):
    """With a narrow rectangle surrogate and no membrane near the threshold, the spikes are locally constant and
    their surrogate derivative 0, so the outputs are smooth in every input: gradcheck against finite differences,
    through the recurrent weight (spikes present), bias and parameters."""
    model, params = MODELS["cuba_lif"]
    x, weight, bias = _inputs(6, 2, 4, torch.float64, True, seed=11)
    recurrent_gradcheck(model, params, x, weight, bias, backend)


@pytest.mark.parametrize("backend", ("reference", *BACKENDS))
@pytest.mark.parametrize("name", ["alif", "sj_hard_mul_input"])
def test_continuation_through_the_state(name, backend):
    model, params = MODELS[name]
    x, weight, bias = _inputs(10, 2, 6, torch.float32, True, seed=8)
    kw = dict(backend=backend, return_state=True, **params)
    whole, whole_state = spikefuse.recurrent(x, model, weight, bias, **kw)
    first, state = spikefuse.recurrent(x[:4], model, weight, bias, **kw)
    second, last = spikefuse.recurrent(x[4:], model, weight, bias, state=state, **kw)
    assert whole.sum() > 0
    assert torch.equal(torch.cat([first, second]), whole)
    for a, b in zip(last, whole_state):
        assert torch.equal(a, b)
    as_dict = spikefuse.recurrent(
        x[4:], model, weight, bias, state=dict(zip((*model.states, "spikes"), state)), backend=backend, **params
    )
    assert torch.equal(as_dict, second)


def test_one_autograd_node_for_all_steps():
    model, params = MODELS["leaky"]
    x, weight, bias = _inputs(30, 2, 4, torch.float32, True)
    spikes = spikefuse.recurrent(x.requires_grad_(), model, weight.requires_grad_(), bias, backend="cpu", **params)
    assert type(spikes.grad_fn).__name__ == "_EagerRecurrentBackward"
    assert spikes.grad_fn.next_functions[0][0] is not None  # straight to x's accumulator: no node per step


def test_keeps_bits_and_states_only():
    """Kept for backward: the spikes as bits, the input (recompute) or the states the backward reads (potential),
    the parameters and initial states, the weight; nothing of size T*B*H per step besides."""
    model, params = MODELS["leaky"]
    x, weight, bias = _inputs(40, 8, 16, torch.float32, True)
    for memory in ("recompute", "potential"):
        spikes = spikefuse.recurrent(
            x.clone().requires_grad_(), model, weight.requires_grad_(), bias, backend="cpu", memory=memory, **params
        )
        sizes = sorted(t.nbytes for t in spikes.grad_fn.saved_tensors if t is not None)
        assert sizes[-1] == x.nbytes and x.nbytes // 32 in sizes and sizes[-2] < x.nbytes / 16, (memory, sizes)


def test_errors():
    model, params = MODELS["leaky"]
    x, weight, bias = _inputs(3, 2, 4, torch.float32, True)
    with pytest.raises(ValueError, match=r"x must be \[T, B, H\]"):
        spikefuse.recurrent(x[:, 0], model, weight, **params)
    with pytest.raises(ValueError, match=r"weight must be \[H, H\] \(all to all\) or \[H\]"):
        spikefuse.recurrent(x, model, weight[:3], **params)
    with pytest.raises(ValueError, match=r"bias must be None or a tensor of shape \[H\]"):
        spikefuse.recurrent(x, model, weight, bias[:2], **params)
    with pytest.raises(ValueError, match="state must be a tuple of 2 tensors"):
        spikefuse.recurrent(x, model, weight, state=(torch.zeros(2, 4),), **params)
    with pytest.raises(ValueError, match="state spikes must be a tensor of shape"):
        spikefuse.recurrent(x, model, weight, state=(torch.zeros(2, 4), torch.zeros(3, 4)), **params)
    with pytest.raises(ValueError, match="T=0"):
        spikefuse.recurrent(x[:0], model, weight, **params)
    with pytest.raises(TypeError, match="needs the parameter 'decay'"):
        spikefuse.recurrent(x, model, weight)
    spikes = spikefuse.recurrent(x.requires_grad_(), model, weight, backend="cpu", **params)
    with pytest.raises(RuntimeError, match="double backward .* use backend='reference'"):
        torch.autograd.grad(spikes.sum(), x, create_graph=True)


def test_half_precision_runs_in_float32():
    model, params = MODELS["leaky"]
    x, weight, bias = _inputs(5, 2, 8, torch.float32, True)
    half = x.to(torch.bfloat16)
    got = spikefuse.recurrent(half, model, weight, bias, backend="cpu", **params)
    want = spikefuse.recurrent(half.float(), model, weight, bias, backend="reference", **params)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want)


def test_backend_modules_share_entry_points():
    from spikefuse.ops.recurrent import cpu, triton

    names = ("bind_forward", "replay", "bind_backward", "initial", "handoff", "handoff_grad", "kernels")
    for module in (cpu, triton):
        assert all(callable(getattr(module, n)) for n in names)
    assert recurrent_autograd.backend_module("cpu") is cpu
