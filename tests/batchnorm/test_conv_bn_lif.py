"""Conv -> BatchNorm -> LIF in one call that recomputes the convolution in backward (``conv_batchnorm_lif``,
``spikefuse.nn.ConvBatchNormLIF``) against the composition ``SeqToBatch(conv) -> batchnorm_lif``; the same for any
engine neuron (``conv_batchnorm_neuron``, ``spikefuse.nn.ConvBatchNormNeuron``), of which the LIF's is a preset.

Every backend, fp32 and fp64, training and eval, 1-d and 2-d convolutions with stride/padding/groups, with and
without a conv bias, a learnable per-channel decay: spikes and running statistics equal, every gradient within
1e-5 relative; gradcheck in fp64; only the conv input (and per-channel tensors) saved; bad input.
"""

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from spikefuse.bn_functional import conv_batchnorm_lif, conv_batchnorm_neuron  # noqa: E402
from spikefuse.neurons import CUBA_LIF  # noqa: E402
from spikefuse.nn import (  # noqa: E402
    ALIF,
    BatchNormLIF1d,
    BatchNormLIF2d,
    BatchNormNeuron,
    ConvBatchNormLIF,
    ConvBatchNormNeuron,
    CubaLIF,
    SeqToBatch,
)

from tests.ops.cases import saved_storages  # noqa: E402

THRESHOLD = 0.4

CONVS = {  # name: (conv, input shape [T, B, C, ...])
    "2d-stride2-pad1-bias": (lambda: nn.Conv2d(3, 5, 3, stride=2, padding=1), (3, 2, 3, 9, 9)),
    "2d-groups-nobias": (lambda: nn.Conv2d(4, 6, 3, groups=2, bias=False), (2, 3, 4, 6, 5)),
    "1d-T1": (lambda: nn.Conv1d(2, 3, 3, padding=2, dilation=2), (1, 4, 2, 7)),
}


def _pair(name, backend, dtype, learnable):
    """(composition, fused module) from the same weights."""
    make, shape = CONVS[name]
    torch.manual_seed(0)
    conv = make().to(dtype)
    cls = BatchNormLIF2d if len(shape) == 5 else BatchNormLIF1d
    kw = dict(
        decay=0.5,
        threshold=THRESHOLD,
        backend=backend,
        learnable_decay=learnable,
        channels=conv.out_channels if learnable else None,
    )
    bn_a, bn_b = cls(conv.out_channels, **kw).to(dtype), cls(conv.out_channels, **kw).to(dtype)
    with torch.no_grad():
        for bn in (bn_a, bn_b):
            bn.weight.copy_(torch.linspace(0.8, 1.3, conv.out_channels))
            bn.bias.copy_(torch.linspace(-0.2, 0.3, conv.out_channels))
            if learnable:
                bn.decay.copy_(torch.linspace(0.3, 0.7, conv.out_channels))
    conv_b = make().to(dtype)
    conv_b.load_state_dict(conv.state_dict())
    return nn.Sequential(SeqToBatch(conv), bn_a), ConvBatchNormLIF(conv_b, bn_b), shape


