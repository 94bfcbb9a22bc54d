"""``spikefuse.batchnorm.cpu`` against torch: the statistics and the normalization the engine's cpu neuron
kernels fuse against ``native_batch_norm`` bit for bit, ``backward`` against ``native_batch_norm_backward`` to
rounding.

The fused BatchNorm+LIF op's backward normalizes with these; if torch changes its CPU kernel, this fails (and the
spikes of the recomputation would no longer be the forward's).
"""

import pytest
import torch

from spikefuse.neurons import LIF_MODELS, neuron_spec
from spikefuse.batchnorm import cpu as batchnorm_cpu
from spikefuse.ops.bitpack import pack
from spikefuse.ops.engine import NeuronInputs
from spikefuse.ops.engine import cpu as engine_cpu
from spikefuse.surrogate import Sigmoid


def _normalized_by_neuron_kernel(x: torch.Tensor, norm: batchnorm_cpu.Normalization, t_steps: int) -> torch.Tensor:
    """BatchNorm of ``x`` as the cpu backend's backward kernels compute it: the rows that blocks of neurons read
    (``batchnorm_cpu.source_tile``), gathered over blocks of a ragged size."""
    x2 = x.reshape(t_steps, -1)
    src = batchnorm_cpu.source_args(x2, norm)
    out = torch.empty_like(x2)
    n, block = x2.shape[1], 37
    for n0 in range(0, n, block):
        m = min(block, n - n0)
        out[:, n0 : n0 + m] = torch.from_numpy(batchnorm_cpu.source_tile(x2.numpy(), n0, m, src))
    return out.reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", [(128, 16, 8, 8), (14, 5, 3, 7), (64, 16), (6, 3, 5), (2, 1, 2), (4, 600, 3)])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_fused_normalization_is_native_batch_norm_bit_for_bit(dtype, shape, affine):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    channels = shape[1]
    w = (torch.rand(channels, generator=g) + 0.5).to(dtype) if affine else None
    b = torch.randn(channels, generator=g).to(dtype) if affine else None
    y, mean, invstd = torch.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    residual = (torch.rand(shape, generator=g) < 0.3).to(dtype)
    spatial = x[0, 0].numel()
    for t_steps in (1, 2):  # [T*B, C, ...] merged: the channel of neuron j is (j // spatial) % C at every step
        norm = batchnorm_cpu.Normalization(mean, invstd, w, b, spatial)
        assert torch.equal(_normalized_by_neuron_kernel(x, norm, t_steps), y)
        norm = batchnorm_cpu.Normalization(mean, invstd, w, b, spatial, residual=residual * 0.7)
        assert torch.equal(_normalized_by_neuron_kernel(x, norm, t_steps), y + residual * 0.7)
        norm = batchnorm_cpu.Normalization(mean, invstd, w, b, spatial, residual_bits=pack(residual)[0])
        assert torch.equal(_normalized_by_neuron_kernel(x, norm, t_steps), y + residual)


@pytest.mark.parametrize(
    "shape", [(128, 64, 8, 8), (128, 17, 2, 2), (3, 9, 5), (2, 1, 2), (40, 7, 3, 3, 2), (5, 100, 33)]
)
@pytest.mark.parametrize("running", [True, False], ids=["running", "no-running"])
@pytest.mark.parametrize("momentum", [0.1, 0.37, 1.0])
def test_statistics_are_native_batch_norm_bit_for_bit(shape, running, momentum):
    """Mean, invstd and the running statistics' update of float32 input: channels in groups of eight and the ones left
    over, means far from 0 and spreads far from 1 (the double sums' rounding shows there)."""
    g = torch.Generator().manual_seed(sum(shape))
    for scale, offset in ((1.0, 0.0), (1e-3, 7.0), (40.0, -3.0)):
        x = torch.randn(shape, generator=g) * scale + offset
        assert batchnorm_cpu.statistics_supported(x, None, None, None)
        rm = torch.randn(shape[1], generator=g) if running else None
        rv = torch.rand(shape[1], generator=g) + 0.5 if running else None
        rm_torch = rm.clone() if running else None
        rv_torch = rv.clone() if running else None
        _, mean, invstd = torch.native_batch_norm(x, None, None, rm_torch, rv_torch, True, momentum, 1e-5)
        before = (rm.clone(), rv.clone()) if running else None
        got_mean, got_invstd, got_rm, got_rv = batchnorm_cpu.statistics(x, rm, rv, momentum, 1e-5)
        assert torch.equal(got_mean, mean) and torch.equal(got_invstd, invstd)
        if running:
            assert torch.equal(got_rm, rm_torch) and torch.equal(got_rv, rv_torch)
            assert torch.equal(rm, before[0]) and torch.equal(rv, before[1]), "the update goes to copies"
        else:
            assert got_rm is None and got_rv is None


