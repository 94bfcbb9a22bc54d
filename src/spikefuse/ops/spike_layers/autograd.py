"""The autograd operations of the layers fed by spikes (:mod:`spikefuse.nn.spike_layers`), beside their kernels.

- :class:`_SpikeLinearFn`: ``F.linear`` keeping its input as bits, its products dense (torch's) or sparse, read from
  the bits (:mod:`.cpu`);
- :class:`CSRLinearFunction`: ``F.linear`` of an input with values (framed events are counts), from its nonzero
  entries (the :class:`.cpu.CSR` kept for backward instead of the input);
- :class:`SparseGradLinearFunction`: torch's product whose backward reads the output gradient's nonzero entries;
- :class:`_SpikeConvFn`: torch's convolution keeping its input as bits (no kernel of its own: torch's convolution
  and ``convolution_backward`` on the unpacked input).

:func:`pack_saved` / :func:`unpack_saved` keep an input as bits in its memory order (channels-last included): every
spike layer's Function saves its input so, the max-pool's too (:mod:`spikefuse.ops.maxpool.autograd`). The two spike
Functions keep their names with the underscore: ``torch.profiler`` and ``spikefuse bench profile`` report a
Function by its class name (``_SpikeConvFnBackward``), and committed profiles name them so.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..autograd_guards import refuse_double_backward
from ..bitpack import pack, unpack
from . import cpu

__all__ = [
    "input_major",
    "pack_saved",
    "unpack_saved",
    "_SpikeLinearFn",
    "CSRLinearFunction",
    "SparseGradLinearFunction",
    "_SpikeConvFn",
]


# ----------------------------------------------------------------------------------------- packing with layout
def pack_saved(x: torch.Tensor):
    """Pack ``x`` in its memory order: ``(packed, shape, dtype, perm)``; ``perm`` undoes a channels-last layout."""
    perm = None
    if not x.is_contiguous():
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            perm = (0, 2, 3, 1)
        elif x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            perm = (0, 2, 3, 4, 1)
    src = x.permute(perm) if perm else x
    packed, shape = pack(src, binary=True)
    return packed, shape, x.dtype, perm


def unpack_saved(packed, shape, dtype, perm) -> torch.Tensor:
    x = unpack(packed, shape, dtype)
    if perm:
        inverse = [0] * len(perm)
        for i, p in enumerate(perm):
            inverse[p] = i
        x = x.permute(inverse)
    return x


def _shape_like(shape, dtype, device, perm) -> torch.Tensor:
    """An uninitialized tensor with the saved input's shape and layout (backward reads only its metadata)."""
    if perm:
        fmt = torch.channels_last if len(perm) == 4 else torch.channels_last_3d
        return torch.empty([shape[0], shape[-1], *shape[1:-1]], dtype=dtype, device=device, memory_format=fmt)
    return torch.empty(shape, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------------- linear
def input_major(weight: torch.Tensor) -> bool:
    """Whether a linear layer's ``weight [N, K]`` lies in memory input by input, a transposed view of a row-major
    ``[K, N]``: how :class:`spikefuse.nn.SpikeLinear` with ``sparse`` keeps it, as its sparse products read ``W.T``
    and write ``dW.T``. The dense weight gradients below are computed in the weight's layout, which torch then takes
    as it is (``param.grad`` keeps its parameter's layout: another one costs a transposing copy)."""
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


def _dense_weight_grad(g2: torch.Tensor, x2: torch.Tensor, input_major_weight: bool) -> torch.Tensor:
    """``g2.T @ x2`` in the weight's layout, as torch's backward of ``F.linear`` computes it: input-major as ``(x2.T @
    g2).T``."""
    return x2.t().mm(g2).t() if input_major_weight else g2.t().mm(x2)


class _SpikeLinearFn(torch.autograd.Function):
    """``F.linear`` saving its input as bits. ``bits``: the input's bits where the caller has them (else packed here
    when the weight needs a gradient); ``sparse_forward`` / ``sparse_weight_grad``: the forward product / the weight
    gradient from the bits by :mod:`.cpu` (the caller checked that they can run) instead of
    torch's dense product; ``sparse_grad``: the input gradient, and the weight gradient where it is not read from
    the bits, from the output gradient's CSR (:func:`.cpu.output_grad_csr`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, bits=None, sparse_forward=False, sparse_weight_grad=False, sparse_grad=False):
        rows = math.prod(x.shape[:-1])
        if sparse_forward:
            y = cpu.linear(bits, rows, weight.t().contiguous(), bias).view(*x.shape[:-1], weight.shape[0])
        else:
            y = F.linear(x, weight, bias)
        need_x, need_w, _ = ctx.needs_input_grad[:3]
        ctx.x_shape = x.shape
        ctx.input_major = input_major(weight)
        ctx.packed_meta = None
        ctx.sparse_weight_grad, ctx.sparse_grad = sparse_weight_grad, sparse_grad
        saved = [None, None]
        if need_w:
            if bits is None:
                bits, shape, dtype, _ = pack_saved(x.reshape(-1, x.shape[-1]))
                ctx.packed_meta = (shape, dtype)
            else:
                ctx.packed_meta = (torch.Size([rows, x.shape[-1]]), x.dtype)
            saved[0] = bits
        if need_x:
            saved[1] = weight
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        # a backward of bits and kernels, not differentiable ops: refused under create_graph=True rather than
        # silently giving no second-order terms
        refuse_double_backward(
            "SpikeLinear",
            "the layer keeps its input as bits; use torch.nn.Linear where a gradient of the gradient is needed",
        )
        packed, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = grad_b = None
        reads_grad = need_x or (need_w and not ctx.sparse_weight_grad)
        grad_csr = cpu.output_grad_csr(g2, ctx.sparse_grad) if reads_grad else None
        # Without a CSR, the same ops, on the same shapes and layouts, as torch's backward of addmm / mm for nn.Linear
        # (whose weight gradient, too, follows the weight's layout: mm_mat2_backward).
        if need_x:
            grad_x = cpu.input_grad(g2, weight, grad_csr).view(ctx.x_shape)
        if need_w:
            shape, dtype = ctx.packed_meta
            if ctx.sparse_weight_grad:
                grad_w = cpu.weight_grad(g2, packed, shape[1])
            elif grad_csr is None:
                grad_w = _dense_weight_grad(g2, unpack(packed, shape, dtype), ctx.input_major)
            else:
                grad_w = cpu.csr_t_matmul(grad_csr, unpack(packed, shape, dtype))
        if need_b:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None


class CSRLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` whose rows ``x.reshape(-1, K)`` the caller gave as their
    :class:`.cpu.CSR` ``csr`` (:func:`.cpu.to_csr`): the output by :func:`.cpu.csr_linear`, the weight gradient by
    :func:`.cpu.csr_weight_grad` from the CSR, kept for backward instead of ``x``; the input gradient the dense
    ``G @ W`` (or from ``G``'s CSR: :func:`.cpu.input_grad` with ``sparse_grad``) and the bias gradient ``G.sum(0)``,
    torch's own ops for ``nn.Linear``. Call it as ``CSRLinearFunction.apply(x, weight, bias, csr, sparse_grad)``
    (``sparse_grad`` optional, False)."""

    @staticmethod
    def forward(ctx, x, weight, bias, csr, sparse_grad=False):
        rows = math.prod(x.shape[:-1])
        if csr.indptr.numel() != rows + 1 or csr.cols != x.shape[-1]:
            raise ValueError(
                f"the CSR is of a [{csr.indptr.numel() - 1}, {csr.cols}] matrix, the input has {rows} rows of "
                f"{x.shape[-1]}"
            )
        y = cpu.csr_linear(csr, weight.t().contiguous(), bias).view(*x.shape[:-1], weight.shape[0])
        need_x, need_w, _ = ctx.needs_input_grad[:3]
        ctx.x_shape, ctx.cols, ctx.sparse_grad = x.shape, csr.cols, sparse_grad
        ctx.save_for_backward(
            weight if need_x else None, *(csr.indptr, csr.indices, csr.values) if need_w else (None, None, None)
        )
        return y

    @staticmethod
    def backward(ctx, grad_y):
        refuse_double_backward(
            "a sparse linear product", "use torch.nn.Linear where a gradient of the gradient is needed"
        )
        weight, indptr, indices, values = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        if need_x:
            grad_x = cpu.input_grad(g2, weight, cpu.output_grad_csr(g2, ctx.sparse_grad)).view(ctx.x_shape)
        else:
            grad_x = None
        grad_w = cpu.csr_weight_grad(g2, cpu.CSR(indptr, indices, values, ctx.cols)) if need_w else None
        grad_b = g2.sum(0) if need_b else None
        return grad_x, grad_w, grad_b, None, None


class SparseGradLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` by torch's product, keeping ``x``, whose backward reads only the nonzero entries
    of the output gradient ``G``: the input gradient ``G @ W`` by :func:`.cpu.input_grad`, the weight gradient ``G.T @
    X`` by :func:`.cpu.csr_t_matmul`, both from ``G``'s CSR (:func:`.cpu.output_grad_csr` with ``sparse_grad``, which
    may leave them to torch's dense products), the bias gradient ``G.sum(0)``. For inputs with no sparsity of their own
    to read (:class:`spikefuse.nn.SpikeLinear` keeps spikes as bits, counts as a CSR). Call it as
    ``SparseGradLinearFunction.apply(x, weight, bias, sparse_grad)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, sparse_grad):
        need_x, need_w, _ = ctx.needs_input_grad[:3]
        ctx.x_shape, ctx.sparse_grad, ctx.input_major = x.shape, sparse_grad, input_major(weight)
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        refuse_double_backward(
            "a sparse linear product", "use torch.nn.Linear where a gradient of the gradient is needed"
        )
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        grad_csr = cpu.output_grad_csr(g2, ctx.sparse_grad)
        grad_x = cpu.input_grad(g2, weight, grad_csr).view(ctx.x_shape) if need_x else None
        grad_w = None
        if need_w:
            x2 = x.reshape(-1, x.shape[-1])
            if grad_csr is None:
                grad_w = _dense_weight_grad(g2, x2, ctx.input_major)
            else:
                grad_w = cpu.csr_t_matmul(grad_csr, x2)
        grad_b = g2.sum(0) if need_b else None
        return grad_x, grad_w, grad_b, None


# ----------------------------------------------------------------------------------------------- convolution
class _SpikeConvFn(torch.autograd.Function):
    """Convolution of a batch ``[N, C, ...]``; ``pre_pad``/``pre_mode``: an ``F.pad`` applied first (non-zeros
    padding modes, asymmetric ``padding='same'``), done here so that the unpadded input is what gets saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, pre_pad, pre_mode):
        xp = F.pad(x, pre_pad, mode=pre_mode) if pre_pad is not None else x
        zeros = [0] * len(stride)
        y = torch.convolution(xp, weight, bias, stride, padding, dilation, False, zeros, groups)
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.conv = (stride, padding, dilation, groups, pre_pad, pre_mode, bias is not None)
        saved = [None, None]
        if need_w:
            packed, shape, dtype, perm = pack_saved(x)
            saved[0] = packed
        else:
            x_cl = (
                not x.is_contiguous()
                and x.dim() in (4, 5)
                and x.is_contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
            )
            perm = ((0, 2, 3, 1) if x.dim() == 4 else (0, 2, 3, 4, 1)) if x_cl else None
            shape = x.permute(perm).shape if perm else x.shape
            dtype = x.dtype
        ctx.meta = (shape, dtype, perm)
        saved[1] = weight  # convolution_backward reads the weight (its shape and layout only, for grad_weight)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        # a backward of bits and kernels, not differentiable ops: refused under create_graph=True rather than
        # silently giving no second-order terms
        refuse_double_backward(
            "SpikeConv1d/2d/3d",
            "the layer keeps its input as bits; use torch.nn.Conv1d/2d/3d where a gradient of the gradient is needed",
        )
        packed, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        stride, padding, dilation, groups, pre_pad, pre_mode, has_bias = ctx.conv
        shape, dtype, perm = ctx.meta
        if need_w:
            x = unpack_saved(packed, shape, dtype, perm)
        else:
            x = _shape_like(shape, dtype, grad_y.device, perm)
        xp = F.pad(x, pre_pad, mode=pre_mode) if pre_pad is not None else x
        bias_sizes = [weight.shape[0]] if has_bias else None
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_y,
            xp,
            weight,
            bias_sizes,
            stride,
            padding,
            dilation,
            False,
            [0] * len(stride),
            groups,
            [need_x, need_w, need_b],
        )
        if need_x and pre_pad is not None:
            # The pad's backward (linear, reads no input values), taken from torch's own autograd of F.pad.
            with torch.enable_grad():
                probe = torch.empty(x.shape, dtype=dtype, device=grad_y.device, requires_grad=True)
                (grad_x,) = torch.autograd.grad(F.pad(probe, pre_pad, mode=pre_mode), probe, grad_x)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None
