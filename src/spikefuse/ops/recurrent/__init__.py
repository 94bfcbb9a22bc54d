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

``sparse_grad=True`` (CPU backend, all to all): the backward reads only the nonzero entries of ``G``, the gradient
of each step's input current (mostly zero behind a surrogate of compact support, as
:class:`spikefuse.surrogate.Rectangle`, where the leak does not carry it back): the reverse loop is one kernel call
whose step product ``G[t] @ W`` sums, row by row, the weight rows of ``G[t]``'s nonzero entries in increasing index
(:func:`.cpu.backward_sparse`), and the weight's gradient over all steps is ``G``'s CSR times the previous spikes
(:func:`spikefuse.ops.spike_layers.cpu.csr_t_matmul`; with ``sparse=True`` it reads the spikes' bits as before). The
reference's current is then :class:`SparseGradCurrent`, whose backward sums the spikes' gradient in that order in
plain torch ops. ``sparse_grad="auto"``, as ``sparse="auto"``: each call takes the way the share of nonzero ``G`` of
the previous backward with the same weight tensor says (:func:`last_grad_rate`), the sparse backward below
:data:`CROSSOVER_GRAD_RECURRENT` from the spike layers' :data:`~spikefuse.ops.spike_layers.cpu.CROSSOVER_ROWS` rows
(``T*B``) on.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ..spike_layers.reference import linear_reference
from ..spike_layers import cpu as sparse_cpu

__all__ = [
    "StepBuffers",
    "GradBuffers",
    "ALIGNMENT",
    "aligned",
    "current",
    "current_backward",
    "SparseCurrent",
    "CROSSOVER_RECURRENT",
    "last_spike_rate",
    "record_spike_rate",
    "SparseGradCurrent",
    "last_grad_rate",
    "record_grad_rate",
    "use_sparse_grad",
    "CROSSOVER_GRAD_RECURRENT",
]


class StepBuffers(NamedTuple):
    """One call's tensors as every backend's forward entry points take them (``bind_forward``, ``forward_sparse``,
    ``replay``): the input ``x`` ``[T, B, H]``; ``r`` ``[B, H]``, each step's recurrent current (None where the kernel
    sums it itself); the states ``cur`` ``[S, B, H]`` (the initial ones, then the last step's); ``spikes`` ``[T, B,
    H]``, written; ``hist``, where every step's states the backward reads are kept (None: keep none); the parameters
    ``par`` ``[P, H]``."""

    x: torch.Tensor
    r: torch.Tensor | None
    cur: torch.Tensor
    spikes: torch.Tensor
    hist: torch.Tensor | None
    par: torch.Tensor


class GradBuffers(NamedTuple):
    """One call's tensors as every backend's backward entry points take them (``bind_backward``, ``backward_sparse``,
    ``initial``, ``handoff_grad``): ``need``, whether each parameter needs its gradient; the spikes' gradient ``gy``
    ``[T, B, H]``; ``grec`` ``[B, H]``, the spikes' gradient through the next step's current; ``G`` ``[T, B, H]``,
    each step's input gradient, written; the states' gradient ``gS`` ``[S, B, H]`` and the spike's ``gs`` ``[B, H]``
    carried back a step at a time; the kept states ``hist``; the initial states ``init`` ``[S, B, H]``; the input
    the backward reads, ``xin`` (``G`` where it reads none); ``par`` ``[P, H]``; ``acc``, the parameters' gradients
    per neuron."""

    need: list[bool]
    gy: torch.Tensor
    grec: torch.Tensor
    G: torch.Tensor
    gS: torch.Tensor
    gs: torch.Tensor
    hist: torch.Tensor
    init: torch.Tensor
    xin: torch.Tensor
    par: torch.Tensor
    acc: torch.Tensor


#: Where ``spikefuse.recurrent(..., sparse="auto")`` takes the sparse layer: a spike rate, of the previous call with
#: the same weight, below this. Measured on the 2-core AMD EPYC by ``python benchmarks/sparse_recurrent_crossover.py
#: --threads 1 --repeats 21`` (``benchmarks/results/sparse_recurrent_crossover.md``): a recurrent LIF layer's
#: forward+backward with ``sparse=True`` ties the dense layer's at 60% spikes for the SHD size (T=250, batch 32, 256),
#: at 35-60% for sequential MNIST's (T=28, batch 32, 256), not below 65% for a small layer (T=100, batch 8, 64); the
#: constant sits below the lowest, as the linear layers' crossovers do.
CROSSOVER_RECURRENT = 0.30

# id(weight) -> (a weak reference to it, the spike rate of its last call with sparse="auto")
_RATES: dict[int, tuple[weakref.ref, float]] = {}
# id(weight) -> (a weak reference to it, the share of nonzero G of its last backward with sparse_grad="auto")
_GRAD_RATES: dict[int, tuple[weakref.ref, float]] = {}


def _last(table: dict, weight: torch.Tensor) -> float | None:
    entry = table.get(id(weight))
    return entry[1] if entry is not None and entry[0]() is weight else None


def _record(table: dict, weight: torch.Tensor, rate: float) -> None:
    key = id(weight)
    table[key] = (weakref.ref(weight, lambda _, key=key: _forget(table, key)), float(rate))


def last_spike_rate(weight: torch.Tensor) -> float | None:
    """The spike rate of the last ``sparse="auto"`` call of a recurrent layer with this ``weight`` tensor (the same
    object), counted from the bits its kernels wrote; None where none ran."""
    return _last(_RATES, weight)


def record_spike_rate(weight: torch.Tensor, rate: float) -> None:
    """Keep ``rate`` as ``weight``'s last spike rate (until ``weight`` is freed)."""
    _record(_RATES, weight, rate)


def last_grad_rate(weight: torch.Tensor) -> float | None:
    """The share of nonzero entries of ``G`` (the gradient of every step's input current) in the last backward of a
    ``sparse_grad="auto"`` recurrent layer with this ``weight`` tensor (the same object); None where none ran."""
    return _last(_GRAD_RATES, weight)


def record_grad_rate(weight: torch.Tensor, rate: float) -> None:
    """Keep ``rate`` as ``weight``'s last share of nonzero ``G`` (until ``weight`` is freed)."""
    _record(_GRAD_RATES, weight, rate)


#: Where ``sparse_grad="auto"`` takes the recurrent layer's sparse backward: a share of nonzero ``G``, of the previous
#: backward with the same weight, below this. Measured on the 2-core AMD EPYC at the SHD size (T=250, batch 32, 256,
#: one thread; ``benchmarks/results/sparse_recurrent_gradients.md`` and ``sparse_recurrent_active.md``): the sparse
#: backward against the dense one 0.68-0.73x at 4-17% nonzero, 0.89-0.91x at 44%, 0.99-1.00x at 64%, 1.05-1.08x at
#: 75%; the constant sits below the tie, as :data:`CROSSOVER_RECURRENT` does. (The spike layers' single product pays
#: only below their :data:`~spikefuse.ops.spike_layers.cpu.CROSSOVER_GRAD`; here each step's product on ``[B, H]``
#: rows gains more from every zero.)
CROSSOVER_GRAD_RECURRENT = 0.40


def use_sparse_grad(weight: torch.Tensor, rows: int) -> bool:
    """``sparse_grad="auto"``'s way for a call with ``rows`` (``T*B``) rows: the sparse backward from the spike
    layers' :data:`~spikefuse.ops.spike_layers.cpu.CROSSOVER_ROWS` rows on where the previous backward with this
    ``weight`` had under :data:`CROSSOVER_GRAD_RECURRENT` of ``G`` nonzero (its count taken one call late: ``G``
    exists only as the backward makes it); the dense one otherwise and on the first call."""
    rate = last_grad_rate(weight)
    return rows >= sparse_cpu.CROSSOVER_ROWS and rate is not None and rate < CROSSOVER_GRAD_RECURRENT


def _forget(table: dict, key: int) -> None:
    entry = table.get(key)
    if entry is not None and entry[0]() is None:
        del table[key]


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


class SparseGradCurrent(torch.autograd.Function):
    """The recurrent current ``spikes @ weight.T + bias`` (``weight`` ``[H, H]``) of the reference backend with
    ``sparse_grad``: the forward :func:`current`'s (or, with ``sparse``, :class:`SparseCurrent`'s sums), the
    spikes' gradient ``grad @ weight`` summed as :func:`.cpu.backward_sparse` sums it, from zero over the nonzero
    entries of ``grad``'s row in increasing index (:func:`~spikefuse.ops.spike_layers.reference.linear_reference`,
    plain torch ops), the weight's and the bias's the dense products'. ``holder``: None, or ``[weight, nonzero,
    elements, steps]`` counting the nonzero gradients of every step for ``sparse_grad="auto"``, which records the
    share in :func:`record_grad_rate` once all ``steps`` ran. ``SparseGradCurrent.apply(spikes, weight, bias, sparse,
    holder)``."""

    @staticmethod
    def forward(ctx, spikes, weight, bias, sparse, holder):
        ctx.save_for_backward(spikes, weight)
        ctx.has_bias, ctx.holder = bias is not None, holder
        return linear_reference(spikes, weight, bias) if sparse else current(spikes, weight, bias)

    @staticmethod
    def count(holder, grad: torch.Tensor) -> None:
        """Add ``grad``'s nonzero entries to ``holder`` (None: nothing), recording the share at its last step."""
        if holder is not None:
            holder[1] += int(torch.count_nonzero(grad))
            holder[2] += grad.numel()
            holder[3] -= 1
            if holder[3] == 0 and holder[0]() is not None:
                record_grad_rate(holder[0](), holder[1] / max(1, holder[2]))

    @staticmethod
    def backward(ctx, grad):
        spikes, weight = ctx.saved_tensors
        SparseGradCurrent.count(ctx.holder, grad)
        grad_bias = grad.sum(0) if ctx.has_bias else None
        return linear_reference(grad, weight.t()), grad.t() @ spikes, grad_bias, None, None
