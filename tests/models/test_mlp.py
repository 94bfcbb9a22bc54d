"""The feed-forward MLP of ``build_model("mlp")``: shapes, its layers per ``sparse``, the same outputs and gradients
with the sparse products as with torch's (to rounding) on event counts, the lean form."""

import pytest
import torch
from torch import nn

from spikefuse.models import SPARSE_MODELS, build_model
from spikefuse.nn import SpikeLinear


def frames(shape, seed=0, p=0.1):
    """Framed events: counts 0-3 per pixel and bin."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < p) * torch.randint(1, 4, shape, generator=g).float()


def step(model, x, y):
    out = model(x)
    torch.nn.functional.cross_entropy(out.mean(0), y).backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def linears(model):
    """The linear layers, not the recurrent layers' own products."""
    return [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and not name.endswith("recurrent")]


@pytest.mark.parametrize("name", SPARSE_MODELS)
@pytest.mark.parametrize("sparse", [True, "auto"])
def test_sparse_gives_the_dense_outputs_and_gradients_to_rounding(name, sparse):
    """Every linear layer a SpikeLinear of that ``sparse`` (the input layer reading counts), the same weights: the
    outputs and every gradient equal torch's layers' to rounding."""
    x, y = frames((6, 4, 2, 5, 5), seed=1), torch.randint(0, 10, (4,))
    kw = {"image_size": 5} if name == "mlp" else {}
    in_channels = 2 if name == "mlp" else 50
    torch.manual_seed(0)
    dense = build_model(name, in_channels, 10, hidden=40, **kw)
    torch.manual_seed(0)
    sparse_model = build_model(name, in_channels, 10, hidden=40, sparse=sparse, **kw)
    layers = linears(sparse_model)
    if name == "mlp":  # its readout's product too small for the sparse kernels: torch's layer
        assert type(layers.pop()) is nn.Linear
    assert all(type(m) is SpikeLinear and m.sparse == sparse for m in layers)
    assert not any(isinstance(m, SpikeLinear) for m in linears(dense))
    out_d, grads_d = step(dense, x, y)
    out_s, grads_s = step(sparse_model, x, y)
    torch.testing.assert_close(out_s, out_d, rtol=1e-5, atol=1e-5)
    assert grads_s.keys() == grads_d.keys()
    for key in grads_d:
        torch.testing.assert_close(grads_s[key], grads_d[key], rtol=1e-4, atol=1e-5, msg=key)


def test_mlp_shapes_layers_and_errors():
    model = build_model("mlp", 2, 10, image_size=(34, 34), hidden=16)
    assert model(frames((3, 2, 2, 34, 34))).shape == (3, 2, 10)
    assert [type(m) for m in model.layers][::2] == [nn.Linear] * 3
    assert [m.out_features for m in linears(model)] == [16, 16, 10] and model.in_features == 2 * 34 * 34
    with pytest.raises(ValueError, match=r"SpikingMLP takes \[T, B, \.\.\.\] inputs of 2312 features a step"):
        model(torch.zeros(3, 2, 100))
    with pytest.raises(ValueError, match=r"sparse must be True, False or 'auto', got 'yes'"):
        build_model("mlp", 2, 10, sparse="yes")
    with pytest.raises(ValueError, match=r"sparse must be True, False or 'auto', got 'yes'"):
        build_model("srnn", 8, 10, sparse="yes")


def test_mlp_lean_form_keeps_the_outputs_and_its_sparse_layers():
    """--memory lean: the layers fed by spikes keep their input as bits, the input layer (counts) stays torch's;
    the same outputs and gradients. A sparse model's spike layers stay as they are."""
    x, y = frames((5, 3, 2, 4, 4), seed=2), torch.randint(0, 10, (3,))
    torch.manual_seed(0)
    fused = build_model("mlp", 2, 10, image_size=4, hidden=12)
    torch.manual_seed(0)
    lean = build_model("mlp", 2, 10, image_size=4, hidden=12, memory="lean")
    assert [type(m) for m in linears(lean)] == [nn.Linear, SpikeLinear, SpikeLinear]
    out_f, grads_f = step(fused, x, y)
    out_l, grads_l = step(lean, x, y)
    assert torch.equal(out_f, out_l) and grads_f.keys() == grads_l.keys()
    for key in grads_f:
        assert torch.equal(grads_f[key], grads_l[key]), key
    sparse_lean = build_model("mlp", 2, 10, image_size=4, hidden=12, memory="lean", sparse="auto")
    expected = [(SpikeLinear, "auto")] * 2 + [(SpikeLinear, False)]  # the readout, torch's, keeps its input as bits
    assert [(type(m), m.sparse) for m in linears(sparse_lean)] == expected


@pytest.mark.parametrize("sparse", [False, True])
def test_sparse_grad_windows_the_neurons_and_reads_the_gradients_sparsely(sparse, monkeypatch):
    """``sparse_grad=w``: the LIF's surrogate windowed, the layers before the neurons ``sparse_grad="auto"`` (with
    ``sparse=False`` the input layer, fed counts, stays torch's), the readout dense; the gradients of torch's layers
    behind the same windowed neurons to rounding, with the gradients' CSR taken wherever ``auto`` may."""
    from spikefuse.nn import LIF, NeuronFactory
    from spikefuse.ops.spike_layers import cpu as sparse_cpu
    from spikefuse.surrogate import Sigmoid, Windowed

    monkeypatch.setattr(sparse_cpu, "CROSSOVER_GRAD", 1.0)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_ROWS", 1)
    made = []
    monkeypatch.setattr(sparse_cpu, "to_csr", lambda x, c=None, f=sparse_cpu.to_csr: made.append(x.shape) or f(x, c))
    x, y = frames((6, 4, 2, 5, 5), seed=3), torch.randint(0, 10, (4,))
    torch.manual_seed(0)
    windowed = NeuronFactory(LIF, {"surrogate": Windowed(Sigmoid(4.0), 0.1)})
    dense = build_model("mlp", 2, 10, image_size=5, hidden=40, neuron=windowed)
    torch.manual_seed(0)
    model = build_model("mlp", 2, 10, image_size=5, hidden=40, sparse=sparse, sparse_grad=0.1)
    assert [m.surrogate for m in model.layers[1::2]] == [windowed.arguments["surrogate"]] * 2
    layer_types = [SpikeLinear if sparse else nn.Linear, SpikeLinear, nn.Linear]
    assert [type(m) for m in linears(model)] == layer_types
    assert [getattr(m, "sparse_grad", False) for m in linears(model)] == ["auto" if sparse else False, "auto", False]
    out_d, grads_d = step(dense, x, y)
    made.clear()
    out_s, grads_s = step(model, x, y)
    assert (24, 40) in made  # the hidden layer's output gradient, read by its CSR
    torch.testing.assert_close(out_s, out_d, rtol=1e-5, atol=1e-5)
    for key in grads_d:
        torch.testing.assert_close(grads_s[key], grads_d[key], rtol=1e-4, atol=1e-5, msg=key)


def test_sparse_grad_windows_any_neurons_surrogate():
    """``sparse_grad`` windows the surrogate of the model's neuron, whichever it is (an ALIF's here)."""
    from spikefuse.models import ALIF_NEURON
    from spikefuse.surrogate import DEFAULT, Windowed

    model = build_model("mlp", 2, 10, image_size=5, hidden=8, neuron=ALIF_NEURON, sparse_grad=0.1)
    assert [type(m).__name__ for m in model.layers[1::2]] == ["ALIF", "ALIF"]
    assert all(m.surrogate == Windowed(DEFAULT, 0.1) for m in model.layers[1::2])
