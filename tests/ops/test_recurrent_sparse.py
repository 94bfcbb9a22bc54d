"""The sparse recurrent layer (:func:`spikefuse.recurrent` with ``sparse=True``): each step's current summed inside the
numba step kernel from the bits of the previous step's spikes, the weight's gradient from the same bits.

Its oracle is the reference backend with ``sparse=True`` (:class:`~spikefuse.ops.recurrent.SparseCurrent`, the same
sums in plain torch ops): spikes, states and currents bit for bit, the weight's gradient bit for bit against
:func:`~spikefuse.ops.spike_layers.reference.weight_grad_reference`. Against the dense layer: spikes equal but at
threshold ties (counted), gradients to 1e-5, gradcheck in float64; odd sizes, T=1, B=1, rows with no spike and with
every neuron spiking; both memory modes; the refusals.
"""

import pytest
import torch

import spikefuse
import spikefuse.nn as snn
from spikefuse.neurons import ALIF_MODEL, CUBA_LIF, LIF_MODELS, SPIKINGJELLY_MODELS
from spikefuse.ops.spike_layers import reference
from spikefuse.surrogate import ATan
from spikefuse.threads import set_threads
from tests.ops.cases import recurrent_gradcheck

MODELS = {
    "leaky": (LIF_MODELS[("snntorch", "soft")], {"decay": 0.9, "threshold": 0.8}),
    "lif_hard": (LIF_MODELS[("paper", "hard")], {"decay": 0.8, "threshold": 0.7, "v_reset": -0.1}),
    "cuba_lif": (CUBA_LIF, {"alpha": 0.8, "beta": 0.7, "threshold": 0.9}),
    "alif": (ALIF_MODEL, {"decay": 0.8, "rho": 0.9, "b0": 0.6, "beta": 0.4}),
    "sj_hard_mul_input": (SPIKINGJELLY_MODELS[("hard", "mul_input")], {"decay": 0.6, "threshold": 0.7}),
}


def _inputs(t_steps, batch, hidden, dtype, seed=0, drive=0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t_steps, batch, hidden, generator=g, dtype=dtype) * 0.8 + drive
    weight = torch.randn(hidden, hidden, generator=g, dtype=dtype) * (0.6 / hidden**0.5)
    bias = torch.randn(hidden, generator=g, dtype=dtype) * 0.1
    return x, weight, bias


def _run(model, params, x, weight, bias, upstream, **kw):
    """Spikes, final state and the gradients of x, the weight and the bias (snnTorch's surrogate, ATan(2), unless
    ``kw`` names one)."""
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    kw = {"surrogate": "atan", **kw}
    spikes, final = spikefuse.recurrent(*leaves[:1], model, *leaves[1:], return_state=True, **params, **kw)
    loss = (spikes * upstream).sum() + sum((v * (i + 1.5)).sum() for i, v in enumerate(final[:-1]))
    return spikes, final, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("memory", ["recompute", "potential"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_equals_its_reference_bit_for_bit(name, dtype, memory):
    model, params = MODELS[name]
    x, weight, bias = _inputs(11, 3, 70, dtype)  # 70 neurons: two words a row, the second part-filled
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    want = _run(model, params, x, weight, bias, upstream, backend="reference", sparse=True)
    got = _run(model, params, x, weight, bias, upstream, backend="cpu", sparse=True, memory=memory)
    assert 0 < float(want[0].detach().mean()) < 1
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    if dtype == torch.float64 or name == "leaky":  # (float32 gradients of the longer chains differ by rounding)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_weight_gradient_sums_in_the_references_order():
    """The weight's gradient ``sum_t G[t].T @ s[t-1]`` from the kept bits: bit for bit the plain-torch sum over the
    rows in increasing order (``G`` is the gradient of each step's input current, x's gradient here)."""
    model, params = MODELS["leaky"]
    x, weight, bias = _inputs(30, 5, 67, torch.float32, seed=2)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    spikes, _, (grad_x, grad_weight, _) = _run(model, params, x, weight, bias, upstream, backend="cpu", sparse=True)
    previous = torch.cat([torch.zeros_like(spikes[:1]), spikes[:-1]]).reshape(-1, 67)
    assert torch.equal(grad_weight, reference.weight_grad_reference(grad_x.reshape(-1, 67), previous))


@pytest.mark.parametrize("name", ["leaky", "alif"])
def test_against_the_dense_layer(name):
    """The same spikes as the dense product but at threshold ties (their count in a SHD-sized layer: under 1e-5 of
    the spikes), gradients to 1e-5 in float64."""
    model, params = MODELS[name]
    x, weight, bias = _inputs(100, 32, 256, torch.float32, seed=4, drive=-0.3)
    dense = spikefuse.recurrent(x, model, weight * 4, bias, backend="cpu", **params)
    sparse = spikefuse.recurrent(x, model, weight * 4, bias, backend="cpu", sparse=True, **params)
    assert 0.02 < float(dense.mean()) < 0.2  # 37,000-93,000 spikes
    assert float((dense != sparse).sum()) < 1e-5 * float(dense.sum())
    x, weight, bias = _inputs(20, 4, 33, torch.float64, seed=5)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=x.dtype)
    want = _run(model, params, x, weight, bias, upstream, backend="cpu")
    got = _run(model, params, x, weight, bias, upstream, backend="cpu", sparse=True)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 3, 5), (6, 1, 1), (4, 1, 64), (3, 2, 65), (5, 2, 130)], ids=str)
