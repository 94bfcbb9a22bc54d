"""spikefuse's Spike-driven Transformer against SpikingJelly's zoo model (same weights: same spikes, outputs and
gradients), the lean form against the default form, and the configuration checks."""

import pytest
import torch

from spikefuse.models import build_model
from spikefuse.models.spike_driven_transformer import from_spikingjelly_state_dict, sdt_tiny
from spikefuse.nn import to_lean
from tests.batchnorm.test_lean import _assert_same_training
from tests.models.zoo import assert_same_neurons_give_the_zoo_models_outputs, head_inputs

ZOO = dict(T=2, in_channels=3, num_classes=10, embed_dims=64, num_heads=4, depths=1, pooling_stat="0011")


def _zoo(**neuron):
    zoo = pytest.importorskip("spikingjelly.activation_based.model.spike_driven_transformer")
    torch.manual_seed(0)
    return zoo.SpikeDrivenTransformer(**ZOO, **neuron)


def _ours_from(zoo, **kw):
    ours = sdt_tiny(3, 10, **kw)
    ours.load_state_dict(from_spikingjelly_state_dict(zoo.state_dict()))  # strict: every key maps
    return ours


def _image():
    return torch.rand(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_default_neurons_give_the_zoo_models_spikes_and_outputs():
    """The zoo's own LIFNode (input halved) against spikefuse's LIF with the potential scaled by tau: every spike
    is equal here, up to the head's input (the zoo's is its mean over T; its head runs once on that mean, ours at
    every step, so the outputs agree to rounding)."""
    zoo = _zoo()
    ours = _ours_from(zoo)
    assert list(from_spikingjelly_state_dict(zoo.state_dict())) == list(ours.state_dict())  # the zoo's order
    zoo_head, ours_head = head_inputs(zoo), head_inputs(ours)
    x = _image()
    y_zoo, y = zoo(x), ours(x)
    assert 0 < ours_head[0].mean() < 1
    assert torch.equal(ours_head[0].mean(0), zoo_head[0])
    torch.testing.assert_close(y.mean(0), y_zoo, rtol=1e-6, atol=1e-6)


def test_same_neurons_give_the_zoo_models_outputs_and_gradients():
    """The zoo with spikefuse's SpikingJelly ``LIFNode`` (``decay_input=False``: spikefuse's LIF with decay 1/2)
    runs the same operations up to the head's order and the layout of the attention's sum over tokens: the same
    spikes, outputs and gradients to rounding."""
    pytest.importorskip("spikingjelly")
    assert_same_neurons_give_the_zoo_models_outputs(_zoo, _ours_from, _image, from_spikingjelly_state_dict)


def test_lean_form_fuses_every_batchnorm_before_a_neuron_and_trains_as_the_default_form():
    kw = dict(embed_dims=16, num_heads=2, depths=2)
    # In float64: the zoo's conv biases before a BatchNorm have gradients that are 0 but for rounding, which in
    # float32 reaches 1e-6 of the largest gradient.
    torch.manual_seed(0)
    default = sdt_tiny(3, 10, **kw).double()
    torch.manual_seed(0)
    lean = sdt_tiny(3, 10, **kw).double()
    counts = to_lean(lean)
    assert counts["bn_lif"] == 3 + 2 * (3 + 1)  # the patch stages; per block Q, K, V and the MLP's first BN
    assert counts["conv_bn_lif"] == 1  # the first stage's conv, on the image
    # convs reading spikes: patch stages 2-3, the final stage, the position embedding; per block Q, K, V, the
    # projection, both MLP convs; the head.
    assert counts["spike_layers"] == 4 + 2 * 6 + 1
    # the third stage's max-pool ("0011"), after its neuron, is a spike max-pool in the default form already; the
    # final stage's pools BN output
    assert counts["pools"] == 0
    assert counts["recompute_neurons"] == 1 + 2 * 3 + 1  # final_lif; shortcut, attention, lif1 per block; head's
    x = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    saved_default, saved_lean = _assert_same_training(default, lean, x, torch.tensor([1, 7, 3]))
    # (the default form keeps the spike max-pool's input as bits too)
    assert saved_lean < 0.55 * saved_default, f"lean saves {saved_lean} bytes, the default form {saved_default}"


def test_a_residual_mlp_is_not_fused_across_its_add():
    counts = to_lean(sdt_tiny(3, 10, embed_dims=16, num_heads=2, mlp_ratio=1.0))
    assert counts["bn_lif"] == 3 + 3  # the patch stages, Q, K, V: lif2 reads bn1's output plus the residual


def test_bad_configurations_and_inputs_are_refused():
    with pytest.raises(ValueError, match="pooling_stat must be four"):
        sdt_tiny(pooling_stat="011")
    with pytest.raises(ValueError, match="pooling_stat must be four"):
        sdt_tiny(pooling_stat="0021")
    with pytest.raises(ValueError, match="positive multiple of 8"):
        sdt_tiny(embed_dims=20)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        sdt_tiny(embed_dims=24, num_heads=5)
    with pytest.raises(ValueError, match="depths must be >= 1"):
        sdt_tiny(depths=0)
    model = build_model("sdt_tiny", 1, 10, embed_dims=16, num_heads=2, image_size=(28, 28))
    assert model(torch.rand(1, 2, 1, 28, 28)).shape == (1, 2, 10)  # MNIST: 7x7 tokens
    with pytest.raises(ValueError, match=r"\[T, B, 1, H, W\]"):
        model(torch.rand(2, 1, 28, 28))
    with pytest.raises(ValueError, match="built for"):
        model(torch.rand(1, 2, 1, 32, 32))
