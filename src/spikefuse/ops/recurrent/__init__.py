"""Recurrent layers of any :class:`~spikefuse.neurons.NeuronModel`: the neuron's input at step t is the layer's input
``x[t]`` plus the recurrent current of the previous step's spikes, ``x_rec[t] = current(s[t-1])``:

- all to all: ``s[t-1] @ W.T + b`` (``W`` ``[H, H]``, an ``nn.Linear``'s weight; the bias optional);
- one to one: ``w * s[t-1] + b`` (``w`` ``[H]``, each neuron's own spike).

The current joins the step's input as :attr:`NeuronModel.recurrent_step` says. Backends, run by :mod:`.autograd`
(its time loop, forward and reverse, around each backend's step kernels): ``reference`` (:func:`spikefuse.ops.engine.reference.run` with ``recurrent``: the serial PyTorch
loop, differentiated by autograd, the oracle), ``cpu`` (numba step kernels, :mod:`.cpu`) and ``triton``
(:mod:`.triton`). The generated backends compute each step's current with the same torch call as the reference
(:func:`current`), on the same ``[B, H]`` spikes, so their spikes and states equal the reference's bit for bit; all
else of a step is one kernel, and the time loop runs once forward and once in reverse inside one autograd operation
(:mod:`.autograd`), the weight's gradient one matrix product over all ``T*B`` rows.

``sparse=True`` (CPU, all to all): the step kernel sums each step's current from the weight rows of the previous
step's spikes only, read from the bits it wrote as it made them (:func:`.cpu.forward_sparse`: the whole time loop in
one call), and the weight's gradient reads the same bits (:func:`spikefuse.ops.sparse_cpu.row_weight_grad`). The
reference's current is then :class:`SparseCurrent`, the same sums in the same order in plain torch ops.
"""

from __future__ import annotations

import torch

from ..sparse_cpu import linear_reference

__all__ = ["ALIGNMENT", "aligned", "current", "current_backward", "SparseCurrent"]


#: The address alignment (bytes) of the spikes a product reads, by device type: BLAS libraries pick their kernels by
#: the operands' alignment (MKL rounded a product of the same values differently for a row of a larger tensor than
#: for a fresh one), so every product reads spikes at the alignment of a fresh tensor.
ALIGNMENT = {"cpu": 64, "cuda": 256}


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where its address is not at :data:`ALIGNMENT`."""
    return t if t.data_ptr() % ALIGNMENT.get(t.device.type, 1) == 0 else t.clone()


def current(spikes: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out=None) -> torch.Tensor:
    """The recurrent current of ``spikes`` ``[B, H]``: ``spikes @ weight.T + bias`` for a ``[H, H]`` weight (what
    ``F.linear`` computes), ``weight * spikes + bias`` for a ``[H]`` one; into ``out`` (aligned) when given."""
    spikes = aligned(spikes)
    if weight.dim() == 2:
        if bias is None:
            return torch.mm(spikes, weight.t(), out=out)
        return torch.addmm(bias, spikes, weight.t(), out=out)
    if out is None:
        product = spikes * weight
        return product if bias is None else product + bias
    torch.mul(spikes, weight, out=out)
    return out if bias is None else out.add_(bias)


def current_backward(grad: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The gradient of the spikes from the gradient ``grad`` ``[B, H]`` of their current, into ``out``."""
    if weight.dim() == 2:
        return torch.mm(grad, weight, out=out)
    return torch.mul(grad, weight, out=out)


class SparseCurrent(torch.autograd.Function):
    """The recurrent current ``spikes @ weight.T + bias`` (``weight`` ``[H, H]``) of the sparse layer, summed as its
    step kernel sums it: from zero over the spiking neurons in increasing index, then the bias
    (:func:`~spikefuse.ops.sparse_cpu.linear_reference`, plain torch ops); the reference backend's current with
    ``sparse=True``, the oracle of the kernel's bits. Its gradients are the dense products' (autograd cannot
    differentiate the list of spikes in the spikes). ``SparseCurrent.apply(spikes, weight, bias)``."""

    @staticmethod
    def forward(ctx, spikes, weight, bias):
        ctx.save_for_backward(spikes, weight)
        ctx.has_bias = bias is not None
        return linear_reference(spikes, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        spikes, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ spikes, grad.sum(0) if ctx.has_bias else None
