"""Sparse gradients through the recurrent layer (:func:`spikefuse.recurrent` with ``sparse_grad``): the backward reads
only the nonzero entries of ``G``, the gradient of every step's input current.

The oracle: the dense backward of the same kernels with its per-step product ``G[t] @ W`` replaced by the plain-torch
sum in the sparse order (:func:`~spikefuse.ops.spike_layers.reference.linear_reference` ``(G[t], W.t())``), bit for
bit, for every gradient but the weight's, which is bit for bit the plain-torch sum over all steps in its own order
(:func:`~spikefuse.ops.spike_layers.reference.weight_grad_reference`). Against the dense backward: gradients to 1e-5,
gradcheck in float64; odd sizes, T=1, B=1, H=1, all-zero and all-nonzero ``G``; ``"auto"`` both ways; the refusals.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (conftest may have chosen the GPU)

import pytest
import torch

import spikefuse
import spikefuse.nn as snn
from spikefuse.models.srnn import SRNN
from spikefuse.neurons import ALIF_MODEL, CUBA_LIF, LIF_MODELS
from spikefuse.ops import recurrent as recurrent_ops
from spikefuse.ops.recurrent import autograd as recurrent_autograd
from spikefuse.ops.spike_layers import reference
from spikefuse.surrogate import ATan, Rectangle, Triangle
from tests.ops.cases import recurrent_gradcheck

MODELS = {
    "leaky": (LIF_MODELS[("snntorch", "soft")], {"decay": 0.9, "threshold": 0.8}),
    "cuba_lif": (CUBA_LIF, {"alpha": 0.8, "beta": 0.7, "threshold": 0.9}),
    "alif": (ALIF_MODEL, {"decay": 0.8, "rho": 0.9, "b0": 0.6, "beta": 0.4}),
}


def _inputs(t_steps, batch, hidden, dtype, seed=0, drive=0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t_steps, batch, hidden, generator=g, dtype=dtype) * 0.8 + drive
    weight = torch.randn(hidden, hidden, generator=g, dtype=dtype) * (0.6 / hidden**0.5)
    bias = torch.randn(hidden, generator=g, dtype=dtype) * 0.1
    upstream = torch.randn(x.shape, generator=g, dtype=dtype)
    return x, weight, bias, upstream


def _grads(model, params, x, weight, bias, upstream, final_weight=1.0, **kw):
    """Spikes and the gradients of x, the weight, the bias, the initial spikes and the initial states (a Rectangle
    surrogate unless ``kw`` names one); ``final_weight`` scales the final states' part of the loss."""
    batch, hidden = x.shape[1:]
    g = torch.Generator().manual_seed(7)
    spikes0 = (torch.rand(batch, hidden, generator=g) < 0.3).to(x.dtype)
    init = [torch.randn(batch, hidden, generator=g, dtype=x.dtype) * 0.2 for _ in model.states]
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias, spikes0, *init)]
    kw = {"surrogate": Rectangle(0.5), **kw}
    spikes, final = spikefuse.recurrent(
        leaves[0], model, leaves[1], leaves[2], state=(*leaves[4:], leaves[3]), return_state=True, **params, **kw
    )
    loss = (spikes * upstream).sum() + final_weight * sum((v * (i + 1.5)).sum() for i, v in enumerate(final[:-1]))
    return spikes, torch.autograd.grad(loss, leaves)


