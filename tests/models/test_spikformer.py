"""spikefuse's Spikformer against SpikingJelly's zoo Spikformer (same weights: same outputs and gradients), the
attention's spike product against its reference, the lean form's conversions, and the size checks."""

import pytest
import torch

from spikefuse.models import build_model
from spikefuse.models.spikformer import (
    from_spikingjelly_state_dict,
    spike_attention,
    spike_attention_reference,
    spikformer_tiny,
)
from spikefuse.nn import LIF, NeuronFactory, to_lean
from spikefuse.surrogate import Sigmoid

ZOO = dict(T=2, img_size_h=32, img_size_w=32, patch_size=4, num_classes=10, embed_dims=64, num_heads=4, depths=1)


def _zoo(**neuron):
    zoo = pytest.importorskip("spikingjelly.activation_based.model.spikformer")
    torch.manual_seed(0)
    return zoo.Spikformer(**ZOO, **neuron)


def _ours_from(zoo, **kw):
    ours = spikformer_tiny(3, 10, **kw)
    ours.load_state_dict(from_spikingjelly_state_dict(zoo.state_dict()))  # strict: every key maps
    return ours


def test_default_neurons_give_the_zoo_models_outputs():
    """The zoo's own LIFNode (tau=2, input halved) against spikefuse's LIF with the potential scaled by tau: the
    charge rounds differently, but no potential lies within a rounding of its threshold here, so every spike and
    thus the head's output (the same ops on the same spikes) is equal."""
    zoo = _zoo()
    ours = _ours_from(zoo)
    x = torch.rand(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(x), zoo(x))


def test_same_neurons_give_the_zoo_models_outputs_and_gradients_bit_for_bit():
    """The zoo with spikefuse's SpikingJelly ``LIFNode`` (``decay_input=False``: ``v = v/2 + x``, spikefuse's
    LIF with decay 1/2) runs the same operations: outputs and every gradient equal bit for bit."""
    pytest.importorskip("spikingjelly")
    from spikefuse.compat.spikingjelly import LIFNode

    neuron = dict(tau=2.0, decay_input=False, v_threshold=1.0, detach_reset=True, surrogate_function=Sigmoid(4.0))
    zoo = _zoo(spiking_neuron=LIFNode, **neuron)
    ours = _ours_from(
        zoo, neuron=NeuronFactory(LIF, dict(decay=0.5, threshold=1.0, surrogate=Sigmoid(4.0), detach_reset=True))
    )
    x = torch.rand(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    xz, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yz, yo = zoo(xz), ours(xo)
    assert torch.equal(yo, yz)
    yz.square().sum().backward()
    yo.square().sum().backward()
    assert torch.equal(xo.grad, xz.grad)
    zoo_grads = from_spikingjelly_state_dict({n: p.grad for n, p in zoo.named_parameters()})
    ours_grads = dict((n, p.grad) for n, p in ours.named_parameters())
    assert zoo_grads.keys() == ours_grads.keys()
    for name, g in ours_grads.items():
        assert torch.equal(g, zoo_grads[name]), name


def test_spike_attention_is_exact_against_its_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.rand(2, 3, 8, 20, generator=g) < 0.3).float().requires_grad_() for _ in range(3))
    got, want = spike_attention(q, k, v, 0.125), spike_attention_reference(q, k, v, 0.125)
    assert torch.equal(got, want)
    grad = torch.randn(got.shape, generator=g)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads):  # real-valued gradients: summed in another order
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


def test_lean_form_fuses_every_batchnorm_before_a_neuron():
    counts = to_lean(spikformer_tiny(3, 10, embed_dims=16, num_heads=2))
    # BN+LIF: SPS stages 1-2 (3-4 pool first), the position embedding, Q/K/V, projection, both MLP layers.
    assert counts["bn_lif"] == 7
    # recomputed convs reading real values: the first stage's (on the image), Q/K/V's and the MLP's first.
    assert counts["conv_bn_lif"] == 3
    # convs reading spikes: SPS stages 2-4, the position embedding, the projection, the MLP's second.
    assert counts["spike_layers"] == 6
    assert counts["recompute_neurons"] == 3  # after the two max-pools, and the attention neuron


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="patch_size"):
        spikformer_tiny(patch_size=3)
    with pytest.raises(ValueError, match="multiples of 4"):
        spikformer_tiny(image_size=30)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        spikformer_tiny(embed_dims=24, num_heads=5)
    model = build_model("spikformer_tiny", 1, 10, embed_dims=16, num_heads=2, image_size=(28, 28))
    assert model(torch.rand(1, 2, 1, 28, 28)).shape == (1, 2, 10)  # MNIST: a 7x7 token grid
    with pytest.raises(ValueError, match=r"\[T, B, 1, H, W\]"):
        model(torch.rand(2, 1, 28, 28))
    with pytest.raises(ValueError, match="built for"):
        model(torch.rand(1, 2, 1, 32, 32))
