"""``spikefuse.ops.maxpool.cpu`` against torch's max-pooling: the forward bit for bit on any input (ties, signed
zeros, NaN, -inf), the backward from bits bit for bit on binary input, over kernel, stride, padding, dilation and
ceil_mode in 1, 2 and 3 dimensions.

If torch changes which maximum of a window it picks, this fails here rather than in a gradient of a model.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from spikefuse.ops.maxpool import cpu as maxpool_cpu
from spikefuse.ops.bitpack import pack, pack_torch

POOLS = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
SHAPES = {1: (2, 3, 11), 2: (2, 3, 7, 6), 3: (1, 2, 5, 6, 7)}


def _settings(dims):
    """Every valid (kernel, stride, padding, dilation, ceil_mode) of small values, per-dim tuples."""
    for k, s, p, d, ceil in itertools.product([1, 2, 3], [1, 2, 3], [0, 1], [1, 2], [False, True]):
        per_dim = [(v,) * dims for v in (k, s, p, d)]
        if dims > 1:  # uneven windows too
            per_dim[0] = (k,) + (max(1, k - 1),) * (dims - 1)
        kernel, _, padding, dilation = per_dim
        # torch's "pad should be at most half of effective kernel size"
        if all(2 * pi <= (ki - 1) * di + 1 for ki, pi, di in zip(kernel, padding, dilation)):
            yield (*per_dim, ceil)


def _case_ids():
    return [(dims, setting) for dims in (1, 2, 3) for setting in _settings(dims)]


@pytest.mark.parametrize("dims,setting", _case_ids(), ids=lambda v: str(v) if isinstance(v, int) else None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_binary_forward_and_backward_are_torch_bit_for_bit(dims, setting, dtype):
    kernel, stride, padding, dilation, ceil = setting
    pool = POOLS[dims]
    g = torch.Generator().manual_seed(dims)
    for p in (0.0, 0.3, 1.0):  # no spike (every window's first element), some, all (ties everywhere)
        x = (torch.rand(SHAPES[dims], generator=g) < p).to(dtype)
        xr = x.clone().requires_grad_()
        y = pool(xr, kernel, stride, padding, dilation, ceil)
        grad_y = torch.randn(y.shape, generator=g, dtype=dtype)
        y.backward(grad_y)
        assert torch.equal(maxpool_cpu.forward(x, y.shape, kernel, stride, padding, dilation), y)
        bits = pack(x, reuse=False)[0]
        out, out_bits = maxpool_cpu.forward_from_bits(bits, x.shape, y.shape, kernel, stride, padding, dilation, dtype)
        assert torch.equal(out, y) and out.dtype == dtype
        if y[0, 0].numel() % 8 == 0:  # each output plane fills whole bytes
            assert torch.equal(out_bits, pack_torch(y))
        else:
            assert out_bits is None
        grad_x = maxpool_cpu.backward(grad_y, bits, x.shape, kernel, stride, padding, dilation)
        assert torch.equal(grad_x, xr.grad), f"p={p}: a gradient went to another maximum of its window"


@pytest.mark.parametrize("width", [8, 57, 58, 70])
def test_rows_as_words_up_to_57_elements_and_bit_tests_beyond(width):
    """Rows of up to 57 elements are read as words (a row may start at any bit of a byte: odd widths put the rows
    at every offset); wider rows run the kernel testing one bit at a time. Both are torch's gradient."""
    x = (torch.rand(3, 2, 5, width, generator=torch.Generator().manual_seed(width)) < 0.3).float()
    xr = x.clone().requires_grad_()
    y = F.max_pool2d(xr, (2, 3), (1, 2), (1, 1))
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    y.backward(grad_y)
    bits = pack(x, reuse=False)[0]
    assert maxpool_cpu.reads_rows_as_words(x.shape) == (width <= 57)
    grad_x = maxpool_cpu.backward(grad_y, bits, x.shape, (2, 3), (1, 2), (1, 1), (1, 1))
    assert torch.equal(grad_x, xr.grad)
    if width > 57:
        with pytest.raises(ValueError, match=f"maxpool.cpu.forward_from_bits: rows of {width} elements, at most 57"):
            maxpool_cpu.forward_from_bits(bits, x.shape, y.shape, (2, 3), (1, 2), (1, 1), (1, 1), torch.float32)
    else:
        out, _ = maxpool_cpu.forward_from_bits(bits, x.shape, y.shape, (2, 3), (1, 2), (1, 1), (1, 1), torch.float32)
        assert torch.equal(out, y)


def test_forward_matches_torch_on_any_values():
    """Signed zeros (the first of equal maxima wins), -inf, and NaN (the last NaN of a window wins)."""
    g = torch.Generator().manual_seed(0)
    choices = torch.tensor([0.0, -0.0, 1.0, -1.0, float("-inf"), float("nan"), 2.5])
    x = choices[torch.randint(0, len(choices), (3, 4, 9, 8), generator=g)]
    y = F.max_pool2d(x, 3, 2, 1)
    mine = maxpool_cpu.forward(x, y.shape, (3, 3), (2, 2), (1, 1), (1, 1))
    assert torch.equal(mine.view(torch.int32), y.view(torch.int32))  # bit patterns: -0.0 and NaNs included


def test_empty_batch():
    x = torch.zeros(0, 3, 8, 8)
    y = maxpool_cpu.forward(x, (0, 3, 4, 4), (2, 2), (2, 2), (0, 0), (1, 1))
    assert y.shape == (0, 3, 4, 4)
    grad_x = maxpool_cpu.backward(y, pack(x)[0], x.shape, (2, 2), (2, 2), (0, 0), (1, 1))
    assert grad_x.shape == x.shape
    out, out_bits = maxpool_cpu.forward_from_bits(
        pack(x)[0], x.shape, y.shape, (2, 2), (2, 2), (0, 0), (1, 1), torch.float32
    )
    assert out.shape == (0, 3, 4, 4) and out_bits.numel() == 0
