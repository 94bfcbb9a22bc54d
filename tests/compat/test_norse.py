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


FEED_FORWARD = {
    "LIF": lambda p: norse.LIFParameters(
        v_leak=torch.tensor(0.1), v_th=torch.tensor(0.6), tau_mem_inv=torch.tensor(80.0)
    ),
    "LSNN": lambda p: norse.LSNNParameters(v_th=torch.tensor(0.7), beta=torch.tensor(0.3)),
}


@pytest.mark.parametrize("name", list(FEED_FORWARD))
def test_feed_forward_modules_match_norse(name):
    """Norse's ``LIF``/``LSNN`` (all steps a call) and ``LIFCell``/``LSNNCell`` (a step a call, in Norse's loop), with
    Norse's parameter records: the spikes and states of Norse's modules bit for bit, Norse's state records, the input
    gradient; ``[T, F]`` inputs without a batch, a sparse input, and a net of Norse's ``SequentialState``."""
    import spikefuse.compat.norse as CN

    p = FEED_FORWARD[name](None)
    g = torch.Generator().manual_seed(4)
    x = (torch.rand(30, 3, 12, generator=g) * (3.0 if name == "LSNN" else 1.0)).requires_grad_()
    theirs, ours = getattr(norse, name)(p), getattr(CN, name)(p)
    (z1, s1), (z2, s2) = theirs(x), ours(x)
    assert 0.02 < float(z1.mean()) < 0.9 and torch.equal(z1, z2)
    assert type(s2) is type(s1) and all(torch.equal(a, b) for a, b in zip(s1, s2))
    w = torch.rand(z1.shape, generator=g)
    (g1,) = torch.autograd.grad((z1 * w).sum(), x)
    (g2,) = torch.autograd.grad((z2 * w).sum(), x)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-7)
    cells = getattr(norse, f"{name}Cell")(p), getattr(CN, f"{name}Cell")(p)
    runs = []
    for cell in cells:
        state, zs = None, []
        for x_t in x.detach():
            z, state = cell(x_t, state)
            zs.append(z)
        runs.append((torch.stack(zs), state))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[1][0], z1.detach())
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    flat = x.detach()[:, 0]  # [T, F]: no batch
    assert torch.equal(theirs(flat)[0], ours(flat)[0])
    sparse = [m(x.detach().to_sparse())[0] for m in (theirs, ours)]
    assert sparse[0].layout == sparse[1].layout and torch.equal(sparse[1].to_dense(), z1.detach())
    nets = [norse.SequentialState(torch.nn.Linear(12, 12), m) for m in (theirs, ours)]
    nets[1][0].load_state_dict(nets[0][0].state_dict())
    outs = [net(x.detach()) for net in nets]
    assert torch.equal(outs[0][0], outs[1][0])


def test_norse_records_and_refusals():
    """The recurrent modules hand out Norse's own state records; a spike function other than Norse's default is
    refused (it ran the default's gradient, silently)."""
    import spikefuse.compat.norse as CN

    _, state = CN.LIFRecurrent(4, 3)(torch.rand(5, 2, 4))
    assert isinstance(state, norse.LIFState)
    _, state = CN.LSNNRecurrent(4, 3)(torch.rand(5, 2, 4))
    assert isinstance(state, norse.LSNNState)
    for make in (
        lambda: CN.LIF(norse.LIFParameters(method="tanh")),
        lambda: CN.LIFRecurrent(4, 3, p=norse.LIFParameters(method="heaviside"))(torch.rand(5, 2, 4)),
    ):
        with pytest.raises(NotImplementedError, match="spike function method='(tanh|heaviside)'"):
            make()
    with pytest.raises(NotImplementedError, match="record_states"):
        CN.LIF(record_states=True)


@pytest.mark.parametrize("name", ["LIFRecurrent", "LSNNRecurrent"])
def test_recurrent_modules_take_what_norse_takes(name):
    """``[T, input_size]`` without a batch (the spikes ``[T, hidden_size]``, the states ``[hidden_size]``, which
    continue a sequence) runs as a batch of one: Norse's spikes, its states up to the rounding of its vector
    products (Norse multiplies vectors there, a BLAS kernel of its own); sparse inputs (sparse spikes where Norse's
    are): Norse's spikes bit for bit."""
    import spikefuse.compat.norse as CN

    torch.manual_seed(2)
    theirs = getattr(norse, name)(6, 5)
    torch.manual_seed(2)
    ours = getattr(CN, name)(6, 5)
    x = (torch.rand(20, 6, generator=torch.Generator().manual_seed(3)) < 0.4).float() * 20
    (z1, s1), (z2, s2) = theirs(x[:12]), ours(x[:12])
    assert z1.sum() > 0 and torch.equal(z1, z2)
    for a, b in zip(s1, s2):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-5)
    assert torch.equal(theirs(x[12:], s1)[0], ours(x[12:], s2)[0])
    batched = x.reshape(10, 2, 6)
    (z1, _), (z2, _) = theirs(batched.to_sparse()), ours(batched.to_sparse())
    assert z1.layout == z2.layout and torch.equal(z1.to_dense(), z2.to_dense())


