"""The autograd operations of max-pooling (:mod:`spikefuse.nn.spike_layers`' ``SpikeMaxPool1d/2d/3d``,
:class:`spikefuse.nn.MaxPool2d`) on the kernels of :mod:`.cpu`. Their names keep the underscore: ``torch.profiler``
and ``spikefuse bench profile`` report a Function by its class name (``_SpikeMaxPoolFnBackward``), and committed
profiles name them so.
"""

from __future__ import annotations

import torch

from .. import bitpack
from ..autograd_guards import refuse_double_backward
from ..spike_layers.autograd import pack_saved, unpack_saved
from . import cpu, out_shape, per_dim

__all__ = ["_SpikeMaxPoolFn", "_MaxPoolFn"]


class _SpikeMaxPoolFn(torch.autograd.Function):
    """``pool(x, *args)`` (``F.max_pool1d/2d/3d``) saving ``x`` as bits. torch's max-pooling saves its input and
    the argmax indices (int64: twice the bytes of a float32 input). A contiguous float32/float64 CPU input runs
    :mod:`.cpu` (torch's output; backward finds torch's indices from the bits): from the
    input's bits where its neuron kernel made them (:func:`spikefuse.ops.bitpack.spike_bits`: the input is spikes
    for certain), packing the output too, else from the input's values. Any other input is unpacked in backward and
    runs torch's own pooling and its backward again, which picks the same indices."""

    @staticmethod
    def forward(ctx, x, pool, args):
        packed, *meta = pack_saved(x)
        ctx.pool, ctx.args, ctx.meta = pool, args, meta
        ctx.save_for_backward(packed)
        ctx.numba = x.device.type == "cpu" and x.dtype in cpu.SUPPORTED_DTYPES and x.is_contiguous()
        if not ctx.numba:
            return pool(x, *args)
        # torch's pooling on a meta tensor: torch's checks of the arguments and its output shape, no work
        out_shape = pool(torch.empty(x.shape, dtype=x.dtype, device="meta"), *args).shape
        pooling = per_dim(x.dim() - 2, args)
        spikes = bitpack.spike_bits(x)
        if spikes is None or not cpu.reads_rows_as_words(x.shape):
            return cpu.forward(x, out_shape, *pooling)
        out, out_bits = cpu.forward_from_bits(spikes, x.shape, out_shape, *pooling, x.dtype)
        if out_bits is not None:  # spikes too: the next spike layer saves them without packing
            bitpack.remember(out, out_bits, spikes=True)
        return out

    @staticmethod
    def backward(ctx, grad_y):
        # a backward of bits and kernels, not differentiable ops: refused under create_graph=True rather than
        # silently giving no second-order terms
        refuse_double_backward(
            "SpikeMaxPool1d/2d/3d",
            "the layer keeps its input as bits; use torch.nn.MaxPool1d/2d/3d where a gradient of the "
            "gradient is needed",
        )
        (packed,) = ctx.saved_tensors
        if ctx.numba:
            shape = ctx.meta[0]
            return cpu.backward(grad_y, packed, shape, *per_dim(len(shape) - 2, ctx.args)), None, None
        x = unpack_saved(packed, *ctx.meta).requires_grad_()
        with torch.enable_grad():
            y = ctx.pool(x, *ctx.args)
        (grad_x,) = torch.autograd.grad(y, x, grad_y)
        return grad_x, None, None


class _MaxPoolFn(torch.autograd.Function):
    """``F.max_pool2d(x, *args)`` on :mod:`.cpu`, saving the int32 index of every maximum
    (torch saves its input and int64 indices)."""

    @staticmethod
    def forward(ctx, x, args):
        out, indices = cpu.forward_with_indices(x, out_shape(x.shape, *args), *args)
        ctx.save_for_backward(indices)
        ctx.in_shape = x.shape
        return out

    @staticmethod
    def backward(ctx, grad_y):
        refuse_double_backward(
            "spikefuse.nn.MaxPool2d", "use torch.nn.MaxPool2d where a gradient of the gradient is needed"
        )
        (indices,) = ctx.saved_tensors
        return cpu.backward_from_indices(grad_y, indices, ctx.in_shape), None
