"""spikefuse.compat.snntorch's recurrent convolutions (``RLeaky``/``RSynaptic`` with ``conv2d_channels``) and its
``StateLeaky``/``LinearLeaky`` against the installed snnTorch 1.0: snnTorch's spikes and states bit for bit in its
step loop and in ``sequence`` (on the one-step path and on the fused layer of one step), gradients to 1e-5, no graph
break compiled, snnTorch's ``utils.reset``; ``LinearLeaky``'s recursion (``recursive=True``) against snnTorch's
filter, its spike differences counted."""

from __future__ import annotations

import pytest
import torch

snntorch = pytest.importorskip("snntorch", reason="snnTorch is not installed (pip install snntorch)")

from spikefuse.compat import snntorch as C  # noqa: E402

from . import BACKENDS  # noqa: E402
from .test_snntorch import RESETS, _close, _loop  # noqa: E402

T, B, CH, H, W = 6, 2, 3, 5, 4

CONV = {
    "rleaky": (snntorch.RLeaky, C.RLeaky, dict(beta=0.8, threshold=0.6)),
    "rsynaptic": (snntorch.RSynaptic, C.RSynaptic, dict(alpha=0.7, beta=0.85, threshold=0.6)),
}


def _conv_pair(name, backend="cpu", **kw):
    peer_cls, ours_cls, base = CONV[name]
    torch.manual_seed(3)
    peer = peer_cls(**base, conv2d_channels=CH, **kw)
    ours = ours_cls(**base, conv2d_channels=CH, **kw, backend=backend)
    ours.load_state_dict(peer.state_dict(), strict=True)
    return peer, ours


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reset", RESETS)
@pytest.mark.parametrize("name", list(CONV))
def test_recurrent_convolution_matches_snntorch(name, reset, backend):
    """The loop with states handed back and ``sequence``: spikes and states bit for bit, gradients of the input,
    beta and the convolution's weight and bias to 1e-5; "cpu" runs the one-step path, "reference" the fused layer of
    one step fed the convolution's current."""
    peer, ours = _conv_pair(name, backend, kernel_size=3, reset_mechanism=reset, learn_beta=True)
    g = torch.Generator().manual_seed(5)
    x = torch.rand(T, B, CH, H, W, generator=g)
    upstream = torch.randn(T, B, CH, H, W, generator=g)
    results = []
    for module, run in (
        (peer, _loop),
        (ours, _loop),
        (ours, lambda m, x: (lambda o: (o[0], o[1:]))(m.sequence(x))),
    ):
        module.reset_mem()
        xs = x.clone().requires_grad_()
        spikes, states = run(module, xs)
        loss = (spikes * upstream).sum() + sum((s * (i + 1)).sum() for i, s in enumerate(states))
        learnables = [xs, module.beta, module.recurrent.weight, module.recurrent.bias]
        results.append((spikes, states, torch.autograd.grad(loss, learnables)))
    p_spk, p_states, p_grads = results[0]
    assert 0 < float(p_spk.detach().mean()) < 1, "degenerate input: all or no spikes"
    for spikes, states, grads in results[1:]:
        assert torch.equal(spikes, p_spk) and all(map(torch.equal, states, p_states))
        for what, a, b in zip(["x", "beta", "weight", "bias"], grads, p_grads):
            _close(a, b, what)


def test_recurrent_convolution_options():
    """learn_recurrent=False (the convolution fixed), a kernel of two sizes, init_hidden with snnTorch's
    ``utils.reset`` between samples, ``drop_in_for``: snnTorch's spikes."""
    import snntorch.utils

    x = torch.rand(T, B, CH, H, W, generator=torch.Generator().manual_seed(6))
    for kw in (dict(kernel_size=3, learn_recurrent=False), dict(kernel_size=(1, 3), reset_mechanism="zero")):
        peer, ours = _conv_pair("rleaky", **kw)
        learnt = [p.requires_grad for p in ours.recurrent.parameters()]
        assert learnt == [kw.get("learn_recurrent", True)] * 2
        (s1, st1), (s2, st2) = _loop(peer, x), _loop(ours, x)
        assert s1.sum() > 0 and torch.equal(s1, s2) and all(map(torch.equal, st1, st2))
        made = C.drop_in_for(peer)
        made.reset_mem()
        peer.reset_mem()
        assert torch.equal(_loop(made, x)[0], _loop(peer, x)[0])
    peer, ours = _conv_pair("rsynaptic", kernel_size=3, init_hidden=True)
    for sample in (x, x.flip(0)):
        outs = []
        for module in (peer, ours):
            snntorch.utils.reset(torch.nn.Sequential(module))  # (it finds the neurons among a net's children)
            outs.append(torch.stack([module(x_t) for x_t in sample]))
        assert torch.equal(*outs)
    assert float(ours.mem.detach().abs().sum()) > 0
    snntorch.utils.reset(torch.nn.Sequential(ours))
    assert float(ours.mem.abs().sum()) == 0


