"""Perez-Nieves & Goodman's sparse gradient through the recurrent layer (:class:`spikefuse.surrogate.Active`): the
gradients of a neuron's states after a step are zero where the step's fire value is outside the window.

The oracle: the reference backend's serial loop (:func:`spikefuse.ops.engine.reference.run`, the states' gradients
masked by ``torch.where``). The cpu backend against it on fresh random inputs: spikes and final states bit-identical,
every gradient to 1e-5 relative (float32 and float64), with ``sparse_grad`` False / True / "auto", both memory
modes, ``sparse`` True and False, odd sizes, T=1, B=1; the share of nonzero ``G`` below the exact gradient's on the
same input; a hand-written mask of the states' gradients on a LIF; the refusals of every other entry point that
takes a surrogate, by message.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (conftest may have chosen the GPU)

import pickle

import pytest
import torch

import spikefuse
from spikefuse.neurons import ALIF_MODEL, CUBA_LIF, LIF_MODELS, SPIKINGJELLY_MODELS, neuron_spec
from spikefuse.surrogate import Active, ATan, Rectangle, Sigmoid, Triangle, Windowed

MODELS = {
    "leaky": (LIF_MODELS[("snntorch", "soft")], {"decay": 0.9, "threshold": 0.8}),
    "cuba_lif": (CUBA_LIF, {"alpha": 0.8, "beta": 0.7, "threshold": 0.9}),
    "alif": (ALIF_MODEL, {"decay": 0.8, "rho": 0.9, "b0": 0.6, "beta": 0.4}),
    # a handoff: the states handed out after the last step's reset
    "sj_hard_mul_input": (SPIKINGJELLY_MODELS[("hard", "mul_input")], {"decay": 0.6, "threshold": 0.7}),
}
LEAKY = MODELS["leaky"]


def _inputs(t_steps, batch, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t_steps, batch, hidden, generator=g, dtype=dtype) * 0.8 + 0.3
    weight = torch.randn(hidden, hidden, generator=g, dtype=dtype) * (0.6 / hidden**0.5)
    bias = torch.randn(hidden, generator=g, dtype=dtype) * 0.1
    upstream = torch.randn(x.shape, generator=g, dtype=dtype)
    return x, weight, bias, upstream


def _grads(model, params, x, weight, bias, upstream, learn_params=False, **kw):
    """Spikes, final states and the gradients of x, the weight, the bias, the initial spikes and states (and of the
    parameters made tensors with ``learn_params``)."""
    batch, hidden = x.shape[1:]
    g = torch.Generator().manual_seed(7)
    spikes0 = (torch.rand(batch, hidden, generator=g) < 0.3).to(x.dtype)
    init = [torch.randn(batch, hidden, generator=g, dtype=x.dtype) * 0.2 for _ in model.states]
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias, spikes0, *init)]
    params = dict(params)
    if learn_params:
        for i, (k, v) in enumerate(params.items()):
            params[k] = torch.full((hidden,), v, dtype=x.dtype) + 0.01 * torch.arange(hidden, dtype=x.dtype) / hidden
            params[k].requires_grad_()
            leaves.append(params[k])
    spikes, final = spikefuse.recurrent(
        leaves[0], model, leaves[1], leaves[2], state=(*leaves[4 : 4 + len(init)], leaves[3]), return_state=True,
        **params, **kw,
    )  # fmt: skip
    loss = (spikes * upstream).sum() + sum((v * (i + 1.5)).sum() for i, v in enumerate(final[:-1]))
    return spikes, final, torch.autograd.grad(loss, leaves)


def _close(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        scale = float(b.abs().max()) or 1.0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale, msg=f"gradient {i}")


@pytest.mark.parametrize("sparse_grad", [False, True, "auto"])
@pytest.mark.parametrize("memory", ["potential", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_cpu_equals_the_reference(name, dtype, memory, sparse_grad):
    model, params = MODELS[name]
    x, weight, bias, upstream = _inputs(13, 3, 70, dtype)
    surrogate = Active(Sigmoid(4.0), 0.3)
    kw = {"surrogate": surrogate, "memory": memory, "sparse_grad": sparse_grad}
    for _ in range(2 if sparse_grad == "auto" else 1):  # "auto": the second call takes the way the first counted
        spikes, final, got = _grads(model, params, x, weight, bias, upstream, backend="cpu", **kw)
        spikes_r, final_r, want = _grads(model, params, x, weight, bias, upstream, backend="reference", **kw)
        assert torch.equal(spikes, spikes_r)
        for a, b in zip(final, final_r):
            assert torch.equal(a, b)
        _close(got, want)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 5), (1, 4, 33), (9, 1, 65), (6, 2, 1)], ids=str)
def test_odd_shapes_and_learned_parameters(shape, sparse):
    model, params = LEAKY
    for dtype in (torch.float32, torch.float64):
        x, weight, bias, upstream = _inputs(*shape, dtype, seed=3)
        kw = {"surrogate": Active(ATan(), 0.4), "sparse": sparse, "sparse_grad": True, "learn_params": True}
        spikes, _, got = _grads(model, params, x, weight, bias, upstream, backend="cpu", **kw)
        spikes_r, _, want = _grads(model, params, x, weight, bias, upstream, backend="reference", **kw)
        assert torch.equal(spikes, spikes_r)
        _close(got, want)


def test_the_oracle_masks_the_states_gradients():
    """The reference's gradient against a hand-written LIF loop whose membrane's gradient is masked by a hook."""
    model, params = LEAKY
    torch.manual_seed(1)
    t_steps, batch, hidden = 11, 2, 17
    x, weight, bias, upstream = _inputs(t_steps, batch, hidden, torch.float64, seed=5)
    width, surrogate = 0.25, Active(Sigmoid(4.0), 0.25)

    class Spike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, u):
            ctx.save_for_backward(u)
            return (u > 0).to(u.dtype)

        @staticmethod
        def backward(ctx, g):
            (u,) = ctx.saved_tensors
            return g * surrogate.derivative(u)

    def loop(x, weight, bias):
        v = torch.zeros(batch, hidden, dtype=x.dtype)
        s = torch.zeros(batch, hidden, dtype=x.dtype)
        out = []
        for t in range(t_steps):
            reset = Spike.apply(v - params["threshold"])
            v = params["decay"] * v + x[t] + s @ weight.t() + bias - reset * params["threshold"]
            keep = (v - params["threshold"]).abs() <= width
            v.register_hook(lambda g, keep=keep: torch.where(keep, g, 0.0))
            s = Spike.apply(v - params["threshold"])
            out.append(s)
        return torch.stack(out)

    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    want = torch.autograd.grad((loop(*leaves) * upstream).sum(), leaves)
    for backend in ("reference", "cpu"):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        spikes = spikefuse.recurrent(
            leaves[0], model, leaves[1], leaves[2], surrogate=surrogate, backend=backend, **params
        )
        got = torch.autograd.grad((spikes * upstream).sum(), leaves)
        _close(got, want)


@pytest.mark.parametrize("name", list(MODELS))
def test_nonzero_share_drops(name):
    model, params = MODELS[name]
    x, weight, bias, upstream = _inputs(40, 4, 64, torch.float32, seed=11)
    share = {}
    for label, surrogate in (("exact", Windowed(Sigmoid(4.0), 0.3)), ("active", Active(Sigmoid(4.0), 0.3))):
        _, _, grads = _grads(model, params, x, weight, bias, upstream, backend="cpu", surrogate=surrogate)
        share[label] = float((grads[0] != 0).double().mean())
    assert 0 < share["active"] < share["exact"], share


def test_active_surrogate_itself():
    a = Active(Sigmoid(4.0), 0.5)
    assert type(a).__name__ == "ActiveSigmoid" and isinstance(a, Active) and not isinstance(a, Windowed)
    assert a.params() == (4.0, 0.5)
    u = torch.linspace(-1, 1, 41, dtype=torch.float64)
    assert torch.equal(a.derivative(u), Windowed(Sigmoid(4.0), 0.5).derivative(u))
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(Active("atan", 1)) == "Active(surrogate=ATan(alpha=2.0), width=1.0)"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Active(Rectangle(0.5), 0.2), "has two parameters"),
        (lambda: Active(Sigmoid(), 0.0), "width must be a positive finite number"),
        (lambda: Active(Sigmoid(), float("inf")), "width must be a positive finite number"),
        (lambda: Windowed(Active(Sigmoid(), 0.3), 0.3), "Active surrogate, windowed already"),
    ],
)
def test_bad_surrogates_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


ONLY_RECURRENT = "only spikefuse.recurrent implements"


def test_triton_backend_refuses():
    model, params = LEAKY
    x, weight, bias, _ = _inputs(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="triton backend does not implement.*backend='cpu'"):
        spikefuse.recurrent(x, model, weight, bias, surrogate=Active(Sigmoid(), 0.3), backend="triton", **params)


def test_other_entry_points_refuse():
    active = Active(Triangle(2.0), 0.5)
    x = torch.randn(5, 2, 3, 4, 4)
    model, params = LEAKY
    for backend in ("cpu", "reference"):
        with pytest.raises(ValueError, match=f"neuron layer.*{ONLY_RECURRENT}"):
            spikefuse.neuron(x, model, surrogate=active, backend=backend, **params)
        with pytest.raises(ValueError, match=ONLY_RECURRENT):
            spikefuse.lif(x, surrogate=active, backend=backend)
    with pytest.raises(ValueError, match=f"neuron layer.*{ONLY_RECURRENT}"):
        spikefuse.nn.LIF(surrogate=active)(x)
    mean, var = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match=f"BatchNorm fused.*{ONLY_RECURRENT}"):
        spikefuse.batchnorm_lif(x, mean, var, training=True, surrogate=active, backend="cpu")
    with pytest.raises(ValueError, match=f"BatchNorm fused.*{ONLY_RECURRENT}"):
        spikefuse.batchnorm_neuron(x, mean, var, training=True, model=model, surrogate=active, backend="cpu", **params)
    from spikefuse.distributed import timesplit_lif, timesplit_neuron

    with pytest.raises(ValueError, match=f"time split.*{ONLY_RECURRENT}"):
        timesplit_lif(x, surrogate=active)
    with pytest.raises(ValueError, match=f"time split.*{ONLY_RECURRENT}"):
        timesplit_neuron(x, model, surrogate=active, **params)
    from spikefuse.ops.engine import step as one_step

    spec = neuron_spec(model, active)
    p = [torch.tensor([v]) for v in params.values()]
    with pytest.raises(ValueError, match=f"one-step.*{ONLY_RECURRENT}"):
        one_step.step(spec, x[0], p, [torch.zeros_like(x[0])])


def test_one_to_one_weight():
    model, params = MODELS["cuba_lif"]
    x, _, bias, upstream = _inputs(15, 2, 23, torch.float64, seed=4)
    weight = torch.randn(23, dtype=torch.float64) * 0.5
    kw = {"surrogate": Active(Sigmoid(4.0), 0.3), "memory": "recompute"}
    spikes, _, got = _grads(model, params, x, weight, bias, upstream, backend="cpu", **kw)
    spikes_r, _, want = _grads(model, params, x, weight, bias, upstream, backend="reference", **kw)
    assert torch.equal(spikes, spikes_r)
    _close(got, want)
