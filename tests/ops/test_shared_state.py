"""``v_init`` / ``grad_state`` of one value shared by every neuron (``[1]``), as the API passes them for the default
initial state and an unused final state: the same results, bit for bit, as the same value expanded to ``[N]`` (which
the reference defines), no ``grad_v_init``, and through the API the reference's results on every backend."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import spikefuse  # noqa: E402
from spikefuse import params as P  # noqa: E402
from spikefuse.surrogate import Sigmoid  # noqa: E402

from tests.ops.cases import dynamics_combos, make_inputs, make_spec, spec_id  # noqa: E402

SHAPE = (5, 2, 3, 7)  # T, B, C, inner: N = 42 (not a multiple of a vector width)
COMBOS = [
    pytest.param(c, id=spec_id(make_spec(*c, Sigmoid(), False)).removesuffix("-sigmoid")) for c in dynamics_combos()
]


def _pair(spec, per_channel, seed=3):
    """Inputs ``(x2, leak, inner, v_shared [1], v_full [N])`` with the shared start value the API would use."""
    x, leak, _ = make_inputs(SHAPE, spec, torch.float32, seed, per_channel=per_channel)
    x2 = x.reshape(SHAPE[0], -1)
    inner = SHAPE[3] if per_channel else 1
    v_shared = torch.full((1,), spec.v_reset if spec.reset == P.HARD else 0.0)
    return x2, leak, inner, v_shared, v_shared.expand(x2.shape[1]).contiguous()


# The LIF specs' reference entry points (the neuron engine's shared-state cases: tests/neurons/test_engine.py)
@pytest.mark.parametrize("save", [P.SAVE_POTENTIAL, P.SAVE_INPUT], ids=["potential", "recompute"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize("combo", COMBOS)
def test_shared_v_init_and_grad_state_equal_their_expansion(combo, per_channel, save):
    ops = spikefuse.ops.reference
    spec = make_spec(*combo, Sigmoid(), False)
    args = spec.kernel_args()
    x2, leak, inner, v_shared, v_full = _pair(spec, per_channel)
    shared = ops.forward(x2, leak, inner, v_shared, args, save)
    full = ops.forward(x2, leak, inner, v_full, args, save)
    for a, b in zip(shared, full):
        assert (a is None and b is None) or torch.equal(a, b)

    gs = torch.randn(x2.shape, generator=torch.Generator().manual_seed(1))
    x_bwd = x2  # the reference always recomputes from x
    for gst_shared in (torch.zeros(1), torch.full((1,), 0.75)):
        gst_full = gst_shared.expand(x2.shape[1]).contiguous()
        gx_s, gv_s, gl_s = ops.backward(gs, gst_shared, x_bwd, leak, inner, v_shared, shared[2], args, save, True)
        gx_f, gv_f, gl_f = ops.backward(gs, gst_full, x_bwd, leak, inner, v_full, full[2], args, save, True)
        assert gv_s is None and gv_f is not None and gv_f.shape == (x2.shape[1],)
        assert torch.equal(gx_s, gx_f)
        assert (gl_s is None and gl_f is None) or torch.equal(gl_s, gl_f)


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