@pytest.mark.parametrize("name", ["LIFRecurrentCell", "LSNNRecurrentCell"])
def test_recurrent_cells_match_norse_in_its_loop(name):
    """Norse's recurrent cells, one step a call in Norse's loop: the same weights from the same seed, Norse's spikes
    and states bit for bit, its state records; a sparse step too."""
    import spikefuse.compat.norse as CN

    torch.manual_seed(5)
    theirs = getattr(norse, name)(6, 5)
    torch.manual_seed(5)
    ours = getattr(CN, name)(6, 5)
    assert torch.equal(theirs.input_weights, ours.input_weights)
    x = (torch.rand(25, 3, 6, generator=torch.Generator().manual_seed(6)) < 0.4).float() * 20
    runs = []
    for cell in (theirs, ours):
        state, zs = None, []
        for x_t in x:
            z, state = cell(x_t, state)
            zs.append(z)
        runs.append((torch.stack(zs), state))
    (z1, s1), (z2, s2) = runs
    assert z1.sum() > 0 and torch.equal(z1, z2) and type(s2) is type(s1)
    assert all(torch.equal(a, b) for a, b in zip(s1, s2))
    sparse = [cell(x[0].to_sparse())[0] for cell in (theirs, ours)]
    assert sparse[0].layout == sparse[1].layout and torch.equal(sparse[0].to_dense(), sparse[1].to_dense())


@pytest.mark.parametrize("name", ["LIFRecurrentCell", "LSNNRecurrentCell"])
def test_recurrent_cells_step_in_one_node_with_norses_gradients(name):
    """A recurrent cell's step is one autograd node (the engine's one-step op, fed the recurrent current of the
    previous spikes) after the input's product: Norse's spikes and states bit for bit in its loop, batched and
    unbatched (``[I]`` a step: Norse's vector products), and the gradients of the input, both weights and a
    learnable ``tau_mem_inv`` of Norse's record to 1e-5 over 12 steps (see the module's docstring), from a loss on
    every step's spikes and the last states; the fused layer (``backend="reference"``) gives the same."""
    import spikefuse.compat.norse as CN

    params = norse.LSNNParameters if "LSNN" in name else norse.LIFParameters
    tau = torch.tensor(150.0, requires_grad=True)
    p = params(tau_mem_inv=tau, v_th=torch.tensor(0.3))
    g = torch.Generator().manual_seed(7)
    x = (torch.rand(12, 3, 9, generator=g) < 0.5).float() * (3.0 if "LSNN" in name else 1.0)
    upstream = torch.randn(12, 3, 8, generator=g)
    runs = {}
    for key, lib, kw in (("norse", norse, {}), ("step", CN, {}), ("fused", CN, {"backend": "reference"})):
        torch.manual_seed(8)
        cell = getattr(lib, name)(9, 8, p, **kw)
        xs = x.clone().requires_grad_()
        state, zs = None, []
        for x_t in xs:
            z, state = cell(x_t, state)
            zs.append(z)
        if key == "step":
            assert type(z.grad_fn).__name__ == "_StepBackward"
        zs = torch.stack(zs)
        loss = (zs * upstream).sum() + state.v.sum() + state.i.sum()
        inputs = [xs, cell.input_weights, cell.recurrent_weights, tau]
        runs[key] = zs, state, torch.autograd.grad(loss, inputs)
        flat, state = [], None
        for x_t in x[:, 1]:  # no batch: [I] a step
            z, state = cell(x_t, state)
            flat.append(z)
        runs[key] += (torch.stack(flat), state)
    (z1, s1, g1, f1, u1) = runs.pop("norse")
    assert 0.02 < float(z1.detach().mean()) < 0.9 and z1.dtype == torch.float32
    for key, (z2, s2, g2, f2, u2) in runs.items():
        assert torch.equal(z2, z1) and type(s2) is type(s1), key
        assert all(torch.equal(a, b) for a, b in zip(s1, s2)), key
        assert torch.equal(f2, f1) and all(a.shape == b.shape for a, b in zip(u1, u2)), key
        if key == "step":
            assert all(torch.equal(a, b) for a, b in zip(u1, u2))
        for what, a, b in zip(("input", "input_weights", "recurrent_weights", "tau_mem_inv"), g1, g2):
            assert float(a.abs().max()) > 0, what
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * max(1.0, float(a.abs().max())), msg=what)


