"""Max-pooling of real values on spikefuse's CPU kernels."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import maxpool_cpu
from ..ops.autograd_guards import refuse_double_backward
from .spike_layers import _per_dim

__all__ = ["MaxPool2d"]


def _out_shape(in_shape, kernel, stride, padding, dilation) -> tuple:
    """torch's output shape of max-pooling ``[N, C, H, W]`` without ``ceil_mode``, computed here: asking torch
    (pooling a meta tensor) took 50 us a call, more than pooling a small input."""
    n, c, *spatial = in_shape
    return (
        n,
        c,
        *(
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, k, s, p, d in zip(spatial, kernel, stride, padding, dilation)
        ),
    )


class _MaxPoolFn(torch.autograd.Function):
    """``F.max_pool2d(x, *args)`` on :mod:`spikefuse.ops.maxpool_cpu`, saving the int32 index of every maximum
    (torch saves its input and int64 indices)."""

    @staticmethod
    def forward(ctx, x, args):
        out, indices = maxpool_cpu.forward_with_indices(x, _out_shape(x.shape, *args), *args)
        ctx.save_for_backward(indices)
        ctx.in_shape = x.shape
        return out

    @staticmethod
    def backward(ctx, grad_y):
        refuse_double_backward(
            "spikefuse.nn.MaxPool2d", "use torch.nn.MaxPool2d where a gradient of the gradient is needed"
        )
        (indices,) = ctx.saved_tensors
        return maxpool_cpu.backward_from_indices(grad_y, indices, ctx.in_shape), None


class MaxPool2d(nn.MaxPool2d):
    """:class:`torch.nn.MaxPool2d`, the same arguments, output and gradients (bit for bit), computed on a contiguous
    float32 CPU input by a numba kernel on the calling thread: torch's CPU kernel on an NCHW input takes about 1.4x
    as long on two threads (3x3 windows, stride 2, at ``[32, 32, 32, 32]``), and keeps the input and int64 indices
    for backward, where this keeps int32 indices only. Any other input, ``ceil_mode=True``, ``return_indices=True``
    and arguments torch refuses run torch's layer, and so does a traced call (``torch.compile``: the compiler makes
    its own kernel, with no graph break)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = _per_dim(2, (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode))
        kernel, _, padding, _ = args
        if (
            torch.compiler.is_compiling()
            or self.return_indices
            or self.ceil_mode
            or any(p > k // 2 for k, p in zip(kernel, padding))  # torch's error
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or not x.is_contiguous()
            or x.dim() != 4
            or math.prod(x.shape[2:]) >= 2**31
            or min(_out_shape(x.shape, *args)[2:]) <= 0  # torch's error
        ):
            return super().forward(x)
        return _MaxPoolFn.apply(x, args)
