"""Fused BatchNorm (+ residual) + any engine neuron (``spikefuse.batchnorm_neuron``) against the composition
``F.batch_norm`` -> ``spikefuse.neuron(..., backend="reference")``.

The current-based and adaptive LIF, and SpikingJelly's hard-reset PLIF form (a neuron that hands on its post-reset
state), on every backend (Triton under its interpreter): spikes, final states and running statistics equal, and the
gradients of x, gamma, beta, the residual, learnable per-channel parameters and the initial states within 1e-5
relative; gradcheck in float64 through the cpu backend's fused normalization; saved-for-backward bytes; errors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import spikefuse  # noqa: E402
from spikefuse.neurons import ALIF_MODEL, CUBA_LIF_MODELS, SPIKINGJELLY_MODELS  # noqa: E402
from spikefuse.ops.bitpack import packed_numel  # noqa: E402

from tests.ops.cases import saved_storages  # noqa: E402

CASES = {  # model, its parameters (the first learnable per channel), surrogate
    "cuba_lif": (CUBA_LIF_MODELS["subtract"], {"alpha": 0.7, "beta": 0.8, "threshold": 0.5}, "atan"),
    "alif": (ALIF_MODEL, {"decay": 0.8, "rho": 0.9, "b0": 0.5, "beta": 0.3}, "sigmoid"),
    "sj_hard_div_input": (
        SPIKINGJELLY_MODELS[("hard", "div_input")],
        {"decay": 2.0, "threshold": 0.5, "v_reset": 0.0},
        "sigmoid",
    ),
}


def _close(actual, expected, name):
    scale = expected.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(scale), msg=lambda m: f"{name}: {m}")


def _inputs(case, shape, dtype, residual, training, seed):
    """``x``, BatchNorm's parameters and running statistics, the residual (None, floats or spikes), the neuron's
    parameters (the first learnable per channel) and states, all leaves that require grad where they can."""
    model, values, surrogate = CASES[case]
    g = torch.Generator().manual_seed(seed)
    channels = shape[2]
    x = (torch.randn(shape, generator=g) * 1.5 + 0.4).to(dtype).requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(channels, generator=g)).to(dtype).requires_grad_(True)
    bias = (0.1 * torch.randn(channels, generator=g)).to(dtype).requires_grad_(True)
    stats = (0.1 * torch.randn(channels, generator=g)).to(dtype), (1 + torch.rand(channels, generator=g)).to(dtype)
    res = None
    if residual == "float":
        res = torch.randn(shape, generator=g).to(dtype).requires_grad_(True)
    elif residual == "spikes":
        res = (torch.rand(shape, generator=g) > 0.6).to(dtype).requires_grad_(True)
    first, *rest = model.params
    params = {
        first: torch.full((channels,), values[first], dtype=dtype).requires_grad_(True),
        **{p: values[p] for p in rest},
    }
    state = tuple((0.2 * torch.randn(shape[1:], generator=g)).to(dtype).requires_grad_(True) for _ in model.states)
    return model, surrogate, x, weight, bias, stats, res, params, state


def _composition(model, surrogate, x, weight, bias, stats, res, params, state, training, momentum=0.1):
    rm, rv = (s.clone() for s in stats)
    y = F.batch_norm(x.flatten(0, 1), rm, rv, weight, bias, training, momentum, 1e-5).unflatten(0, x.shape[:2])
    if res is not None:
        y = y + res
    spikes, final = spikefuse.neuron(
        y, model, surrogate=surrogate, state=state, return_state=True, backend="reference", **params
    )
    return spikes, final, (rm, rv)


def _fused(model, surrogate, x, weight, bias, stats, res, params, state, training, backend, binary, momentum=0.1):
    rm, rv = (s.clone() for s in stats)
    spikes, final = spikefuse.batchnorm_neuron(
        x,
        rm,
        rv,
        weight,
        bias,
        training,
        momentum,
        model=model,
        surrogate=surrogate,
        state=state,
        return_state=True,
        backend=backend,
        residual=res,
        residual_binary=binary,
        **params,
    )
    return spikes, final, (rm, rv)


def _leaves(x, weight, bias, res, params, state):
    return [
        ("x", x),
        ("weight", weight),
        ("bias", bias),
        *([("residual", res)] if res is not None else []),
        *((f"param {k}", v) for k, v in params.items() if isinstance(v, torch.Tensor)),
        *((f"state {i}", v) for i, v in enumerate(state)),
    ]


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "residual,training,dtype",
    [
        (None, True, torch.float32),
        ("spikes", True, torch.float32),
        ("float", True, torch.float64),
        (None, False, torch.float64),
    ],
    ids=["plain-train-fp32", "spikes-train-fp32", "float-train-fp64", "plain-eval-fp64"],
)
def test_matches_composition(backend, case, residual, training, dtype):
    if backend == "triton" and dtype == torch.float64 and residual is None:
        pytest.skip("the interpreter is slow: Triton runs the three other ways")
    shape = (4, 3, 5, 2, 3)
    model, surrogate, x, weight, bias, stats, res, params, state = _inputs(case, shape, dtype, residual, training, 7)
    ref_spikes, ref_final, ref_stats = _composition(
        model, surrogate, x, weight, bias, stats, res, params, state, training
    )
    spikes, final, fused_stats = _fused(
        model, surrogate, x, weight, bias, stats, res, params, state, training, backend, residual == "spikes"
    )
    assert 0 < float(ref_spikes.detach().mean()) < 0.9, "the case must spike, and not everywhere"
    assert torch.equal(spikes, ref_spikes)
    for a, b in zip(final, ref_final):
        assert torch.equal(a, b)
    for a, b in zip(fused_stats, ref_stats):
        assert torch.equal(a, b)
    g = torch.Generator().manual_seed(3)
    grad_spikes = torch.randn(shape, generator=g).to(dtype)
    grad_states = [torch.randn(shape[1:], generator=g).to(dtype) for _ in final]
    leaves = _leaves(x, weight, bias, res, params, state)

    def grads(out_spikes, out_final):
        loss = (out_spikes * grad_spikes).sum() + sum((v * gv).sum() for v, gv in zip(out_final, grad_states))
        return torch.autograd.grad(loss, [v for _, v in leaves])

    for (name, _), got, want in zip(leaves, grads(spikes, final), grads(ref_spikes, ref_final)):
        _close(got, want, name)


@pytest.mark.parametrize("case", ["cuba_lif", "sj_hard_div_input"])
@pytest.mark.parametrize("residual", [None, "spikes"])
def test_gradcheck_fp64_cpu(case, residual):
    """The cpu backend normalizes inside its neuron kernel in training mode: gradcheck goes through that, on the
    final states with a detached reset, where the exact derivative exists (spikes are piecewise constant, and their
    backward is the surrogate by design)."""
    model, surrogate, x, weight, bias, stats, res, params, state = _inputs(
        case, (3, 2, 3, 2), torch.float64, residual, True, 11
    )
    first = model.params[0]

    def fn(x, weight, bias, p, *state):
        rm, rv = (s.clone() for s in stats)
        spikes, final = spikefuse.batchnorm_neuron(
            x,
            rm,
            rv,
            weight,
            bias,
            True,
            model=model,
            surrogate=surrogate,
            detach_reset=True,
            state=state,
            return_state=True,
            backend="cpu",
            residual=res,
            residual_binary=res is not None,
            **{**params, first: p},
        )
        assert 0 < float(spikes.detach().mean()) < 1, "the case must spike, and not everywhere"
        return final

    assert torch.autograd.gradcheck(fn, (x, weight, bias, params[first], *state), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_saves_only_x_residual_bits_and_per_channel_values(backend):
    shape = (6, 4, 8, 5, 5)
    model, surrogate, x, weight, bias, stats, res, params, state = _inputs(
        "alif", shape, torch.float32, "spikes", True, 5
    )
    state = None
    storages, _ = saved_storages(
        lambda: _fused(model, surrogate, x, weight, bias, stats, res, params, state, True, backend, True)
    )
    per_channel = 64 * shape[2] * 4  # mean, invstd, weight, bias, parameters: a few per-channel vectors at most
    expected = x.numel() * x.element_size() + packed_numel(x.numel())
    assert expected <= sum(storages.values()) <= expected + per_channel


def test_errors():
    x = torch.randn(2, 3, 4)
    model = CUBA_LIF_MODELS["subtract"]
    kw = dict(alpha=0.5, beta=0.5)
    with pytest.raises(TypeError, match="model must be a spikefuse.neurons.NeuronModel"):
        spikefuse.batchnorm_neuron(x, None, None, training=True, model="cuba", **kw)
    with pytest.raises(TypeError, match="cuba_lif has no parameter 'decay'"):
        spikefuse.batchnorm_neuron(x, None, None, training=True, model=model, decay=0.5, **kw)
    with pytest.raises(ValueError, match="batchnorm_neuron expects x of shape \\[T, B, C, ...\\]"):
        spikefuse.batchnorm_neuron(torch.randn(2, 3), None, None, training=True, model=model, **kw)
    with pytest.raises(ValueError, match="residual has shape \\(2, 3, 5\\) but x has \\(2, 3, 4\\)"):
        spikefuse.batchnorm_neuron(x, None, None, training=True, model=model, residual=torch.zeros(2, 3, 5), **kw)
    with pytest.raises(ValueError, match="cuba_lif: state v must be a tensor of shape \\(3, 4\\)"):
        spikefuse.batchnorm_neuron(
            x, None, None, training=True, model=model, state=(torch.zeros(3, 4), torch.zeros(3)), **kw
        )
    with pytest.raises(ValueError, match="training=False normalizes with the running statistics"):
        spikefuse.batchnorm_neuron(x, None, None, training=False, model=model, **kw)
