"""``spikefuse.nn.CubaLIF``, ``ALIF`` and ``EngineNeuron``: same spikes as the functional call, learnable scalar and
per-channel parameters, stateful streaming, and bad input refused by message."""

import pytest
import torch

import spikefuse
from spikefuse.neurons import ALIF_MODEL, CUBA_LIF_ZERO
from spikefuse.nn import ALIF, CubaLIF, EngineNeuron
from tests.triton_on_cuda import GPU_TEST_MODE


def test_cuba_lif_module_equals_functional_and_learns_per_channel():
    layer = CubaLIF(0.8, 0.9, threshold=0.7, reset="zero", learnable=("alpha", "beta"), channels=3)
    x = (torch.rand(5, 2, 3, 4) * 0.8).requires_grad_()
    out = layer(x)
    want = spikefuse.neuron(
        x.detach(),
        CUBA_LIF_ZERO,
        surrogate=layer.surrogate,
        alpha=torch.full((3,), 0.8),
        beta=torch.full((3,), 0.9),
        threshold=0.7,
        backend="reference",
    )
    assert torch.equal(out.detach(), want)
    (out * torch.rand_like(out)).sum().backward()
    assert layer.alpha.grad.shape == (3,) and layer.beta.grad.shape == (3,) and float(layer.beta.grad.abs().sum()) > 0


