"""Models: shapes, structure (parameter counts of SpikingJelly's / torchvision's ResNets), forward/backward on tiny
inputs, and the fused CPU backend agreeing with the serial reference on whole networks."""

import copy

import pytest
import torch

from spikefuse.models import (
    LIANG_NEURON,
    MODELS,
    PAPER_NEURON,
    NeuronFactory,
    build_model,
    replace_neurons,
    set_neuron_backend,
    neuron_layers,
)
from spikefuse.nn import LIF
from spikefuse.surrogate import ATan, Rectangle, Sigmoid


BACKENDS = ["reference", "cpu"]

# Tiny versions of every registered model (same code paths, small widths).
TINY = {
    "resnet-tiny": dict(width=4),
    "resnet18": dict(width=4),
    "resnet34": dict(width=2),
    "resnet50": dict(width=2),
    "liang-small": dict(hidden=(16, 8)),
    "liang-medium": dict(hidden=(16, 8)),
    "liang-large": dict(hidden=(16, 8)),
}


def tiny(name, backend, in_channels=2, num_classes=5, size=8, **extra):
    kw = dict(TINY[name], image_size=size, **extra)
    if name.startswith("resnet"):
        kw.setdefault("stem", "cifar")
    torch.manual_seed(0)
    return build_model(name, in_channels, num_classes, neuron_backend=backend, **kw)


def test_registry_names():
    assert set(MODELS) == {
        "resnet-tiny",
        "resnet18",
        "resnet34",
        "resnet50",
        "sew_resnet_tiny",
        "sew_resnet18",
        "sew_resnet34",
        "spikformer_tiny",
        "spikformer",
        "sdt_tiny",
        "sdt",
        "qkformer_tiny",
        "qkformer",
        "liang-small",
        "liang-medium",
        "liang-large",
        "srnn",
        "mlp",
    }
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet19", 3, 10)


@pytest.mark.parametrize(
    "name, params",
    [("resnet18", 11_689_512), ("resnet34", 21_797_672), ("resnet50", 25_557_032)],
)
def test_resnet_structure_matches_torchvision_parameter_count(name, params):
    # SpikingJelly's Spiking-ResNets have torchvision's layers (neurons have no parameters): same count
    m = build_model(name, 3, 1000, stem="imagenet")
    assert sum(p.numel() for p in m.parameters()) == params
    neurons = len(neuron_layers(m))
    blocks = {"resnet18": 8, "resnet34": 16, "resnet50": 16}[name]
    per_block = 3 if name == "resnet50" else 2
    assert neurons == 1 + blocks * per_block


def test_neuron_defaults_follow_the_papers():
    r = build_model("resnet-tiny", 1, 10)
    lif = neuron_layers(r)[0][1]
    assert (lif.decay, lif.threshold, lif.v_reset, lif.surrogate, lif.backend) == (0.2, 0.3, 0.0, Sigmoid(4.0), "auto")
    liang = build_model("liang-small", 3, 10)
    lif = neuron_layers(liang)[0][1]
    assert (lif.decay, lif.threshold, lif.surrogate) == (0.25, 0.25, Rectangle(1.0, 1.0))
    assert liang.in_features == 512 * 4 * 4  # 32x32 CIFAR after three 2x2 poolings
    assert PAPER_NEURON.backend == LIANG_NEURON.backend == "auto"
    # explicit options and the backend override
    opts = NeuronFactory(LIF, {"decay": 0.5, "threshold": 1.0, "surrogate": ATan(), "detach_reset": True})
    m = build_model("resnet-tiny", 1, 10, neuron=opts, neuron_backend="reference")
    assert all(n.decay == 0.5 and n.detach_reset and n.backend == "reference" for _, n in neuron_layers(m))
    assert NeuronFactory.from_dict(opts.to_dict()) == opts
    with pytest.raises(TypeError, match="neuron= is a spikefuse.nn.NeuronFactory .*got dict"):
        build_model("resnet-tiny", 1, 10, neuron={"decay": 0.5})


def test_imagenet_stem_and_odd_sizes():
    m = build_model("resnet-tiny", 3, 7, stem="imagenet", width=4, neuron_backend="reference")
    assert m(torch.rand(2, 1, 3, 40, 40)).shape == (2, 1, 7)
    liang = build_model("liang-small", 1, 3, image_size=(28, 20), hidden=(8,), neuron_backend="reference")
    assert liang(torch.rand(2, 2, 1, 28, 20)).shape == (2, 2, 3)
    with pytest.raises(ValueError, match=r"\[T, B, C, H, W\]"):
        m(torch.rand(2, 3, 8, 8))


def test_replace_and_switch_neurons():
    m = build_model("resnet-tiny", 1, 10, width=4)
    n = len(neuron_layers(m))
    set_neuron_backend(m, "reference")
    assert all(x.backend == "reference" for _, x in neuron_layers(m))
    assert replace_neurons(m, lambda lif: torch.nn.ReLU()) == n
    assert not neuron_layers(m)


@pytest.mark.parametrize("name", list(TINY))
def test_forward_backward_tiny(name):
    m = tiny(name, "reference")
    x = torch.rand(3, 2, 2, 8, 8)
    y = m(x)
    assert y.shape == (3, 2, 5) and torch.isfinite(y).all()
    y.mean(0).logsumexp(1).sum().backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", list(TINY))
def test_cpu_backend_agrees_with_reference(name):
    # In float64: a 50-layer float32 network amplifies rounding until the reference itself is ~1e-5 from the exact
    # gradients (seen on an AMD EPYC), so a float32 comparison measures the machine, not the kernel. In float64
    # the only difference left is the kernel's polynomial exp in the surrogate (< 1e-8 relative).
    ref = tiny(name, "reference", size=8).double()
    fused = set_neuron_backend(copy.deepcopy(ref), "cpu")
    torch.manual_seed(1)
    x = torch.rand(4, 3, 2, 8, 8, dtype=torch.float64)
    target = torch.randn(3, 5, dtype=torch.float64)
    outs, grads = [], []
    for m in (ref, fused):
        y = m(x)
        (y.mean(0) * target).sum().backward()
        outs.append(y.detach())
        grads.append([p.grad.detach().clone() for p in m.parameters()])
    assert torch.equal(outs[1], outs[0])
    for g_fused, g_ref in zip(grads[1], grads[0]):
        assert _rel(g_fused, g_ref) <= 1e-5