def _in_sparse_order(grad, weight, out):
    """The dense backward's per-step product replaced by the plain-torch sum in the sparse kernel's order."""
    return out.copy_(reference.linear_reference(grad, weight.t()))


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("memory", ["recompute", "potential"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_equals_its_oracle_bit_for_bit(name, dtype, memory, sparse, monkeypatch):
    model, params = MODELS[name]
    x, weight, bias, upstream = _inputs(13, 3, 70, dtype)  # 70 neurons: odd, two words a row with sparse=True
    kw = {"backend": "cpu", "memory": memory, "sparse": sparse, "final_weight": 0.0}  # (final states: G everywhere)
    spikes, got = _grads(model, params, x, weight, bias, upstream, sparse_grad=True, **kw)
    grad_x = got[0]
    share = float((grad_x != 0).double().mean())
    assert 0.05 < share < 0.95, share  # zeros to skip and nonzeros to sum
    monkeypatch.setattr(recurrent_autograd, "current_backward", _in_sparse_order)
    spikes_o, want = _grads(model, params, x, weight, bias, upstream, **kw)
    assert torch.equal(spikes, spikes_o)
    for i, (a, b) in enumerate(zip(got, want)):
        if i != 1:  # the weight's gradient: below
            assert torch.equal(a, b), i
    hidden = x.shape[2]
    previous = torch.cat([_spikes0(x, model), spikes[:-1].reshape(-1, hidden)])
    flat_g = grad_x.reshape(-1, hidden)
    if sparse:  # from the spikes' bits: the rows in increasing order
        assert torch.equal(got[1], reference.weight_grad_reference(flat_g, previous))
    else:  # from G's CSR: G's rows in increasing order
        assert torch.equal(got[1], reference.weight_grad_reference(previous, flat_g).t())
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


def _spikes0(x, model):
    """The initial spikes :func:`_grads` passes (the same generator)."""
    batch, hidden = x.shape[1:]
    g = torch.Generator().manual_seed(7)
    return (torch.rand(batch, hidden, generator=g) < 0.3).to(x.dtype)


@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (1, 4, 9), (9, 1, 65), (7, 3, 67), (5, 2, 128)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_against_the_dense_backward(shape, dtype):
    model, params = MODELS["leaky"]
    x, weight, bias, upstream = _inputs(*shape, dtype, seed=3)
    spikes_d, dense = _grads(model, params, x, weight, bias, upstream, backend="cpu")
    for kw in ({"backend": "cpu"}, {"backend": "cpu", "sparse": True}, {"backend": "reference"}):
        spikes, got = _grads(model, params, x, weight, bias, upstream, sparse_grad=True, **kw)
        assert torch.equal(spikes, spikes_d)
        for a, b in zip(got, dense):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("surrogate", [Rectangle(1e-6), ATan(2.0)], ids=["all_zero", "all_nonzero"])
def test_all_zero_and_all_nonzero_gradients(surrogate):
    """A surrogate nowhere nonzero at these membranes, and no final-state loss: ``G`` all zero (the sparse products
    add nothing; the gradients are exact zeros); ATan: ``G`` nowhere zero (every entry summed)."""
    model, params = MODELS["leaky"]
    x, weight, bias, upstream = _inputs(8, 3, 33, torch.float64, seed=5)
    final_weight = 0.0 if isinstance(surrogate, Rectangle) else 1.0
    kw = {"surrogate": surrogate, "backend": "cpu", "final_weight": final_weight}
    _, dense = _grads(model, params, x, weight, bias, upstream, **kw)
    _, got = _grads(model, params, x, weight, bias, upstream, sparse_grad=True, **kw)
    share = float((got[0] != 0).double().mean())
    assert share == (0.0 if final_weight == 0.0 else 1.0)
    for a, b in zip(got, dense):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)
    if final_weight == 0.0:
        assert not got[1].any() and not got[3].any()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gradcheck_fp64(backend):
    model, params = MODELS["cuba_lif"]
    x, weight, bias, _ = _inputs(6, 2, 4, torch.float64, seed=11)
    recurrent_gradcheck(model, params, x, weight, bias, backend, sparse_grad=True)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_auto_takes_either_way_by_the_last_share(backend):
    """The first call and a share at or above CROSSOVER_GRAD_RECURRENT: the dense backward bit for bit; below it: the sparse
    one bit for bit. Every call records its own share of nonzero G."""
    model, params = MODELS["leaky"]
    x, weight, bias, upstream = _inputs(64, 4, 40, torch.float32, seed=9)  # 256 rows: CROSSOVER_ROWS

    def run(w, sparse_grad):
        spikes = spikefuse.recurrent(x, model, w, bias, surrogate=Rectangle(0.5), backend=backend,
                                     sparse_grad=sparse_grad, **params)  # fmt: skip
        return torch.autograd.grad((spikes * upstream).sum(), [w, spikes])

    dense_w, _ = run(weight.clone().requires_grad_(), False)
    sparse_w, _ = run(weight.clone().requires_grad_(), True)
    assert not torch.equal(dense_w, sparse_w)  # (rounding tells the two ways apart)
    w = weight.clone().requires_grad_()
    assert recurrent_ops.last_grad_rate(w) is None
    assert torch.equal(run(w, "auto")[0], dense_w)
    assert 0 < recurrent_ops.last_grad_rate(w) < 1  # the share of nonzero G it counted
    recurrent_ops.record_grad_rate(w, recurrent_ops.CROSSOVER_GRAD_RECURRENT / 2)
    assert torch.equal(run(w, "auto")[0], sparse_w)
    recurrent_ops.record_grad_rate(w, recurrent_ops.CROSSOVER_GRAD_RECURRENT)
    assert torch.equal(run(w, "auto")[0], dense_w)


def test_auto_below_the_rows_and_where_it_cannot_run_is_dense():
    model, params = MODELS["leaky"]
    x, weight, bias, upstream = _inputs(8, 2, 16, torch.float32)  # 16 rows: below CROSSOVER_ROWS
    w = weight.clone().requires_grad_()
    recurrent_ops.record_grad_rate(w, 0.0)
    spikes = spikefuse.recurrent(x, model, w, bias, backend="cpu", sparse_grad="auto", **params)
    (got,) = torch.autograd.grad(spikes.sum(), w)
    w2 = weight.clone().requires_grad_()
    (want,) = torch.autograd.grad(spikefuse.recurrent(x, model, w2, bias, backend="cpu", **params).sum(), w2)
    assert torch.equal(got, want)
    one_to_one = torch.full((16,), 0.1, requires_grad=True)  # nothing to skip: auto runs dense, True refuses
    spikefuse.recurrent(x, model, one_to_one, backend="cpu", sparse_grad="auto", **params).sum().backward()
    with pytest.raises(ValueError, match="one to one"):
        spikefuse.recurrent(x, model, one_to_one, backend="cpu", sparse_grad=True, **params)


def test_refusals():
    model, params = MODELS["leaky"]
    x, weight, bias, _ = _inputs(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="sparse_grad must be True, False or 'auto', got 'yes'"):
        spikefuse.recurrent(x, model, weight, bias, sparse_grad="yes", **params)
    w = weight.clone().requires_grad_()
    with pytest.raises(ValueError, match="triton backend has no kernel .* backend='cpu'.* sparse_grad='auto'"):
        spikefuse.recurrent(x, model, w, bias, backend="triton", sparse_grad=True, **params)
    with pytest.raises(ValueError, match="sparse_grad must be True, False or 'auto'"):
        snn.RecurrentLIF(8, sparse_grad="on")
    with pytest.raises(ValueError, match="sparse_grad must be True, False or 'auto'"):
        SRNN(8, 3, hidden=8, sparse_grad=1)
    with torch.no_grad():  # no backward: nothing to refuse, the forward as always
        spikefuse.recurrent(x, model, weight, bias, backend="triton", sparse_grad=True, **params)


@pytest.mark.parametrize("cls", ["RecurrentLIF", "RecurrentCubaLIF", "RecurrentALIF"])
def test_modules(cls):
    kw = {
        "RecurrentLIF": {},
        "RecurrentCubaLIF": {"alpha": 0.8, "beta": 0.9},
        "RecurrentALIF": {"decay": 0.9, "rho": 0.95},
    }[cls]
    torch.manual_seed(0)
    dense = getattr(snn, cls)(24, surrogate=Triangle(2.0), backend="cpu", **kw)
    sparse = getattr(snn, cls)(24, surrogate=Triangle(2.0), backend="cpu", sparse_grad=True, **kw)
    sparse.load_state_dict(dense.state_dict())
    assert "sparse_grad=True" in repr(sparse)
    x = torch.randn(12, 3, 24) * 0.8 + 0.4
    for layer in (dense, sparse):
        layer(x).square().sum().backward()
    for a, b in zip(dense.parameters(), sparse.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


def test_srnn_passes_it_to_its_recurrent_layers():
    from spikefuse.nn import LIF, NeuronFactory

    net = SRNN(
        10,
        3,
        hidden=16,
        sparse_grad="auto",
        neuron=NeuronFactory(LIF, dict(decay=0.9, threshold=0.5, surrogate=Rectangle())),
    )
    layers = [m for m in net.modules() if isinstance(m, snn.Recurrent)]
    assert layers and all(m.sparse_grad == "auto" for m in layers)
    net(torch.randn(6, 2, 10)).sum().backward()


@pytest.mark.parametrize("memory, sparse", [("potential", False), ("recompute", True)])
def test_custom_ops_with_sparse_grad_pass_opcheck(memory, sparse):
    """The custom ops with ``sparse_grad=True`` (``torch.compile``'s path): schema, fake kernels, autograd; its
    backward equal to the dense one's to rounding."""
    from spikefuse.neurons import neuron_spec
    from spikefuse.ops.recurrent import autograd as R

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, generator=g, dtype=torch.float64)
    params = [torch.full((1,), v, dtype=torch.float64) for v in (0.8, 0.9, 0.6, 0.4)]
    init = [torch.zeros(1, dtype=torch.float64), torch.rand(2, 5, generator=g, dtype=torch.float64)]
    spikes0 = torch.zeros(2, 5, dtype=torch.float64)
    weight = torch.randn(5, 5, generator=g, dtype=torch.float64) * 0.3
    bias = torch.zeros(5, dtype=torch.float64)
    neuron = neuron_spec(ALIF_MODEL, Rectangle(0.5), memory=memory).op_key
    call, dense = (R._call_key(neuron, "cpu", sparse, sparse_grad) for sparse_grad in (True, False))
    args = (x, weight, bias, spikes0, params, init, call)
    torch.library.opcheck(R.recurrent_forward, args)
    out = R.recurrent_forward(*args)
    grads = [torch.rand_like(x), [torch.rand(2, 5, generator=g, dtype=torch.float64) for _ in init]]
    layer = [x if memory == "recompute" else x.new_empty(0), weight, bias, spikes0, out[3]]
    need = [True, True, False, True, False, False, False]
    backward_args = (*grads, layer, params, init, list(out[4:]))
    torch.library.opcheck(R.recurrent_backward, (*backward_args, call, need))
    for a, b in zip(
        R.recurrent_backward(*backward_args, call, need), R.recurrent_backward(*backward_args, dense, need)
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