def test_odd_shapes(shape):
    model, params = MODELS["lif_hard"]
    x, weight, bias = _inputs(*shape, torch.float64, seed=7)
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(8), dtype=x.dtype)
    want = _run(model, params, x, weight, bias, upstream, backend="reference", sparse=True)
    got = _run(model, params, x, weight, bias, upstream, backend="cpu", sparse=True)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("drive", [-50.0, 50.0], ids=["no_spike", "all_spike"])
def test_rows_with_no_spike_and_all_spiking(drive):
    model, params = MODELS["leaky"]
    x, weight, bias = _inputs(4, 3, 70, torch.float64, seed=9, drive=drive)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(10), dtype=x.dtype)
    want = _run(model, params, x, weight, bias, upstream, backend="cpu")
    got = _run(model, params, x, weight, bias, upstream, backend="cpu", sparse=True)
    assert float(got[0].detach().mean()) in (0.0, 1.0) and torch.equal(got[0], want[0])
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gradcheck_fp64(backend):
    """As the dense layer's gradcheck: a narrow rectangle surrogate and no membrane near the threshold make the
    outputs smooth in the input, the weight (spikes present), the bias and the parameters."""
    model, params = MODELS["cuba_lif"]
    x, weight, bias = _inputs(6, 2, 4, torch.float64, seed=11)
    recurrent_gradcheck(model, params, x, weight, bias, backend, sparse=True)


def test_continuation_through_the_state_and_threads():
    """A run split in two calls (the second starting from the first's last spikes, packed as the first step's bits)
    equals one call; one thread and two give the same bits (each row's sums are the row's own)."""
    model, params = MODELS["alif"]
    x, weight, bias = _inputs(12, 40, 64, torch.float32, seed=12)  # 40*64 neurons: enough to split the rows
    kw = dict(backend="cpu", return_state=True, sparse=True, **params)
    whole, whole_state = spikefuse.recurrent(x, model, weight, bias, **kw)
    first, state = spikefuse.recurrent(x[:5], model, weight, bias, **kw)
    second, last = spikefuse.recurrent(x[5:], model, weight, bias, state=state, **kw)
    assert torch.equal(torch.cat([first, second]), whole)
    for a, b in zip(last, whole_state):
        assert torch.equal(a, b)
    try:
        set_threads(1)
        serial = spikefuse.recurrent(x, model, weight, bias, **kw)[0]
    finally:
        set_threads(2)
    assert torch.equal(serial, whole)


def test_layer_option():
    torch.manual_seed(0)
    dense = snn.RecurrentALIF(33, decay=0.8, rho=0.9, b0=0.5, beta=0.3)
    sparse = snn.RecurrentALIF(33, decay=0.8, rho=0.9, b0=0.5, beta=0.3, sparse=True)
    sparse.load_state_dict(dense.state_dict())
    assert "sparse=True" in repr(sparse) and "sparse" not in repr(dense)
    x = torch.rand(15, 2, 33, generator=torch.Generator().manual_seed(1))
    got, want = sparse(x), dense(x)
    assert 0 < float(want.mean()) and torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(sparse.recurrent.weight.grad, dense.recurrent.weight.grad, rtol=1e-5, atol=1e-6)


def test_refusals_say_why():
    model, params = MODELS["leaky"]
    x, weight, bias = _inputs(3, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="sparse must be True, False or 'auto', got 'yes'"):
        spikefuse.recurrent(x, model, weight, sparse="yes", **params)
    with pytest.raises(ValueError, match="sparse must be True, False or 'auto', got 1"):
        snn.RecurrentLIF(4, decay=0.9, sparse=1)
    with pytest.raises(ValueError, match="one to one"):
        spikefuse.recurrent(x, model, weight[0], sparse=True, **params)
    with pytest.raises(ValueError, match="the backend is 'triton'"):
        spikefuse.recurrent(x, model, weight, sparse=True, backend="triton", **params)
    state = (torch.zeros(2, 4), torch.full((2, 4), 0.5))
    with pytest.raises(ValueError, match="initial spikes of state hold a value other than 0 and 1"):
        spikefuse.recurrent(x, model, weight, state=state, sparse=True, **params)
    with pytest.raises(ValueError, match="one to one"):
        snn.RecurrentLIF(4, decay=0.9, all_to_all=False, sparse=True)(x)


def test_compiles_with_a_state_and_checks_its_spikes_in_the_op():
    """``sparse=True`` with a ``state`` under ``torch.compile(fullgraph=True)``: no graph break (the initial spikes'
    check, which reads values, runs inside the op), the eager spikes; spikes other than 0 and 1 refused there too."""
    model, params = MODELS["leaky"]
    x, weight, bias = _inputs(5, 2, 9, torch.float32)
    spikes0 = (torch.rand(2, 9, generator=torch.Generator().manual_seed(4)) > 0.5).float()
    surrogate = ATan(2.0)  # (an instance: a name makes one while dynamo traces, a graph break of its own)

    def run(x, spikes0):
        state = (torch.zeros(2, 9), spikes0)
        return spikefuse.recurrent(x, model, weight, bias, state=state, sparse=True, surrogate=surrogate, **params)

    compiled = torch.compile(run, fullgraph=True, dynamic=False)
    assert torch._dynamo.explain(run)(x, spikes0).graph_break_count == 0
    assert torch.equal(compiled(x, spikes0), run(x, spikes0))
    with pytest.raises(
        ValueError, match="sparse=True reads the initial spikes as bits, but the initial spikes of state"
    ):
        compiled(x, spikes0 * 0.5)
