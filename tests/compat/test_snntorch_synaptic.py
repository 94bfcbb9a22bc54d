"""``spikefuse.compat.snntorch.Synaptic`` against the real snnTorch ``Synaptic`` looped over time: spikes, ``syn``
and ``mem`` bit for bit (float32 and float64, both reset mechanisms, learnable alpha/beta), gradients of the input,
alpha and beta to 1e-5; state kept between calls; unsupported options refused by message."""

import pytest
import torch

snntorch = pytest.importorskip("snntorch")

from spikefuse.compat.snntorch import Synaptic  # noqa: E402


def _snntorch_loop(layer, x, syn=None, mem=None):
    spk = []
    for x_t in x.unbind(0):
        s, syn, mem = layer(x_t) if syn is None else layer(x_t, syn, mem)
        spk.append(s)
    return torch.stack(spk), syn, mem


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reset,delay", [("subtract", True), ("zero", True), ("zero", False)],
                         ids=["subtract", "zero", "zero-no-delay"])
@pytest.mark.parametrize("learn", [False, True])
def test_synaptic_matches_snntorch(backend, dtype, reset, delay, learn):
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(12, 3, 8, generator=g, dtype=dtype) * 0.9).requires_grad_()
    x_ours = x.detach().clone().requires_grad_()
    kw = dict(alpha=0.7, beta=0.85, threshold=0.9, reset_mechanism=reset, learn_alpha=learn, learn_beta=learn,
              reset_delay=delay)
    ref, ours = snntorch.Synaptic(**kw), Synaptic(**kw, backend=backend)
    spk, syn, mem = _snntorch_loop(ref, x)
    o_spk, o_syn, o_mem = ours(x_ours)
    assert 0 < float(spk.detach().mean()) < 1
    assert o_spk.dtype == spk.dtype == torch.float32
    assert torch.equal(o_spk, spk) and torch.equal(o_syn, syn) and torch.equal(o_mem, mem)
    w = torch.rand(spk.shape, generator=g)
    ((spk * w).sum() + mem.sum() + syn.sum()).backward()
    ((o_spk * w).sum() + o_mem.sum() + o_syn.sum()).backward()
    torch.testing.assert_close(x_ours.grad, x.grad, rtol=1e-5, atol=1e-7)
    if learn:
        torch.testing.assert_close(ours.alpha.grad, ref.alpha.grad, rtol=1e-5, atol=0)
        torch.testing.assert_close(ours.beta.grad, ref.beta.grad, rtol=1e-5, atol=0)


def test_state_continues_between_calls_and_step():
    x = torch.rand(10, 2, 5)
    ref, ours = snntorch.Synaptic(alpha=0.6, beta=0.9), Synaptic(alpha=0.6, beta=0.9)
    spk, syn, mem = _snntorch_loop(ref, x)
    first = ours(x[:6])[0]
    second, o_syn, o_mem = ours(x[6:])  # no states given: the stored ones, as snnTorch
    assert torch.equal(torch.cat([first, second]), spk) and torch.equal(o_syn, syn) and torch.equal(o_mem, mem)
    ours.reset_mem()
    s0, syn0, mem0 = ours.step(x[0])
    r0, rsyn0, rmem0 = snntorch.Synaptic(alpha=0.6, beta=0.9)(x[0])
    assert torch.equal(s0, r0) and torch.equal(syn0, rsyn0) and torch.equal(mem0, rmem0)


@pytest.mark.parametrize(
    "kw, error, message",
    [
        (dict(reset_mechanism="none"), ValueError, "reset_mechanism must be one of"),
        (dict(reset_delay=False), NotImplementedError, "reset_delay=False is supported with reset_mechanism='zero'"),
        (dict(learn_threshold=True), NotImplementedError, "learn_threshold=True is not supported"),
        (dict(alpha=torch.rand(4)), ValueError, "alpha must be a single number here"),
    ],
)
def test_unsupported_options(kw, error, message):
    with pytest.raises(error, match=message):
        Synaptic(**{"alpha": 0.5, "beta": 0.5, **kw})
