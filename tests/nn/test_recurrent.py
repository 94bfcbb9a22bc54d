"""The recurrent ``nn`` layers: the same spikes and gradients as :func:`spikefuse.recurrent` on the reference, their
recurrent weights learnt, per-neuron learnable parameters, kept states, errors."""

import pytest
import torch

import spikefuse
from spikefuse import nn as snn
from spikefuse.neurons import LIF_MODELS

LAYERS = {
    "lif": lambda **kw: snn.RecurrentLIF(6, decay=0.8, threshold=0.6, learnable=("decay",), channels=6, **kw),
    "lif_soft_one_to_one": lambda **kw: snn.RecurrentLIF(
        6, decay=0.8, threshold=0.6, v_reset=None, all_to_all=False, **kw
    ),
    "cuba": lambda **kw: snn.RecurrentCubaLIF(6, alpha=0.7, beta=0.8, threshold=0.5, learnable=("beta",), **kw),
    "alif": lambda **kw: snn.RecurrentALIF(6, decay=0.8, rho=0.9, b0=0.5, beta=0.3, bias=False, **kw),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_matches_reference(name):
    torch.manual_seed(0)
    ref = LAYERS[name](backend="reference")
    ours = LAYERS[name]()
    ours.load_state_dict(ref.state_dict())
    x = torch.rand(12, 3, 6, generator=torch.Generator().manual_seed(1)) * 0.8
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for layer in (ref, ours):
        xs = x.clone().requires_grad_()
        spikes = layer(xs)
        (spikes * upstream).sum().backward()
        grads.append((spikes, xs.grad, [p.grad for p in layer.parameters()]))
    (s1, g1, p1), (s2, g2, p2) = grads
    assert 0 < float(s1.detach().mean()) < 1 and torch.equal(s1, s2)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
    assert all(a is not None for a in p1)
    for a, b in zip(p2, p1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_module_is_the_functional_layer():
    layer = snn.RecurrentLIF(5, decay=0.9, threshold=0.7)
    x = torch.rand(7, 2, 5)
    want = spikefuse.recurrent(
        x,
        LIF_MODELS[("paper", "hard")],
        layer.recurrent.weight,
        layer.recurrent.bias,
        decay=0.9,
        threshold=0.7,
        v_reset=0.0,
        surrogate="sigmoid",
    )
    assert torch.equal(layer(x), want)


def test_stateful_layer_continues_and_resets():
    layer = snn.RecurrentCubaLIF(4, alpha=0.6, beta=0.9, threshold=0.4, stateful=True)
    whole = snn.RecurrentCubaLIF(4, alpha=0.6, beta=0.9, threshold=0.4)
    whole.load_state_dict(layer.state_dict())
    x = torch.rand(10, 2, 4)
    with torch.no_grad():
        assert torch.equal(torch.cat([layer(x[:3]), layer(x[3:])]), whole(x))
        assert len(layer.state) == 3  # i, v and the last spikes
        spikefuse.nn.reset_states(torch.nn.Sequential(layer))
        assert layer.state is None and torch.equal(layer(x), whole(x))


def test_errors():
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        snn.RecurrentLIF(0, decay=0.5)
    with pytest.raises(ValueError, match="decay must lie in"):
        snn.RecurrentLIF(3, decay=1.5)
    with pytest.raises(ValueError, match=r"takes input currents \[T, B, 3\]"):
        snn.RecurrentLIF(3, decay=0.5)(torch.rand(4, 2, 5))
    with pytest.raises(ValueError, match="unknown reset"):
        snn.RecurrentCubaLIF(3, 0.5, 0.5, reset="hard-ish")


def _recurrent_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        snn.SeqToBatch(torch.nn.Linear(6, 12)),
        snn.RecurrentLIF(12, decay=0.9, threshold=0.5, backend="cpu"),
        snn.RecurrentALIF(12, decay=0.9, rho=0.95, backend="cpu", memory="recompute"),
    )


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_recurrent_custom_ops_pass_opcheck(backend):
    """torch.library.opcheck of the recurrent layer's custom ops: schema, fake kernels against the real ones, the
    autograd registration; both memory modes (what the forward keeps differs), all-to-all and one-to-one weights, and
    the sparse product on the CPU (its bits are words of another shape)."""
    from spikefuse.neurons import ALIF_MODEL, neuron_spec
    from spikefuse.ops.recurrent import autograd as R
    from spikefuse.surrogate import ATan

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, generator=g, dtype=torch.float64)
    params = [torch.tensor([0.8], dtype=torch.float64, requires_grad=True)] + [
        torch.full((1,), v, dtype=torch.float64) for v in (0.9, 0.6, 0.4)
    ]
    init = [torch.zeros(1, dtype=torch.float64), torch.rand(2, 5, generator=g, dtype=torch.float64)]
    spikes0 = torch.zeros(2, 5, dtype=torch.float64)
    runs = [
        (torch.randn(5, 5, generator=g, dtype=torch.float64) * 0.3, "potential", False),
        (torch.randn(5, generator=g, dtype=torch.float64) * 0.3, "recompute", False),
    ]
    if backend == "cpu":
        runs.append((torch.randn(5, 5, generator=g, dtype=torch.float64) * 0.3, "recompute", True))
    for weight, memory, sparse in runs:
        weight.requires_grad_(True)
        bias = torch.zeros(5, dtype=torch.float64, requires_grad=True)
        neuron = neuron_spec(ALIF_MODEL, ATan(2.0), memory=memory).op_key
        call = R._call_key(neuron, backend, sparse, False)
        args = (x, weight, bias, spikes0, params, init, call)
        torch.library.opcheck(R.recurrent_forward, args)
        out = R.recurrent_forward(*args)
        grad_spikes, grad_final = torch.rand_like(x), [torch.rand(2, 5, dtype=torch.float64) for _ in init]
        detached = [t.detach() for t in (weight, bias)]
        torch.library.opcheck(
            R.recurrent_backward,
            (
                grad_spikes,
                grad_final,
                [x if memory == "recompute" else x.new_empty(0), *detached, spikes0, out[3].detach()],
                [p.detach() for p in params],
                init,
                [t.detach() for t in out[4:]],
                call,
                [True, True, False, True, False, False, False],
            ),
        )


