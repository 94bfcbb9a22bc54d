"""The public API: validation of bad input (by message), backend selection, state continuation, the Triton
backend against the reference."""

import os
import subprocess
import sys

import pytest
import torch

import spikefuse
from tests import lif_spec
from spikefuse.surrogate import ATan, Rectangle
from tests.triton_on_cuda import GPU_TEST_MODE


def lif(x, **kw):
    kw.setdefault("decay", 0.2)
    kw.setdefault("threshold", 0.3)
    return spikefuse.lif(x, **kw)


@pytest.mark.parametrize(
    "x, kwargs, error, message",
    [
        (torch.ones(3, 4, dtype=torch.int32), {}, TypeError, "floating-point dtype"),
        (torch.ones(3, 4, dtype=torch.bool), {}, TypeError, "floating-point dtype"),
        (torch.tensor(1.0), {}, ValueError, "time dimension first"),
        (torch.ones(0, 4), {}, ValueError, "T=0"),
        ([1.0, 2.0], {}, TypeError, "torch.Tensor"),
        (torch.ones(3, 4), {"v_init": torch.zeros(5)}, ValueError, "v_init has shape"),
        (torch.ones(3, 4), {"v_init": torch.zeros(4, dtype=torch.int64)}, TypeError, "v_init must be a floating-point"),
        (torch.ones(3, 4), {"v_init": torch.zeros(4, device="meta")}, ValueError, "same device"),
        (torch.ones(3, 4), {"decay": torch.ones(4, device="meta")}, ValueError, "same device"),
        (torch.ones(3, 4), {"surrogate": "nope"}, ValueError, "unknown surrogate 'nope': use one of"),
        (torch.ones(3, 4), {"surrogate": object()}, ValueError, "unknown surrogate"),
        (torch.ones(3, 4), {"backend": "cuda"}, ValueError, "unknown backend 'cuda': use one of"),
        (torch.ones(3, 4), {"memory": "none"}, ValueError, "unknown memory mode"),
        (torch.ones(3, 4), {"decay": float("nan")}, TypeError, "finite number"),
        (torch.ones(3, 4), {"decay": torch.ones(2, 2)}, ValueError, "scalar or a 1-D per-channel"),
        (torch.ones(3, 2, 5), {"decay": torch.ones(4)}, ValueError, "has 5 channels in dim 2"),
        (torch.ones(3, 4), {"threshold": "1"}, TypeError, "threshold must be a number"),
        (torch.ones(3, 4), {"v_reset": "0"}, TypeError, "v_reset must be a number or None"),
        (torch.ones(3, 4), {"threshold": float("inf")}, ValueError, "threshold must be a finite number"),
        (torch.ones(3, 4), {"threshold": float("nan")}, ValueError, "threshold must be a finite number"),
        (torch.ones(3, 4), {"v_reset": float("-inf")}, ValueError, "v_reset must be a finite number"),
        (torch.ones(3, 4), {"decay": torch.tensor(float("nan"))}, ValueError, r"decay holds NaN or inf \(nan\)"),
        (torch.ones(3, 4), {"decay": torch.tensor([0.5, float("inf")])}, ValueError, "channel 1: inf"),
        (torch.ones(3, 4), {"decay": -0.5}, ValueError, r"decay must lie in \[0, 1\].*got -0.5"),
        (torch.ones(3, 4), {"decay": 1.5}, ValueError, r"decay must lie in \[0, 1\].*got 1.5"),
        (torch.ones(3, 4), {"decay": torch.tensor([0.5, 0.2, 1.25, 0.1])}, ValueError, "channel 2: 1.25"),
        (torch.ones(3, 4), {"threshold": 0.0}, ValueError, "threshold must be > 0"),
        (torch.ones(3, 4), {"threshold": -0.3}, ValueError, "threshold must be > 0"),
        (torch.ones(3, 4), {"threshold": 0.3, "v_reset": 0.3}, ValueError, "v_reset must be below the threshold"),
    ],
)
def test_bad_input_raises_clear_error(x, kwargs, error, message):
    with pytest.raises(error, match=message):
        lif(x, backend=kwargs.pop("backend", "reference"), **kwargs)


