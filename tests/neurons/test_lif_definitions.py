"""The LIF definitions of :mod:`spikefuse.neurons.lif` on the neuron engine against the serial loop of the LIF spec
they were written from (:mod:`tests.lif_spec`, plain PyTorch): spikes
and states bit-identical, gradients of the input, the initial state and the decay to 1e-5; and which calls run
which. SpikingJelly's forms hand on the post-reset membrane (the definitions' handoff), so their states and the
gradients of those states go through it."""

import pytest
import torch

import spikefuse
import spikefuse.nn
from spikefuse.neurons import LIF_MODELS, SPIKINGJELLY_MODELS, NeuronModel
from spikefuse.surrogate import ATan, Sigmoid
from tests import lif_spec as P

pytest.importorskip("numba")

CASES = {  # (dynamics, reset) or ("spikingjelly", reset, charge) -> v_reset of the case
    ("paper", "hard"): -0.1,
    ("paper", "soft"): 0.0,
    ("paper", "none"): 0.0,
    ("snntorch", "soft"): 0.0,
    ("snntorch", "hard"): 0.0,
    ("snntorch", "none"): 0.0,
    **{
        ("spikingjelly", reset, charge): -0.1 if reset == "hard" else 0.0
        for reset in ("hard", "soft")
        for charge in ("if", "div_input", "div", "mul_input", "mul")
    },
    ("spikingjelly", "none", "div_input"): 0.0,  # no reset, no handoff (one form: the charges are the ones above)
}


def _spec_and_model(case, **spec_options) -> tuple[P.LIFCase, NeuronModel]:
    """The spec of a case (as the layers build it) and its definition."""
    if case[0] == "spikingjelly":
        _, reset, charge = case
        spec = P.LIFCase(reset=reset, dynamics=P.SPIKINGJELLY, charge=charge, state_post_reset=True, **spec_options)
        return spec, SPIKINGJELLY_MODELS[(reset, charge)]
    dynamics, reset = case
    return P.LIFCase(reset=reset, dynamics=dynamics, **spec_options), LIF_MODELS[case]


def _close(a, b, what):
    scale = max(float(b.abs().max()), 1e-6)
    err = float((a - b).abs().max())
    assert err <= 1e-5 * scale, f"{what}: max abs diff {err:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("detach", [False, True], ids=["reset-grad", "detach-reset"])
@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "-".join(c))
def test_engine_lif_equals_the_spec_reference(case, detach):
    """The engine's reference of every definition (``tests/ops/test_cpu.py`` runs every form's fused CPU kernels
    against the spec's loop, ``tests/test_functional.py`` the Triton kernels)."""
    _check(case, detach, False, "reference")


@pytest.mark.parametrize(
    "case", [("paper", "hard"), ("snntorch", "soft"), ("spikingjelly", "hard", "mul_input")], ids=lambda c: "-".join(c)
)
def test_per_channel_decay(case):
    _check(case, False, True, "cpu")


@pytest.mark.parametrize("case", [("paper", "hard"), ("spikingjelly", "soft", "div_input")], ids=lambda c: "-".join(c))
@pytest.mark.parametrize("detach", [False, True], ids=["reset-grad", "detach-reset"])
def test_memory_potential(case, detach):
    """The engine keeping the potentials in forward (the LIF layer's default) instead of recomputing them."""
    _check(case, detach, True, "cpu", memory="potential")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [("paper", "hard"), ("spikingjelly", "hard", "mul_input")], ids=lambda c: "-".join(c))
def test_half_precision_input(case, dtype):
    """float16 / bfloat16 inputs run in float32 on both sides: spikes (in the input's dtype) and float32 states bit
    for bit; the input's gradient in its dtype, where rounding the float32 gradients, which agree to 1e-5, may
    differ by one unit in the last place (the reference's half-precision x.grad is that of its float32 copy)."""
    _check(case, False, False, "cpu", dtype=dtype)


