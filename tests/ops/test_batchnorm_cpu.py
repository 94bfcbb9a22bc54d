"""``spikefuse.ops.batchnorm_cpu.normalize`` against torch's ``native_batch_norm``: bit for bit.

The fused BatchNorm+LIF op's backward recomputes the normalized input with it; if torch changes the formula of its
CPU kernel, this fails (and the spikes of the recomputation would no longer be the forward's).
"""

import pytest
import torch

from spikefuse.ops import batchnorm_cpu
from spikefuse.ops.bitpack import pack


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", [(128, 16, 8, 8), (13, 5, 3, 7), (64, 16), (6, 3, 5), (1, 1, 2)])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_normalize_is_native_batch_norm_bit_for_bit(dtype, shape, affine):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    channels = shape[1]
    w = (torch.rand(channels, generator=g) + 0.5).to(dtype) if affine else None
    b = torch.randn(channels, generator=g).to(dtype) if affine else None
    y, mean, invstd = torch.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    residual = (torch.rand(shape, generator=g) < 0.3).to(dtype)
    assert torch.equal(batchnorm_cpu.normalize(x, mean, invstd, w, b), y)
    assert torch.equal(batchnorm_cpu.normalize(x, mean, invstd, w, b, residual=residual * 0.7), y + residual * 0.7)
    bits = pack(residual)[0]
    assert torch.equal(batchnorm_cpu.normalize(x, mean, invstd, w, b, residual_bits=bits), y + residual)


def test_bad_input():
    x = torch.randn(4, 3, 2)
    mean, invstd = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="contiguous float32/float64 CPU tensor"):
        batchnorm_cpu.normalize(x.half(), mean, invstd, None, None)
    with pytest.raises(ValueError, match="contiguous"):
        batchnorm_cpu.normalize(x.transpose(0, 2), mean, invstd, None, None)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        batchnorm_cpu.normalize(x, torch.zeros(2), invstd, None, None)
