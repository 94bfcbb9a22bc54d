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
one call), and the weight's gradient reads the same bits (:func:`spikefuse.ops.spike_layers.cpu.row_weight_grad`). The
reference's current is then :class:`SparseCurrent`, the same sums in the same order in plain torch ops.

``sparse="auto"``: the layer's spike rate is known only after its steps have run, so each call takes the way the
rate of the previous call with the same weight tensor says (:func:`last_spike_rate`: counted from the bits the
kernels wrote, :func:`record_spike_rate`): the sparse layer below :data:`CROSSOVER_RECURRENT`, the dense one at or
above it and where no call with that weight ran before.
"""

from __future__ import annotations

import weakref

import torch

from ..spike_layers.reference import linear_reference

__all__ = [
    "ALIGNMENT",
    "aligned",
    "current",
    "current_backward",
    "SparseCurrent",
    "CROSSOVER_RECURRENT",
    "last_spike_rate",
    "record_spike_rate",
]

#: Where ``spikefuse.recurrent(..., sparse="auto")`` takes the sparse layer: a spike rate, of the previous call with
#: the same weight, below this. Measured on the 2-core AMD EPYC by ``python benchmarks/sparse_recurrent_crossover.py
#: --threads 1 --repeats 21`` (``benchmarks/results/sparse_recurrent_crossover.md``): a recurrent LIF layer's
#: forward+backward with ``sparse=True`` ties the dense layer's at 60% spikes for the SHD size (T=250, batch 32, 256),
#: at 35-60% for sequential MNIST's (T=28, batch 32, 256), not below 65% for a small layer (T=100, batch 8, 64); the
#: constant sits below the lowest, as the linear layers' crossovers do.
CROSSOVER_RECURRENT = 0.30

# id(weight) -> (a weak reference to it, the spike rate of its last call with sparse="auto")
_RATES: dict[int, tuple[weakref.ref, float]] = {}


def last_spike_rate(weight: torch.Tensor) -> float | None:
    """The spike rate of the last ``sparse="auto"`` call of a recurrent layer with this ``weight`` tensor (the same
    object), counted from the bits its kernels wrote; None where none ran."""
    entry = _RATES.get(id(weight))
    return entry[1] if entry is not None and entry[0]() is weight else None


def record_spike_rate(weight: torch.Tensor, rate: float) -> None:
    """Keep ``rate`` as ``weight``'s last spike rate (until ``weight`` is freed)."""
    key = id(weight)
    _RATES[key] = (weakref.ref(weight, lambda _, key=key: _forget(key)), float(rate))


def _forget(key: int) -> None:
    entry = _RATES.get(key)
    if entry is not None and entry[0]() is None:
        del _RATES[key]


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
    (:func:`~spikefuse.ops.spike_layers.reference.linear_reference`, plain torch ops); the reference backend's current
    with ``sparse=True``, the oracle of the kernel's bits. Its gradients are the dense products' (autograd cannot
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