def test_recurrent_network_compiles_without_a_graph_break():
    """The recurrent layer is a custom op like the engine's: a recurrent network compiles with fullgraph=True, no
    graph break, and gives the eager spikes and gradients."""
    eager, compiled_net = _recurrent_net(), _recurrent_net()
    x = torch.rand(7, 3, 6) * 2
    assert torch._dynamo.explain(compiled_net)(x).graph_break_count == 0
    compiled = torch.compile(compiled_net, fullgraph=True, backend="aot_eager")
    y_eager, y_comp = eager(x), compiled(x)
    assert torch.equal(y_eager, y_comp) and 0 < float(y_eager.detach().mean()) < 1
    y_eager.sum().backward()
    y_comp.sum().backward()
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled_net.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_recurrent_layer_runs_as_its_first_call_in_a_process():
    """A compiled recurrent layer whose compiled call is the first in its process: the kernels compile then (dynamo
    traced into numba's compiler there and crashed)."""
    import subprocess
    import sys

    script = (
        "import torch, spikefuse.nn as snn\n"
        "m = snn.RecurrentLIF(16, decay=0.9, backend='cpu')\n"
        "x = torch.rand(5, 3, 16) * 2\n"
        "y = torch.compile(m, fullgraph=True, backend='aot_eager')(x)\n"
        "y.sum().backward()\n"
        "assert torch.equal(y, m(x)) and m.recurrent.weight.grad is not None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_repr_says_the_reset():
    """A soft reset shows as the constructor's ``v_reset=None`` (the repr showed the definition's unused v_reset=0.0,
    a hard reset's look); a hard one its value."""
    assert "v_reset=None" in repr(snn.RecurrentLIF(4, decay=0.9, v_reset=None))
    assert "v_reset=0.0" not in repr(snn.RecurrentLIF(4, decay=0.9, v_reset=None))
    assert "v_reset=0.25" in repr(snn.RecurrentLIF(4, decay=0.9, v_reset=0.25))


def test_compiled_recurrent_layer_without_weight_or_bias_gradients():
    """With neither the recurrent weight nor its bias learning, the backward op's empty gradients are separate tensors
    (a compiled graph refuses outputs that alias one another)."""
    layer = snn.RecurrentLIF(8, decay=0.9, threshold=1.0, backend="cpu")
    layer.recurrent.requires_grad_(False)
    x = torch.rand(6, 3, 8, requires_grad=True)
    eager = torch.autograd.grad(layer(x).sum(), x)[0]
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(torch.autograd.grad(compiled(x).sum(), x)[0], eager, rtol=1e-6, atol=1e-7)


def test_time_first_is_checked_where_the_sizes_tell():
    """One step ``[B, H]`` and a batch-first ``[B, T, H]`` after a stateful call of batch B: refused, saying what to
    do; a sequence of another batch after ``reset_state()`` runs."""
    layer = snn.RecurrentLIF(6, decay=0.9, stateful=True, backend="reference")
    with pytest.raises(ValueError, match=r"got one step \(4, 6\): pass x.unsqueeze\(0\)"):
        layer(torch.rand(4, 6))
    layer(torch.rand(5, 4, 6))  # T=5, B=4: keeps a state of batch 4
    with pytest.raises(
        ValueError, match=r"batch-first input\? Use x.transpose\(0, 1\), or collate with spikefuse.data"
    ):
        layer(torch.rand(4, 5, 6))
    layer.reset_state()
    assert layer(torch.rand(4, 5, 6)).shape == (4, 5, 6)
