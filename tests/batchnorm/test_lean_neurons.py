"""The lean form of networks of engine neurons (CubaLIF, ALIF, a user's NeuronModel) against their default form:
a Spiking-ResNet bottleneck block on spikes (its tail one BatchNorm + residual + neuron op, the shortcut saved as
bits) and a whole tiny Spiking-ResNet (its stem one conv + BatchNorm + neuron op), from the same weights: spikes
equal, gradients within 1e-5 relative (``test_lean``'s comparison), running statistics equal, less saved."""

import pytest
import torch

from spikefuse.models import ALIF_NEURON, CUBA_LIF_NEURON, NeuronFactory, build_model
from spikefuse.models.resnet import Bottleneck
from spikefuse.neurons import NeuronModel
from spikefuse.nn import BatchNormNeuron, ConvBatchNormNeuron, EngineNeuron, SpikeConv2d, to_lean

from tests.batchnorm.test_lean import _assert_same_training, _saved_bytes

#: A user's neuron: a leaky membrane driven through a leaky current, with a hard reset to 0.
USER_MODEL = NeuronModel(
    name="test_lean_user_neuron",
    states=("i", "v"),
    params=("alpha", "decay", "threshold"),
    step=(("v", "where(s, 0, v)"), ("i", "alpha*i + x"), ("v", "decay*v + i")),
    fire="v - threshold",
    defaults=(("threshold", 0.8),),
)

NEURONS = {
    "cubalif": CUBA_LIF_NEURON,
    "alif": ALIF_NEURON,
    "user": NeuronFactory(EngineNeuron, {"model": USER_MODEL, "alpha": 0.4, "decay": 0.6}),
}


@pytest.mark.parametrize("name", list(NEURONS))
def test_resnet_of_any_neuron(name):
    torch.manual_seed(0)
    plain = build_model("resnet-tiny", 3, 10, neuron=NEURONS[name], neuron_backend="reference", width=4, stem="cifar")
    torch.manual_seed(0)
    lean = build_model("resnet-tiny", 3, 10, neuron=NEURONS[name], neuron_backend="cpu", width=4, stem="cifar")
    counts = to_lean(lean)
    assert counts["conv_bn_lif"] == 1 and counts["bn_add_lif"] == 4 and counts["bn_lif"] == 5
    assert isinstance(lean.bn1, ConvBatchNormNeuron)
    assert isinstance(lean.layer2[0].bn2, BatchNormNeuron) and lean.layer2[0].fused_tail
    x = torch.rand(3, 2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    saved_p, saved_l = _assert_same_training(plain, lean, x, torch.tensor([1, 7]))
    assert saved_l < 0.45 * saved_p, f"lean saves {saved_l} bytes, the default form {saved_p}"


@pytest.mark.parametrize("name", list(NEURONS))
def test_bottleneck_block_of_any_neuron(name):
    """The identity shortcut is the block's input spikes: the fused tail saves them as bits."""
    neuron = NEURONS[name].with_backend("reference")
    torch.manual_seed(2)
    plain = Bottleneck(8, 2, 1, None, neuron)
    lean = Bottleneck(8, 2, 1, None, neuron.with_backend("cpu"))
    lean.load_state_dict(plain.state_dict())
    to_lean(lean)
    assert lean.fused_tail and isinstance(lean.bn3, BatchNormNeuron) and isinstance(lean.conv1, SpikeConv2d)
    g = torch.Generator().manual_seed(3)
    spikes = (torch.rand(3, 2, 8, 5, 5, generator=g) < 0.4).float()
    weights = torch.rand(3, 2, 8, 5, 5, generator=g)
    results = []
    for block in (plain, lean):
        x = spikes.clone().requires_grad_()
        saved, out = _saved_bytes(block, lambda: block(x))
        (out * weights).sum().backward()
        grads = [("x", x.grad)] + [(key, p.grad) for key, p in block.named_parameters()]
        results.append((out.detach(), grads, saved))
    (out_p, grads_p, saved_p), (out_l, grads_l, saved_l) = results
    assert torch.equal(out_l, out_p), "spikes differ"
    noise = 5e-6 * max(float(g.abs().max()) for _, g in grads_p)  # as test_lean's: rounding of a gradient near 0
    for (key, g), (_, g_l) in zip(grads_p, grads_l, strict=True):
        err = float((g_l - g).abs().max())
        assert err <= max(1e-5 * float(g.abs().max()), noise), f"{key}: max abs diff {err:.3e}"
    for (key, b), (_, b_l) in zip(plain.named_buffers(), lean.named_buffers(), strict=True):
        assert torch.equal(b_l, b), key
    assert saved_l < 0.5 * saved_p, f"lean saves {saved_l} bytes, the default form {saved_p}"


def test_models_take_engine_neurons():
    """Every feed-forward model family builds its neurons from a NeuronFactory (the recurrent srnn takes cell=)."""
    for name, kw in (
        ("sew_resnet_tiny", {"width": 4, "stem": "cifar"}),
        ("liang-small", {"image_size": 8}),
        ("mlp", {"image_size": 4}),
    ):
        model = build_model(name, 3, 10, neuron=ALIF_NEURON, **kw)
        neurons = [m for m in model.modules() if isinstance(m, EngineNeuron)]
        assert neurons and all(type(m).__name__ == "ALIF" for m in neurons), name
    with pytest.raises(
        TypeError, match="SRNN's neuron= is the LIF cell's settings, a NeuronFactory of LIF, got CubaLIF"
    ):
        build_model("srnn", 4, 3, neuron=CUBA_LIF_NEURON)
    with pytest.raises(TypeError, match="no parameter 'tau'"):
        NeuronFactory(EngineNeuron, {"model": USER_MODEL, "alpha": 0.4, "decay": 0.6, "tau": 2.0})


def test_synchronized_batchnorm_unfuses_the_stem():
    """A data-parallel or time-split run synchronizes BatchNorm over the ranks, which the fused op cannot: the
    stem's ConvBatchNormNeuron becomes the convolution then a TimeSplitBatchNormNeuron, as ConvBatchNormLIF does."""
    from spikefuse.distributed.timesplit import TimeSplitBatchNormNeuron, convert_batchnorm

    model = build_model("resnet-tiny", 3, 10, neuron=ALIF_NEURON, width=4, stem="cifar", memory="lean")
    convert_batchnorm(model)
    assert not any(isinstance(m, (ConvBatchNormNeuron, BatchNormNeuron)) for m in model.modules())
    assert isinstance(model.bn1[1], TimeSplitBatchNormNeuron)