def test_recurrent_convolution_compiles_without_a_graph_break():
    """A step with the kept states and ``sequence``, traced whole; a compiled step loop (the fused layer of one
    step) gives the eager spikes and states."""
    x = torch.rand(T, B, CH, H, W, generator=torch.Generator().manual_seed(7))
    for name in CONV:
        _, module = _conv_pair(name, kernel_size=3)
        module(x[0])
        assert torch._dynamo.explain(module)(x[0]).graph_break_count == 0, name
        assert torch._dynamo.explain(module.sequence)(x).graph_break_count == 0, name
        _, eager = _conv_pair(name, kernel_size=3)
        _, traced = _conv_pair(name, kernel_size=3)
        (s1, st1), (s2, st2) = _loop(eager, x), _loop(torch.compile(traced, fullgraph=True, backend="aot_eager"), x)
        assert s1.sum() > 0 and torch.equal(s1, s2) and all(map(torch.equal, st1, st2)), name


def test_recurrent_convolution_compiled_gradients():
    """The compiled loop's gradients are eager's: the recurrent backward op returns no two outputs aliasing each other
    (an empty weight and bias gradient shared one tensor, which a compiled graph refuses)."""
    x = torch.rand(T, B, CH, H, W, generator=torch.Generator().manual_seed(7))
    _, eager = _conv_pair("rleaky", kernel_size=3)
    _, traced = _conv_pair("rleaky", kernel_size=3)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    for module, xs in ((eager, xe), (torch.compile(traced, fullgraph=True, backend="aot_eager"), xc)):
        spikes, states = _loop(module, xs)
        (spikes.sum() + states[-1].sum()).backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-6)


def test_recurrent_convolution_refusals():
    refused = [
        (dict(conv2d_channels=3), TypeError, "conv2d_channels and kernel_size must both be given"),
        (dict(kernel_size=3), TypeError, "conv2d_channels and kernel_size must both be given"),
        (dict(conv2d_channels=3, kernel_size=2), ValueError, "kernel_size must be an odd positive int"),
        (dict(linear_features=4, kernel_size=3), TypeError, "linear_features cannot be given with conv2d_channels"),
        (dict(all_to_all=False, conv2d_channels=3, kernel_size=3), TypeError, "takes V, not linear_features"),
    ]
    for kw, error, message in refused:
        with pytest.raises(error, match=message):
            C.RLeaky(beta=0.5, **kw)
    layer = C.RLeaky(beta=0.5, conv2d_channels=3, kernel_size=3, backend="reference")
    with pytest.raises(ValueError, match=r"the input must be \[B, C, H, W\] per step"):
        layer(torch.rand(3, 4, 4))


FEATURES_IN, FEATURES = 6, 5
LINEAR = {
    "scalar": dict(beta=0.9),
    "per_channel_learnt": dict(beta=torch.linspace(0.5, 0.95, FEATURES), learn_beta=True, learn_threshold=True),
    "truncated": dict(beta=0.8, kernel_truncation_steps=7, learn_beta=True),
    "graded": dict(beta=0.85, graded_spikes_factor=0.5, learn_graded_spikes_factor=True),
    "membrane_only": dict(beta=0.9, output=False),
}


def _outputs_and_grads(module, x):
    xs = x.clone().requires_grad_()
    out = module(xs)
    out = out if isinstance(out, tuple) else (out,)
    loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in out)
    learnables = [p for n, p in module.named_parameters() if n != "beta"]  # (snnTorch's beta is not read)
    return out, torch.autograd.grad(loss, [xs, *learnables])


@pytest.mark.parametrize("case", list(LINEAR))
def test_linear_leaky_matches_snntorch(case):
    """The default: snnTorch's spikes and membranes bit for bit, its parameters under its names and in its order,
    gradients to 1e-5. ``recursive=True``: membranes and gradients to 1e-5, and the spikes snnTorch's except at
    threshold ties (counted: none here, inputs of 16-bit values; the differing spikes are at most those within
    rounding of the threshold)."""
    torch.manual_seed(1)
    peer = snntorch.LinearLeaky(in_features=FEATURES_IN, out_features=FEATURES, threshold=0.5, **LINEAR[case])
    x = (torch.randn(30, 4, FEATURES_IN, generator=torch.Generator().manual_seed(2)) * 256).round() / 256
    want, want_grads = _outputs_and_grads(peer, x)
    assert 0 < float(want[0].mean()) < 1 or case == "membrane_only"
    for recursive in (False, True):
        ours = C.LinearLeaky(
            in_features=FEATURES_IN, out_features=FEATURES, threshold=0.5, recursive=recursive, **LINEAR[case]
        )
        ours.load_state_dict(peer.state_dict(), strict=True)
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in peer.named_parameters()]
        got, grads = _outputs_and_grads(ours, x)
        if not recursive:
            assert all(map(torch.equal, got, want))
        else:
            mem, want_mem = got[-1], want[-1]
            torch.testing.assert_close(mem, want_mem, rtol=1e-5, atol=1e-5)
            if len(got) > 1:
                near_threshold = (want_mem - 0.5).abs() < 1e-5
                differing = got[0] != want[0]
                assert not (differing & ~near_threshold).any() and int(differing.sum()) == 0
        for a, b in zip(grads, want_grads):
            if recursive:  # (tau's gradient sums terms that cancel: 1e-6 of 5e-3 apart with a truncated kernel)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                _close(a, b, case)


