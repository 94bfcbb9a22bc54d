"""Products of binary spikes with a dense weight on the CPU that read only the active (spiking) inputs.

A layer fed by spikes multiplies a 0/1 matrix ``S [M, K]`` (``M = T*B`` rows) by its weight ``W [N, K]``; at a few
percent spikes almost every multiply-add of the dense product multiplies by zero. These numba kernels do only the
others:

- :func:`linear`: ``Y = S @ W.T (+ bias)``. Each row gathers the rows of ``W.T [K, N]`` (the caller's transposed
  copy: one contiguous row of ``N`` weights per input) that its active inputs pick and adds them into the row's
  output. Rows in parallel.
- :func:`weight_grad`: ``dW = G.T @ S`` for the output gradient ``G [M, N]``: for each row ``m`` and each of its
  active inputs ``k``, ``dW[:, k] += G[m, :]``, accumulated as ``dW.T [K, N]`` (then copied into ``dW``). The
  threads split the inputs ``k`` between them, each reading every row of ``G`` and adding only into its own rows of
  ``dW.T``: no two threads write one element, and each element sums in the order of the rows. (Splitting the rows
  instead, with a partial ``dW`` per thread summed at the end, reads ``G`` once instead of once per thread, but its
  sums would follow the split, which changes with the thread count.)

**The active lists are the packed bits** (:mod:`spikefuse.ops.bitpack`'s layout, ``S`` flattened row-major, bit
``i`` of the string being element ``i``): a kernel reads a row's bits 64 at a time and takes the set ones lowest
first, so no list of indices is built or kept. A neuron kernel writes these bits as it makes the spikes
(:func:`spikefuse.ops.bitpack.spike_bits`), and a spike layer packs its input for backward anyway; from a dense 0/1
tensor the bits are one :func:`~spikefuse.ops.bitpack.pack` pass (which also checks that it is binary) -- in this
first form spikes that did not come from a neuron kernel take that pass, not yet a list the producer wrote.

**Exactness.** Each output element is summed in one fixed order: ``linear`` from zero over the active inputs in
increasing ``k``, then ``+ bias``; ``weight_grad`` from zero over the active rows in increasing ``m``. The plain-
PyTorch references beside them (:mod:`.reference`: ``linear_reference`` and ``weight_grad_reference``) sum in the same
order and are their oracle, bit for bit; against torch's dense product (its own blocked order) they agree to rounding.
float32 and float64.

**Spike rows from a word boundary** (:func:`pack_spike_rows`, int64 ``[rows, words_per_row(K)]``): the layout
in which a kernel that writes rows in parallel writes the bits of its rows (in bitpack's layout two rows share a byte
where ``K % 8``). The recurrent step kernels (:mod:`spikefuse.ops.recurrent.cpu`, ``sparse=True``) pack each step's
spike row into it as they make it (:func:`pack_row`) and sum the next step's current from it
(:func:`active_inputs`, :func:`summed_weight_rows`: :func:`linear`'s row); :func:`row_linear` and
:func:`row_weight_grad` are :func:`linear` and :func:`weight_grad` reading it, in the same orders.

**Inputs with values** (framed events are counts per pixel and bin, not spikes): :func:`to_csr` lists a dense
``X [M, K]``'s nonzero entries row by row with their values (a :class:`CSR`: one pass counting each row's, one
writing them), and :func:`csr_linear` / :func:`csr_weight_grad` are the same products weighted by the values,
``Y = X @ W.T (+ bias)`` and ``dW = G.T @ X``, in the same orders (each term ``value * weight``, rounded, then added).
The forward reads the rows, the weight gradient splits the inputs ``k`` between threads as above, each thread
skipping the entries of other threads in every row (the rows' indices are increasing, so a row's scan stops at its
first index past the thread's: one comparison per entry and thread, where a column-major copy would cost a
counting sort of the entries at every call). ``CSRLinearFunction`` (:mod:`.autograd`) is the autograd operation of both,
keeping the CSR for backward instead of ``X``. The references take any input: for spikes every value is 1 and ``1 * w``
is ``w``, the same bits as the binary kernels'.

Speed (``spikefuse bench sparse``, ``benchmarks/results/sparse_full.md``, 2 threads): the SHD input product
``[8000 x 700] @ [700 x 256]``, forward + weight gradient, in 0.16x torch's dense time at 5% spikes and 0.94x at
50%; the transposes of the weight and of ``dW.T``, at every call, cost as much as a small product
(:data:`CROSSOVER_ROWS`).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np
import torch
from numba import njit, prange, types
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from ...threads import match_numba_threads
from .. import buffers
from ..bit_layout import packed_numel
from ..bitpack import NotBinaryError

__all__ = [
    "SUPPORTED_DTYPES",
    "CROSSOVER_FORWARD",
    "CROSSOVER_WEIGHT_GRAD",
    "CROSSOVER_ROWS",
    "CROSSOVER_WORK",
    "linear",
    "weight_grad",
    "spike_count",
    "row_spike_count",
    "words_per_row",
    "pack_spike_rows",
    "row_linear",
    "row_weight_grad",
    "CROSSOVER_VALUES",
    "CSR",
    "nonzero_counts",
    "nonzero_counts_binary",
    "to_csr",
    "csr_linear",
    "csr_weight_grad",
    "csr_t_matmul",
    "CROSSOVER_GRAD",
    "output_grad_csr",
    "input_grad",
]

SUPPORTED_DTYPES = (torch.float32, torch.float64)

#: Where ``SpikeLinear(sparse="auto")`` takes the sparse products: at least ``CROSSOVER_ROWS`` rows (``T*B*...``), and
#: a spike rate below ``CROSSOVER_FORWARD`` (the forward) / ``CROSSOVER_WEIGHT_GRAD`` (the weight gradient). Measured on
#: the 2-core AMD EPYC (Zen 5) of ``benchmarks/results/sparse_crossover.md`` by ``spikefuse bench sparse --threads 2
#: --products recurrent shd nmnist --rows 128 256 1280 8000 --rates 5 20 30 40 50 60 --repeats 9 --tag crossover``,
#: the layer keeping its weight input-major (no transpose at a call): forward 42.4-54.4%, weight gradient 38.9-54.4%
#: from 128 rows to 8000, the N-MNIST layer's the lowest (two earlier runs of the same command: down to 41.2-41.5%
#: and 35.8-41.3%). The constants sit below the lowest from 256 rows on, so that ``auto`` is not slower than dense
#: where it picks sparse; below ``CROSSOVER_ROWS`` (measured down to 128 rows, where the sparse products still paid)
#: ``auto`` takes the dense products without a count.
CROSSOVER_FORWARD = 0.40
CROSSOVER_WEIGHT_GRAD = 0.35
CROSSOVER_ROWS = 256
#: ... and at least this many multiply-adds (``rows * in_features * out_features``): the smallest product the sparse one
#: was measured to pay on, [256 x 256] -> 256 (``sparse_crossover.md``). On sequential MNIST ``spikefuse train --model
#: srnn --sparse auto`` ran 0.94x dense samples/s (``benchmarks/results/sparse_smnist.md``) with every row count above
#: ``CROSSOVER_ROWS`` but products too small for the per-call costs: the readout [1792 x 256] -> 10 (4.6 M) and the
#: input layer [1792 x 28] -> 256 (12.8 M).
CROSSOVER_WORK = 256**3
#: Where ``SpikeLinear(sparse="auto")`` takes the products of an input with values (:class:`CSR`): at least
#: ``CROSSOVER_ROWS`` rows and a share of nonzero entries below this, forward and weight gradient together (the CSR is
#: built for both). Measured on the 2-core AMD EPYC by ``python benchmarks/sparse_values_crossover.py --threads 2
#: --repeats 31`` (``benchmarks/results/sparse_values_crossover.md``): one training call of the layer, every per-call
#: cost included, ties torch's at 29-34% nonzero for the N-MNIST input layer at T=10 (batches 32 and 128), 38% for an
#: SHD-size one; below the lowest, as the spikes' crossovers are.
CROSSOVER_VALUES = 0.25
#: Where ``sparse_grad="auto"`` reads a layer's output gradient by its :class:`CSR` (:func:`output_grad_csr`): from
#: ``CROSSOVER_ROWS`` rows on and a share of nonzero gradients below this. Measured on the 2-core AMD EPYC by ``python
#: benchmarks/sparse_gradients.py --threads 2 --repeats 7`` (``benchmarks/results/sparse_gradients.md``): the
#: backward of a layer (input, weight and bias gradients, the CSR's passes included) ties torch's between 20% and 50%
#: nonzero at 8000 rows and at 20% for a [320 x 256] -> 256 layer; below the lowest, as the other crossovers are.
CROSSOVER_GRAD = 0.15

# Below this many output elements a call runs on one thread: waking the pool costs more than the work (a recurrent
# step's [32, 256] output takes a few microseconds).
_SERIAL_WORK = 1 << 14

# Row tasks per thread of the forward: enough that rows of different spike counts even out, few enough that each
# task's list buffer is allocated rarely.
_TASKS_PER_THREAD = 8

_ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)
_LITTLE_ENDIAN = sys.byteorder == "little"


# ------------------------------------------------------------------------------------------------------- kernels
@intrinsic
def _popcount(typingctx, x):
    """The number of set bits of an unsigned integer (LLVM's ctpop: one instruction where the machine has it)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.ctpop", [args[0].type])
        return builder.call(fn, args)

    return x(x), codegen


@njit(inline="always")
def _bits(words, start, n):
    """Bits ``start .. start + n - 1`` (``1 <= n <= 64``) of the bit string ``words`` as the low bits of a uint64."""
    w = start >> 6
    shift = start & 63
    word = words[w] >> np.uint64(shift)
    if shift and w + 1 < words.size:
        word |= words[w + 1] << np.uint64(64 - shift)
    return word & (_ALL_ONES >> np.uint64(64 - n))


@njit(inline="always")
def active_inputs(words, start, k_in, active):
    """The indices of the set bits among bits ``start .. start + k_in - 1`` into ``active``, lowest first; returns
    how many."""
    count = 0
    for c in range(0, k_in, 64):
        word = _bits(words, start + c, min(64, k_in - c))
        while word:
            active[count] = c + trailing_zeros(word)
            count += 1
            word &= word - np.uint64(1)
    return count


@njit(inline="always")
def summed_weight_rows(weight_t, active, count, bias, acc):
    """``acc = sum of weight_t[active[j]] for j < count, in increasing j (+ bias)``: from zero, four weight rows per
    pass over the accumulator, ``(((acc + a) + b) + c) + d``, the order of one at a time with a quarter of the
    accumulator's loads and stores. The row of the sparse forward (:func:`_linear_kernel`) and of a recurrent step's
    current computed inside the step kernel (:mod:`spikefuse.ops.recurrent.cpu`)."""
    n = acc.size
    for i in range(n):
        acc[i] = 0
    j = 0
    while j + 4 <= count:
        a, b, c, d = (
            weight_t[active[j]],
            weight_t[active[j + 1]],
            weight_t[active[j + 2]],
            weight_t[active[j + 3]],
        )
        for i in range(n):
            acc[i] = (((acc[i] + a[i]) + b[i]) + c[i]) + d[i]
        j += 4
    for jj in range(j, count):
        a = weight_t[active[jj]]
        for i in range(n):
            acc[i] += a[i]
    if bias.size:
        for i in range(n):
            acc[i] += bias[i]


@njit(inline="always")
def weighted_rows_of_nonzeros(g, weight, active, acc):
    """``acc = sum of g[h] * weight[h] over the nonzero g[h], in increasing h``: one row of ``G @ W`` (``g`` a row of
    ``G [M, K]``, ``weight [K, N]``) from the row's nonzero entries only, listed into ``active`` first, then summed
    from zero four weight rows per pass, ``(((acc + a * ga) + b * gb) + c * gc) + d * gd``, the order of
    :func:`_csr_linear_kernel` (and of :func:`.reference.linear_reference` ``(g, weight.t())``). The recurrent layer's
    step product ``G[t] @ W`` with ``sparse_grad`` (:mod:`spikefuse.ops.recurrent.cpu`)."""
    count = 0
    for h in range(g.size):
        if g[h] != 0:
            active[count] = h
            count += 1
    n = acc.size
    for i in range(n):
        acc[i] = 0
    j = 0
    while j + 4 <= count:
        ka, kb, kc, kd = active[j], active[j + 1], active[j + 2], active[j + 3]
        a, b, c, d = weight[ka], weight[kb], weight[kc], weight[kd]
        ga, gb, gc, gd = g[ka], g[kb], g[kc], g[kd]
        for i in range(n):
            acc[i] = (((acc[i] + a[i] * ga) + b[i] * gb) + c[i] * gc) + d[i] * gd
        j += 4
    for jj in range(j, count):
        a, ga = weight[active[jj]], g[active[jj]]
        for i in range(n):
            acc[i] += a[i] * ga


@njit(inline="always")
def pack_row(row, words):
    """The bits of the 0/1 ``row`` into ``words`` (``ceil(row.size / 64)`` words, bit ``i`` of word ``w`` element
    ``64*w + i``, the bits past the row zero): a spike row packed by the kernel that wrote it, while in its cache."""
    n = row.size
    for w in range(words.size):
        word = np.uint64(0)
        for i in range(min(64, n - 64 * w)):
            if row[64 * w + i] != 0:
                word |= np.uint64(1) << np.uint64(i)
        words[w] = word


@njit(parallel=True, cache=True)
def _linear_kernel(words, row_bits, weight_t, bias, tasks, out):
    """``out[m] = sum of weight_t[k] over the set bits k of row m (bits from ``m * row_bits`` on), in increasing k
    (+ bias)`` (:func:`summed_weight_rows`)."""
    rows = out.shape[0]
    k_in = weight_t.shape[0]
    per_task = -(-rows // tasks)
    for t in prange(tasks):
        active = np.empty(k_in, np.int64)
        for m in range(t * per_task, min(rows, (t + 1) * per_task)):
            count = active_inputs(words, m * row_bits, k_in, active)
            summed_weight_rows(weight_t, active, count, bias, out[m])


@njit(parallel=True, cache=True)
def _weight_grad_kernel(words, row_bits, grad, bounds, out_t):
    """``out_t[k] = sum of grad[m] over the rows m whose bit k is set (row m's bits from ``m * row_bits`` on), in
    increasing m``; task ``t`` owns inputs ``bounds[t] .. bounds[t + 1] - 1`` (its rows of ``out_t``, which no other
    task writes)."""
    rows, n = grad.shape
    for t in prange(bounds.size - 1):
        k0, k1 = bounds[t], bounds[t + 1]
        for k in range(k0, k1):
            for i in range(n):
                out_t[k, i] = 0
        for m in range(rows):
            g = grad[m]
            for c in range(k0, k1, 64):
                word = _bits(words, m * row_bits + c, min(64, k1 - c))
                while word:
                    acc = out_t[c + trailing_zeros(word)]
                    word &= word - np.uint64(1)
                    for i in range(n):
                        acc[i] += g[i]


@njit(cache=True)
def _count_kernel(words, nbits):
    total = 0
    whole = nbits >> 6
    for w in range(whole):
        total += _popcount(words[w])
    if nbits & 63:
        total += _popcount(words[whole] & (_ALL_ONES >> np.uint64(64 - (nbits & 63))))
    return total


@njit(parallel=True, cache=True)
def _nonzero_counts_kernel(x, counts):
    rows, cols = x.shape
    for m in prange(rows):
        count = 0
        for k in range(cols):
            if x[m, k] != 0:
                count += 1
        counts[m] = count


@njit(parallel=True, cache=True)
def _nonzero_counts_binary_kernel(x, counts, others):
    """:func:`_nonzero_counts_kernel`, and ``others[m]``: how many entries of row ``m`` are neither 0 nor 1."""
    rows, cols = x.shape
    for m in prange(rows):
        count = 0
        other = 0
        for k in range(cols):
            v = x[m, k]
            if v != 0:
                count += 1
                if v != 1:
                    other += 1
        counts[m] = count
        others[m] = other


@njit(parallel=True, cache=True)
def _csr_fill_kernel(x, indptr, indices, values):
    """Row ``m``'s nonzero entries into ``indices`` / ``values`` from ``indptr[m]`` on. Without a branch on the
    value: every element is written at the next free slot, which only a nonzero one then takes (at 10% nonzero a
    branch on the value mispredicts often: 1.4 against 1.1 ms for [1280 x 2312] in cache); the row's scan stops at
    its last nonzero entry, so no slot past the row is written (nor, with counts too high, an element past the row
    read)."""
    rows, cols = x.shape
    for m in prange(rows):
        j, end = indptr[m], indptr[m + 1]
        k = 0
        while j < end and k < cols:
            v = x[m, k]
            indices[j] = k
            values[j] = v
            j += v != 0
            k += 1


@njit(parallel=True, cache=True)
def _csr_linear_kernel(indptr, indices, values, weight_t, bias, tasks, out):
    """``out[m] = sum of values[j] * weight_t[indices[j]]`` over row ``m``'s entries in increasing index (+ bias):
    :func:`_linear_kernel` with each weight row scaled by its value, four per pass over the accumulator."""
    rows, n = out.shape
    per_task = -(-rows // tasks)
    for t in prange(tasks):
        for m in range(t * per_task, min(rows, (t + 1) * per_task)):
            acc = out[m]
            for i in range(n):
                acc[i] = 0
            j, end = indptr[m], indptr[m + 1]
            while j + 4 <= end:
                a, b, c, d = (
                    weight_t[indices[j]],
                    weight_t[indices[j + 1]],
                    weight_t[indices[j + 2]],
                    weight_t[indices[j + 3]],
                )
                va, vb, vc, vd = values[j], values[j + 1], values[j + 2], values[j + 3]
                for i in range(n):
                    acc[i] = (((acc[i] + a[i] * va) + b[i] * vb) + c[i] * vc) + d[i] * vd
                j += 4
            for jj in range(j, end):
                a, va = weight_t[indices[jj]], values[jj]
                for i in range(n):
                    acc[i] += a[i] * va
            if bias.size:
                for i in range(n):
                    acc[i] += bias[i]


@njit(parallel=True, cache=True)
def _csr_weight_grad_kernel(indptr, indices, values, grad, bounds, out_t):
    """``out_t[k] = sum of grad[m] * value`` over the entries ``(m, k, value)`` in increasing ``m``; task ``t`` owns
    inputs ``bounds[t] .. bounds[t + 1] - 1``, as in :func:`_weight_grad_kernel`."""
    rows, n = grad.shape
    for t in prange(bounds.size - 1):
        k0, k1 = bounds[t], bounds[t + 1]
        for k in range(k0, k1):
            for i in range(n):
                out_t[k, i] = 0
        for m in range(rows):
            g = grad[m]
            for j in range(indptr[m], indptr[m + 1]):
                k = indices[j]
                if k >= k1:
                    break
                if k >= k0:
                    acc, v = out_t[k], values[j]
                    for i in range(n):
                        acc[i] += g[i] * v


# ------------------------------------------------------------------------------------------------------ wrappers
def _words(bits: torch.Tensor, nbits: int) -> np.ndarray:
    """The packed ``bits`` of ``nbits`` elements as uint64 words (bit ``i`` of word ``w`` is element ``64*w + i``),
    padded with zeros to whole words: a view where the bytes are whole, aligned words, else a copy (1/8 of a byte
    per element)."""
    if bits.dtype != torch.uint8 or bits.dim() != 1 or bits.device.type != "cpu":
        raise ValueError(f"bits must be a 1-D uint8 CPU tensor, got {bits.dtype} {tuple(bits.shape)} on {bits.device}")
    if bits.numel() != packed_numel(nbits):
        raise ValueError(f"bits has {bits.numel()} bytes, but {nbits} elements take {packed_numel(nbits)}")
    nbytes = 8 * -(-nbits // 64)
    if bits.numel() == nbytes and bits.is_contiguous() and bits.data_ptr() % 8 == 0 and _LITTLE_ENDIAN:
        return bits.numpy().view(np.uint64)
    padded = np.zeros(nbytes, np.uint8)
    padded[: bits.numel()] = bits.numpy()
    words = padded.view("<u8")  # pack's bit order is a little-endian word's: on other machines the bytes are swapped
    return words if words.dtype.isnative else words.astype(np.uint64)


def _check_float(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if t.device.type != "cpu" or t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"the sparse CPU products take float32 or float64 CPU tensors; {name} is {t.dtype} on {t.device}"
        )
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} is {t.dtype}, the weight {dtype}: give both one dtype")


def _bounds(n: int, tasks: int) -> np.ndarray:
    """``0 = b[0] <= ... <= b[tasks'] = n``: ``n`` items in ``min(n, tasks)`` runs of nearly equal length."""
    return np.linspace(0, n, max(1, min(n, tasks)) + 1).round().astype(np.int64)


def linear(bits: torch.Tensor, rows: int, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``S @ weight_t (+ bias)`` of the spikes ``S [rows, K]`` given as their packed ``bits``
    (:func:`spikefuse.ops.bitpack.pack` of ``S``), ``weight_t [K, N]`` the transposed weight of a linear layer
    (``weight.t().contiguous()``): ``[rows, N]`` in the weight's dtype, each element summed from zero over the active
    inputs in increasing ``k``, then the bias added (:func:`.reference.linear_reference`'s order). Not differentiable:
    the autograd Function of :class:`spikefuse.nn.SpikeLinear` calls it and :func:`weight_grad`."""
    _check_float("the weight", weight_t)
    if weight_t.dim() != 2:
        raise ValueError(f"weight_t must be [K, N], got shape {tuple(weight_t.shape)}")
    k_in = weight_t.shape[0]
    return _linear_words(_words(bits, rows * k_in), k_in, rows, weight_t, bias)


def _linear_words(words: np.ndarray, row_bits: int, rows: int, weight_t: torch.Tensor, bias) -> torch.Tensor:
    n = weight_t.shape[1]
    if bias is not None:
        _check_float("the bias", bias, weight_t.dtype)
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    out = buffers.empty((rows, n), weight_t.dtype)
    if out.numel():
        threads = match_numba_threads(rows * n, _SERIAL_WORK)
        w = weight_t.detach().contiguous().numpy()  # detached: these are not differentiable ops
        _linear_kernel(
            words,
            row_bits,
            w,
            np.empty(0, w.dtype) if bias is None else bias.detach().contiguous().numpy(),
            min(rows, threads * _TASKS_PER_THREAD),
            out.numpy(),
        )
    return out


def weight_grad(grad: torch.Tensor, bits: torch.Tensor, k_in: int) -> torch.Tensor:
    """``grad.T @ S`` of the output gradient ``grad [M, N]`` and the spikes ``S [M, k_in]`` given as their packed
    ``bits``: the weight gradient ``[N, k_in]`` of a linear layer, each element summed from zero over the active rows
    in increasing ``m`` (:func:`.reference.weight_grad_reference`'s order). Input-major: a transposed view of the
    ``[k_in, N]`` the kernel writes, the layout in which :class:`spikefuse.nn.SpikeLinear` with ``sparse`` keeps its
    weight, so the gradient reaches it without a copy (``.contiguous()`` makes a row-major one)."""
    _check_float("the gradient", grad)
    if grad.dim() != 2:
        raise ValueError(f"grad must be [M, N], got shape {tuple(grad.shape)}")
    return _weight_grad_words(grad, _words(bits, grad.shape[0] * k_in), k_in, k_in)


def _weight_grad_words(grad: torch.Tensor, words: np.ndarray, row_bits: int, k_in: int) -> torch.Tensor:
    rows, n = grad.shape
    out_t = buffers.empty((k_in, n), grad.dtype)
    if out_t.numel():
        threads = match_numba_threads(rows * n, _SERIAL_WORK)
        _weight_grad_kernel(words, row_bits, grad.detach().contiguous().numpy(), _bounds(k_in, threads), out_t.numpy())
    return out_t.t()


# ------------------------------------------------------------------------------------------- spike rows as words
def words_per_row(k_in: int) -> int:
    """The uint64 words of one row of ``k_in`` spikes in the row-padded layout of :func:`pack_spike_rows`."""
    return -(-k_in // 64)


@njit(cache=True)
def _pack_rows_kernel(x, words):
    """Every row of ``x`` into its words (:func:`pack_row`); False at the first element that is not 0 or 1."""
    for m in range(x.shape[0]):
        for k in range(x.shape[1]):
            if x[m, k] != 0 and x[m, k] != 1:
                return False
        pack_row(x[m], words[m])
    return True


def pack_spike_rows(x: torch.Tensor) -> torch.Tensor:
    """The bits of the spikes ``x [rows, K]`` row by row, each row from a word boundary: int64 ``[rows,
    words_per_row(K)]`` (read as uint64 words, bit ``i`` of word ``w`` element ``64*w + i``). In this layout a
    kernel writing rows in parallel writes words of its own (packed bits would share a byte between rows where
    ``K % 8``), so the recurrent step kernels write their spikes' bits in it. Raises
    :class:`~spikefuse.ops.bitpack.NotBinaryError` where an element is not 0 or 1."""
    _check_matrix("the spikes", x)
    words = torch.empty(x.shape[0], words_per_row(x.shape[1]), dtype=torch.int64)
    if not _pack_rows_kernel(x.detach().contiguous().numpy(), words.numpy().view(np.uint64)):
        raise NotBinaryError("the spikes hold a value other than 0 and 1: not spikes, which the sparse product reads")
    return words


def _row_words(words: torch.Tensor, k_in: int) -> np.ndarray:
    if words.dtype != torch.int64 or words.dim() != 2 or words.shape[1] != words_per_row(k_in):
        raise ValueError(
            f"words must be int64 [rows, {words_per_row(k_in)}] for rows of {k_in} spikes, got {words.dtype} "
            f"{tuple(words.shape)}"
        )
    return words.contiguous().numpy().view(np.uint64).reshape(-1)


def row_linear(words: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` of spikes given as their row-padded words (:func:`pack_spike_rows`), in the same order."""
    _check_float("the weight", weight_t)
    if weight_t.dim() != 2:
        raise ValueError(f"weight_t must be [K, N], got shape {tuple(weight_t.shape)}")
    k_in = weight_t.shape[0]
    return _linear_words(_row_words(words, k_in), 64 * words.shape[1], words.shape[0], weight_t, bias)


def row_weight_grad(grad: torch.Tensor, words: torch.Tensor, k_in: int) -> torch.Tensor:
    """:func:`weight_grad` of spikes given as their row-padded words (:func:`pack_spike_rows`), in the same order
    and layout."""
    _check_matrix("the gradient", grad)
    if words.shape[0] != grad.shape[0]:
        raise ValueError(f"the gradient has {grad.shape[0]} rows, the spikes {words.shape[0]}")
    return _weight_grad_words(grad, _row_words(words, k_in), 64 * words.shape[1], k_in)


def spike_count(bits: torch.Tensor, numel: int) -> int:
    """The number of set bits among the first ``numel`` of ``bits``: the active inputs of a spike tensor of ``numel``
    elements, from its packed bits (a pass over 1/32 of a float32 tensor's bytes)."""
    return int(_count_kernel(_words(bits, numel), numel))


def row_spike_count(words: torch.Tensor) -> int:
    """The number of set bits of ``words`` (int64, the row-padded spike rows of :func:`pack_spike_rows`, whose bits
    past each row are zero): the spikes those rows hold."""
    if words.dtype != torch.int64:
        raise ValueError(f"words must be int64, got {words.dtype}")
    flat = words.contiguous().reshape(-1).numpy().view(np.uint64)
    return int(_count_kernel(flat, 64 * flat.size))


# --------------------------------------------------------------------------------------------- inputs with values
class CSR(NamedTuple):
    """The nonzero entries of a matrix ``[rows, cols]`` row by row (compressed sparse rows): row ``m``'s are
    ``indices[indptr[m] : indptr[m + 1]]`` (int64, increasing) with their ``values`` (the matrix's dtype)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor
    cols: int


def _check_matrix(name: str, x: torch.Tensor) -> None:
    _check_float(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be a matrix [rows, cols], got shape {tuple(x.shape)}")


def nonzero_counts(x: torch.Tensor) -> torch.Tensor:
    """The number of nonzero entries of each row of ``x [rows, cols]`` (float32 or float64 on the CPU): int64
    ``[rows]``, one pass over ``x``. NaN counts as nonzero, ``-0.0`` as zero (the dense product would add ``+-0``)."""
    _check_matrix("the input", x)
    counts = torch.empty(x.shape[0], dtype=torch.int64)
    if x.numel():
        match_numba_threads(x.numel(), _SERIAL_WORK)
        _nonzero_counts_kernel(x.detach().contiguous().numpy(), counts.numpy())
    else:
        counts.zero_()
    return counts


def nonzero_counts_binary(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(nonzero_counts(x), whether every entry is 0 or 1)`` in the one pass: ``SpikeLinear(sparse="auto")``'s
    check of an input that held values before (NaN is nonzero and not binary)."""
    _check_matrix("the input", x)
    counts = torch.zeros(x.shape[0], dtype=torch.int64)
    others = torch.zeros(x.shape[0], dtype=torch.int64)
    if x.numel():
        match_numba_threads(x.numel(), _SERIAL_WORK)
        _nonzero_counts_binary_kernel(x.detach().contiguous().numpy(), counts.numpy(), others.numpy())
    return counts, not bool(others.any())


def to_csr(x: torch.Tensor, counts: torch.Tensor | None = None) -> CSR:
    """The :class:`CSR` of ``x [rows, cols]``; ``counts``: :func:`nonzero_counts` of ``x`` where the caller has
    them (``SpikeLinear(sparse="auto")`` counts first to choose), else counted here."""
    if counts is None:
        counts = nonzero_counts(x)
    else:
        _check_matrix("the input", x)
        if counts.shape != (x.shape[0],) or counts.dtype != torch.int64:
            raise ValueError(f"counts must be int64 of shape ({x.shape[0]},), got {counts.dtype} {tuple(counts.shape)}")
    indptr = torch.zeros(x.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=indptr[1:])
    nnz = int(indptr[-1])
    indices, values = torch.empty(nnz, dtype=torch.int64), torch.empty(nnz, dtype=x.dtype)
    if nnz:
        match_numba_threads(x.numel(), _SERIAL_WORK)
        _csr_fill_kernel(x.detach().contiguous().numpy(), indptr.numpy(), indices.numpy(), values.numpy())
    return CSR(indptr, indices, values, x.shape[1])


def csr_linear(csr: CSR, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``X @ weight_t (+ bias)`` of the input ``X [rows, K]`` given as its :class:`CSR`, ``weight_t [K, N]`` the
    transposed weight: ``[rows, N]``, each element summed from zero over the row's entries in increasing ``k``, each
    term ``value * weight`` (:func:`.reference.linear_reference`'s order), then the bias added. Not differentiable:
    :class:`.autograd.CSRLinearFunction` is."""
    _check_float("the weight", weight_t)
    if weight_t.dim() != 2 or weight_t.shape[0] != csr.cols:
        raise ValueError(
            f"weight_t must be [{csr.cols}, N] for a CSR of {csr.cols} columns, got {tuple(weight_t.shape)}"
        )
    _check_float("the CSR", csr.values, weight_t.dtype)
    rows, n = csr.indptr.numel() - 1, weight_t.shape[1]
    if bias is not None:
        _check_float("the bias", bias, weight_t.dtype)
        if bias.shape != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    out = buffers.empty((rows, n), weight_t.dtype)
    if out.numel():
        threads = match_numba_threads(rows * n, _SERIAL_WORK)
        w = weight_t.detach().contiguous().numpy()
        _csr_linear_kernel(
            csr.indptr.numpy(),
            csr.indices.numpy(),
            csr.values.numpy(),
            w,
            np.empty(0, w.dtype) if bias is None else bias.detach().contiguous().numpy(),
            min(rows, threads * _TASKS_PER_THREAD),
            out.numpy(),
        )
    return out


def csr_t_matmul(csr: CSR, dense: torch.Tensor, name: str = "the dense operand") -> torch.Tensor:
    """``A.T @ dense`` of a matrix ``A [M, C]`` given as its :class:`CSR` and ``dense [M, N]``: ``[C, N]``, row ``c``
    summed from zero over the entries ``(m, c, value)`` in increasing ``m``, each term ``dense[m] * value``
    (:func:`.reference.weight_grad_reference` ``(dense, A).t()``'s order). The weight gradient ``G.T @ X`` of a linear
    layer from the CSR of its output gradient ``G`` (``csr_t_matmul(to_csr(G), X)``), and, transposed, from that of its
    input (:func:`csr_weight_grad`). ``name``: what the errors call ``dense``."""
    _check_matrix(name, dense)
    _check_float("the CSR", csr.values, dense.dtype)
    rows, n = dense.shape
    if csr.indptr.numel() != rows + 1:
        raise ValueError(f"{name} has {rows} rows, the CSR {csr.indptr.numel() - 1}")
    out = buffers.empty((csr.cols, n), dense.dtype)
    if out.numel():
        threads = match_numba_threads(rows * n, _SERIAL_WORK)
        _csr_weight_grad_kernel(
            csr.indptr.numpy(),
            csr.indices.numpy(),
            csr.values.numpy(),
            dense.detach().contiguous().numpy(),
            _bounds(csr.cols, threads),
            out.numpy(),
        )
    return out


def csr_weight_grad(grad: torch.Tensor, csr: CSR) -> torch.Tensor:
    """``grad.T @ X`` of the output gradient ``grad [M, N]`` and the input ``X [M, K]`` given as its :class:`CSR`:
    the weight gradient ``[N, K]``, each element summed from zero over the rows in increasing ``m``, each term
    ``gradient * value`` (:func:`.reference.weight_grad_reference`'s order); input-major, as :func:`weight_grad`'s."""
    return csr_t_matmul(csr, grad, "the gradient").t()


# ------------------------------------------------------------------------------------------- sparse output gradients
def output_grad_csr(grad: torch.Tensor, sparse_grad: bool | str) -> CSR | None:
    """The :class:`CSR` of a linear layer's output gradient ``grad [M, N]``, from which its backward products read
    only the nonzero gradients, or None for torch's dense products: ``sparse_grad`` ``True`` always, ``"auto"`` from
    :data:`CROSSOVER_ROWS` rows on where under :data:`CROSSOVER_GRAD` of the gradients are nonzero (the count is the
    CSR's first pass), ``False`` never."""
    if sparse_grad is False:
        return None
    if sparse_grad == "auto" and grad.shape[0] < CROSSOVER_ROWS:
        return None
    counts = nonzero_counts(grad)
    if sparse_grad == "auto" and int(counts.sum()) >= CROSSOVER_GRAD * grad.numel():
        return None
    return to_csr(grad, counts)


def input_grad(grad: torch.Tensor, weight: torch.Tensor, grad_csr: CSR | None) -> torch.Tensor:
    """``grad [M, N] @ weight [N, K]``, a linear layer's input gradient: torch's dense product (``nn.Linear``'s), or
    from ``grad``'s :class:`CSR` (:func:`output_grad_csr`) by :func:`csr_linear`, each element summed from zero over
    the row's nonzero gradients in increasing ``n`` (:func:`.reference.linear_reference` ``(grad, weight.t())``'s
    order)."""
    return grad.mm(weight) if grad_csr is None else csr_linear(grad_csr, weight)
