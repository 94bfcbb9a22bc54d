"""The public API on CUDA tensors (the Triton backend compiled for the GPU) against the plain-PyTorch reference on
the CPU: every shipped neuron module, both memory modes, learnable per-channel parameters, the fused BatchNorm with
the LIF and with engine neurons, float64 gradcheck, torch.compile, and a second GPU's device guard. A lean
Spiking-ResNet18 trains on the GPU as its vanilla form does there.

Spikes and states must equal the CPU reference's bit for bit (the kernels round as the reference does: no FMA
contraction, correctly rounded divisions); gradients agree to 1e-5. Skipped without a CUDA GPU (CI has none); the
same kernels run under Triton's interpreter in the other Triton tests, which ``SPIKEFUSE_TEST_TRITON=cuda`` runs
on the GPU as well (``tests/triton_on_cuda.py``).
"""

import pytest
import torch

import spikefuse
from spikefuse import nn as snn
from spikefuse.compat import snntorch as sf_snntorch
from spikefuse.compat import spikingjelly as sf_spikingjelly
from spikefuse.models import build_model
from spikefuse.neurons import ALIF_MODEL, CUBA_LIF
from tests.batchnorm.test_lean import _assert_same_training
from tests.triton_on_cuda import GPU_TEST_MODE

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and GPU_TEST_MODE),
    reason="needs a CUDA GPU (CI has none) and SPIKEFUSE_TEST_TRITON=cuda (else the session runs Triton's interpreter)",
)

SHAPE = (9, 3, 4, 5, 7)  # T=9, batch 3, 4 channels, odd spatial sizes


