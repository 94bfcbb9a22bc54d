"""The one-step kernels (:mod:`spikefuse.ops.engine.step`) against the reference's step: spikes and states bit for bit
in float32, gradients to 1e-5, gradcheck in float64; a step with a handoff, a reset in the step, several states, per
neuron parameters, a recurrent current; non-finite input refused; which calls take this path."""

from __future__ import annotations

import pytest
import torch

from spikefuse.neurons import (
    ALIF_MODEL,
    CUBA_LIF_MODELS,
    LIF_MODELS,
    SNNTORCH_NO_DELAY_MODELS,
    SPIKINGJELLY_MODELS,
    neuron_spec,
)
from spikefuse.ops.nonfinite import NonFiniteError
from spikefuse.ops.engine import reference, step
from spikefuse.surrogate import ATan, Sigmoid

MODELS = {
    "lif_soft": LIF_MODELS[("paper", "soft")],
    "leaky_subtract": LIF_MODELS[("snntorch", "soft")],
    "cuba_lif": CUBA_LIF_MODELS["subtract"],
    "alif": ALIF_MODEL,
    "sj_hard_div_input": SPIKINGJELLY_MODELS[("hard", "div_input")],  # a handoff
    "leaky_subtract_no_delay": SNNTORCH_NO_DELAY_MODELS[("leaky", "subtract")],  # a handoff and a reset signal
}


def _inputs(model, shape, dtype, per_neuron: bool, recurrent: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.rand(*s, generator=g, dtype=dtype)  # noqa: E731
    x = (rand(*shape) * 2 - 0.5).requires_grad_()
    x_rec = (rand(*shape) - 0.5).requires_grad_() if recurrent else None
    defaults = dict(model.defaults)
    params = []
    for p in model.params:
        value = {"threshold": 0.7, "v_th": 0.7, "b0": 0.7}.get(p, defaults.get(p, 0.5))
        params.append(torch.tensor(float(value), dtype=dtype).requires_grad_())
    if per_neuron:  # the first parameter one value per neuron of a row
        params[0] = (rand(shape[-1]) * 0.5 + 0.4).requires_grad_()
    states = [(rand(*shape) * 1.2 - 0.2).requires_grad_() for _ in model.states]
    return x, x_rec, params, states


def _reference(model, x, x_rec, params, states, surrogate, detach_reset):
    """The reference's one step of the same values, ``[spikes, *states]`` of ``x``'s shape."""
    n, shape = x.numel(), x.shape
    flat = [p.expand(shape).reshape(-1) if p.ndim else p.reshape(1) for p in params]  # one value per neuron, or one
    recurrent = None if x_rec is None else ((lambda _s: x_rec.reshape(-1)), x.new_zeros(n))
    spikes, final = reference.run(
        model, x.reshape(1, n), flat, 1, [v.reshape(-1) for v in states], surrogate, detach_reset, recurrent=recurrent
    )
    return [spikes[0].reshape(shape), *(v.reshape(shape) for v in final)]


def _leaves(x, x_rec, params, states):
    return [x, *([x_rec] if x_rec is not None else []), *params, *states]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("detach_reset", [False, True])
@pytest.mark.parametrize("recurrent", [False, True])
def test_step_equals_the_reference(name, detach_reset, recurrent):
    model, surrogate = MODELS[name], ATan(2.0)
    x, x_rec, params, states = _inputs(model, (3, 5), torch.float32, per_neuron=True, recurrent=recurrent, seed=1)
    got = step.step(neuron_spec(model, surrogate, detach_reset), x, params, states, x_rec=x_rec)
    want = _reference(model, x, x_rec, params, states, surrogate, detach_reset)
    assert 0 < float(got[0].detach().mean()) < 1, "degenerate input: all or no spikes"
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)
    weights = [torch.rand(a.shape, generator=torch.Generator().manual_seed(i)) for i, a in enumerate(got)]
    leaves = _leaves(x, x_rec, params, states)
    grads = [
        torch.autograd.grad(sum((a * w).sum() for a, w in zip(out, weights)), leaves, allow_unused=True)
        for out in (got, want)
    ]
    for a, b, leaf in zip(*grads, leaves):
        a = torch.zeros_like(leaf) if a is None else a
        b = torch.zeros_like(leaf) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["leaky_subtract", "alif", "sj_hard_div_input", "leaky_subtract_no_delay"])
def test_step_gradcheck_in_float64(name):
    """The states with a detached reset, the output with an exact derivative (a spike's backward is the surrogate's
    by design), as a function of every input."""
    model, surrogate = MODELS[name], Sigmoid(4.0)
    x, x_rec, params, states = _inputs(model, (2, 3), torch.float64, per_neuron=True, recurrent=True, seed=2)
    k = len(params)

    def new_states(x, x_rec, *rest):
        return tuple(step.step(neuron_spec(model, surrogate, True), x, list(rest[:k]), list(rest[k:]), x_rec=x_rec)[1:])

    assert torch.autograd.gradcheck(new_states, (x, x_rec, *params, *states), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_odd_shapes_one_neuron_and_half_precision():
    model, surrogate = MODELS["cuba_lif"], ATan(2.0)
    for shape in [(1,), (1, 1), (2, 3, 5, 7)]:
        x, _, params, states = _inputs(model, shape, torch.float32, per_neuron=False, recurrent=False, seed=3)
        got = step.step(neuron_spec(model, surrogate, False), x, params, states)
        want = _reference(model, x, None, params, states, surrogate, False)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    x = torch.rand(4, 6, dtype=torch.float16) * 2
    states = [torch.rand(4, 6) for _ in model.states]
    params = [torch.tensor(0.5), torch.tensor(0.8), torch.tensor(0.7)][: len(model.params)]
    spikes, *new = step.step(neuron_spec(model, surrogate, True), x, params, states)
    want = _reference(model, x.float(), None, params, states, surrogate, True)
    assert spikes.dtype == torch.float16 and torch.equal(spikes.float(), want[0])
    assert all(v.dtype == torch.float32 and torch.equal(v, w) for v, w in zip(new, want[1:]))


def test_non_finite_input_is_refused_by_name():
    model, surrogate = MODELS["leaky_subtract"], ATan(2.0)
    x, _, params, states = _inputs(model, (2, 4), torch.float32, per_neuron=False, recurrent=False, seed=4)
    bad = x.detach().clone()
    bad[1, 2] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN"):
        step.step(neuron_spec(model, surrogate, True), bad, params, states)
    states[0] = states[0].detach().clone()
    states[0][0, 0] = float("inf")
    with pytest.raises(NonFiniteError):
        step.step(neuron_spec(model, surrogate, True), x, params, states)


def test_states_are_tensors_of_their_own_and_double_backward_is_refused():
    model, surrogate = MODELS["leaky_subtract"], ATan(2.0)
    x, _, params, states = _inputs(model, (2, 4), torch.float32, per_neuron=False, recurrent=False, seed=5)
    spikes, v = step.step(neuron_spec(model, surrogate, True), x, params, states)
    assert v._base is None  # detachable in place (snnTorch's detach_hidden)
    with pytest.raises(RuntimeError, match="double backward .* first-order gradients only"):
        torch.autograd.grad(spikes.sum() + v.sum(), x, create_graph=True)


def test_which_calls_take_the_step():
    x = torch.rand(4, 8)
    assert step.takes("auto", x) and step.takes("cpu", x)
    assert not step.takes("reference", x)
    assert not step.takes("auto", x.to(torch.int64))
    assert not step.takes("auto", torch.rand(step.MAX_NEURONS + 1))  # the fused kernels' threads pay there
