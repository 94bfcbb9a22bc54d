"""The recurrent network of ``build_model("srnn")``: shapes, the leaky readout against its loop, the lean form's
outputs and gradients equal to the fused form's, the reference backend's equal to the fused kernels', ``sparse``
reaching every layer."""

import pytest
import torch

from spikefuse.models import build_model, set_neuron_backend
from spikefuse.models.srnn import LeakyReadout


def test_leaky_readout_is_its_loop():
    x = torch.randn(30, 4, 3, dtype=torch.float64)
    v, want = torch.zeros(4, 3, dtype=torch.float64), []
    for x_t in x:
        v = 0.8 * v + x_t
        want.append(v)
    torch.testing.assert_close(LeakyReadout(0.8)(x), torch.stack(want), rtol=1e-12, atol=1e-12)


def _step(model, x, y):
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out.mean(0), y)
    loss.backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("cell", ["lif", "cubalif", "alif"])
def test_lean_form_equals_fused(cell):
    """--memory lean: recomputing recurrent layers and bit-packed spike inputs; the same outputs and gradients."""
    x = (torch.rand(12, 5, 2, 4, 4) < 0.3).float()  # spike frames, flattened to 32 features a step
    y = torch.randint(0, 10, (5,))
    torch.manual_seed(0)
    fused = build_model("srnn", 32, 10, hidden=24, layers=2, cell=cell, spike_inputs=True)
    torch.manual_seed(0)
    lean = build_model("srnn", 32, 10, hidden=24, layers=2, cell=cell, spike_inputs=True, memory="lean")
    assert type(lean.layers[2]).__name__ == "SpikeLinear" and type(fused.layers[2]).__name__ == "Linear"
    out_f, grads_f = _step(fused, x, y)
    out_l, grads_l = _step(lean, x, y)
    assert out_f.shape == (12, 5, 10) and torch.equal(out_f, out_l)
    for a, b in zip(grads_f, grads_l):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_reference_backend_gives_the_same_network():
    x = torch.rand(20, 3, 28)
    torch.manual_seed(1)
    model = build_model("srnn", 28, 10, hidden=16)
    out = model(x)
    assert 0 < float(model.layers[1].recurrent.weight.detach().abs().sum())
    torch.testing.assert_close(set_neuron_backend(model, "reference")(x), out, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"SRNN takes whole sequences \[T, B, ...\] \(time first\) of 28 features"):
        model(torch.rand(20, 3, 27))
    with pytest.raises(ValueError, match="unknown cell"):
        build_model("srnn", 28, 10, cell="gru")


def test_a_step_or_batch_first_input_is_pointed_to_time_major():
    """A single step ``[B, F]`` is refused by its rank, with the way to a sequence of one step; every refusal names
    the time-major collate, as a batch-first ``[B, T, F]`` has a sequence's sizes (nothing can refuse it)."""
    model = build_model("srnn", 28, 10, hidden=8)
    with pytest.raises(ValueError, match=r"got \(3, 28\): one step \[B, F\]\? Pass x.unsqueeze\(0\).*time_major"):
        model(torch.rand(3, 28))
    with pytest.raises(ValueError, match=r"got \(20, 3, 27\)\. A DataLoader .* spikefuse.data.time_major"):
        model(torch.rand(20, 3, 27))


@pytest.mark.parametrize("cell", ["lif", "cubalif", "alif"])
@pytest.mark.parametrize("sparse", [True, "auto"])
def test_sparse_reaches_the_recurrent_layers(cell, sparse):
    """``sparse`` sets the recurrent layers' (their recurrent products reading only the neurons that spiked) as the
    linear layers': the same weights give the dense network's outputs and gradients to rounding (spikes may differ
    only at threshold ties, none here)."""
    from spikefuse.nn import SpikeLinear
    from spikefuse.nn.recurrent import Recurrent

    x = (torch.rand(15, 4, 20, generator=torch.Generator().manual_seed(3)) < 0.3).float()
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(2)
    dense = build_model("srnn", 20, 10, hidden=32, layers=2, cell=cell, spike_inputs=True)
    torch.manual_seed(2)
    model = build_model("srnn", 20, 10, hidden=32, layers=2, cell=cell, spike_inputs=True, sparse=sparse)
    recurrent = [m for m in model.modules() if isinstance(m, Recurrent)]
    linear = [
        m for m in model.modules() if isinstance(m, torch.nn.Linear) and m not in [r.recurrent for r in recurrent]
    ]
    assert len(recurrent) == 2 and all(m.sparse == sparse for m in recurrent)
    assert len(linear) == 3 and all(type(m) is SpikeLinear and m.sparse == sparse for m in linear)
    assert not any(m.sparse for m in dense.modules() if isinstance(m, Recurrent))
    out_d, grads_d = _step(dense, x, y)
    out_s, grads_s = _step(model, x, y)
    torch.testing.assert_close(out_s, out_d, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_d, grads_s):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
