"""The recurrent ``nn`` layers: the same spikes and gradients as :func:`spikefuse.recurrent` on the reference, their
recurrent weights learnt, per-neuron learnable parameters, kept states, errors."""

import pytest
import torch

import spikefuse
from spikefuse import nn as snn
from spikefuse.neurons import LIF_MODELS

LAYERS = {
    "lif": lambda **kw: snn.RecurrentLIF(6, decay=0.8, threshold=0.6, learnable=("decay",), channels=6, **kw),
    "lif_soft_one_to_one": lambda **kw: snn.RecurrentLIF(
        6, decay=0.8, threshold=0.6, v_reset=None, all_to_all=False, **kw
    ),
    "cuba": lambda **kw: snn.RecurrentCubaLIF(6, alpha=0.7, beta=0.8, threshold=0.5, learnable=("beta",), **kw),
    "alif": lambda **kw: snn.RecurrentALIF(6, decay=0.8, rho=0.9, b0=0.5, beta=0.3, bias=False, **kw),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_matches_reference(name):
    torch.manual_seed(0)
    ref = LAYERS[name](backend="reference")
    ours = LAYERS[name]()
    ours.load_state_dict(ref.state_dict())
    x = torch.rand(12, 3, 6, generator=torch.Generator().manual_seed(1)) * 0.8
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for layer in (ref, ours):
        xs = x.clone().requires_grad_()
        spikes = layer(xs)
        (spikes * upstream).sum().backward()
        grads.append((spikes, xs.grad, [p.grad for p in layer.parameters()]))
    (s1, g1, p1), (s2, g2, p2) = grads
    assert 0 < float(s1.detach().mean()) < 1 and torch.equal(s1, s2)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
    assert all(a is not None for a in p1)
    for a, b in zip(p2, p1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_module_is_the_functional_layer():
    layer = snn.RecurrentLIF(5, decay=0.9, threshold=0.7)
    x = torch.rand(7, 2, 5)
    want = spikefuse.recurrent(
        x,
        LIF_MODELS[("paper", "hard")],
        layer.recurrent.weight,
        layer.recurrent.bias,
        decay=0.9,
        threshold=0.7,
        v_reset=0.0,
        surrogate="sigmoid",
    )
    assert torch.equal(layer(x), want)


def test_stateful_layer_continues_and_resets():
    layer = snn.RecurrentCubaLIF(4, alpha=0.6, beta=0.9, threshold=0.4, stateful=True)
    whole = snn.RecurrentCubaLIF(4, alpha=0.6, beta=0.9, threshold=0.4)
    whole.load_state_dict(layer.state_dict())
    x = torch.rand(10, 2, 4)
    with torch.no_grad():
        assert torch.equal(torch.cat([layer(x[:3]), layer(x[3:])]), whole(x))
        assert len(layer.state) == 3  # i, v and the last spikes
        spikefuse.nn.reset_states(torch.nn.Sequential(layer))
        assert layer.state is None and torch.equal(layer(x), whole(x))


def test_errors():
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        snn.RecurrentLIF(0, decay=0.5)
    with pytest.raises(ValueError, match="decay must lie in"):
        snn.RecurrentLIF(3, decay=1.5)
    with pytest.raises(ValueError, match=r"takes input currents \[T, B, 3\]"):
        snn.RecurrentLIF(3, decay=0.5)(torch.rand(4, 2, 5))
    with pytest.raises(ValueError, match="unknown reset"):
        snn.RecurrentCubaLIF(3, 0.5, 0.5, reset="hard-ish")
