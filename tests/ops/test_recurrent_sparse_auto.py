"""``sparse="auto"`` on the recurrent layer (:func:`spikefuse.recurrent`, ``nn.Recurrent*``): each call takes the
sparse layer where the previous call with the same weight tensor counted a spike rate below
``spikefuse.ops.recurrent.CROSSOVER_RECURRENT``, the dense one otherwise; either way the call is bit for bit that of
``sparse=True`` or ``sparse=False`` (spikes, states and every gradient), and it records its own rate, counted from the
bits its kernels wrote, for the next.
"""

import pytest
import torch

import spikefuse
import spikefuse.nn as snn
from spikefuse.neurons import LIF_MODELS
from spikefuse.ops import recurrent as recurrent_ops
from spikefuse.ops.recurrent import autograd as recurrent_autograd

MODEL = LIF_MODELS[("snntorch", "soft")]
PARAMS = {"decay": 0.9, "threshold": 0.8}


def _inputs(t_steps=12, batch=3, hidden=70, drive=0.3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t_steps, batch, hidden, generator=g, dtype=dtype) * 0.8 + drive
    weight = torch.randn(hidden, hidden, generator=g, dtype=dtype) * (0.6 / hidden**0.5)
    bias = torch.randn(hidden, generator=g, dtype=dtype) * 0.1
    return x, weight, bias


def _run(x, weight, bias, sparse, backend="cpu", memory="potential"):
    """Spikes, final state and the gradients of x, the weight and the bias; ``weight`` is used as given (a leaf),
    so that ``auto`` finds its rate."""
    xs, bs = x.clone().requires_grad_(), bias.clone().requires_grad_()
    spikes, final = spikefuse.recurrent(
        xs, MODEL, weight, bs, return_state=True, sparse=sparse, backend=backend, memory=memory, **PARAMS
    )
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    loss = (spikes * upstream).sum() + (final[0] * 1.5).sum()
    return (spikes.detach(), *(v.detach() for v in final), *torch.autograd.grad(loss, [xs, weight, bs]))


def _rate(spikes):
    return int(spikes.count_nonzero()) / spikes.numel()