def _assert_grads_close(got, want, name):
    scale = max(float(want.abs().max()), 1.0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


def _compare(make, x):
    """``make(backend=...)`` built twice with the same parameters: the reference on the CPU, the default backend on
    the GPU. Same outputs bit for bit, same input and parameter gradients to 1e-5, same buffers."""
    torch.manual_seed(0)
    ref = make(backend="reference")
    gpu = make(backend="auto").cuda()
    gpu.load_state_dict(ref.state_dict())
    x_cpu = x.clone().requires_grad_()
    x_gpu = x.cuda().requires_grad_()
    y_cpu, y_gpu = ref(x_cpu), gpu(x_gpu)
    assert y_gpu.is_cuda and y_gpu.dtype == y_cpu.dtype
    assert torch.equal(y_gpu.cpu(), y_cpu), f"outputs differ in {int((y_gpu.cpu() != y_cpu).sum())} elements"
    rate = float(y_cpu.detach().float().mean())
    assert 0 < rate < 1, "the input never (or always) makes a spike: the test would check nothing"
    upstream = torch.randn(y_cpu.shape, dtype=y_cpu.dtype)
    y_cpu.backward(upstream)
    y_gpu.backward(upstream.cuda())
    _assert_grads_close(x_gpu.grad, x_cpu.grad, "grad_x")
    for (name, p_cpu), (_, p_gpu) in zip(ref.named_parameters(), gpu.named_parameters()):
        _assert_grads_close(p_gpu.grad, p_cpu.grad, f"grad {name}")
    for (name, b_cpu), (_, b_gpu) in zip(ref.named_buffers(), gpu.named_buffers()):
        torch.testing.assert_close(b_gpu.cpu(), b_cpu, rtol=1e-6, atol=1e-7, msg=lambda m: f"buffer {name}: {m}")


MODULES = {
    "lif-potential": lambda **kw: snn.LIF(0.7, 0.6, **kw),
    "lif-recompute-soft-per-channel": lambda **kw: snn.LIF(
        0.7, 0.6, v_reset=None, learnable_decay=True, channels=4, memory="recompute", **kw
    ),
    "lif-detach": lambda **kw: snn.LIF(0.6, 0.5, detach_reset=True, **kw),
    "cuba-lif-per-channel": lambda **kw: snn.CubaLIF(
        0.8, 0.7, threshold=0.6, learnable=("alpha", "beta"), channels=4, **kw
    ),
    "cuba-lif-zero-potential": lambda **kw: snn.CubaLIF(
        0.8, 0.7, threshold=0.6, reset="zero", memory="potential", **kw
    ),
    "alif": lambda **kw: snn.ALIF(0.8, 0.9, b0=0.5, beta=0.4, learnable=("decay",), channels=4, **kw),
    "spikingjelly-lif": lambda **kw: sf_spikingjelly.LIFNode(
        tau=1.25, decay_input=True, v_threshold=0.4, step_mode="m", **kw
    ),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_module_on_gpu_equals_cpu_reference(name):
    _compare(MODULES[name], torch.rand(SHAPE) * 1.2 - 0.1)


def test_snntorch_synaptic_on_gpu_equals_cpu_reference():
    x = torch.rand(SHAPE) * 1.2
    x_gpu = x.cuda()
    ref = sf_snntorch.Synaptic(alpha=0.8, beta=0.7, backend="reference")
    gpu = sf_snntorch.Synaptic(alpha=0.8, beta=0.7).cuda()
    syn_c, mem_c = ref.init_synaptic()
    syn_g, mem_g = gpu.init_synaptic()
    for t in range(x.shape[0]):
        s_c, syn_c, mem_c = ref(x[t], syn_c, mem_c)
        s_g, syn_g, mem_g = gpu(x_gpu[t], syn_g, mem_g)
        for got, want in ((s_g, s_c), (syn_g, syn_c), (mem_g, mem_c)):
            assert got.is_cuda and torch.equal(got.cpu(), want)


def test_batchnorm_lif_on_gpu_equals_cpu_reference():
    def make(backend):
        layer = snn.BatchNormLIF2d(4, decay=0.6, threshold=0.5, backend=backend)
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
        return layer

    _compare(make, torch.randn(SHAPE) * 2 + 0.5)


def test_batchnorm_neuron_on_gpu_equals_cpu_reference():
    def make(backend):
        return snn.BatchNormNeuron(torch.nn.BatchNorm2d(4), snn.CubaLIF(0.8, 0.7, threshold=0.5, backend=backend))

    _compare(make, torch.randn(SHAPE) * 2 + 0.5)


@pytest.mark.parametrize("training", [True, False])
def test_fused_batchnorm_backward_on_gpu_is_nn_batchnorms(training):
    """The BatchNorm backward of the fused op on CUDA (cuDNN's in training, from the recompute's reserve space) gives
    what autograd of ``F.batch_norm`` gives, bit for bit."""
    from spikefuse.batchnorm.autograd import _CUDNN_IMPL, _batch_norm, _torch_batch_norm, _torch_batch_norm_backward

    gen = torch.Generator().manual_seed(3)
    x, grad_y = (torch.randn(12, 5, 7, 9, generator=gen).cuda() * 2 + 0.5 for _ in range(2))
    weight, bias = torch.rand(5, generator=gen).cuda() + 0.5, torch.randn(5, generator=gen).cuda()
    rm, rv = torch.randn(5, generator=gen).cuda(), torch.rand(5, generator=gen).cuda() + 0.5
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y_want = torch.nn.functional.batch_norm(leaves[0], rm.clone(), rv.clone(), leaves[1], leaves[2], training)
    want = torch.autograd.grad(y_want, leaves, grad_y)
    _, mean, invstd, _, _ = _torch_batch_norm(x, weight, bias, rm.clone(), rv.clone(), training, 0.1, 1e-5)
    y, reserve, impl = _batch_norm(x, weight, bias, rm, rv, training, 1e-5)
    assert torch.equal(y, y_want)
    assert impl == _CUDNN_IMPL, "cuDNN did not run: the test checks nothing"
    got = _torch_batch_norm_backward(grad_y, x, weight, rm, rv, mean, invstd, training, 1e-5, True, reserve, impl)
    for name, g, w in zip(("x", "weight", "bias"), got, want):
        assert torch.equal(g, w), f"grad_{name} differs by {float((g - w).abs().max())}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lean_resnet18_on_gpu_trains_as_vanilla(dtype, monkeypatch):
    """``memory="lean"`` on the GPU (fused BatchNorm+LIF and BatchNorm+add+LIF on Triton, spike inputs packed as
    bits by torch ops, spike max-pooling) against the vanilla form (nn.BatchNorm, the serial reference LIF) on the
    GPU from the same weights: outputs bit-identical, gradients 1e-5, running statistics equal, for two steps.
    Both run the same cuDNN convolutions; TF32 off so that the float32 case checks float32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    forms = []
    for memory, backend in (("fused", "reference"), ("lean", "auto")):
        torch.manual_seed(0)
        model = build_model("resnet18", 3, 10, width=8, stem="imagenet", neuron_backend=backend, memory=memory)
        forms.append(model.to(device="cuda", dtype=dtype))
    x = torch.rand(4, 3, 3, 32, 32, dtype=dtype, generator=torch.Generator().manual_seed(1)).cuda()
    saved_vanilla, saved_lean = _assert_same_training(*forms, x, torch.tensor([1, 7, 3], device="cuda"))
    assert saved_lean < 0.3 * saved_vanilla, f"lean saves {saved_lean} bytes, vanilla {saved_vanilla}"


def test_lean_resnet18_under_autocast_on_gpu_trains_as_the_default_form(monkeypatch):
    """Under ``torch.autocast("cuda", torch.bfloat16)`` (``--precision bf16``): the lean form (its stem's fused
    conv+BatchNorm+LIF in bfloat16 as nn.Conv2d is there) against the default form (nn.BatchNorm + the fused LIF
    reading bfloat16): outputs bit-identical, gradients 1e-5, running statistics equal, for two steps."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    forms = []
    for memory in ("fused", "lean"):
        torch.manual_seed(0)
        forms.append(build_model("resnet18", 3, 10, width=8, stem="cifar", memory=memory).cuda())
    x = torch.rand(4, 3, 3, 16, 16, generator=torch.Generator().manual_seed(1)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _assert_same_training(*forms, x, torch.tensor([1, 7, 3], device="cuda"))
        assert forms[1](x).dtype == torch.bfloat16


@pytest.mark.parametrize("memory", ["fused", "lean"])
def test_training_step_captures_in_a_cuda_graph(memory):
    """A Spiking-ResNet's forward and backward captured in one CUDA graph (no host sync, no host-side allocation
    in the fused ops) and replayed on a new input: the outputs and gradients of eager mode from the same state."""
    import copy

    torch.manual_seed(0)
    model = build_model("resnet-tiny", 3, 10, memory=memory).cuda()
    static_x = torch.rand(3, 4, 3, 16, 16, device="cuda")

    def step(m, x):
        out = m(x)
        out.mean(0).square().sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph: Triton compiles, cuDNN picks its algorithms
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            step(model, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_out = step(model, static_x)
    eager = copy.deepcopy(model)  # the state (running statistics) the replay starts from
    static_x.copy_(torch.rand_like(static_x))
    graph.replay()
    eager.zero_grad(set_to_none=True)
    want = step(eager, static_x.clone())
    assert torch.equal(static_out, want)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        _assert_grads_close(p.grad, q.grad.cpu(), name)


def test_a_non_finite_input_on_gpu_makes_that_neurons_spikes_nan():
    """On CUDA tensors the call does not read the kernels' flags (a host sync per call): the neuron that read the
    inf spikes NaN from that step on, every other spike is as without it."""
    x = torch.rand(6, 8, device="cuda") * 1.2
    x[2, 5] = float("inf")
    spikes = spikefuse.lif(x, decay=0.7, threshold=0.6)
    clean = spikefuse.lif(x.nan_to_num(posinf=0.0), decay=0.7, threshold=0.6)
    assert spikes[2:, 5].isnan().all() and not spikes[:2].isnan().any()
    others = torch.arange(8, device="cuda") != 5
    assert torch.equal(spikes[:, others], clean[:, others]) and torch.equal(spikes[:2], clean[:2])


def test_whole_model_compiles_fullgraph_on_gpu(monkeypatch):
    """``torch.compile(fullgraph=True)`` of a whole Spiking-ResNet (the fused LIF custom ops inside inductor's
    graph): the outputs and gradients of eager mode. Inductor's channels-last layout optimization is off: its
    convolutions round differently from eager mode's, which flips a few spikes near the threshold (2 of 49152 in the
    first block on an H200) and the flips spread through the network (``benchmarks/gpu_compile_check.py bisect``)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "layout_optimization", False)
    torch.manual_seed(0)
    model = build_model("resnet-tiny", 3, 10, stem="cifar").cuda().eval()
    # 16x16 images: the last stage at 2x2 (at 1x1 cuDNN's weight gradient comes back contiguous where inductor's
    # channels-last layout expects channels-last, an inductor fault whatever the neurons)
    x = torch.rand(3, 4, 3, 16, 16, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    got = compiled(x)
    got.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    want = model(x)
    want.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for g, p in zip(grads, model.parameters()):
        _assert_grads_close(g, p.grad.cpu(), "compiled grad")


@pytest.mark.parametrize(
    "model, params",
    [(CUBA_LIF, dict(alpha=0.8, beta=0.7, threshold=0.5)), (ALIF_MODEL, dict(decay=0.8, rho=0.9, b0=0.5, beta=0.4))],
)
def test_gradcheck_float64_on_gpu(model, params):
    x = (torch.rand(5, 2, 3, dtype=torch.float64, device="cuda") * 1.5).requires_grad_()
    p = {
        k: torch.tensor(v, dtype=torch.float64, device="cuda", requires_grad=True)
        for k, v in params.items()
        if k != "threshold" and k != "b0"
    }
    fixed = {k: v for k, v in params.items() if k not in p}

    def fn(x, *values):
        _, state = spikefuse.neuron(
            x,
            model,
            surrogate="sigmoid",
            detach_reset=True,
            return_state=True,
            backend="triton",
            **fixed,
            **dict(zip(p, values)),
        )
        return tuple(state)

    assert torch.autograd.gradcheck(fn, (x, *p.values()), eps=1e-6, atol=1e-6)


def test_torch_compile_fullgraph_on_gpu():
    layer = snn.LIF(0.7, 0.6).cuda()
    x = (torch.rand(SHAPE, device="cuda") * 1.2).requires_grad_()
    compiled = torch.compile(layer, fullgraph=True)
    y = compiled(x)
    assert torch.equal(y, layer(x.detach()))
    y.sum().backward()
    want = x.detach().clone().requires_grad_()
    layer(want).sum().backward()
    torch.testing.assert_close(x.grad, want.grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_on_gpu(dtype):
    x = torch.rand(SHAPE) * 1.2
    want = spikefuse.lif(x.to(dtype).float(), decay=0.7, threshold=0.6, backend="reference")
    got = spikefuse.lif(x.to(dtype).cuda(), decay=0.7, threshold=0.6)
    assert got.dtype == dtype and torch.equal(got.float().cpu(), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_second_gpu_runs_under_its_own_device_guard():
    x = torch.rand(SHAPE, device="cuda:1") * 1.2
    for layer in (snn.LIF(0.7, 0.6), snn.CubaLIF(0.8, 0.7, threshold=0.6)):
        assert torch.equal(layer.to("cuda:1")(x).cpu(), layer.cpu()(x.cpu()))


@pytest.mark.parametrize("all_to_all", [True, False], ids=["all_to_all", "one_to_one"])
@pytest.mark.parametrize("name", ["lif", "cuba_lif", "alif"])
def test_recurrent_layer_on_gpu(name, all_to_all):
    """The recurrent layer's Triton step kernels with cuBLAS products: spikes and states bit for bit those of the
    reference on the same GPU (the same cuBLAS products), gradients to 1e-5 of it and of the CPU reference."""
    from spikefuse.neurons import LIF_MODELS

    model, params = {
        "lif": (LIF_MODELS[("snntorch", "soft")], dict(decay=0.9, threshold=0.8)),
        "cuba_lif": (CUBA_LIF, dict(alpha=0.8, beta=0.7, threshold=0.6)),
        "alif": (ALIF_MODEL, dict(decay=0.8, rho=0.9, b0=0.5, beta=0.3)),
    }[name]
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 16, 64, generator=g) * 0.5
    weight = torch.randn((64, 64) if all_to_all else (64,), generator=g) * (0.15 if all_to_all else 0.5)
    bias = torch.randn(64, generator=g) * 0.05
    upstream = torch.randn(x.shape, generator=g)
    results = {}
    for device, backend in (("cpu", "reference"), ("cuda", "reference"), ("cuda", "auto")):
        xs, w, b = (t.to(device).requires_grad_() for t in (x, weight, bias))
        spikes, state = spikefuse.recurrent(xs, model, w, b, backend=backend, return_state=True, **params)
        grads = torch.autograd.grad((spikes * upstream.to(device)).sum() + state[0].sum(), [xs, w, b])
        results[(device, backend)] = (spikes, state, grads)
    spikes, state, grads = results[("cuda", "auto")]
    ref_spikes, ref_state, ref_grads = results[("cuda", "reference")]
    assert spikes.is_cuda and 0 < float(spikes.mean()) < 1
    assert torch.equal(spikes, ref_spikes) and all(torch.equal(a, b) for a, b in zip(state, ref_state))
    for what, got, want in zip(("x", "weight", "bias"), grads, ref_grads):
        _assert_grads_close(got, want.cpu(), f"grad {what} (GPU reference)")
    cpu_spikes = results[("cpu", "reference")][0]
    assert float((spikes.cpu() != cpu_spikes).float().mean()) < 0.05  # cuBLAS and MKL round apart; dynamics alike


def test_snntorch_rleaky_sequence_on_gpu_is_its_loop():
    torch.manual_seed(0)
    layer = sf_snntorch.RLeaky(beta=0.9, linear_features=32).cuda()
    x = torch.rand(50, 8, 32, device="cuda") * 0.5
    spk, mem = layer.reset_mem()
    loop = []
    for x_t in x:
        spk, mem = layer(x_t, spk, mem)
        loop.append(spk)
    layer.reset_mem()
    spk_seq, mem_seq = layer.sequence(x)
    assert 0 < float(spk_seq.mean()) < 1
    assert torch.equal(torch.stack(loop), spk_seq) and torch.equal(mem, mem_seq)


def test_recurrent_network_compiles_fullgraph_on_gpu():
    """The recurrent layer's custom ops under ``torch.compile(fullgraph=True)`` (inductor) on the GPU, the lean srnn's
    spike layers packing through theirs: the eager outputs and gradients."""
    for memory in ("fused", "lean"):
        torch.manual_seed(0)
        eager = build_model("srnn", 20, 10, hidden=48, memory=memory).cuda()
        traced = build_model("srnn", 20, 10, hidden=48, memory=memory).cuda()
        traced.load_state_dict(eager.state_dict())
        x = torch.rand(30, 8, 20, device="cuda")
        want, got = eager(x), torch.compile(traced, fullgraph=True)(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        want.square().mean().backward()
        got.square().mean().backward()
        for (name, p), q in zip(eager.named_parameters(), traced.parameters()):
            _assert_grads_close(q.grad, p.grad.cpu(), f"{memory} compiled grad {name}")
