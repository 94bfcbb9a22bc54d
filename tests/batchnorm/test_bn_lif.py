"""Fused BatchNorm+LIF (recompute) against the composition SeqToBatch(nn.BatchNorm) -> spikefuse.lif(reference).

Every backend: spikes equal, running statistics equal, gradients of x, gamma, beta, a learnable decay and v_init
within 1e-5 relative; 1-d ([T, B, C], [T, B, C, L]) and 2-d inputs, odd channel counts, T=1, eval mode,
momentum=None, affine=False; saved-for-backward bytes = x + O(C); torch.compile(fullgraph=True).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import spikefuse  # noqa: E402
from spikefuse.bn_functional import batchnorm_lif  # noqa: E402
from spikefuse.nn import BatchNormLIF1d, BatchNormLIF2d  # noqa: E402
from tests import lif_spec  # noqa: E402
from spikefuse.ops.engine import cpu  # noqa: E402
from spikefuse.surrogate import Sigmoid  # noqa: E402

from tests.ops.cases import saved_storages  # noqa: E402

BACKENDS = ["reference", "cpu", "triton"]
THRESHOLD, MARGIN = 0.4, 1e-3


def _bn_for(shape, **kw):
    return (nn.BatchNorm2d if len(shape) == 5 else nn.BatchNorm1d)(shape[2], **kw)


def _fused_for(shape, backend, **kw):
    return (BatchNormLIF2d if len(shape) == 5 else BatchNormLIF1d)(shape[2], backend=backend, **kw)


def _well_posed_input(shape, seed, decay=0.5):
    """An input whose normalized potentials stay ``MARGIN`` away from the threshold (no spike flips on ulps)."""
    for attempt in range(200):
        g = torch.Generator().manual_seed(seed * 1000 + attempt)
        x = torch.randn(shape, generator=g) * 2 + 0.5
        y = nn.functional.batch_norm(x.flatten(0, 1), None, None, training=True).reshape(shape[0], -1)
        h = lif_spec.loop(y, torch.tensor([decay]), 1, torch.zeros(y.shape[1]), lif_spec.LIFCase(THRESHOLD))[2]
        # gamma/beta below stay close to 1/0; check a band around the threshold wide enough for them
        if ((h - THRESHOLD).abs() > MARGIN).all() and ((h * 0.9 + 0.05 - THRESHOLD).abs() > MARGIN).all():
            return x
    raise AssertionError("no well-posed input found")


def _close(actual, expected, name):
    scale = expected.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(scale), msg=lambda m: f"{name}: {m}")


def _run_pair(shape, backend, *, train=True, momentum=0.1, affine=True, learnable=True, steps=1, eval_after=False):
    torch.manual_seed(0)
    bn = _bn_for(shape, momentum=momentum, affine=affine)
    fused = _fused_for(
        shape,
        backend,
        momentum=momentum,
        affine=affine,
        decay=0.5,
        threshold=THRESHOLD,
        surrogate=Sigmoid(3.0),
        learnable_decay=learnable,
        channels=shape[2] if learnable else None,
    )
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.linspace(0.9, 1.1, shape[2]))
            bn.bias.copy_(torch.linspace(-0.05, 0.05, shape[2]))
    fused.load_state_dict(bn.state_dict(), strict=False)
    decay_ref = torch.full((shape[2],), 0.5, requires_grad=True) if learnable else 0.5
    bn.train(train)
    fused.train(train)
    for step in range(steps):
        x = _well_posed_input(shape, step)
        xa = x.clone().requires_grad_(True)
        xb = x.clone().requires_grad_(True)
        ref_y = bn(xa.flatten(0, 1)).unflatten(0, shape[:2])
        ref = spikefuse.lif(ref_y, decay=decay_ref, threshold=THRESHOLD, surrogate=Sigmoid(3.0), backend="reference")
        out = fused(xb)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert torch.equal(out, ref), "spikes differ"
        g = torch.randn(shape, generator=torch.Generator().manual_seed(7 + step))
        (ref * g).sum().backward()
        (out * g).sum().backward()
        _close(xb.grad, xa.grad, "grad x")
    if affine:
        _close(fused.weight.grad, bn.weight.grad, "grad gamma")
        _close(fused.bias.grad, bn.bias.grad, "grad beta")
    if learnable:
        _close(fused.decay.grad, decay_ref.grad, "grad decay")
    torch.testing.assert_close(fused.running_mean, bn.running_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(fused.running_var, bn.running_var, rtol=1e-6, atol=0)
    assert int(fused.num_batches_tracked) == int(bn.num_batches_tracked)
    if eval_after:
        bn.eval()
        fused.eval()
        x = _well_posed_input(shape, 99)
        ref = spikefuse.lif(
            bn(x.flatten(0, 1)).unflatten(0, shape[:2]), decay=0.5, threshold=THRESHOLD, backend="reference"
        )
        assert torch.equal(fused(x), ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape",
    [(3, 2, 3, 3, 5), (1, 4, 5, 2, 3), (4, 3, 5), (2, 2, 7, 3)],
    ids=["2d-C3", "2d-T1", "1d-TBC", "1d-TBCL"],
)
def test_matches_composition_training(backend, shape):
    _run_pair(shape, backend, eval_after=True)


def test_cpu_backward_over_several_source_blocks(monkeypatch):
    """The cpu backend's fused BatchNorm backward cuts its blocks to ``SOURCE_SCRATCH_BYTES`` of scratch (it runs at a
    lean step's memory peak): over several of those blocks, the last partial, the reference backend's results."""
    shape = (8, 2, 4, 45, 45)
    neurons = 2 * 4 * 45 * 45
    blocks = []  # the block size of each fused-BatchNorm backward, as the cpu backend picks it
    original_block = cpu._block

    def recorded_block(n, threads, scratch_per_neuron=0, scratch_bytes=cpu.SCRATCH_BYTES):
        block = original_block(n, threads, scratch_per_neuron, scratch_bytes)
        if scratch_bytes == cpu.SOURCE_SCRATCH_BYTES:
            blocks.append(block)
        return block

    monkeypatch.setattr(cpu, "_block", recorded_block)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 2 + 0.5
    g = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    results = []
    for backend in ("reference", "cpu"):
        torch.manual_seed(0)
        layer = _fused_for(shape, backend, decay=0.5, threshold=THRESHOLD, learnable_decay=True, channels=shape[2])
        xb = x.clone().requires_grad_(True)
        out = layer(xb)
        (out * g).sum().backward()
        results.append((out, xb.grad, layer.weight.grad, layer.bias.grad, layer.decay.grad))
    (ref, *ref_grads), (out, *grads) = results
    assert len(blocks) == 1 and blocks[0] < cpu.BLOCK and blocks[0] % 64 == 0
    assert -(-neurons // blocks[0]) >= 2 and neurons % blocks[0], "several blocks, the last partial"
    assert torch.equal(out, ref) and 0 < out.mean() < 1
    for name, a, b in zip(("x", "gamma", "beta", "decay"), grads, ref_grads):
        _close(a, b, f"grad {name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_mode_gradients(backend):
    # eval: y uses the running statistics and grad_x = gamma*invstd*grad_y
    _run_pair((3, 2, 5, 2, 2), backend, train=False)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_momentum_none_cumulative_average(backend):
    _run_pair((2, 3, 3, 4), backend, momentum=None, steps=3)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_affine_false(backend):
    _run_pair((3, 2, 5), backend, affine=False, learnable=False)


def test_functional_v_init_gradient_and_state():
    torch.manual_seed(0)
    shape = (3, 2, 3, 4)
    x = _well_posed_input(shape, 3)
    v = (torch.rand(shape[1:]) * 0.2).requires_grad_(True)
    w = torch.ones(3, requires_grad=True)
    rm, rv = torch.zeros(3), torch.ones(3)
    s, st = batchnorm_lif(
        x, rm, rv, w, None, True, 0.1, 1e-5, decay=0.5, threshold=THRESHOLD, v_init=v, return_state=True, backend="cpu"
    )
    (s.sum() + st.sum()).backward()
    v2 = v.detach().clone().requires_grad_(True)
    y = nn.functional.batch_norm(x.flatten(0, 1), torch.zeros(3), torch.ones(3), None, None, True).unflatten(
        0, shape[:2]
    )
    s2, st2 = spikefuse.lif(y, decay=0.5, threshold=THRESHOLD, v_init=v2, return_state=True, backend="reference")
    (s2.sum() + st2.sum()).backward()
    assert torch.equal(s, s2)
    torch.testing.assert_close(st, st2)
    _close(v.grad, v2.grad, "grad v_init")


def _saved_bytes(fn):
    storages, out = saved_storages(fn)
    return sum(storages.values()), out


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_saves_only_x_and_per_channel_stats(backend):
    shape = (4, 3, 5, 4, 4)
    x = torch.randn(shape, requires_grad=True)
    m = BatchNormLIF2d(5, decay=0.5, threshold=THRESHOLD, learnable_decay=True, channels=5, backend=backend)
    saved, out = _saved_bytes(lambda: m(x * 1.0))  # x*1.0: the saved x is a non-leaf, as a conv output is
    assert x.nbytes <= saved <= x.nbytes + 8 * 5 * 4
    out.sum().backward()
    # the composition with the default fused LIF saves about twice as much
    bn = nn.BatchNorm2d(5)
    ref_saved, _ = _saved_bytes(
        lambda: spikefuse.lif(
            bn((x * 1.0).flatten(0, 1)).unflatten(0, shape[:2]), decay=0.5, threshold=THRESHOLD, backend=backend
        )
    )
    assert ref_saved >= 2 * x.nbytes  # BN input x + the potentials h (+ v_init)


def test_compile_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    shape = (3, 2, 4, 3, 3)
    m = BatchNormLIF2d(4, decay=0.5, threshold=THRESHOLD, learnable_decay=True, channels=4, backend="cpu")
    eager = BatchNormLIF2d(4, decay=0.5, threshold=THRESHOLD, learnable_decay=True, channels=4, backend="cpu")
    eager.load_state_dict(m.state_dict())
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = _well_posed_input(shape, 5)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_c, out_e = compiled(xa), eager(xb)
    assert torch.equal(out_c, out_e)
    out_c.sum().backward()
    out_e.sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(m.weight.grad, eager.weight.grad) and torch.equal(m.decay.grad, eager.decay.grad)
    assert torch.equal(m.running_mean, eager.running_mean) and int(m.num_batches_tracked) == 1


def test_errors():
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        batchnorm_lif(x, torch.zeros(3), torch.ones(3), training=True, decay=0.5, threshold=1.0)
    with pytest.raises(ValueError, match="running statistics"):
        batchnorm_lif(x, None, None, training=False, decay=0.5, threshold=1.0)
    with pytest.raises(ValueError, match="more than 1 value"):
        batchnorm_lif(torch.randn(1, 1, 4), None, None, training=True, decay=0.5, threshold=1.0)
    with pytest.raises(ValueError, match=r"\[T, B, C, H, W\]"):
        BatchNormLIF2d(4)(x)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_double_backward_through_fused_bn_lif_raises(backend):
    """The fused op's backward is not differentiable on any backend (even the reference one is wrapped in it)."""
    torch.manual_seed(0)
    m = BatchNormLIF2d(3, decay=0.5, threshold=0.3, backend=backend).double()
    x = torch.randn(2, 2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward.*fused BatchNorm\\+neuron op.*backend='reference'"):
        (grad_x,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)


def test_torch_func_over_fused_bn_lif_raises():
    m = BatchNormLIF2d(3, decay=0.5, threshold=0.3).eval()  # training mode stops earlier, in torch's own BN update
    with pytest.raises(RuntimeError, match="torch.func transforms.*fused BatchNorm\\+LIF op"):
        torch.func.grad(lambda x: m(x).sum())(torch.randn(2, 2, 3, 4, 4))


# --------------------------------------------------------------------------- BatchNorm + residual add + LIF
def _well_posed_residual_pair(shape, seed, binary, dtype):
    """``(x, residual)`` whose potentials of ``LIF(BN(x) + residual)`` stay ``MARGIN`` from the threshold."""
    for attempt in range(400):
        g = torch.Generator().manual_seed(seed * 1000 + attempt)
        x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
        if binary:
            res = (torch.rand(shape, generator=g) < 0.3).to(dtype)
        else:
            res = (torch.randn(shape, generator=g) * 0.5).to(dtype)
        y = nn.functional.batch_norm(x.flatten(0, 1), None, None, training=True).reshape(shape[0], -1)
        y = y + res.reshape(shape[0], -1)
        spec = lif_spec.LIFCase(THRESHOLD)
        h = lif_spec.loop(y, torch.tensor([0.5], dtype=dtype), 1, torch.zeros(y.shape[1], dtype=dtype), spec)[2]
        if ((h - THRESHOLD).abs() > MARGIN).all():
            return x, res
    raise AssertionError("no well-posed input found")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("binary", [False, True], ids=["float-residual", "spike-residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", [(3, 2, 3, 3, 5), (1, 3, 4, 5)], ids=["2d", "1d-T1"])
def test_residual_matches_composition(backend, binary, dtype, shape):
    """LIF(BN(x) + residual) fused == SeqToBatch(nn.BatchNorm) -> + residual -> lif(reference): spikes, state and
    running statistics equal; gradients of x, residual, gamma, beta and a per-channel decay within 1e-5."""
    torch.manual_seed(0)
    channels = shape[2]
    bn = _bn_for(shape).to(dtype)
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.9, 1.1, channels))
        bn.bias.copy_(torch.linspace(-0.05, 0.05, channels))
    fused = _fused_for(
        shape, backend, decay=0.5, threshold=THRESHOLD, surrogate=Sigmoid(3.0), learnable_decay=True, channels=channels
    ).to(dtype)
    fused.load_state_dict(bn.state_dict(), strict=False)
    decay_ref = torch.full((channels,), 0.5, dtype=dtype, requires_grad=True)
    x, res = _well_posed_residual_pair(shape, 1, binary, dtype)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ra, rb = res.clone().requires_grad_(True), res.clone().requires_grad_(True)
    ref, ref_state = spikefuse.lif(
        bn(xa.flatten(0, 1)).unflatten(0, shape[:2]) + ra,
        decay=decay_ref,
        threshold=THRESHOLD,
        surrogate=Sigmoid(3.0),
        return_state=True,
        backend="reference",
    )
    fused.stateful = True
    out = fused(xb, rb * 1.0, residual_binary=binary)  # rb*1.0: a non-leaf residual, as a block's shortcut is
    assert torch.equal(out, ref), "spikes differ"
    assert torch.equal(fused.state, ref_state.detach()), "state differs"
    g = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    (ref * g).sum().backward()
    (out * g).sum().backward()
    _close(xb.grad, xa.grad, "grad x")
    _close(rb.grad, ra.grad, "grad residual")
    _close(fused.weight.grad, bn.weight.grad, "grad gamma")
    _close(fused.bias.grad, bn.bias.grad, "grad beta")
    _close(fused.decay.grad, decay_ref.grad, "grad decay")
    assert torch.equal(fused.running_mean, bn.running_mean) and torch.equal(fused.running_var, bn.running_var)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(backend, dtype):
    """float16 / bfloat16 input and residual, the neuron in float32 (Triton reads and writes the half-precision
    tensors itself, the CPU gets them converted): the reference's spikes in the input's dtype, and its gradients of
    x, the residual, gamma, beta and the decay within the input's rounding."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 2, 4, 5, generator=gen) * 2 + 0.5).to(dtype)
    residual = torch.rand(x.shape, generator=gen).to(dtype)
    upstream = torch.randn(x.shape, generator=gen).to(dtype)
    out = {}
    for b in ("reference", backend):
        leaves = [t.clone().requires_grad_() for t in (x, residual)]
        weight, bias = torch.linspace(0.9, 1.1, 4, requires_grad=True), torch.zeros(4, requires_grad=True)
        decay = torch.full((4,), 0.6, requires_grad=True)
        spikes = batchnorm_lif(
            leaves[0], None, None, weight, bias, True, decay=decay, threshold=THRESHOLD, backend=b, residual=leaves[1]
        )
        spikes.backward(upstream)
        out[b] = spikes.detach(), [leaves[0].grad, leaves[1].grad, weight.grad, bias.grad, decay.grad]
    (s_ref, g_ref), (s, g) = out["reference"], out[backend]
    assert s.dtype == dtype and 0 < float(s_ref.float().mean()) < 1 and torch.equal(s, s_ref)
    for name, a, b in zip(("x", "residual", "gamma", "beta", "decay"), g, g_ref):
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(
            a.float(), b.float(), rtol=eps, atol=eps * float(b.float().abs().max()), msg=lambda m: f"grad {name}: {m}"
        )


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("binary", [False, True], ids=["float-residual", "spike-residual"])
def test_residual_gradcheck_fp64(backend, binary):
    """gradcheck of the final state with a detached reset, where the exact derivative exists (spikes themselves
    are piecewise constant and their backward is the surrogate by design, see tests/ops/test_cpu.py)."""
    shape = (3, 2, 2, 3)
    x, res = _well_posed_residual_pair(shape, 2, binary, torch.float64)
    w = torch.linspace(0.9, 1.1, 2, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    decay = torch.full((2,), 0.5, dtype=torch.float64, requires_grad=True)
    inputs = (x.requires_grad_(True), w, b, decay) + (() if binary else (res.requires_grad_(True),))

    def state_of(x, w, b, decay, r=res):
        return batchnorm_lif(
            x,
            None,
            None,
            w,
            b,
            True,
            decay=decay,
            threshold=THRESHOLD,
            detach_reset=True,
            residual=r,
            residual_binary=binary,
            return_state=True,
            backend=backend,
        )[1]

    assert torch.autograd.gradcheck(state_of, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_residual_saved_bytes(backend):
    """A float residual is saved as is; a binary one as bits (x + residual/32 + O(C))."""
    shape = (4, 3, 5, 4, 4)
    x = torch.randn(shape, requires_grad=True)
    res = (torch.rand(shape) < 0.5).float().requires_grad_(True)
    m = BatchNormLIF2d(5, decay=0.5, threshold=THRESHOLD, backend=backend)
    saved_float, _ = _saved_bytes(lambda: m(x * 1.0, res * 1.0))
    saved_bits, out = _saved_bytes(lambda: m(x * 1.0, res * 1.0, residual_binary=True))
    assert 2 * x.nbytes <= saved_float <= 2 * x.nbytes + 8 * 5 * 4
    assert x.nbytes + x.numel() // 8 <= saved_bits <= x.nbytes + x.numel() // 8 + 8 * 5 * 4
    out.sum().backward()
    assert res.grad is not None and x.grad is not None


def test_residual_errors():
    x = torch.randn(2, 3, 4)
    kw = dict(decay=0.5, threshold=1.0, training=True)
    with pytest.raises(ValueError, match=r"residual has shape \(2, 3, 5\) but x has \(2, 3, 4\)"):
        batchnorm_lif(x, None, None, residual=torch.zeros(2, 3, 5), **kw)
    with pytest.raises(TypeError, match="residual is torch.float64 but x is torch.float32"):
        batchnorm_lif(x, None, None, residual=torch.zeros(2, 3, 4, dtype=torch.float64), **kw)
    with pytest.raises(TypeError, match="residual must be a tensor"):
        batchnorm_lif(x, None, None, residual=[0.0], **kw)
    with pytest.raises(ValueError, match="residual_binary=True describes a residual, but residual is None"):
        batchnorm_lif(x, None, None, residual_binary=True, **kw)
    m = BatchNormLIF1d(3, decay=0.5, threshold=1.0)
    previous = spikefuse.nn.set_debug(True)
    try:
        with pytest.raises(ValueError, match=r"expects binary spikes \(0 or 1\) as residual.*0\.5 at index"):
            m(x, torch.full_like(x, 0.5), residual_binary=True)
    finally:
        spikefuse.nn.set_debug(previous)


@pytest.mark.parametrize(
    "shape",
    [(3, 4, 6, 8, 8), (1, 2, 3, 2, 4), (2, 3, 5, 3, 3), (2, 16, 64, 8, 8), (2, 4, 16, 1, 1)],
    ids=["T3", "T1", "N-odd", "two-blocks", "1x1-maps"],
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_cpu_forward_packs_its_spikes_for_the_next_layer(monkeypatch, shape, residual):
    """In training, the cpu kernel packs the spike rows it writes (where each step's row starts on a byte: N a
    multiple of 8), with BatchNorm fused into it or not (1x1 maps: torch's BatchNorm), so that the layer saving them
    as bits packs nothing: the bits are the spikes' exactly, and the spikes those of the op that packs none (the
    custom op's body); in eval mode nothing is packed."""
    from spikefuse.batchnorm import autograd
    from spikefuse.ops import bitpack

    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 2 + 0.3
    res = (torch.rand(shape, generator=g) < 0.3).float() if residual else None
    packs = []
    pack_cpu = bitpack._pack_cpu
    monkeypatch.setattr(bitpack, "_pack_cpu", lambda t: packs.append(t.shape) or pack_cpu(t))
    kw = dict(training=True, decay=0.5, threshold=THRESHOLD, backend="cpu", residual=res, residual_binary=residual)
    spikes = batchnorm_lif(x, None, None, **kw)
    packs_of_residual = len(packs)
    bits = bitpack._remembered(spikes.flatten(0, 1))
    n = spikes[0].numel()
    if n % 8:
        assert bits is None
    else:
        assert bits is not None and torch.equal(bits, bitpack.pack_torch(spikes))
    assert torch.equal(bitpack.pack(spikes)[0], bitpack.pack_torch(spikes))
    assert len(packs) == packs_of_residual + (1 if n % 8 else 0)
    neuron, params, init = autograd.lif_neuron(lif_spec.LIFCase(THRESHOLD).neuron(), torch.tensor([0.5]), None, x)
    none = torch.empty(0)
    tensors = [none if res is None else res.flatten(0, 1), none, none, none, none]
    call = autograd._call_key(neuron, "cpu", True, "bits" if residual else "none")
    op_body = autograd._forward_impl(x.flatten(0, 1), tensors, params, init, [0.1, 1e-5], [shape[0], 1], call)
    assert torch.equal(op_body[0].reshape(shape), spikes)
    assert bitpack._remembered(op_body[0]) is None
    running = torch.zeros(shape[2]), torch.ones(shape[2])
    assert bitpack._remembered(batchnorm_lif(x, *running, **{**kw, "training": False})) is None