def test_state_leaky_and_linear_leaky_calls():
    """StateLeaky bit for bit; snnTorch's warning for spike settings without spikes; the kept ``spk``/``mem``;
    shapes refused by message; no graph break compiled, either membrane; ``utils.reset`` leaves them be."""
    import snntorch.utils

    x = torch.randn(12, 3, 4, generator=torch.Generator().manual_seed(3))
    peer = snntorch.StateLeaky(beta=torch.tensor([0.5, 0.7, 0.9, 0.95]), channels=4, threshold=0.3)
    ours = C.StateLeaky(beta=torch.tensor([0.5, 0.7, 0.9, 0.95]), channels=4, threshold=0.3)
    ours.load_state_dict(peer.state_dict(), strict=True)
    assert isinstance(ours, snntorch.StateLeaky)
    assert all(map(torch.equal, ours(x), peer(x))) and torch.equal(ours.spk, peer.spk)
    with pytest.warns(UserWarning, match="spike-related settings are unused when output=False"):
        C.StateLeaky(beta=0.9, channels=4, output=False, learn_threshold=True)
    with pytest.raises(ValueError, match=r"Beta shape .* must be either \(4,\) or \(1,\)"):
        C.StateLeaky(beta=torch.rand(3), channels=4)
    with pytest.raises(ValueError, match="kernel_truncation_steps must be None or a positive int"):
        C.StateLeaky(beta=0.9, channels=4, kernel_truncation_steps=0)
    with pytest.raises(ValueError, match=r"takes a whole sequence \[T, B, C\]"):
        ours(x[0])
    linear = C.LinearLeaky(beta=0.9, in_features=4, out_features=2)
    with pytest.raises(ValueError, match=r"takes a whole sequence \[T, B, in_features\]"):
        linear(x[0])
    spk, mem = linear(x)
    assert linear.mem is mem and linear.spk is spk
    snntorch.utils.reset(torch.nn.Sequential(linear))
    for recursive in (False, True):
        module = C.LinearLeaky(beta=0.9, in_features=4, out_features=2, recursive=recursive)
        assert torch._dynamo.explain(module)(x).graph_break_count == 0, recursive


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(learn_beta=True, learn_threshold=True, kernel_truncation_steps=3), dict(output=False)],
    ids=["plain", "learnable-truncated", "membrane-only"],
)
def test_drop_in_for_linear_and_state_leaky_gives_the_peers_outputs(kw):
    """drop_in_for (and so use_spikefuse_neurons) takes snnTorch's LinearLeaky / StateLeaky: the same state_dict,
    tau included, and snnTorch's spikes and membranes bit for bit."""
    snn_neurons = pytest.importorskip("snntorch._neurons.linearleaky")
    from snntorch._neurons.stateleaky import StateLeaky as PeerStateLeaky

    torch.manual_seed(3)
    beta = torch.rand(4) * 0.8 + 0.1
    for peer in (
        snn_neurons.LinearLeaky(beta=beta, in_features=5, out_features=4, **kw),
        PeerStateLeaky(beta, 4, **kw),
    ):
        ours = C.drop_in_for(peer)
        assert type(ours).__name__ == type(peer).__name__ and type(ours).__module__ == C.__name__
        assert list(ours.state_dict()) == list(peer.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), peer.state_dict().values()))
        x = torch.randn(7, 2, 5 if type(peer).__name__ == "LinearLeaky" else 4) * 2
        want, got = peer(x), ours(x)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_use_spikefuse_neurons_replaces_a_linear_leaky():
    from snntorch._neurons.linearleaky import LinearLeaky as PeerLinearLeaky

    from spikefuse.compat import use_spikefuse_neurons

    net = torch.nn.Sequential(PeerLinearLeaky(beta=0.8, in_features=5, out_features=3, output=True))
    x = torch.randn(6, 2, 5) * 2
    want = net(x)
    assert use_spikefuse_neurons(net).replaced == ["0"]
    assert isinstance(net[0], C.LinearLeaky) and all(map(torch.equal, net(x), want))