def _close(a, b, what):
    scale = max(float(b.abs().max()), 1e-12)
    assert float((a - b).abs().max()) <= 1e-5 * scale, what


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CONVS))
def test_matches_composition(backend, dtype, name):
    composed, fused, shape = _pair(name, backend, dtype, learnable=name.startswith("2d-stride"))
    g = torch.Generator().manual_seed(3)
    for training in (True, True, False):  # the second step starts from updated running statistics
        composed.train(training), fused.train(training)
        x = (torch.rand(shape, generator=g, dtype=dtype) * 2).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        a, b = composed(x), fused(x2)
        assert torch.equal(a, b), "spikes differ"
        grad = torch.rand(a.shape, generator=g, dtype=dtype)
        (a * grad).sum().backward()
        (b * grad).sum().backward()
        _close(x2.grad, x.grad, "grad x")
        for (name_a, p), (_, q) in zip(composed.named_parameters(), fused.named_parameters()):
            _close(q.grad, p.grad, f"grad {name_a}")
            p.grad = q.grad = None
        for (name_a, p), (_, q) in zip(composed.named_buffers(), fused.named_buffers()):
            assert torch.equal(p, q), name_a


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gradcheck_fp64(backend):
    """gradcheck of the final state with a detached reset, where the exact derivative exists (spikes themselves
    are piecewise constant and their backward is the surrogate by design); inputs kept away from the threshold."""
    g = torch.Generator().manual_seed(4)
    for _ in range(100):
        x = torch.rand(2, 2, 2, 4, 4, generator=g, dtype=torch.float64) * 2
        w = torch.randn(3, 2, 3, 3, generator=g, dtype=torch.float64)
        z = nn.functional.conv2d(x.flatten(0, 1), w, None, 1, 1)
        y = nn.functional.batch_norm(z, None, None, training=True)
        if float((y - THRESHOLD).abs().min()) > 1e-3 and float((0.5 * y - THRESHOLD).abs().min()) > 1e-3:
            break
    gamma = torch.linspace(0.99, 1.01, 3, dtype=torch.float64, requires_grad=True)
    beta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    decay = torch.full((3,), 0.5, dtype=torch.float64, requires_grad=True)

    def state_of(x, w, gamma, beta, decay):
        return conv_batchnorm_lif(
            x,
            w,
            None,
            1,
            1,
            1,
            1,
            None,
            None,
            gamma,
            beta,
            True,
            decay=decay,
            threshold=THRESHOLD,
            detach_reset=True,
            return_state=True,
            backend=backend,
        )[1]

    inputs = (x.requires_grad_(), w.requires_grad_(), gamma, beta, decay)
    assert torch.autograd.gradcheck(state_of, inputs, eps=1e-7, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_saves_the_conv_input_not_its_output(backend):
    composed, fused, shape = _pair("2d-stride2-pad1-bias", backend, torch.float32, learnable=False)
    x = torch.rand(shape, requires_grad=True) * 1.0
    saved_composed, _ = saved_storages(lambda: composed(x))
    saved_fused, out = saved_storages(lambda: fused(x))
    params = {p.untyped_storage().data_ptr() for p in fused.parameters()}
    fused_bytes = sum(n for ptr, n in saved_fused.items() if ptr not in params)
    assert x.untyped_storage().data_ptr() in saved_fused
    assert x.nbytes <= fused_bytes <= x.nbytes + 8 * 5 * 4  # x and per-channel tensors
    conv_out = out.nbytes  # the conv output has the spikes' shape and dtype
    assert sum(saved_composed.values()) >= fused_bytes + conv_out


def test_bad_input():
    x = torch.rand(2, 3, 3, 6, 6)
    w = torch.randn(4, 3, 3, 3)
    kw = dict(decay=0.5, threshold=THRESHOLD, training=True)
    with pytest.raises(ValueError, match=r"a 2-d convolution expects x of shape \[T, B, C, \.\.\.\] with 5 dims"):
        conv_batchnorm_lif(x[0], w, None, 1, 0, 1, 1, None, None, **kw)
    with pytest.raises(ValueError, match="x has 3 channels .dim 2. but the convolution expects 6"):
        conv_batchnorm_lif(x, torch.randn(4, 3, 3, 3), None, 1, 0, 1, 2, None, None, **kw)
    with pytest.raises(ValueError, match=r"stride must be an int or 2 ints, got \[1, 1, 1\]"):
        conv_batchnorm_lif(x, w, None, (1, 1, 1), 0, 1, 1, None, None, **kw)
    with pytest.raises(TypeError, match="conv_weight must be the weight tensor"):
        conv_batchnorm_lif(x, torch.randn(4, 3), None, 1, 0, 1, 1, None, None, **kw)
    with pytest.raises(TypeError, match="x must have a floating-point dtype"):
        conv_batchnorm_lif(x.int(), w, None, 1, 0, 1, 1, None, None, **kw)
    bn = BatchNormLIF2d(4, decay=0.5, threshold=THRESHOLD)
    with pytest.raises(ValueError, match="bn_lif has 4 channels but conv gives 5"):
        ConvBatchNormLIF(nn.Conv2d(3, 5, 3), bn)
    with pytest.raises(ValueError, match="zero padding given as numbers"):
        ConvBatchNormLIF(nn.Conv2d(3, 4, 3, padding="same"), bn)
    with pytest.raises(ValueError, match="zero padding given as numbers"):
        ConvBatchNormLIF(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), bn)
    with pytest.raises(TypeError, match="conv must be an nn.Conv1d, Conv2d or Conv3d, got Linear"):
        ConvBatchNormLIF(nn.Linear(3, 4), bn)
    with pytest.raises(ValueError, match="bn_lif is stateful: it keeps its state between calls"):
        ConvBatchNormLIF(nn.Conv2d(3, 4, 3), BatchNormLIF2d(4, decay=0.5, threshold=THRESHOLD, stateful=True))


# ------------------------------------------------------------------------------------------ any engine neuron


def _alif():
    return ALIF(decay=0.6, rho=0.8, b0=0.4, beta=0.3, learnable=("decay",), channels=5, backend="cpu")


