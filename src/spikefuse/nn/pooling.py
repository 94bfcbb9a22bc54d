"""Max-pooling of real values on spikefuse's CPU kernels."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.maxpool import out_shape, per_dim
from ..ops.maxpool.autograd import _MaxPoolFn

__all__ = ["MaxPool2d"]


class MaxPool2d(nn.MaxPool2d):
    """:class:`torch.nn.MaxPool2d`, the same arguments, output and gradients (bit for bit), computed on a contiguous
    float32 CPU input by a numba kernel on the calling thread: torch's CPU kernel on an NCHW input takes about 1.4x
    as long on two threads (3x3 windows, stride 2, at ``[32, 32, 32, 32]``), and keeps the input and int64 indices
    for backward, where this keeps int32 indices only. Any other input, ``ceil_mode=True``, ``return_indices=True``
    and arguments torch refuses run torch's layer, and so does a traced call (``torch.compile``: the compiler makes
    its own kernel, with no graph break)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = per_dim(2, (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode))
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
            or min(out_shape(x.shape, *args)[2:]) <= 0  # torch's error
        ):
            return super().forward(x)
        return _MaxPoolFn.apply(x, args)
