"""Norse 1.1's feed-forward LIF and LSNN as spikefuse neuron models (``spikefuse.compat.norse``), on the generated
CPU kernels and the reference, against Norse's own modules: spikes and post-reset states bit for bit in float32
over 40 steps, input gradients to 1e-5 over 12.

Why not over 40: the surrogate's derivative is rounded differently (Norse divides the gradient by
``(|u| + 1)^2``, spikefuse multiplies it by the derivative), a last-bit difference that the LSNN's backward
recursion through its undetached resets and threshold jumps amplifies with time: about 1e-8 relative after 12
steps, 1e-3 after 40 (the same happens between two plain PyTorch loops that differ only in that division).
"""

import pytest
import torch

norse = pytest.importorskip("norse.torch")

import spikefuse  # noqa: E402
from spikefuse.compat.norse import NORSE_LIF, NORSE_LSNN, SUPERSPIKE, lif_params, lsnn_params  # noqa: E402

CASES = {
    "lif": (NORSE_LIF, lambda: norse.LIF(), lif_params, 0.8),
    "lsnn": (NORSE_LSNN, lambda: norse.LSNN(), lsnn_params, 3.0),
}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_norse(name, backend):
    model, make, params_of, scale = CASES[name]
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(40, 3, 20, generator=g) * scale).requires_grad_()
    x_ours = x.detach().clone().requires_grad_()
    z, state = make()(x)
    params = params_of()
    init = None
    if model is NORSE_LSNN:  # Norse starts b at v_th
        init = (torch.zeros(3, 20), torch.zeros(3, 20), torch.full((3, 20), float(params["v_th"])))
    ours, final = spikefuse.neuron(
        x_ours, model, surrogate=SUPERSPIKE, state=init, return_state=True, backend=backend, **params
    )
    assert 0.02 < float(z.detach().mean()) < 0.9
    assert torch.equal(ours, z)
    for k, a in zip(model.states, final):  # the post-reset states, handed out by the models' handoff
        assert torch.equal(a, getattr(state, k)), k
    # Norse's state, passed back, continues the sequence: two calls give the spikes of one
    first, middle = spikefuse.neuron(
        x_ours.detach()[:17], model, surrogate=SUPERSPIKE, state=init, return_state=True, backend=backend, **params
    )
    rest = spikefuse.neuron(
        x_ours.detach()[17:], model, surrogate=SUPERSPIKE, state=tuple(middle), backend=backend, **params
    )
    assert torch.equal(torch.cat([first, rest]), z.detach())
    w = torch.rand(z.shape, generator=g)
    (z[:12] * w[:12]).sum().backward()
    (ours[:12] * w[:12]).sum().backward()
    assert float(x.grad.abs().max()) > 0
    torch.testing.assert_close(x_ours.grad, x.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", ["LIFRecurrent", "LSNNRecurrent"])
def test_recurrent_modules_match_norse(name, backend):
    """Norse's recurrent modules against spikefuse's (the same weights drawn from the same seed): spikes and every
    state bit for bit, continuing from a Norse state too; gradients of the input and both weights to 1e-5."""
    import spikefuse.compat.norse as CN

    T, B, n_in, H = 24, 3, 12, 10
    torch.manual_seed(1)
    peer = getattr(norse, name)(n_in, H)
    torch.manual_seed(1)
    ours = getattr(CN, name)(n_in, H, backend=backend)
    x = (torch.rand(T, B, n_in, generator=torch.Generator().manual_seed(2)) < 0.3).float() * (
        4.0 if "LIF" in name else 20.0
    )
    xp, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    (zp, sp), (zo, so) = peer(xp), ours(xo)
    assert 0 < float(zp.detach().mean()) < 1
    assert torch.equal(zp, zo) and type(so).__name__ == type(sp).__name__
    for a, b in zip(sp, so):
        assert torch.equal(a, b)
    first = peer(x[:10])[1]
    assert torch.equal(ours(x[10:], first)[0], peer(x[10:], first)[0])
    upstream = torch.randn(zp.shape, generator=torch.Generator().manual_seed(3))
    grads = [
        torch.autograd.grad((z * upstream).sum() + s.v.sum(), [xx, m.input_weights, m.recurrent_weights])
        for z, s, xx, m in ((zp, sp, xp, peer), (zo, so, xo, ours))
    ]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * max(1.0, float(a.abs().max())))
    assert not grads[1][2].diagonal().any()  # no autapses: the diagonal's gradient zeroed, as in Norse


def test_backend_and_memory_refused_at_construction():
    """As the native modules: an unknown backend or memory mode fails when the module is made, not at its first call."""
    import spikefuse.compat.norse as CN

    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        CN.LIFRecurrent(4, 3, backend="cuda")
    with pytest.raises(ValueError, match="unknown memory mode 'bogus'"):
        CN.LSNNRecurrent(4, 3, memory="bogus")


@pytest.mark.parametrize("name", ["LIFRecurrent", "LSNNRecurrent"])
def test_compiles_without_a_graph_break(name):
    """``torch.compile(fullgraph=True)``: no graph break (the initial states were filled from values read on the
    host), and the eager spikes and states."""
    import spikefuse.compat.norse as CN

    cls = getattr(CN, name)
    torch.manual_seed(0)
    eager = cls(6, 5)
    traced = cls(6, 5)
    traced.load_state_dict(eager.state_dict())
    x = torch.rand(9, 3, 6) * 2
    assert torch._dynamo.explain(traced)(x).graph_break_count == 0
    (s1, st1), (s2, st2) = eager(x), torch.compile(traced, fullgraph=True, backend="aot_eager")(x)
    assert s1.sum() > 0 and torch.equal(s1, s2) and all(map(torch.equal, st1, st2))