def test_conv_batchnorm_neuron_matches_composition():
    """ConvBatchNormNeuron (an ALIF with a learnable per-channel decay) against ``SeqToBatch(conv)`` then the same
    BatchNormNeuron: the LIF tests' checks, on the general op."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1)
    composed = nn.Sequential(SeqToBatch(conv), BatchNormNeuron(nn.BatchNorm2d(5), _alif()))
    fused = ConvBatchNormNeuron(copy.deepcopy(conv), BatchNormNeuron(nn.BatchNorm2d(5), _alif()))
    g = torch.Generator().manual_seed(3)
    for training in (True, True, False):
        composed.train(training), fused.train(training)
        x = torch.rand((3, 2, 3, 9, 9), generator=g) * 2
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        a, b = composed(x1), fused(x2)
        assert torch.equal(a, b), "spikes differ"
        grad = torch.rand(a.shape, generator=g)
        (a * grad).sum().backward()
        (b * grad).sum().backward()
        _close(x2.grad, x1.grad, "grad x")
        for (name, p), (_, q) in zip(composed.named_parameters(), fused.named_parameters(), strict=True):
            _close(q.grad, p.grad, f"grad {name}")
            p.grad = q.grad = None
        for (name, p), (_, q) in zip(composed.named_buffers(), fused.named_buffers(), strict=True):
            assert torch.equal(p, q), name


def test_conv_batchnorm_neuron_gradcheck_fp64():
    """gradcheck of the general op's final states (CubaLIF, detached reset, the reference backend) in every input
    and a per-channel parameter; inputs kept away from the threshold."""
    g = torch.Generator().manual_seed(5)
    for _ in range(100):
        x = torch.rand(2, 1, 2, 3, 3, generator=g, dtype=torch.float64) * 2
        w = torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64)
        y = nn.functional.batch_norm(nn.functional.conv2d(x.flatten(0, 1), w, None, 1, 0), None, None, training=True)
        if float((y - THRESHOLD).abs().min()) > 1e-3 and float((1.5 * y - THRESHOLD).abs().min()) > 1e-3:
            break
    gamma = torch.linspace(0.99, 1.01, 3, dtype=torch.float64, requires_grad=True)
    alpha = torch.full((3,), 0.5, dtype=torch.float64, requires_grad=True)

    def states_of(x, w, gamma, alpha):
        _, (current, potential) = conv_batchnorm_neuron(
            x,
            w,
            None,
            1,
            0,
            1,
            1,
            None,
            None,
            gamma,
            None,
            True,
            model=CUBA_LIF,
            alpha=alpha,
            beta=0.5,
            threshold=THRESHOLD,
            detach_reset=True,
            return_state=True,
            backend="reference",
        )
        return current, potential

    inputs = (x.requires_grad_(), w.requires_grad_(), gamma, alpha)
    assert torch.autograd.gradcheck(states_of, inputs, eps=1e-7, atol=1e-7, rtol=1e-5)


def test_conv_batchnorm_neuron_errors():
    bn_neuron = BatchNormNeuron(nn.BatchNorm2d(4), CubaLIF(alpha=0.5, beta=0.5))
    with pytest.raises(TypeError, match="bn_neuron must be a BatchNormNeuron, got BatchNormLIF2d"):
        ConvBatchNormNeuron(nn.Conv2d(3, 4, 3), BatchNormLIF2d(4, decay=0.5, threshold=THRESHOLD))
    with pytest.raises(ValueError, match="bn_neuron has 4 channels but conv gives 5"):
        ConvBatchNormNeuron(nn.Conv2d(3, 5, 3), bn_neuron)
    with pytest.raises(TypeError, match="conv must be an nn.Conv1d, Conv2d or Conv3d, got Linear"):
        ConvBatchNormNeuron(nn.Linear(3, 4), bn_neuron)
    stateful = BatchNormNeuron(nn.BatchNorm2d(4), CubaLIF(alpha=0.5, beta=0.5, stateful=True))
    with pytest.raises(ValueError, match="bn_neuron is stateful: it keeps its state between calls"):
        ConvBatchNormNeuron(nn.Conv2d(3, 4, 3), stateful)
    with pytest.raises(TypeError, match="has no parameter 'decay'; its parameters: alpha, beta, threshold"):
        conv_batchnorm_neuron(
            torch.rand(2, 3, 3, 6, 6),
            torch.randn(4, 3, 3, 3),
            *(None, 1, 0, 1, 1, None, None, None, None, True),
            model=CUBA_LIF,
            decay=0.5,
        )
