"""spikefuse.compat.snntorch.Leaky against a loop of snnTorch's own Leaky over the time steps.

Spikes and membrane potentials must be bit-identical (torch.equal, float32); gradients of the input, of a
learnable beta and of the initial membrane potential must agree within rtol 1e-5. The state is carried over two
calls.
"""

from __future__ import annotations

import pytest
import torch

snntorch = pytest.importorskip("snntorch", reason="snnTorch is not installed (pip install snntorch)")
from snntorch import surrogate as snn_surrogate  # noqa: E402

from spikefuse import surrogate as sf_surrogate  # noqa: E402
from spikefuse.compat import snntorch as C  # noqa: E402

from . import BACKENDS, GRAD_TOL, away_from_threshold  # noqa: E402

T, SHAPE = 6, (3, 8)


def _peer_loop(peer, x_seq, mem):
    spikes = []
    for x_t in x_seq:
        s, mem = peer(x_t, mem)
        spikes.append(s)
    return torch.stack(spikes), mem


def _inputs(ours, seed: int, mem0: torch.Tensor, shape=SHAPE, scale: float = 0.7, shift: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((2 * T, *shape), generator=g) * scale + shift
    leak, view = ours._leak_and_view(x)
    x2 = away_from_threshold(view, leak.detach(), ours.spec(), v_init=mem0.reshape(view.shape[1:]))
    return x2.reshape(x.shape)


def _compare(peer, ours, x, mem0, learn_beta: bool):
    results = []
    for module in (peer, ours):
        xs = x.clone().requires_grad_(True)
        m0 = mem0.clone().requires_grad_(True)
        if module is peer:
            s1, m1 = _peer_loop(peer, xs[:T], m0)
            s2, m2 = _peer_loop(peer, xs[T:], m1)
        else:
            s1, m1 = ours(xs[:T], m0)
            s2, m2 = ours(xs[T:], m1)
        g = torch.Generator().manual_seed(7)
        w1, w2 = torch.randn(s1.shape, generator=g), torch.randn(s2.shape, generator=g)
        loss = (s1 * w1).sum() + (s2 * w2).sum() + (m1 * 0.3).sum() + (m2 * m2).sum()
        wrt = [xs, m0] + ([module.beta] if learn_beta else [])
        results.append(((s1, m1, s2, m2), torch.autograd.grad(loss, wrt)))
    (peer_out, peer_grads), (our_out, our_grads) = results
    for name, a, b in zip(("spikes[call 1]", "mem[call 1]", "spikes[call 2]", "mem[call 2]"), peer_out, our_out):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs from snnTorch at {(a != b).nonzero()[:5].tolist()}"
    n_spikes = peer_out[0].sum() + peer_out[2].sum()
    assert 0 < n_spikes < peer_out[0].numel() + peer_out[2].numel(), "degenerate input: all or no spikes"
    for name, a, b in zip(("x", "mem0", "beta"), peer_grads, our_grads):
        torch.testing.assert_close(b, a, **GRAD_TOL, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("learn_beta", [False, True], ids=["fixed_beta", "learn_beta"])
@pytest.mark.parametrize("beta", [0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("reset_mechanism", ["subtract", "zero", "none"])
def test_leaky(backend, learn_beta, beta, reset_mechanism):
    kwargs = dict(beta=beta, threshold=0.8, reset_mechanism=reset_mechanism, learn_beta=learn_beta)
    peer, ours = snntorch.Leaky(**kwargs), C.Leaky(backend=backend, **kwargs)
    mem0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)) * 0.4
    # A mean input of about (1 - beta) * threshold / 2 keeps every leak firing some of the time, not always.
    x = _inputs(ours, seed=int(beta * 100), mem0=mem0, scale=0.6, shift=0.4 * (1 - beta) + 0.05)
    _compare(peer, ours, x, mem0, learn_beta)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "spike_grad",
    [
        lambda: snn_surrogate.atan(alpha=3.0),
        lambda: snn_surrogate.fast_sigmoid(slope=10),
        lambda: snn_surrogate.sigmoid(slope=5),
    ],
    ids=["atan3", "fast_sigmoid10", "sigmoid5"],
)
def test_surrogates(backend, spike_grad):
    kwargs = dict(beta=0.7, spike_grad=spike_grad(), learn_beta=True)
    peer, ours = snntorch.Leaky(**kwargs), C.Leaky(backend=backend, **kwargs)
    mem0 = torch.zeros(SHAPE)
    x = _inputs(ours, seed=3, mem0=mem0)
    _compare(peer, ours, x, mem0, learn_beta=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_neuron_beta_conv_layout(backend):
    # beta of shape (C, 1, 1) on [B, C, H, W] in snnTorch: one leak per channel, here expanded per neuron.
    shape = (2, 3, 2, 2)
    beta = torch.tensor([0.3, 0.6, 0.9]).reshape(3, 1, 1)
    peer = snntorch.Leaky(beta=beta.clone(), learn_beta=True)
    ours = C.Leaky(beta=beta.clone(), learn_beta=True, backend=backend)
    mem0 = torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 0.3
    x = _inputs(ours, seed=4, mem0=mem0, shape=shape)
    _compare(peer, ours, x, mem0, learn_beta=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_and_stored_state(backend):
    """``step`` is snnTorch's single-step call; without ``mem`` both keep and reuse their own state."""
    peer, ours = snntorch.Leaky(beta=0.6), C.Leaky(beta=0.6, backend=backend)
    x = _inputs(ours, seed=6, mem0=torch.zeros(SHAPE))
    s_peer = [peer(x_t) for x_t in x[:T]]
    s_ours = [ours.step(x_t) for x_t in x[:T]]
    for (a, ma), (b, mb) in zip(s_peer, s_ours):
        assert torch.equal(a, b) and torch.equal(ma, mb)
    spk_peer, mem_peer = _peer_loop(peer, x[T:], None)  # continues from the stored state
    spk_ours, mem_ours = ours(x[T:])
    assert torch.equal(spk_peer, spk_ours) and torch.equal(mem_peer, mem_ours)
    peer.reset_mem(), ours.reset_mem()
    assert torch.equal(peer.mem, ours.mem) and not ours.mem.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_init_hidden_output_and_graded_spikes(backend):
    kwargs = dict(beta=0.5, init_hidden=True, output=True, graded_spikes_factor=0.5)
    peer, ours = snntorch.Leaky(**kwargs), C.Leaky(backend=backend, **kwargs)
    x = _inputs(ours, seed=8, mem0=torch.zeros(SHAPE))
    spikes = torch.stack([peer(x_t)[0] for x_t in x])
    spk, mem = ours(x)
    assert torch.equal(spikes, spk) and torch.equal(peer.mem, mem)
    assert set(spk.unique().tolist()) <= {0.0, 0.5}
    only_spikes = C.Leaky(beta=0.5, init_hidden=True, backend=backend)(x)
    assert torch.equal(only_spikes, spk * 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_surrogate_disable_gives_no_spike_gradient(backend):
    peer = snntorch.Leaky(beta=0.5, surrogate_disable=True)
    ours = C.Leaky(beta=0.5, surrogate_disable=True, backend=backend)
    x = _inputs(ours, seed=9, mem0=torch.zeros(SHAPE))
    xs = x.clone().requires_grad_(True)
    s1, m1 = _peer_loop(peer, xs, None)
    s2, m2 = ours(xs)
    assert torch.equal(s1, s2) and torch.equal(m1, m2)
    torch.testing.assert_close(torch.autograd.grad(m2.sum(), xs)[0], torch.autograd.grad(m1.sum(), xs)[0], **GRAD_TOL)


def test_surrogate_mapping_and_errors():
    assert C.to_surrogate(None) == sf_surrogate.ATan(2.0)
    assert C.to_surrogate(snn_surrogate.atan()) == sf_surrogate.ATan(2.0)
    assert C.to_surrogate(snn_surrogate.fast_sigmoid()) == sf_surrogate.FastSigmoid(25.0)
    assert C.to_surrogate(snn_surrogate.sigmoid(slope=7)) == sf_surrogate.Sigmoid(7.0)
    assert C.to_surrogate(sf_surrogate.Triangle(2.0)) == sf_surrogate.Triangle(2.0)
    unsupported_grads = (
        snn_surrogate.triangular(),
        snn_surrogate.heaviside(),
        snn_surrogate.straight_through_estimator(),
        lambda u: u,
    )
    for unsupported in unsupported_grads:
        with pytest.raises(ValueError, match="unsupported spike_grad.*atan"):
            C.Leaky(beta=0.5, spike_grad=unsupported)
    with pytest.raises(NotImplementedError, match="reset_delay=False"):
        C.Leaky(beta=0.5, reset_delay=False)
    with pytest.raises(NotImplementedError, match="learn_threshold"):
        C.Leaky(beta=0.5, learn_threshold=True)
    with pytest.raises(ValueError, match="reset_mechanism"):
        C.Leaky(beta=0.5, reset_mechanism="hard")
    with pytest.raises(ValueError, match="per-neuron beta"):
        C.Leaky(beta=torch.rand(3, 8))(torch.rand(T, 3, 8))  # varies along the batch dim


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_input_float32_spikes(backend):
    peer = snntorch.Leaky(beta=0.7, reset_mechanism="zero")
    ours = C.Leaky(beta=0.7, reset_mechanism="zero", backend=backend)
    x = _inputs(ours, seed=12, mem0=torch.zeros(SHAPE)).double()
    s1, m1 = _peer_loop(peer, x, None)
    s2, m2 = ours(x)
    assert s1.dtype == s2.dtype == torch.float32 and m1.dtype == m2.dtype == torch.float64
    assert torch.equal(s1, s2) and torch.equal(m1, m2)
