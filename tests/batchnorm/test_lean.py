"""``spikefuse.nn.to_lean`` and ``build_model(..., memory="lean")`` against the model before the conversion.

For every registered model and a user-built Sequential, from the same weights and input: outputs (the readout of
the spikes) bit-identical, loss and every gradient within 1e-5 relative, running statistics equal, and the bytes
autograd saves for backward counted (parameters excluded) and compared with the plain form.
"""

import pytest
import torch
from torch import nn

import spikefuse
from spikefuse.models import MODELS, RECURRENT_MODELS, build_model
from spikefuse.nn import (
    ALIF,
    LIF,
    BatchNormLIF1d,
    BatchNormLIF2d,
    BatchNormNeuron,
    ConvBatchNormLIF,
    ConvBatchNormNeuron,
    CubaLIF,
    SeqToBatch,
    SpikeConv2d,
    SpikeLinear,
    SpikeMaxPool2d,
    to_lean,
)
from spikefuse.batchnorm.lean import LEAN_COUNTS, RECOMPUTE_MAX_MACS, ShapeOnlyAvgPool2d


def _saved_bytes(model, fn):
    """Bytes of the unique storages autograd saves while running ``fn``, the model's parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def _step(model, x, labels):
    for p in model.parameters():
        p.grad = None
    saved, out = _saved_bytes(model, lambda: model(x))
    loss = nn.functional.cross_entropy(out.mean(0), labels)
    loss.backward()
    return out.detach(), loss.detach(), [(n, p.grad) for n, p in model.named_parameters()], saved


def _assert_same_training(plain, lean, x, labels, steps=2):
    """Parameters and buffers are compared in registration order, which the conversions keep (their names change:
    ``bn1.module.weight`` becomes ``bn1.weight``, or ``bn1.bn_lif.weight`` inside a ConvBatchNormLIF)."""
    for _ in range(steps):  # the second step starts from running statistics the first one updated
        out_p, loss_p, grads_p, saved_p = _step(plain, x, labels)
        out_l, loss_l, grads_l, saved_l = _step(lean, x, labels)
        assert torch.equal(out_l, out_p), "outputs differ: a spike flipped"
        torch.testing.assert_close(loss_l, loss_p, rtol=1e-6, atol=0)
        assert len(grads_l) == len(grads_p)
        # A gradient that is 0 up to rounding (a conv bias before BatchNorm, which removes the mean) is rounding
        # noise, not 1e-5 of itself: every gradient may also be off by 5e-6 of the model's largest gradient (the
        # Spike-driven Transformer's projection bias is 1.4e-6 of it in the vanilla form alone, against float64).
        noise = 5e-6 * max(float(g.abs().max()) for _, g in grads_p)
        for (name, g), (lean_name, g_l) in zip(grads_p, grads_l):
            assert g.shape == g_l.shape, f"{name} / {lean_name}: shapes {tuple(g.shape)} {tuple(g_l.shape)}"
            scale = float(g.abs().max())
            err = float((g_l - g).abs().max())
            assert err <= max(1e-5 * scale, noise), f"{name}: max abs diff {err:.3e}, scale {scale:.3e}"
    buffers_p, buffers_l = list(plain.named_buffers()), list(lean.named_buffers())
    assert len(buffers_l) == len(buffers_p)
    for (name, b), (_, b_l) in zip(buffers_p, buffers_l):
        assert torch.equal(b_l, b), name
    return saved_p, saved_l


def _pair(name, seed=0, **kw):
    torch.manual_seed(seed)
    plain = build_model(name, 3, 10, neuron_backend="reference", **kw)  # vanilla: the serial reference
    torch.manual_seed(seed)
    lean = build_model(name, 3, 10, neuron_backend="cpu", memory="lean", **kw)
    return plain, lean


SIZES = {
    "resnet-tiny": {"width": 4, "stem": "cifar"},
    "resnet18": {"width": 4, "stem": "cifar"},
    "resnet34": {"width": 4},
    "resnet50": {"width": 4},
    "sew_resnet_tiny": {"width": 4, "stem": "cifar"},
    "sew_resnet18": {"width": 4, "stem": "cifar"},
    "sew_resnet34": {"width": 4, "stem": "cifar"},
    "spikformer_tiny": {"embed_dims": 16, "num_heads": 2, "image_size": 8},
    "spikformer": {"embed_dims": 16, "num_heads": 2, "depths": 1, "image_size": 8},
    "sdt_tiny": {"embed_dims": 16, "num_heads": 2, "image_size": 8},
    "sdt": {"embed_dims": 16, "num_heads": 2, "depths": 1, "image_size": 8},
    "qkformer_tiny": {"embed_dims": 16, "num_heads": (1, 1, 2), "image_size": 8},
    "qkformer": {"embed_dims": 16, "num_heads": (1, 1, 2), "depths": (1, 1, 1), "image_size": 8},
}


@pytest.mark.parametrize("name", [n for n in MODELS if n not in RECURRENT_MODELS])  # srnn's: tests/models/test_srnn.py
def test_every_registered_model(name):
    kw = SIZES.get(name, {"image_size": 8})
    plain, lean = _pair(name, **kw)
    size = 16 if name in ("resnet34", "resnet50") else 8  # the imagenet stem divides by 4 before the blocks
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3, 2, 3, size, size, generator=g).repeat(1, 1, 1, 1, 1)
    labels = torch.tensor([1, 7])
    saved_p, saved_l = _assert_same_training(plain, lean, x, labels)
    assert not any(isinstance(m, LIF) and m.memory != "recompute" for m in lean.modules())
    assert saved_l < 0.45 * saved_p, f"lean saves {saved_l} bytes, the vanilla form {saved_p}"


def test_lean_resnet_under_autocast_is_the_default_form():
    """Under ``torch.autocast`` (bfloat16) the lean form runs its convolutions in bfloat16 as the default form does
    (the stem's fused conv+BatchNorm+LIF too, which calls aten.convolution, unseen by autocast): same outputs and
    gradients as nn.BatchNorm + the fused LIF there."""
    torch.manual_seed(0)
    plain = build_model("resnet18", 3, 10, neuron_backend="cpu", width=4, stem="cifar")
    torch.manual_seed(0)
    lean = build_model("resnet18", 3, 10, neuron_backend="cpu", memory="lean", width=4, stem="cifar")
    x = torch.rand(3, 2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same_training(plain, lean, x, torch.tensor([1, 7]))
        assert lean(x).dtype == plain(x).dtype == torch.bfloat16


def test_resnet_counts_and_block_structure():
    _, lean = _pair("resnet18", width=4, stem="cifar")
    counts = to_lean(lean)
    assert counts == dict.fromkeys(LEAN_COUNTS, 0), "a second conversion changes nothing"
    torch.manual_seed(0)
    fresh = build_model("resnet18", 3, 10, width=4, stem="cifar")
    counts = to_lean(fresh)
    # stem + one per block fused with their neuron; each block's last neuron fused with BN and the residual add;
    # every block conv and downsample conv reads spikes
    assert counts == {
        "bn_lif": 9,
        "bn_add_lif": 8,
        "conv_bn_lif": 1,
        "spike_layers": 19,
        "recompute_neurons": 0,
        "pools": 0,
    }
    block = fresh.layer2[0]
    assert isinstance(block.bn2, BatchNormLIF2d) and isinstance(block.sn2, nn.Identity)
    assert isinstance(block.downsample[0], SpikeConv2d)
    # the stem conv reads the image, not spikes: recomputed from it in backward
    assert isinstance(fresh.bn1, ConvBatchNormLIF) and isinstance(fresh.conv1, nn.Identity)


def test_resnet_imagenet_stem_pools_spikes_as_bits():
    plain, lean = _pair("resnet18", width=4, stem="imagenet")
    assert isinstance(lean.maxpool.module, SpikeMaxPool2d) and type(plain.maxpool.module) is nn.MaxPool2d
    fresh = build_model("resnet18", 3, 10, width=4, stem="imagenet")
    assert to_lean(fresh)["pools"] == 1
    x = torch.rand(2, 2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    _assert_same_training(plain, lean, x, torch.tensor([3, 5]))


def test_resnet_step_packs_no_spike_tensor(monkeypatch):
    """In a lean ResNet's training step the fused BatchNorm+LIF neurons pack the spikes they write for the layers
    that save them as bits, the spike max-pool pools the stem's spikes from those bits and packs its output, and a
    spike tensor that several layers save (a block's input: its first convolution, its shortcut's, the residual add)
    is handed the same bits: no layer packs a tensor itself."""
    from spikefuse.ops import bitpack

    torch.manual_seed(0)
    lean = build_model("resnet18", 3, 10, width=8, stem="imagenet", memory="lean")
    x = torch.rand(2, 3, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    packed = []
    pack_cpu = bitpack._pack_cpu
    monkeypatch.setattr(bitpack, "_pack_cpu", lambda t: packed.append(t.untyped_storage().data_ptr()) or pack_cpu(t))
    out = lean(x)
    out.sum().backward()
    assert packed == []


def _pooling_net():
    return nn.Sequential(
        SeqToBatch(nn.MaxPool2d(2)),  # real values (the input): stays torch's
        SeqToBatch(nn.Conv2d(2, 4, 3, padding=1)),
        SeqToBatch(nn.BatchNorm2d(4)),
        LIF(decay=0.5, threshold=0.3),
        SeqToBatch(nn.MaxPool2d(3, stride=2, padding=1)),  # spikes
        SeqToBatch(nn.Conv2d(4, 4, 1)),
        LIF(decay=0.5, threshold=0.2),
        spikefuse.nn.Flatten(),
        SeqToBatch(nn.Linear(4 * 3 * 3, 5)),
    )


def test_user_sequential_max_pooling():
    torch.manual_seed(4)
    plain, lean = _pooling_net(), _pooling_net()
    lean.load_state_dict(plain.state_dict())
    counts = to_lean(lean)
    assert counts["pools"] == 1
    assert type(lean[0].module) is nn.MaxPool2d and isinstance(lean[4].module, SpikeMaxPool2d)
    x = torch.rand(3, 2, 2, 12, 12, generator=torch.Generator().manual_seed(6)) * 3
    saved_p, saved_l = _assert_same_training(plain, lean, x, torch.tensor([0, 4]))
    assert saved_l < 0.5 * saved_p


def test_liang_medium_counts():
    _, lean = _pair("liang-medium", image_size=8)
    assert sum(isinstance(m, (BatchNormLIF1d, BatchNormLIF2d)) for m in lean.modules()) == 9
    # spike-fed: convs 2, 3 (stage 1), 5 (stage 2), 7 (stage 3); FC 2 and the readout
    assert sum(isinstance(m, SpikeConv2d) for m in lean.modules()) == 4
    assert sum(isinstance(m, SpikeLinear) for m in lean.modules()) == 2
    assert sum(isinstance(m, ShapeOnlyAvgPool2d) for m in lean.modules()) == 3
    # the first conv (3 channels x 3x3 per output) is recomputed; those after pooling (128 or 256 channels x 3x3)
    # read real values too, but cost too much to recompute
    recomputed = [m for m in lean.modules() if isinstance(m, ConvBatchNormLIF)]
    assert len(recomputed) == 1 and recomputed[0].conv.in_channels == 3
    assert RECOMPUTE_MAX_MACS < 128 * 9


def _user_net():
    return nn.Sequential(
        SeqToBatch(nn.Conv2d(2, 4, 3, padding=1)),
        SeqToBatch(nn.BatchNorm2d(4)),
        LIF(decay=0.6, threshold=0.4, learnable_decay=True, channels=4),
        SeqToBatch(nn.AvgPool2d(2)),
        SeqToBatch(nn.Conv2d(4, 6, 3, padding=1)),
        SeqToBatch(nn.BatchNorm2d(6)),
        LIF(decay=0.5, threshold=0.3, v_reset=None),
        SeqToBatch(nn.Conv2d(6, 6, 1)),  # reads spikes
        LIF(decay=0.5, threshold=0.3),  # no BatchNorm before it: recomputes
        spikefuse.nn.Flatten(),
        SeqToBatch(nn.Linear(6 * 3 * 3, 5)),  # reads spikes
    )


def test_user_sequential():
    torch.manual_seed(3)
    plain = _user_net()
    lean = _user_net()
    lean.load_state_dict(plain.state_dict())
    counts = to_lean(lean)
    assert counts == {
        "bn_lif": 2,
        "bn_add_lif": 0,
        "conv_bn_lif": 2,
        "spike_layers": 2,
        "recompute_neurons": 1,
        "pools": 1,
    }
    # both convs read real values (the input; pooled spikes): recomputed in backward, with their BN and neuron
    for i in (0, 4):
        assert isinstance(lean[i], ConvBatchNormLIF) and isinstance(lean[i].bn_lif, BatchNormLIF2d)
        assert isinstance(lean[i + 1], nn.Identity) and isinstance(lean[i + 2], nn.Identity)
    assert isinstance(lean[0].bn_lif.decay, nn.Parameter) and lean[0].bn_lif.decay.shape == (4,)
    assert isinstance(lean[7], SpikeConv2d) and isinstance(lean[10], SpikeLinear)
    x = torch.rand(4, 3, 2, 6, 6, generator=torch.Generator().manual_seed(5)) * 3
    labels = torch.tensor([0, 4, 2])
    saved_p, saved_l = _assert_same_training(plain, lean, x, labels)
    assert saved_l < 0.5 * saved_p


def _engine_net(backend):
    return nn.Sequential(
        SeqToBatch(nn.Conv2d(2, 4, 3, padding=1)),
        SeqToBatch(nn.BatchNorm2d(4)),
        CubaLIF(
            alpha=0.6, beta=0.8, threshold=0.4, learnable=("beta",), channels=4, backend=backend, memory="potential"
        ),
        SeqToBatch(nn.Conv2d(4, 6, 3, padding=1)),  # reads spikes
        SeqToBatch(nn.BatchNorm2d(6)),
        ALIF(decay=0.7, rho=0.9, b0=0.4, beta=0.2, backend=backend, memory="recompute"),
        spikefuse.nn.Flatten(),
        SeqToBatch(nn.Linear(6 * 6 * 6, 5)),  # reads spikes
    )


def _assert_same_gradients(plain, lean, x, labels):
    out_p, loss_p, grads_p, saved_p = _step(plain, x, labels)
    out_l, loss_l, grads_l, saved_l = _step(lean, x, labels)
    assert torch.equal(out_l, out_p), "outputs differ: a spike flipped"
    torch.testing.assert_close(loss_l, loss_p, rtol=1e-6, atol=0)
    noise = 1e-6 * max(float(g.abs().max()) for _, g in grads_p)  # (see _assert_same_training)
    for (name, g), (_, g_l) in zip(grads_p, grads_l, strict=True):
        err = float((g_l - g).abs().max())
        assert err <= max(1e-5 * float(g.abs().max()), noise), f"{name}: max abs diff {err:.3e}"
    for (name, b), (_, b_l) in zip(plain.named_buffers(), lean.named_buffers(), strict=True):
        assert torch.equal(b_l, b), name
    return saved_p, saved_l


def test_user_sequential_of_engine_neurons():
    """BatchNorm + CubaLIF / ALIF become BatchNormNeuron modules holding both (the same parameters: an optimizer
    made before the conversion still holds them), the first with the convolution reading the input before it
    (ConvBatchNormNeuron); the layers after the neurons read spikes."""
    torch.manual_seed(4)
    plain = _engine_net("reference")
    lean = _engine_net("cpu")
    lean.load_state_dict(plain.state_dict())
    before = [id(p) for p in lean.parameters()]
    counts = to_lean(lean)
    assert counts == {
        "bn_lif": 2,
        "bn_add_lif": 0,
        "conv_bn_lif": 1,
        "spike_layers": 2,
        "recompute_neurons": 1,
        "pools": 0,
    }
    assert isinstance(lean[0], ConvBatchNormNeuron) and isinstance(lean[0].bn_neuron.neuron, CubaLIF)
    assert isinstance(lean[4], BatchNormNeuron) and isinstance(lean[4].neuron, ALIF)
    assert all(isinstance(lean[i], nn.Identity) for i in (1, 2, 5))
    assert lean[0].bn_neuron.neuron.memory == "recompute", "to_lean makes every neuron recompute"
    assert isinstance(lean[3], SpikeConv2d) and isinstance(lean[7], SpikeLinear)
    assert [id(p) for p in lean[0].parameters()] == before[:5]  # conv weight, bias, bn weight, bias, the beta
    x = torch.rand(3, 2, 2, 6, 6, generator=torch.Generator().manual_seed(6)) * 3
    labels = torch.tensor([0, 4])
    saved_p, saved_l = _assert_same_gradients(plain, lean, x, labels)
    assert saved_l < 0.35 * saved_p, f"lean saves {saved_l} bytes, the plain form {saved_p}"


def test_batchnorm_neuron_errors():
    with pytest.raises(TypeError, match="bn must be an nn.BatchNorm1d or BatchNorm2d, got Linear"):
        BatchNormNeuron(nn.Linear(2, 2), CubaLIF(alpha=0.5, beta=0.5))
    with pytest.raises(TypeError, match="neuron must be a spikefuse.nn.EngineNeuron .*got ReLU"):
        BatchNormNeuron(nn.BatchNorm2d(2), nn.ReLU())
    module = BatchNormNeuron(nn.BatchNorm2d(2), CubaLIF(alpha=0.5, beta=0.5))
    with pytest.raises(ValueError, match="with BatchNorm2d expects multi-step input \\[T, B, C, ...\\] of 5 dims"):
        module(torch.randn(2, 3, 2, 4))


@pytest.mark.parametrize("v_reset", [-0.1, None])
def test_batchnorm_neuron_of_a_lif_equals_batchnorm_lif(v_reset):
    """A LIF is an engine neuron: BatchNormNeuron(bn, LIF) runs it through the general fused op (its membrane starting
    at v_reset) and gives BatchNormLIF2d's spikes, gradients and running statistics."""
    torch.manual_seed(5)
    x = torch.randn(4, 3, 2, 5, 5) * 2
    general = BatchNormNeuron(nn.BatchNorm2d(2), LIF(0.6, 0.4, v_reset=v_reset, learnable_decay=True, channels=2))
    preset = BatchNormLIF2d(2, decay=0.6, threshold=0.4, v_reset=v_reset, learnable_decay=True, channels=2)
    outs = []
    for module, decay in ((general, general.neuron.decay), (preset, preset.decay)):
        xi = x.clone().requires_grad_()
        spikes = module(xi)
        (spikes * torch.linspace(-1, 1, spikes.numel()).view_as(spikes)).sum().backward()
        outs.append((spikes, xi.grad, decay.grad))
    bn_general, bn_preset = general.bn, preset
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][0].sum() > 0
    for a, b in zip(outs[0][1:], outs[1][1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(bn_general.running_mean, bn_preset.running_mean)
    assert torch.equal(bn_general.running_var, bn_preset.running_var)


def test_lean_keeps_device_dtype_and_mode():
    net = _user_net().double().eval()
    to_lean(net)
    fused = net[0].bn_lif
    assert fused.weight.dtype == torch.float64 and fused.decay.dtype == torch.float64
    assert not net[0].training and not fused.training and not net[7].training


def test_bad_input():
    with pytest.raises(TypeError, match="to_lean converts an nn.Module, got list"):
        to_lean([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="unknown memory form 'slim': use 'fused'.*or 'lean'"):
        build_model("resnet-tiny", 3, 10, memory="slim")
