"""spikefuse.compat.fuse on the tutorials' step-loop models (snnTorch's feed-forward, convolutional and recurrent
``nn.Sequential`` nets with ``init_hidden=True`` neurons, a SpikingJelly single-step net): the fused model's outputs
and gradients against the peer's own loop (outputs bit for bit in float32, gradients to 1e-5); what it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

snntorch = pytest.importorskip("snntorch", reason="snnTorch is not installed (pip install snntorch)")
from snntorch import utils as snn_utils  # noqa: E402

from spikefuse.compat import FusedSteps, fuse  # noqa: E402

T, B = 6, 3


def _loop(net, x):
    """The tutorials' loop: one call per step, the outputs stacked (a tuple of stacks for a tuple output)."""
    snn_utils.reset(net)
    outs = [net(x_t) for x_t in x.unbind(0)]
    return tuple(torch.stack(c) for c in zip(*outs)) if isinstance(outs[0], tuple) else torch.stack(outs)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _check(make, x):
    """The peer's loop against the fused drop-in model (made by ``make`` with the same seed): outputs bit for bit,
    the gradients of the input and every parameter to 1e-5."""
    torch.manual_seed(0)
    peer = make()
    torch.manual_seed(0)
    fused = fuse(make())
    assert isinstance(fused, FusedSteps)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    want = _as_tuple(_loop(peer, xs[0]))
    snn_utils.reset(fused)
    got = _as_tuple(fused(xs[1]))
    assert len(got) == len(want)
    assert 0 < float(want[0].detach().mean()) < 1, "degenerate input: all or no spikes"
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    weights = [torch.rand(w.shape, generator=torch.Generator().manual_seed(i)) for i, w in enumerate(want)]
    for out, net, xi in ((want, peer, xs[0]), (got, fused, xs[1])):
        sum((o * w).sum() for o, w in zip(out, weights)).backward()
    pairs = [("x", xs[1].grad, xs[0].grad)]
    pairs += [(name, p.grad, q.grad) for (name, p), q in zip(fused.named_parameters(), peer.parameters())]
    for name, a, b in pairs:  # to 1e-5 of the largest element or of 1 (a bias before a BatchNorm: rounding noise)
        scale = max(float(b.abs().max()), 1.0)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}")


def test_feed_forward_tutorial_net_with_a_membrane_readout():
    def make():
        return nn.Sequential(
            nn.Linear(20, 16),
            snntorch.Leaky(beta=0.9, threshold=0.5, init_hidden=True),
            nn.Linear(16, 4),
            snntorch.Leaky(beta=0.8, threshold=0.5, init_hidden=True, output=True),
        )

    _check(make, torch.rand(T, B, 20) * 2)


def test_convolutional_tutorial_net():
    def make():
        return nn.Sequential(
            nn.Conv2d(1, 4, 3),
            nn.MaxPool2d(2),
            snntorch.Leaky(beta=0.9, threshold=0.3, init_hidden=True),
            nn.Flatten(),
            nn.Linear(4 * 3 * 3, 5),
            snntorch.Synaptic(alpha=0.7, beta=0.9, threshold=0.3, init_hidden=True, output=True),
        )

    _check(make, torch.rand(T, B, 1, 8, 8) * 2)


def test_recurrent_tutorial_net():
    def make():
        return nn.Sequential(
            nn.Linear(12, 10),
            snntorch.RLeaky(beta=0.9, threshold=0.5, linear_features=10, init_hidden=True),
            nn.Linear(10, 3),
            snntorch.Leaky(beta=0.9, threshold=0.5, init_hidden=True),
        )

    _check(make, torch.rand(T, B, 12) * 1.5)


def test_batchnorm_in_training_keeps_the_loops_per_step_statistics():
    def make():
        return nn.Sequential(
            nn.Linear(8, 6), nn.BatchNorm1d(6), snntorch.Leaky(beta=0.9, threshold=0.3, init_hidden=True)
        )

    _check(make, torch.rand(T, B, 8))