def _check(case, detach, per_channel, engine_backend, memory="recompute", dtype=torch.float32):
    v_reset, threshold = CASES[case], 0.5
    surrogate = Sigmoid(4.0) if case[0] == "paper" else ATan(2.0)
    g = torch.Generator().manual_seed(sum(map(ord, "".join(case))))
    x = (torch.rand(7, 3, 4, 9, generator=g) * 0.8).to(dtype)
    v0 = torch.rand(3, 4, 9, generator=g) * 0.7
    decay = torch.rand(4, generator=g) * 0.5 + 0.4 if per_channel else torch.tensor(0.8)
    upstream, upstream_state = torch.rand(x.shape, generator=g).to(dtype), torch.rand(v0.shape, generator=g)

    spec, model = _spec_and_model(case, threshold=threshold, v_reset=v_reset, surrogate=surrogate, detach_reset=detach)
    leaves_ref = [t.clone().requires_grad_() for t in (x, v0, decay)]
    spikes_ref, state_ref = P.run(leaves_ref[0], leaves_ref[2], spec, v_init=leaves_ref[1])

    leaves_engine = [t.clone().requires_grad_() for t in (x, v0, decay)]
    spikes_engine, (state_engine,) = spikefuse.neuron(
        leaves_engine[0],
        model,
        surrogate=surrogate,
        detach_reset=detach,
        state=(leaves_engine[1],),
        return_state=True,
        backend=engine_backend,
        memory=memory,
        decay=leaves_engine[2],
        threshold=threshold,
        v_reset=v_reset,
    )

    assert 0 < float(spikes_ref.detach().float().mean()) < 1, "the case must spike and not spike"
    assert spikes_engine.dtype == spikes_ref.dtype == dtype and state_engine.dtype == state_ref.dtype == torch.float32
    assert torch.equal(spikes_engine, spikes_ref)
    if engine_backend == "cpu":
        assert torch.equal(state_engine, state_ref)
    else:  # the serial PyTorch loop rounds like the kernels, except where torch fuses an operation
        torch.testing.assert_close(state_engine, state_ref, rtol=4 * torch.finfo(state_ref.dtype).eps, atol=0)
    for outputs, leaves in (((spikes_ref, state_ref), leaves_ref), ((spikes_engine, state_engine), leaves_engine)):
        torch.autograd.backward(outputs, (upstream, upstream_state))
    for name, a, b in zip(("x", "v_init", "decay"), leaves_engine, leaves_ref):
        if b.grad is None:  # IF: the decay does not enter the reference's dynamics
            assert name == "decay" and (a.grad is None or not a.grad.any()), name
        elif a.dtype == torch.float32:
            _close(a.grad, b.grad, f"grad {name}")
        else:  # the float32 gradients, rounded to the input's dtype
            torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=torch.finfo(a.dtype).eps, atol=1e-6)


def test_where_takes_the_spike_and_two_values():
    with pytest.raises(ValueError, match=r"where takes the spike and two values, where\(s, a, b\)"):
        NeuronModel(name="bad", states=("v",), params=(), step=(("v", "where(v, 0, v) + x"),), fire="v - 1")
    with pytest.raises(ValueError, match=r"where takes the spike and two values"):
        NeuronModel(name="bad", states=("v",), params=(), step=(("v", "where(s, 0) + x"),), fire="v - 1")
    with pytest.raises(ValueError, match=r"calls something other than exp, log, sqrt, heaviside of one argument"):
        NeuronModel(name="bad", states=("v",), params=(), step=(("v", "x"),), fire="where(s, v, 0) - 1")


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "-".join(c))
def test_spikefuse_lif_runs_the_definition(case):
    """The paper's, snnTorch's and SpikingJelly's LIF forms map to their definitions."""
    spec, model = _spec_and_model(case)
    assert spec.neuron().model is model


def test_lif_layer_gives_the_reference_results():
    """``spikefuse.nn.LIF`` (learnable per-channel decay, carried state) on the CPU against the loop of its spec:
    spikes and state bit for bit."""
    layer = spikefuse.nn.LIF(decay=0.7, threshold=0.6, learnable_decay=True, channels=4, stateful=True)
    x = torch.rand(5, 2, 4, 3, generator=torch.Generator().manual_seed(3))
    first, second = layer(x), layer(x)
    spec = P.LIFCase(threshold=0.6, surrogate=layer.surrogate)
    state = None
    for got in (first, second):
        spikes, state = P.run(x, layer.decay.detach(), spec, v_init=state)
        assert torch.equal(got, spikes)
    assert torch.equal(layer.state, state)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("v_reset", [-0.2, [-0.2, 0.1, 0.0]], ids=["scalar", "per-channel"])
def test_hard_reset_membrane_starts_at_v_reset_everywhere(backend, v_reset):
    """The hard-reset LIF's ``initial`` names ``v_reset``: ``spikefuse.neuron`` of its model starts where
    ``spikefuse.lif`` does (bit for bit); a ``v_reset`` that requires grad, per channel too, gets the gradient of
    the start, the fused kernels' against the reference's autograd."""
    model = LIF_MODELS[("paper", "hard")]
    g = torch.Generator().manual_seed(4)
    x = torch.rand(6, 2, 3, generator=g, dtype=torch.float64) * 0.8
    if isinstance(v_reset, float):
        expected = spikefuse.lif(x, decay=0.5, threshold=0.6, v_reset=v_reset, return_state=True)
        got = spikefuse.neuron(x, model, decay=0.5, threshold=0.6, v_reset=v_reset, return_state=True, backend=backend)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1][0], expected[1])
    grads = []
    for b in (backend, "reference"):
        v = torch.tensor(v_reset, dtype=torch.float64, requires_grad=True)
        xi = x.clone().requires_grad_()
        spikes, (state,) = spikefuse.neuron(
            xi, model, decay=0.5, threshold=0.6, v_reset=v, return_state=True, backend=b, surrogate="atan"
        )
        (spikes.sum() + (state**2).sum()).backward()
        grads.append((spikes, xi.grad, v.grad))
    assert grads[0][2].abs().sum() > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_record_without_the_start_parameter_says_so():
    from spikefuse.neurons import neuron_spec

    spec = neuron_spec(LIF_MODELS[("paper", "hard")], Sigmoid(4.0), False)
    with pytest.raises(ValueError, match="state v starts at the parameter v_reset, which this record does not fix"):
        spec.initial_states(torch.zeros(2, 3))
