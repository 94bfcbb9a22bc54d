"""The default initial state (one value shared by every neuron, ``[1]``, as the API passes it, with a shared zero
state gradient when the state is unused) through the API: the reference's results on every backend."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import spikefuse  # noqa: E402

SHAPE = (5, 2, 3, 7)  # T, B, C, inner: N = 42 (not a multiple of a vector width)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("return_state", [False, True])
def test_default_initial_state_through_the_api(backend, return_state):
    """``lif`` without ``v_init`` (shared start, shared zero state gradient when the state is unused) against the
    reference, with the state used or not, learnable per-channel decay."""
    x = (torch.rand(SHAPE) * 0.8).requires_grad_(True)
    decay = torch.full((SHAPE[2],), 0.4, requires_grad=True)
    grads = []
    for name in ("reference", backend):
        xr, dr = x.detach().clone().requires_grad_(True), decay.detach().clone().requires_grad_(True)
        out = spikefuse.lif(xr, decay=dr, threshold=0.5, v_reset=0.1, return_state=return_state, backend=name)
        spikes, state = out if return_state else (out, None)
        w = torch.linspace(-1, 1, spikes.numel()).reshape(spikes.shape)
        loss = (spikes * w).sum() + (state.sum() * 0.5 if state is not None else 0.0)
        loss.backward()
        grads.append((spikes.detach(), None if state is None else state.detach(), xr.grad, dr.grad))
    (s0, st0, gx0, gd0), (s1, st1, gx1, gd1) = grads
    assert torch.equal(s0, s1) and (st0 is None or torch.equal(st0, st1))
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gd1, gd0, rtol=1e-5, atol=1e-5)