def _identical(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.fixture
def sparse_calls(monkeypatch):
    """How many forwards took the sparse product (the cpu kernels' one-call forward)."""
    calls = []
    forward = recurrent_autograd._forward_impl

    def spy(*args):
        calls.append(recurrent_autograd.OBJECTS[args[-1]].sparse)
        return forward(*args)

    monkeypatch.setattr(recurrent_autograd, "_forward_impl", spy)
    return calls


@pytest.mark.parametrize("memory", ["potential", "recompute"])
def test_auto_takes_either_way_by_the_last_rate_bit_for_bit(sparse_calls, monkeypatch, memory):
    """First call dense (no rate yet), then sparse below the crossover, dense at or above it: each call equals
    sparse=True's or sparse=False's bit for bit, and records the rate of the spikes it made."""
    x, weight, bias = _inputs()
    leaf = weight.clone().requires_grad_()
    dense = _run(x, weight.clone().requires_grad_(), bias, False, memory=memory)
    sparse = _run(x, weight.clone().requires_grad_(), bias, True, memory=memory)
    rate = _rate(dense[0])
    assert 0.05 < rate < 0.95
    assert not all(torch.equal(u, v) for u, v in zip(dense[3:], sparse[3:]))  # the two ways are told apart
    sparse_calls.clear()
    assert recurrent_ops.last_spike_rate(leaf) is None
    _identical(_run(x, leaf, bias, "auto", memory=memory), dense)  # no rate yet: dense
    assert recurrent_ops.last_spike_rate(leaf) == rate  # counted from the bits the dense forward packed
    monkeypatch.setattr(recurrent_ops, "CROSSOVER_RECURRENT", rate + 1e-6)
    _identical(_run(x, leaf, bias, "auto", memory=memory), sparse)
    assert recurrent_ops.last_spike_rate(leaf) == _rate(sparse[0])  # counted from the sparse kernel's words
    monkeypatch.setattr(recurrent_ops, "CROSSOVER_RECURRENT", rate)  # at the crossover: dense
    _identical(_run(x, leaf, bias, "auto", memory=memory), dense)
    assert sparse_calls == [False, True, False]


def test_auto_on_the_reference_backend():
    """The reference's ways: its dense current or SparseCurrent, the same choice, bit for bit."""
    x, weight, bias = _inputs(t_steps=6, hidden=20, dtype=torch.float64)
    leaf = weight.clone().requires_grad_()
    dense = _run(x, weight.clone().requires_grad_(), bias, False, backend="reference")
    sparse = _run(x, weight.clone().requires_grad_(), bias, True, backend="reference")
    _identical(_run(x, leaf, bias, "auto", backend="reference"), dense)
    assert recurrent_ops.last_spike_rate(leaf) == _rate(dense[0])
    original = recurrent_ops.CROSSOVER_RECURRENT
    recurrent_ops.CROSSOVER_RECURRENT = 1.0
    try:
        _identical(_run(x, leaf, bias, "auto", backend="reference"), sparse)
    finally:
        recurrent_ops.CROSSOVER_RECURRENT = original


def test_the_rate_belongs_to_the_weight_tensor():
    """Another tensor of the same values has no rate; a freed weight's entry goes with it."""
    x, weight, bias = _inputs(t_steps=3, hidden=8)
    a = weight.clone()
    spikefuse.recurrent(x, MODEL, a, bias, sparse="auto", **PARAMS)
    assert recurrent_ops.last_spike_rate(a) is not None
    assert recurrent_ops.last_spike_rate(weight.clone()) is None
    key = id(a)
    del a
    assert key not in recurrent_ops._RATES


def test_auto_takes_dense_where_sparse_cannot_run(sparse_calls):
    """A one-to-one weight, non-binary initial spikes: dense, no refusal, no rate recorded."""
    x, weight, bias = _inputs(t_steps=4, hidden=6)
    diag = weight[0].clone()
    assert torch.equal(
        spikefuse.recurrent(x, MODEL, diag, sparse="auto", **PARAMS),
        spikefuse.recurrent(x, MODEL, diag, **PARAMS),
    )
    state = (torch.zeros(3, 6), torch.full((3, 6), 0.5))
    spikefuse.recurrent(x, MODEL, weight, state=state, sparse="auto", **PARAMS)
    assert recurrent_ops.last_spike_rate(diag) is None and recurrent_ops.last_spike_rate(weight) is None
    assert sparse_calls == [False, False, False]


def test_layer_auto(monkeypatch, sparse_calls):
    """``nn.Recurrent*(sparse="auto")``: its recurrent weight (a parameter) keeps the rate between calls; the layer's
    calls equal a dense and a sparse layer's of the same weights bit for bit."""
    torch.manual_seed(0)
    layers = {s: snn.RecurrentLIF(33, decay=0.8, threshold=0.5, sparse=s) for s in (False, True, "auto")}
    for layer in layers.values():
        layer.load_state_dict(layers[False].state_dict())
    assert "sparse='auto'" in repr(layers["auto"])
    x = torch.rand(15, 2, 33, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(recurrent_ops, "CROSSOVER_RECURRENT", 1.0)

    def step(layer):
        layer.zero_grad()
        y = layer(x)
        (y * torch.linspace(-1, 1, 33)).sum().backward()
        return y.detach(), layer.recurrent.weight.grad.clone(), layer.recurrent.bias.grad.clone()

    want = {s: step(layers[s]) for s in (False, True)}
    sparse_calls.clear()
    _identical(step(layers["auto"]), want[False])  # first call: dense
    _identical(step(layers["auto"]), want[True])  # the rate is known: sparse
    assert sparse_calls == [False, True]
    assert 0 < recurrent_ops.last_spike_rate(layers["auto"].recurrent.weight) < 1