def test_statistics_support():
    """float32 CPU input of more than one element per sample and channel, float32 (or no) parameters; else torch's
    ``native_batch_norm`` keeps the forward (its channels-last path for 1-element maps, float64)."""
    x = torch.randn(4, 3, 5)
    assert batchnorm_cpu.statistics_supported(x, torch.zeros(3), torch.ones(3), torch.zeros(3))
    assert not batchnorm_cpu.statistics_supported(x.double(), None, None, None)
    assert not batchnorm_cpu.statistics_supported(torch.randn(4, 3, 1, 1), None, None, None)
    assert not batchnorm_cpu.statistics_supported(torch.randn(4, 3), None, None, None)
    assert not batchnorm_cpu.statistics_supported(x, None, torch.ones(3, dtype=torch.float64), None)
    assert not batchnorm_cpu.statistics_supported(torch.randn(0, 3, 5), None, None, None)


def test_bad_input():
    x = torch.randn(4, 3, 2)
    mean, invstd = torch.zeros(3), torch.ones(3)

    def source(x2, norm):
        return batchnorm_cpu.source_args(x2, norm)

    with pytest.raises(ValueError, match=r"not \[B, 3 channels, 5\] merged"):
        source(x.reshape(1, -1), batchnorm_cpu.Normalization(mean, invstd, None, None, 5))
    with pytest.raises(TypeError, match="fused BatchNorm needs float32 or float64 input"):
        source(x.reshape(1, -1).half(), batchnorm_cpu.Normalization(mean, invstd, None, None, 2))
    bad_bits = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="residual_bits must be 3 packed uint8 bytes"):
        source(x.reshape(1, -1), batchnorm_cpu.Normalization(mean, invstd, None, None, 2, residual_bits=bad_bits))
    one, zero = torch.ones(1), torch.zeros(1)
    with pytest.raises(ValueError, match="src and overwrite_x need the states recomputed"):
        engine_cpu.backward(
            neuron_spec(LIF_MODELS[("paper", "hard")], Sigmoid()),
            NeuronInputs(x.reshape(1, -1), [one, one, zero], [zero]),
            torch.zeros(1, 24),
            [zero],
            [False] * 3,
            saved=[torch.zeros(1, 24)],
            src=source(x.reshape(1, -1), batchnorm_cpu.Normalization(mean, invstd, None, None, 2)),
        )


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
@pytest.mark.parametrize(
    "shape", [(128, 16, 8, 8), (13, 5, 3, 7), (64, 16), (6, 3, 5), (4, 3, 1, 1), (9, 2, 17), (6, 3, 16, 17)]
)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("overwrite", [True, False], ids=["over_grad_y", "apart"])
def test_backward_is_native_batch_norm_backward(dtype, rtol, shape, affine, overwrite):
    """Planes of 256+ elements run the per-channel loop, smaller ones the per-sample sums (both paths)."""
    g = torch.Generator().manual_seed(sum(shape) + affine)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    channels = shape[1]
    w = (torch.rand(channels, generator=g) + 0.5).to(dtype) if affine else None
    _, mean, invstd = torch.native_batch_norm(x, w, None, None, None, True, 0.1, 1e-5)
    gy = torch.randn(shape, generator=g).to(dtype)
    ref = torch.ops.aten.native_batch_norm_backward(
        gy, x, w, None, None, mean, invstd, True, 1e-5, [True, affine, affine]
    )
    given = gy.clone()
    grad_x, grad_w, grad_b = batchnorm_cpu.backward(given, x, mean, invstd, w, True, overwrite)
    assert (grad_x.data_ptr() == given.data_ptr()) == overwrite
    if not overwrite:
        assert torch.equal(given, gy)
    # grad_x is gy minus its projections: compared at the scale of gy's contribution, invstd * weight * |gy|
    scale = float((gy.abs() * invstd.reshape(1, -1, *[1] * (x.dim() - 2)) * (1 if w is None else w.abs().max())).max())
    assert float((grad_x - ref[0]).abs().max()) <= rtol * scale
    if affine:
        torch.testing.assert_close(grad_w, ref[1], rtol=rtol, atol=rtol * float(ref[1].abs().max()))
        torch.testing.assert_close(grad_b, ref[2], rtol=rtol, atol=rtol * float(ref[2].abs().max()))
    else:
        assert grad_w is None and grad_b is None


def test_backward_bad_input():
    x = torch.randn(4, 3, 2)
    mean, invstd = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="grad_y must be contiguous, of x's shape"):
        batchnorm_cpu.backward(torch.randn(4, 3, 3), x, mean, invstd, None, False, True)
    with pytest.raises(ValueError, match="grad_y must be contiguous"):
        batchnorm_cpu.backward(torch.randn(2, 3, 4).transpose(0, 2), x, mean, invstd, None, False, True)
    with pytest.raises(ValueError, match="contiguous float32/float64 CPU tensor"):
        batchnorm_cpu.backward(x.half(), x.half(), mean, invstd, None, False, True)