def test_spikingjelly_single_step_net():
    sj = pytest.importorskip("spikingjelly.activation_based", reason="SpikingJelly is not installed")
    from spikingjelly.activation_based import functional, layer, neuron

    def make():
        return nn.Sequential(layer.Flatten(), layer.Linear(16, 8), neuron.LIFNode(tau=2.0, v_threshold=0.4))

    x = torch.rand(T, B, 4, 4) * 2
    torch.manual_seed(0)
    peer = make()
    torch.manual_seed(0)
    fused = fuse(make())
    functional.reset_net(peer)
    want = torch.stack([peer(x_t) for x_t in x])
    functional.reset_net(fused)
    assert torch.equal(fused(x), want) and 0 < float(want.mean()) < 1
    assert sj is not None


def test_snntorch_reset_finds_the_fused_models_neurons():
    """``snntorch.utils.reset`` looks at a network's direct children: it finds a fused model's neurons as it finds
    the model's (a wrapper around the model would hide them, and the next batch would start from the last one's
    states, silently); the fused model's state_dict is the model's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), snntorch.Leaky(beta=0.9, threshold=0.2, init_hidden=True))
    keys = list(net.state_dict())
    fused = fuse(net)
    assert list(fused.state_dict()) == keys
    x = torch.rand(T, B, 5)
    first = fused(x)
    snn_utils.reset(fused)
    assert torch.equal(fused(x), first)


def test_what_fuse_refuses():
    with pytest.raises(TypeError, match="nn.Sequential"):
        fuse(snntorch.Leaky(beta=0.9, init_hidden=True))
    with pytest.raises(ValueError, match="init_hidden=False"):
        fuse(nn.Sequential(nn.Linear(2, 2), snntorch.Leaky(beta=0.9)))
    with pytest.raises(ValueError, match="SLSTM has no spikefuse drop-in"):
        fuse(nn.Sequential(nn.Linear(2, 2), snntorch.SLSTM(2, 2, init_hidden=True)))
    fused = fuse(
        nn.Sequential(
            snntorch.Leaky(beta=0.9, init_hidden=True, output=True), snntorch.Leaky(beta=0.9, init_hidden=True)
        )
    )
    with pytest.raises(ValueError, match="only the model's last neuron may have output=True"):
        fused(torch.rand(T, B, 2))
    with pytest.raises(ValueError, match=r"whole sequence \[T, B, ...\]"):
        fused(torch.rand(2))


def test_a_layer_along_the_batch_runs_per_step():
    """A softmax over dimension 0 of a step's input (the batch) would mix the steps over T*B samples: it runs one
    call per step, as the loop calls it."""

    def make():
        return nn.Sequential(
            nn.Linear(6, 4),
            nn.Softmax(dim=0),
            nn.Linear(4, 4),
            snntorch.Leaky(beta=0.9, threshold=0.1, init_hidden=True),
        )

    _check(make, torch.rand(T, B, 6) * 2)


def test_the_fused_model_compiles_without_a_graph_break():
    """``torch.compile(fullgraph=True)`` of a fused model (``torch._dynamo.explain``: no break), giving the eager
    outputs."""
    torch.manual_seed(0)
    fused = fuse(
        nn.Sequential(
            nn.Linear(8, 6),
            snntorch.Leaky(beta=0.9, threshold=0.5, init_hidden=True),
            nn.Linear(6, 3),
            snntorch.Leaky(beta=0.9, threshold=0.5, init_hidden=True, output=True),
        )
    )
    x = torch.rand(T, B, 8) * 2
    snn_utils.reset(fused)
    eager = fused(x)
    snn_utils.reset(fused)
    explained = torch._dynamo.explain(fused)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    snn_utils.reset(fused)
    compiled = torch.compile(fused, fullgraph=True, backend="eager")(x)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