@pytest.mark.parametrize("name", ["LIFCell", "LSNNCell"])
def test_feed_forward_cells_learn_norses_time_constant(name):
    """A tensor of Norse's record that requires grad (``tau_mem_inv``) gets Norse's gradient from the cells' steps in
    Norse's loop, to 1e-5 over 12 steps, with Norse's spikes."""
    import spikefuse.compat.norse as CN

    tau = torch.tensor(150.0, requires_grad=True)
    p = (norse.LSNNParameters if "LSNN" in name else norse.LIFParameters)(tau_mem_inv=tau, v_th=torch.tensor(0.3))
    x = torch.rand(12, 3, 7, generator=torch.Generator().manual_seed(9)) * (3.0 if "LSNN" in name else 1.0)
    runs = []
    for lib in (norse, CN):
        cell, state, zs = getattr(lib, name)(p), None, []
        for x_t in x:
            z, state = cell(x_t, state)
            zs.append(z)
        zs = torch.stack(zs)
        runs.append((zs, torch.autograd.grad(zs.sum() + state.v.sum(), tau)[0]))
    (z1, g1), (z2, g2) = runs
    assert 0.02 < float(z1.detach().mean()) < 0.9 and torch.equal(z1, z2) and float(g1) != 0
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["LIF", "LSNN"])
def test_feed_forward_layers_learn_norses_time_constant(name):
    """Norse's all-steps ``LIF`` / ``LSNN`` with a learnable ``tau_mem_inv`` in its record, trained three steps (the
    optimizer changes the tensor in place): each step's spikes Norse's bit for bit, its gradient Norse's to 1e-5 (the
    values made at construction would keep the first value and a freed graph)."""
    import spikefuse.compat.norse as CN

    x = torch.rand(12, 3, 7, generator=torch.Generator().manual_seed(9)) * (3.0 if name == "LSNN" else 1.0)
    runs = []
    for lib in (norse, CN):
        tau = torch.tensor(150.0, requires_grad=True)
        p = (norse.LSNNParameters if name == "LSNN" else norse.LIFParameters)(tau_mem_inv=tau, v_th=torch.tensor(0.3))
        layer, opt, steps = getattr(lib, name)(p), torch.optim.SGD([tau], lr=50.0), []
        for _ in range(3):
            z, state = layer(x)
            loss = z.sum() + state.v.sum()
            opt.zero_grad()
            loss.backward()
            steps.append((z.detach(), tau.grad.clone()))
            opt.step()
        runs.append(steps)
    for (z1, g1), (z2, g2) in zip(*runs):
        assert 0.02 < float(z1.mean()) < 0.9 and torch.equal(z1, z2) and float(g1) != 0
        torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-7)


def test_leaky_integrators_match_norse():
    """Norse's ``LI`` (all steps a call) and ``LICell`` (a step a call, in Norse's loop, the state passed back): the
    membranes and ``LIState`` bit for bit, gradients of the input and a learnable ``tau_mem_inv`` to 1e-5; ``[T, F]``
    inputs, sparse inputs, ``record_states``, Norse's ``SequentialState``."""
    import spikefuse.compat.norse as CN

    tau = torch.tensor(80.0, requires_grad=True)
    p = norse.LIParameters(tau_mem_inv=tau, v_leak=torch.tensor(0.1))
    x = torch.randn(30, 3, 12, generator=torch.Generator().manual_seed(7)) * 4
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    runs = []
    for make in (norse.LI, CN.LI, norse.LICell, CN.LICell):
        module, xs = make(p), x.clone().requires_grad_()
        if make in (norse.LI, CN.LI):
            v, state = module(xs)
        else:
            state, vs = None, []
            for x_t in xs:
                v_t, state = module(x_t, state)
                vs.append(v_t)
            v = torch.stack(vs)
        assert type(state) is norse.LIState
        runs.append((v, state, torch.autograd.grad((v * w).sum() + state.i.sum(), [xs, tau])))
    (v1, s1, g1), *others = runs
    for v, state, grads in others:
        assert torch.equal(v, v1) and all(map(torch.equal, state, s1))
        for a, b in zip(grads, g1):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().max())))
    theirs, ours = norse.LI(p), CN.LI(p)
    for inp in (x[:, 0], x.to_sparse()):  # [T, F] without a batch; a sparse input
        (a, sa), (b, sb) = theirs(inp), ours(inp)
        assert torch.equal(a, b) and all(map(torch.equal, sa, sb))
    (a, sa), (b, sb) = norse.LI(p, record_states=True)(x), CN.LI(p, record_states=True)(x)
    assert sb.v.shape == x.shape and all(map(torch.equal, sa, sb))
    nets = [norse.SequentialState(torch.nn.Linear(12, 5), m) for m in (theirs, ours)]
    nets[1][0].load_state_dict(nets[0][0].state_dict())
    assert torch.equal(nets[0](x)[0], nets[1](x)[0])
    with pytest.raises(TypeError, match="record_states is an argument of LI, not of LICell"):
        CN.LICell(p, record_states=True)