@pytest.mark.skipif(GPU_TEST_MODE, reason="the GPU test mode accepts CPU tensors for backend='triton'")
def test_fused_backends_refuse_wrong_device_with_advice(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors.*TRITON_INTERPRET=1"):
        lif(torch.ones(2, 3), backend="triton")
    with pytest.raises(ValueError, match="no fused backend for device type 'meta'"):
        lif(torch.ones(2, 3, device="meta"))


def test_auto_picks_cpu_for_cpu_tensors():
    assert spikefuse.ops.resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert spikefuse.ops.resolve_backend("auto", torch.device("cuda")) == "triton"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("v_reset", [0.0, 0.15, None])
def test_state_continues_the_sequence_exactly(backend, v_reset):
    """Two chunks with the state passed on equal one call: spikes, state and gradients."""
    torch.manual_seed(0)
    x = torch.rand(9, 2, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(9, 2, 6, dtype=torch.float64)
    kw = dict(decay=0.4, threshold=0.5, v_reset=v_reset, surrogate=ATan(), backend=backend, return_state=True)
    y_full, v_full = lif(x, **kw)
    ((y_full * g).sum() + v_full.sum()).backward()
    grad_full = x.grad.clone()
    x.grad = None
    y_a, v_a = lif(x[:4], **kw)
    y_b, v_b = lif(x[4:], v_init=v_a, **kw)
    assert torch.equal(torch.cat([y_a, y_b]), y_full) and torch.equal(v_b, v_full)
    ((torch.cat([y_a, y_b]) * g).sum() + v_b.sum()).backward()
    torch.testing.assert_close(x.grad, grad_full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_per_channel_learnable_decay_gets_gradients(backend):
    torch.manual_seed(0)
    decay = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, requires_grad=True)
    x = torch.rand(5, 2, 3, 4, dtype=torch.float64)
    y = lif(x, decay=decay, surrogate=Rectangle(), backend=backend)
    y.sum().backward()
    assert decay.grad.shape == (3,) and decay.grad.abs().sum() > 0


def test_half_precision_inputs_give_half_spikes_and_float_state():
    x = torch.rand(4, 10).to(torch.bfloat16)
    y, v = lif(x, backend="reference", return_state=True)
    assert y.dtype == torch.bfloat16 and v.dtype == torch.float32


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_parameter_range_checks_reject_on_every_backend(backend):
    """The checks sit in the API, before dispatch: a fused backend cannot skip them."""
    with pytest.raises(ValueError, match="decay holds NaN"):
        lif(torch.rand(3, 4), decay=torch.tensor(float("nan")), backend=backend)
    with pytest.raises(ValueError, match="threshold must be > 0"):
        lif(torch.rand(3, 4), threshold=-1.0, backend=backend)


@pytest.mark.parametrize("decay", [0.0, 1.0, torch.tensor([0.0, 1.0])])
def test_decay_range_includes_its_ends(decay):
    """0 (no memory) and 1 (IF) are the ends of the allowed range, and a soft reset keeps a threshold > 0."""
    y = lif(torch.rand(3, 2, 2), decay=decay, backend="reference")
    assert y.shape == (3, 2, 2)
    assert lif(torch.rand(3, 4), v_reset=None, threshold=0.1, backend="reference").shape == (3, 4)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_zero_neurons_give_empty_results(backend):
    """Zero channels (an empty per-channel decay) or zero neurons: empty spikes and state, no division by zero."""
    y, v = lif(torch.rand(4, 2, 0), decay=torch.rand(0), backend=backend, return_state=True)
    assert y.shape == (4, 2, 0) and v.shape == (2, 0)
    x = torch.rand(4, 0, 3, requires_grad=True)
    lif(x, backend=backend).sum().backward()
    assert x.grad is not None and x.grad.shape == (4, 0, 3)


def _gradient_penalty(backend):
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 16).double()
    x = torch.randn(4, 3, 8, dtype=torch.float64, requires_grad=True)
    y = spikefuse.lif(linear(x), decay=0.5, threshold=0.3, backend=backend)
    (grad_x,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (grad_x**2).sum().backward()
    return linear.weight.grad


def test_double_backward_through_fused_neuron_raises_naming_the_reference():
    """A gradient penalty through the fused kernels used to return a silently wrong d/dW (23.86 vs 21.09)."""
    with pytest.raises(RuntimeError, match="double backward.*'cpu'.*layers with backend='reference'"):
        _gradient_penalty("cpu")


def test_double_backward_on_the_reference_backend_is_autograd_exact():
    """The reference is plain autograd: its second derivative is that of the same loop written inline."""
    grad_w = _gradient_penalty("reference")
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 16).double()
    x = torch.randn(4, 3, 8, dtype=torch.float64, requires_grad=True)
    h, s, spikes = torch.zeros(3, 16, dtype=torch.float64), torch.zeros(3, 16, dtype=torch.float64), []
    for z in linear(x).unbind(0):  # Eq. (1)-(2) with the sigmoid surrogate written as a straight-through term
        h = 0.5 * h * (1 - s) + z
        sig = torch.sigmoid(4 * (h - 0.3))
        s = (h >= 0.3).double() + sig - sig.detach()
        spikes.append(s)
    (grad_x,) = torch.autograd.grad(torch.stack(spikes).sum(), x, create_graph=True)
    (grad_x**2).sum().backward()
    torch.testing.assert_close(grad_w, linear.weight.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_first_order_backward_with_retain_graph_still_works(backend):
    x = torch.rand(4, 6, requires_grad=True)
    y = lif(x, backend=backend)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert x.grad.abs().sum() > 0


def test_torch_func_over_fused_kernels_raises_and_reference_works():
    x = torch.rand(4, 5)
    with pytest.raises(RuntimeError, match=r"torch.func transforms .* fused 'cpu' kernels; use backend='reference'"):
        torch.func.grad(lambda x: lif(x, backend="cpu").sum())(x)
    grad = torch.func.grad(lambda x: lif(x, backend="reference").sum())(x)
    leaf = x.clone().requires_grad_(True)
    lif(leaf, backend="reference").sum().backward()
    assert torch.equal(grad, leaf.grad)
    batched = torch.func.vmap(lambda x: lif(x, backend="reference"))(torch.rand(3, 4, 5))
    assert batched.shape == (3, 4, 5)


# The public API on backend="triton" (Triton's interpreter on the CPU, or the GPU with SPIKEFUSE_TEST_TRITON=cuda)
# against the reference: the kernels generated from the LIF definitions of spikefuse.neurons.lif


def _api_specs():
    """Every dynamics x reset x charge combination of the LIF spec, surrogates cycled, detach_reset alternating."""
    from tests.ops.cases import SURROGATES, dynamics_combos, make_spec, spec_id

    specs = [
        make_spec(*combo, SURROGATES[i % len(SURROGATES)], i % 2 == 1, variant=i)
        for i, combo in enumerate(dynamics_combos())
    ]
    return [pytest.param(spec, id=spec_id(spec)) for spec in specs]


API_SPECS = _api_specs()


def _triton_against_reference(spec, memory, shape, seed, *, chained, per_channel=True):
    """The LIF forms on Triton and on the reference (two chained calls with a learnable decay and v_init, or one)
    over the inputs ``tests.ops.cases.make_inputs`` draws: outputs bit for bit, gradients to 1e-5."""
    from tests.ops.cases import make_inputs

    x, leak, v = make_inputs(shape, spec, seed=seed, per_channel=per_channel)
    results = {}
    for backend in ("triton", "reference"):
        xr, kr, vr = x.clone().requires_grad_(), leak.clone().requires_grad_(chained), v.clone().requires_grad_(chained)
        w = torch.linspace(-1, 1, x.numel()).reshape(x.shape)
        if chained:
            s1, st1 = lif_spec.run(xr[:3], kr, spec, v_init=vr, backend=backend, memory=memory)
            s2, st2 = lif_spec.run(xr[3:], kr, spec, v_init=st1, backend=backend, memory=memory)
            outputs, spikes = (s1, s2, st2), torch.cat([s1, s2])
        else:
            spikes, st2 = lif_spec.run(xr, kr, spec, v_init=vr, backend=backend, memory=memory)
            outputs = (spikes, st2)
        ((spikes * w).sum() + (st2 * st2).sum()).backward()
        results[backend] = outputs, (xr.grad, vr.grad, kr.grad)
    (got, got_grads), (want, want_grads) = results["triton"], results["reference"]
    if x.numel() > 20:
        assert 0 < float(want[0].detach().mean()) < 1, "the input must make some spikes and not only spikes"
    for g, w in zip(got, want):
        assert torch.equal(g.detach(), w.detach())
    for name, g, w in zip(("x", "v_init", "decay"), got_grads, want_grads):
        if w is None:
            assert g is None or not g.any(), name
            continue
        scale = max(float(w.abs().max()), 1.0)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("memory", ["potential", "recompute"])
@pytest.mark.parametrize("spec", API_SPECS)
def test_triton_backend_equals_the_reference(spec, memory):
    _triton_against_reference(spec, memory, (6, 2, 3, 4), 1, chained=False)


@pytest.mark.parametrize("memory", ["potential", "recompute"])
def test_triton_backend_learnable_decay_v_init_and_continuation(memory):
    _triton_against_reference(API_SPECS[0].values[0], memory, (6, 2, 3, 4), 3, chained=True)


@pytest.mark.parametrize(
    "shape",
    [(1, 1), (1, 7), (5, 1), (3, 1, 1, 1), (2, 3, 1, 5, 2), (1, 300), (3, 5, 7)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_triton_backend_odd_shapes(shape):
    """T=1, N=1, unit and trailing dims; a per-channel decay wherever the rank allows more than one channel."""
    _triton_against_reference(
        API_SPECS[7].values[0], "recompute", shape, len(shape), chained=False, per_channel=len(shape) > 2
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_backend_half_precision(dtype):
    """float16 / bfloat16 inputs on Triton, read and written in their dtype, computed in float32: the reference's
    spikes (in the input's dtype) and float32 state bit for bit, its input gradient rounded to the input's dtype."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.rand(7, 2, 3, 5, generator=gen) * 0.9).to(dtype)
    upstream = torch.rand(x.shape, generator=gen).to(dtype)
    results = {}
    for backend in ("triton", "reference"):
        leaf = x.clone().requires_grad_()
        spikes, state = spikefuse.lif(leaf, decay=0.7, threshold=0.5, backend=backend, return_state=True)
        spikes.backward(upstream)
        results[backend] = spikes, state, leaf.grad
    (s, v, g), (s_ref, v_ref, g_ref) = results["triton"], results["reference"]
    assert s.dtype == g.dtype == dtype and v.dtype == torch.float32 and 0 < float(s.detach().float().mean()) < 1
    assert torch.equal(s, s_ref) and torch.equal(v, v_ref)
    torch.testing.assert_close(g.float(), g_ref.float(), rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_importing_spikefuse_does_not_import_triton():
    code = "import sys, spikefuse, spikefuse.functional, spikefuse.ops; assert 'triton' not in sys.modules, 'triton'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_a_backend_whose_compiler_is_missing_says_what_to_install(monkeypatch):
    """numba missing: the first call on the cpu backend names the package to install and the way out."""
    from spikefuse.ops import engine

    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    for name in ("spikefuse.ops.engine.cpu", "spikefuse.ops.numba_common", "spikefuse.batchnorm.cpu"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # restored afterwards
    with pytest.raises(
        RuntimeError,
        match=r"backend='cpu' cannot run: .*numba.*pip install numba. or pick "
        r"backend='reference'",
    ):
        engine.module("cpu")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_parameters_checked_in_the_compute_dtype(backend):
    """A v_reset that only float64 tells apart from the threshold, and a threshold that overflows float32: refused
    on every backend in the dtype the neurons compute in; float64 inputs take them."""
    x = torch.rand(3, 4)
    with pytest.raises(ValueError, match=r"v_reset 0.29999999999 is not below the threshold 0.3 in float32"):
        spikefuse.lif(x, decay=0.5, threshold=0.3, v_reset=0.29999999999, backend=backend)
    with pytest.raises(ValueError, match=r"threshold 1e\+40 is not finite in float32"):
        spikefuse.lif(x, decay=0.5, threshold=1e40, backend=backend)
    assert spikefuse.lif(x.double(), decay=0.5, threshold=1e40, backend=backend).sum() == 0
    with pytest.raises(ValueError, match=r"threshold must be finite in float32"):
        spikefuse.neuron(x, spikefuse.neurons.CUBA_LIF, alpha=0.5, beta=0.5, threshold=1e40, backend=backend)
