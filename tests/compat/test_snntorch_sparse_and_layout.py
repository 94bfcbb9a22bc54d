"""snnTorch's recurrent drop-ins with ``sparse=True`` (the fused layer's recurrent current from the weight rows of the
neurons that spiked) and ``sequence``'s refusal of inputs whose states show they are not time first."""

import pytest
import torch

from spikefuse.compat import snntorch as cs

snntorch = pytest.importorskip("snntorch")

RECURRENT = {
    "rleaky": (snntorch.RLeaky if snntorch else None, cs.RLeaky, dict(beta=0.9, threshold=0.5)),
    "rsynaptic": (snntorch.RSynaptic if snntorch else None, cs.RSynaptic, dict(alpha=0.8, beta=0.9, threshold=0.5)),
}


def _snntorch_loop(peer, x):
    peer.reset_mem()
    return torch.stack([peer(x_t)[0] for x_t in x.unbind(0)])


@pytest.mark.parametrize("name", RECURRENT)
def test_sparse_sequence_is_the_reference_sparse_layer_and_snntorch_spikes(name):
    """``sparse=True``: ``sequence`` gives the reference backend's sparse layer bit for bit (spikes, final states;
    gradients to rounding), and on this input, with no membrane on the threshold within rounding, snnTorch's
    loop's spikes (its final states to rounding: the current sums in another order); the one-step loop keeps snnTorch's own product (its spikes bit for bit). The
    gradients are compared in float64 (in float32 the chain of 30 steps rounds apart, as the dense layer's does)."""
    peer_cls, cls, kw = RECURRENT[name]
    torch.manual_seed(0)
    peer = peer_cls(linear_features=24, **kw)
    fast, reference = (cls(linear_features=24, sparse=True, backend=b, **kw) for b in ("cpu", "reference"))
    for m in (fast, reference):
        m.load_state_dict(peer.state_dict())
    x = torch.rand(30, 5, 24, generator=torch.Generator().manual_seed(1))
    want = _snntorch_loop(peer, x).detach()
    peer_final = [getattr(peer, s).detach() for s in cls.RETURNED]
    outs, grads = [], []
    for m in (fast, reference):
        m.reset_mem()
        outs.append([t.detach() for t in m.sequence(x)])
        m.reset_mem()
        xg = x.double().requires_grad_()
        out = m.sequence(xg)
        (out[0].sum() + out[-1].sum()).backward()
        grads.append([xg.grad, m.recurrent.weight.grad, m.recurrent.bias.grad])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(outs[0][0], want) and 0 < float(want.mean()) < 1
    for a, b in zip(outs[0][1:], peer_final):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    fast.reset_mem()
    assert torch.equal(torch.stack([fast(x_t)[0] for x_t in x.unbind(0)]), want)


@pytest.mark.parametrize("name", RECURRENT)
def test_sparse_is_off_by_default_and_refused_where_it_cannot_run(name):
    _, cls, kw = RECURRENT[name]
    assert cls(linear_features=4, **kw).sparse is False
    with pytest.raises(ValueError, match="sparse must be True or False, got 'auto'"):
        cls(linear_features=4, sparse="auto", **kw)
    with pytest.raises(ValueError, match=r"sparse=True .* takes linear_features, not V \(one to one"):
        cls(all_to_all=False, sparse=True, **kw)
    with pytest.raises(ValueError, match=r"sparse=True .* not V .* or conv2d_channels \(a convolution\)"):
        cls(conv2d_channels=2, kernel_size=3, sparse=True, **kw)
    with pytest.raises(
        ValueError, match=r"sparse=True runs on the CPU backend \(or the reference\), got backend='triton'"
    ):
        cls(linear_features=4, sparse=True, backend="triton", **kw)


def test_sequence_refuses_a_batch_first_input_by_the_states_given():
    """``[B, T, F]`` with the states of a step ``[B, F]``: refused, pointing to the transpose and the time-major
    collate (a step of the loop would zero such states, as snnTorch's does)."""
    lif = cs.RLeaky(beta=0.9, linear_features=6)
    spk, mem = torch.zeros(4, 6), torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"x_seq \(4, 10, 6\) looks batch-first \[B, T, ...\]: the state spk given is"):
        lif.sequence(torch.rand(4, 10, 6), spk, mem)
    with pytest.raises(ValueError, match=r"x.transpose\(0, 1\), or collate .* with spikefuse.data.time_major"):
        lif.sequence(torch.rand(4, 10, 6), None, mem, record=True)
    with pytest.raises(ValueError, match=r"the state mem given is \(3, 6\), not the shape of a step \(4, 6\)"):
        lif.sequence(torch.rand(10, 4, 6), spk[:1].expand(4, 6), mem[:3])
    spikes, _ = lif.sequence(torch.rand(10, 4, 6), spk, mem)  # time first: runs
    assert spikes.shape == (10, 4, 6)


@pytest.mark.parametrize("cls", [cs.Leaky, cs.RLeaky])
def test_sequence_refuses_one_step_of_the_loops_shape(cls):
    """A step ``[B, F]`` of the loop's shape given to ``sequence`` (which would run B steps of one sample): refused
    by the states kept from the loop, or given."""
    lif = cls(beta=0.9, linear_features=6) if cls is cs.RLeaky else cls(beta=0.9)
    x_t = torch.rand(4, 6)
    lif(x_t)
    with pytest.raises(ValueError, match=r"takes the steps \[T, ...\] of a sequence, got \(4, 6\): the shape of one"):
        lif.sequence(x_t)
    lif.reset_mem()  # zeros of the loop's shape: still one step's
    with pytest.raises(ValueError, match=r"call forward\(x\) for one step, or sequence\(x.unsqueeze\(0\)\)"):
        lif.sequence(x_t, record=True)
    assert lif.sequence(x_t.unsqueeze(0))[0].shape == (1, 4, 6)


def test_sequence_takes_states_of_another_batch_and_reset_mems_empty_states():
    """Not refused: kept states of an earlier batch (the last, smaller batch of an epoch, even where T equals the
    earlier batch size: zeroed, as the loop zeroes them) and the empty states of a fresh ``reset_mem()``."""
    lif = cs.RLeaky(beta=0.9, linear_features=6)
    spk, mem = lif.reset_mem()
    assert spk.numel() == 0
    lif.sequence(torch.rand(8, 8, 6), spk, mem)
    spikes, last = lif.sequence(torch.rand(8, 3, 6))
    assert spikes.shape == (8, 3, 6) and last.shape == (3, 6)
