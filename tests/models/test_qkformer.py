"""spikefuse's QKFormer against SpikingJelly's zoo model (same weights: same spikes, outputs and gradients), the
lean form against the default form, and the configuration checks."""

import pytest
import torch

from spikefuse.models import build_model
from spikefuse.models.qkformer import from_spikingjelly_state_dict, qkformer_tiny
from spikefuse.nn import to_lean
from tests.batchnorm.test_lean import _assert_same_training
from tests.models.zoo import assert_same_neurons_give_the_zoo_models_outputs, head_inputs

ZOO = dict(T=2, in_channels=3, num_classes=10, embed_dims=64, num_heads=(2, 4, 4), depths=(1, 1, 1))


def _zoo(**kw):
    zoo = pytest.importorskip("spikingjelly.activation_based.model.qkformer")
    torch.manual_seed(0)
    return zoo.QKFormer(**{**ZOO, **kw})


def _ours_from(zoo, **kw):
    ours = qkformer_tiny(3, 10, **kw)
    ours.load_state_dict(from_spikingjelly_state_dict(zoo.state_dict()))  # strict: every key maps
    return ours


def _image():
    return torch.rand(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("qka_type", ["token", "channel"])
def test_default_neurons_give_the_zoo_models_features_and_outputs(qka_type):
    """The zoo's own LIFNode (input halved) against spikefuse's LIF with the potential scaled by tau: every spike
    is equal here, so is the head's input (the zoo's is its mean over T; its head runs once on that mean, ours at
    every step, so the outputs agree to rounding)."""
    zoo = _zoo(qka_type=qka_type)
    ours = _ours_from(zoo, qka_type=qka_type)
    assert list(from_spikingjelly_state_dict(zoo.state_dict())) == list(ours.state_dict())  # the zoo's order
    zoo_head, ours_head = head_inputs(zoo), head_inputs(ours)
    x = _image()
    y_zoo, y = zoo(x), ours(x)
    assert ours_head[0].abs().sum() > 0
    assert torch.equal(ours_head[0].mean(0), zoo_head[0])
    torch.testing.assert_close(y.mean(0), y_zoo, rtol=1e-6, atol=1e-6)


def test_same_neurons_give_the_zoo_models_outputs_and_gradients():
    """The zoo with spikefuse's SpikingJelly ``LIFNode`` (``decay_input=False``: spikefuse's LIF with decay 1/2)
    runs the same operations up to the head's order: the same outputs and gradients to rounding."""
    pytest.importorskip("spikingjelly")
    assert_same_neurons_give_the_zoo_models_outputs(_zoo, _ours_from, _image, from_spikingjelly_state_dict)


def test_lean_form_fuses_every_batchnorm_before_a_neuron_and_trains_as_the_default_form():
    kw = dict(embed_dims=32, num_heads=(1, 2, 2), depths=(1, 1, 1))
    # In float64: the zoo's conv biases before a BatchNorm have gradients that are 0 but for rounding, which in
    # float32 reaches 1e-6 of the largest gradient.
    torch.manual_seed(0)
    default = qkformer_tiny(3, 10, **kw).double()
    torch.manual_seed(0)
    lean = qkformer_tiny(3, 10, **kw).double()
    counts = to_lean(lean)
    # per patch embedding its last BN and its shortcut's; per block the attention's two and the MLP's two
    assert counts["bn_lif"] == 3 * 2 + 3 * 4
    # convs on the residual stream before a fused BN+neuron: the last two shortcuts; per block Q/K (Q/K/V) and fc1
    assert counts["conv_bn_lif"] == 2 + 3 * 2
    # convs reading spikes: the first patch embedding's conv2, conv3 and shortcut, the next two's conv2; per block
    # the projection and fc2
    assert counts["spike_layers"] == 3 + 2 + 3 * 2
    assert counts["recompute_neurons"] == 2 + 1 + 1 + 3  # the neurons after a max-pool; the attention neurons
    x = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    saved_default, saved_lean = _assert_same_training(default, lean, x, torch.tensor([1, 7, 3]))
    # Not half: the first patch embedding's BN -> max-pool -> neuron (the zoo's order) keeps the BN's output and the
    # pool's indices, and the attentions' products keep their spike operands as floats.
    assert saved_lean < 0.65 * saved_default, f"lean saves {saved_lean} bytes, the default form {saved_default}"


def test_bad_configurations_and_inputs_are_refused():
    with pytest.raises(ValueError, match="one value per stage"):
        qkformer_tiny(depths=(1, 1))
    with pytest.raises(ValueError, match="multiple of 4 and at least 8"):
        qkformer_tiny(embed_dims=30)
    with pytest.raises(ValueError, match="stage 2's 32 channels must be divisible by its num_heads 3"):
        qkformer_tiny(num_heads=(2, 3, 4))
    with pytest.raises(ValueError, match="depths must be >= 0"):
        qkformer_tiny(depths=(1, -1, 1))
    with pytest.raises(ValueError, match="qka_type must be one of"):
        qkformer_tiny(qka_type="head")
    model = build_model("qkformer_tiny", 1, 10, embed_dims=16, num_heads=(1, 1, 2), image_size=(28, 28))
    assert model(torch.rand(1, 2, 1, 28, 28)).shape == (1, 2, 10)  # MNIST: 7x7, 4x4 and 2x2 tokens
    with pytest.raises(ValueError, match=r"\[T, B, 1, H, W\]"):
        model(torch.rand(2, 1, 28, 28))
    with pytest.raises(ValueError, match="built for"):
        model(torch.rand(1, 2, 1, 32, 32))