def test_alif_stateful_streaming_equals_one_call():
    x = torch.rand(12, 2, 7) * 1.5
    whole = ALIF(0.9, 0.8, b0=0.5, beta=0.3)(x)
    streaming = ALIF(0.9, 0.8, b0=0.5, beta=0.3, stateful=True)
    out = torch.cat([streaming(x[:5]), streaming(x[5:])])
    assert torch.equal(out, whole) and 0 < float(whole.mean()) < 1
    with pytest.raises(ValueError, match="call reset_state"):
        streaming(torch.rand(3, 4, 7))
    streaming.reset_state()
    assert streaming(torch.rand(3, 4, 7)).shape == (3, 4, 7)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: CubaLIF(1.5, 0.5), ValueError, "alpha"),
        (lambda: CubaLIF(0.5, 0.5, reset="soft"), ValueError, "unknown reset 'soft': use one of subtract, zero"),
        (lambda: CubaLIF(0.5, 0.5, threshold=0.0), ValueError, "threshold must be a positive number"),
        (lambda: CubaLIF(0.5, 0.5, learnable=("gamma",)), TypeError, "no parameter 'gamma'"),
        (lambda: CubaLIF(0.5, 0.5, channels=4), ValueError, "channels sets the size of learnable"),
        (lambda: ALIF(0.5, float("nan")), ValueError, "rho"),
        (lambda: ALIF(0.5, 0.5, b0=-1.0), ValueError, "b0 .the baseline threshold. must be a positive number"),
        (lambda: EngineNeuron("alif"), TypeError, "model must be a spikefuse.neurons.NeuronModel"),
        (lambda: EngineNeuron(ALIF_MODEL, decay=0.5), TypeError, "needs the parameter 'rho'"),
        (lambda: CubaLIF(0.5, 0.5, backend="gpu"), ValueError, "unknown backend"),
    ],
)
def test_bad_construction(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_bad_calls():
    layer = CubaLIF(0.5, 0.5)
    with pytest.raises(
        TypeError, match="cuba_lif neurons run in float32, float64, float16 or bfloat16, got x of torch.float8_e4m3fn"
    ):
        layer(torch.rand(3, 4).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="T=0 time steps"):
        layer(torch.rand(0, 4))
    with pytest.raises(TypeError, match="floating-point dtype"):
        layer(torch.ones(3, 4, dtype=torch.int32))
    learn = CubaLIF(0.5, 0.5, learnable=("alpha",))
    with torch.no_grad():
        learn.alpha.fill_(float("nan"))
    with pytest.raises(ValueError, match="alpha"):
        learn(torch.rand(3, 4))
    x = torch.rand(3, 2, 4)
    with pytest.raises(ValueError, match=r"state v must be a tensor of shape \(2, 4\)"):
        spikefuse.neuron(x, CUBA_LIF_ZERO, alpha=0.5, beta=0.5, state=(torch.zeros(2, 4), torch.zeros(3)))
    with pytest.raises(ValueError, match="state must hold exactly i, v"):
        spikefuse.neuron(x, CUBA_LIF_ZERO, alpha=0.5, beta=0.5, state={"v": torch.zeros(2, 4)})
    with pytest.raises(TypeError, match="needs the parameter 'alpha'"):
        spikefuse.neuron(x, CUBA_LIF_ZERO, beta=0.5)
    with pytest.raises(ValueError, match="per-channel parameter has 3 entries but the input"):
        spikefuse.neuron(x, CUBA_LIF_ZERO, alpha=torch.rand(3), beta=0.5)
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        spikefuse.neuron(x, CUBA_LIF_ZERO, alpha=0.5, beta=0.5, backend="gpu")


@pytest.mark.skipif(GPU_TEST_MODE, reason="the GPU test mode accepts CPU tensors for backend='triton'")
def test_triton_backend_on_cpu_tensors_says_what_to_do(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        spikefuse.neuron(torch.rand(3, 4), CUBA_LIF_ZERO, alpha=0.5, beta=0.5, backend="triton")


def _engine_model(backend, memory="recompute"):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        spikefuse.nn.SeqToBatch(torch.nn.Linear(8, 16)),
        CubaLIF(0.5, 0.6, learnable=("alpha", "beta"), channels=16, backend=backend, memory=memory),
        spikefuse.nn.SeqToBatch(torch.nn.Linear(16, 4)),
        ALIF(0.8, 0.9, backend=backend, memory=memory),
    )


@pytest.mark.parametrize("backend, memory", [("cpu", "recompute"), ("cpu", "potential"), ("triton", "recompute")])
def test_torch_compile_fullgraph_matches_eager(backend, memory):
    """The engine's kernels are custom ops with fake kernels: torch.compile traces a model of engine neurons without a
    graph break and gives the eager spikes and gradients."""
    torch.manual_seed(0)  # the layers' initial weights: some draws never reach the threshold
    x = torch.rand(5, 3, 8) * 2
    eager, compiled_model = _engine_model(backend, memory), _engine_model(backend, memory)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    y_eager, y_comp = eager(x), compiled(x)
    assert torch.equal(y_eager, y_comp) and 0 < float(y_eager.detach().mean()) < 1
    y_eager.sum().backward()
    y_comp.sum().backward()
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_engine_custom_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake kernels against the real ones, autograd registration."""
    from spikefuse.neurons import neuron_spec
    from spikefuse.ops.engine import autograd as E
    from spikefuse.surrogate import ATan

    x2 = torch.rand(4, 6, dtype=torch.float64)
    params = [
        torch.tensor([0.5], dtype=torch.float64, requires_grad=True),
        torch.full((1,), 0.7, dtype=torch.float64),
        torch.ones(1, dtype=torch.float64),
    ]
    init = [torch.rand(6, dtype=torch.float64, requires_grad=True), torch.zeros(1, dtype=torch.float64)]
    potential = neuron_spec(CUBA_LIF_ZERO, ATan(2.0)).op_key
    recompute = neuron_spec(CUBA_LIF_ZERO, ATan(2.0), memory="recompute").op_key
    torch.library.opcheck(E.engine_forward, (x2, params, init, 1, recompute, "cpu"))
    torch.library.opcheck(E.engine_forward, (x2, params, init, 1, potential, "cpu"))
    # the backward op is not differentiable itself (double backward is refused): its inputs do not require grad
    grad_spikes = torch.rand(4, 6, dtype=torch.float64)
    grad_final = [torch.rand(6, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    params, init = [p.detach() for p in params], [v.detach() for v in init]
    need = [True, False, False]
    torch.library.opcheck(E.engine_backward, (grad_spikes, grad_final, x2, params, init, 1, recompute, "cpu", need, []))
    saved = E.engine_forward(x2, params, init, 1, potential, "cpu")[3:]
    torch.library.opcheck(
        E.engine_backward, (grad_spikes, grad_final, x2, params, init, 1, potential, "cpu", need, saved)
    )


def test_double_backward_is_refused_not_silently_wrong():
    x = torch.rand(4, 3, requires_grad=True)
    spikes = spikefuse.neuron(x, CUBA_LIF_ZERO, alpha=0.5, beta=0.5, surrogate="sigmoid", backend="cpu")
    with pytest.raises(RuntimeError, match="double backward .* cuba_lif_zero neurons .*first-order gradients only"):
        torch.autograd.grad(spikes.sum(), x, create_graph=True)


def test_the_reference_backend_differentiates_twice_and_under_torch_func():
    """backend="reference" runs plain ops: second-order gradients (gradgradcheck in float64 on the final states with
    the reset detached, where the spikes enter as constants and the exact derivative exists) and torch.func's
    transforms work through it (``tests/test_functional.py`` checks a second derivative through the spikes)."""
    x = (torch.rand(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 0.9).requires_grad_()
    alpha = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)

    def states(x, alpha):
        _, (i, v) = spikefuse.neuron(
            x,
            CUBA_LIF_ZERO,
            alpha=alpha,
            beta=0.5,
            threshold=0.6,
            detach_reset=True,
            return_state=True,
            backend="reference",
        )
        return i * v, v

    assert torch.autograd.gradgradcheck(states, (x, alpha), eps=1e-6, atol=1e-7)
    grad = torch.func.grad(lambda x: states(x, alpha.detach())[1].sum())(x.detach())
    torch.testing.assert_close(grad, torch.autograd.grad(states(x, alpha)[1].sum(), x)[0])


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_torch_func_transforms_are_refused_by_the_fused_kernels(backend):
    def loss(x):
        return spikefuse.neuron(x, CUBA_LIF_ZERO, alpha=0.5, beta=0.5, backend=backend).sum()

    with pytest.raises(
        RuntimeError, match="torch.func transforms .* cannot look inside the fused cuba_lif_zero kernels"
    ):
        torch.func.grad(loss)(torch.rand(4, 3))
