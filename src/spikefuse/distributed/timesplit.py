"""Time-split execution of the temporal-fusion paper, Sec. 3.3 (Eq. 4-5, Fig. 1(b) and 6), on ``torch.distributed``.

What each rank holds
--------------------
The ``k`` ranks of a process group (``group``, default the whole world) split the time axis of one sequence into
``k`` contiguous blocks, in rank order: rank ``r`` holds the time steps ``[t_r, t_{r+1})`` of *every* tensor shaped
``[T, B, ...]`` in the network (inputs, activations, spikes, their gradients) -- the same batch ``B`` and the same
neurons on every rank, only other time steps. :func:`time_partition` gives the usual near-equal split; any split
works as long as the blocks are contiguous and ordered by rank. Every rank holds a full replica of the weights.

- :class:`TimeSplitNeuron` / :func:`timesplit_neuron` (any :class:`~spikefuse.neurons.NeuronModel`: CubaLIF,
  ALIF, a user's), with :class:`TimeSplitLIF` / :func:`timesplit_lif` its LIF preset: the neuron recursion is
  serial in time, so rank ``r`` needs the neurons' states at ``t_r``. It receives all of them from rank ``r-1``
  (stacked in one message, the start states of its block), runs its block with the fused kernel and sends its
  final states to rank ``r+1``. Backward runs the chain in reverse: rank ``r`` receives the gradients of its final
  states from rank ``r+1``, runs the block's backward and sends the gradients of its start states to rank
  ``r-1``. To keep the ranks busy at the same time (the pipelining Eq. (4b) assumes), the
  neurons are split into ``chunks`` groups: rank ``r`` computes chunk ``j`` while rank ``r+1`` computes chunk
  ``j-1``, and the states travel with ``isend``/``irecv`` so that transfer overlaps compute. With ``chunks=m`` the
  chain costs about ``t_k + (k-1) * (t_k + T_c) / m`` instead of ``k * t_k``.
- :class:`TimeSplitBatchNorm`: BatchNorm over ``[T, B, C, ...]`` whose batch statistics are all-reduced over the
  group (sum, then centred sum of squares, with the matching backward), so it equals ``nn.BatchNorm`` over all
  ``T*B`` samples of the single-process run. With the data-parallel group instead of a time group, it is a CPU/gloo
  capable ``SyncBatchNorm`` (``torch.nn.SyncBatchNorm`` raises on CPU tensors).
- :func:`time_reduce`: sum or mean over the whole time axis, e.g. for the rate readout. Its result is replicated
  on every rank, and so is everything computed from it (the loss): forward all-reduces, backward passes the
  gradient through unchanged (each rank then back-propagates into its own time block).
- Gradients: each rank's weight gradients cover only its time block; :func:`allreduce_gradients` sums them over
  the group (do it after ``backward()``, before the optimizer step). Parameters used only *after*
  :func:`time_reduce` (a classifier on the time-averaged rate) already hold the full gradient on every rank: leave
  them out (``params=``), or summing would multiply them by ``k``.

Every rank must call ``backward()`` through the outputs of every time-split layer (a loss built from
:func:`time_reduce` does): rank ``r``'s backward waits for the state gradient of rank ``r+1``.

Example (each rank; ``x`` is the full input, the same on every rank, or only the local block)::

    net = nn.Sequential(SeqToBatch(nn.Conv2d(2, 8, 3)), TimeSplitBatchNorm(8), TimeSplitLIF(0.5, 1.0), ...)
    x_local = split_time(x, group)
    logits = time_reduce(net(x_local), group, op="mean")
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    allreduce_gradients(net, group)
    opt.step()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from .. import functional as F
from ..batchnorm.modules import (
    BatchNormLIFBase,
    BatchNormNeuron,
    ConvBatchNormLIF,
    ConvBatchNormNeuron,
    running_average_factor,
)
from ..neuron_functional import neuron
from ..neurons import NeuronModel
from ..neurons.lif import DEFAULT_DECAY, DEFAULT_THRESHOLD
from ..nn.containers import SeqToBatch
from ..nn.engine_neurons import EngineNeuron
from ..nn.neurons import LIF
from ..nn.recurrent import Recurrent
from ..ops.numerics import compute_dtype
from ..surrogate import DEFAULT as DEFAULT_SURROGATE, Surrogate, refuse_active
from ..validation import check_input, check_memory_mode, check_v_init, resolve_neuron

__all__ = [
    "TimeSplitLIF",
    "TimeSplitNeuron",
    "TimeSplitBatchNorm",
    "TimeSplitBatchNormLIF",
    "TimeSplitBatchNormNeuron",
    "timesplit_lif",
    "timesplit_neuron",
    "time_partition",
    "local_time_range",
    "split_time",
    "gather_time",
    "time_reduce",
    "allreduce_gradients",
    "convert_timesplit",
    "convert_batchnorm",
]

# Tags keep the messages of one chunk apart (gloo honours tags; NCCL ignores them and relies on the fixed order).
_FWD_TAG = 0
_BWD_TAG = 1 << 20


# ----------------------------------------------------------------------------------------------------- helpers


def _group_info(group) -> tuple[int, int]:
    """``(rank in group, group size)``; a single rank when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def time_partition(steps: int, parts: int) -> list[tuple[int, int]]:
    """Near-equal contiguous blocks ``[(start, stop), ...]`` of ``range(steps)``, the first ones one step longer."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(int(steps), parts)
    out, start = [], 0
    for r in range(parts):
        stop = start + base + (1 if r < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def local_time_range(steps: int, group=None) -> tuple[int, int]:
    """The ``(start, stop)`` time steps this rank holds under :func:`time_partition`."""
    rank, size = _group_info(group)
    return time_partition(steps, size)[rank]


def split_time(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of the full sequence ``x`` ``[T, ...]`` (a view)."""
    start, stop = local_time_range(x.shape[0], group)
    return x[start:stop]


def gather_time(x_local: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate the time blocks of all ranks in rank order (on every rank). Not differentiable.

    Blocks may have different lengths; every other dimension must agree.
    """
    rank, size = _group_info(group)
    if size == 1:
        return x_local.detach().clone()
    lengths = torch.zeros(size, dtype=torch.int64, device=x_local.device)
    lengths[rank] = x_local.shape[0]
    dist.all_reduce(lengths, group=group)
    longest = int(lengths.max())
    padded = x_local.detach().new_zeros((longest, *x_local.shape[1:]))
    padded[: x_local.shape[0]] = x_local.detach()
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[: int(n)] for p, n in zip(parts, lengths.tolist())])


class _ReduceReplicated(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward: the result and everything after it is replicated."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    """All-reduce (sum) forward and backward: the partial sums of a statistic used by every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _all_reduce_sum(x: torch.Tensor, group, size: int) -> torch.Tensor:
    return x if size == 1 else _AllReduceSum.apply(x, group)


def time_reduce(x_local: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """Sum (``op="sum"``) or mean (``op="mean"``) over the whole time axis of a time-split ``[T_local, ...]`` tensor.

    The result ``[...]`` is the same on every rank; the loss computed from it must be too (every rank computes
    it). Backward hands each rank the gradient of its own block.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    _, size = _group_info(group)
    total = x_local.sum(0)
    if size > 1:
        total = _ReduceReplicated.apply(total, group)
    if op == "mean":
        steps = x_local.shape[0]
        if size > 1:
            n = torch.tensor([float(steps)], device=x_local.device)
            dist.all_reduce(n, group=group)
            steps = int(n.item())
        total = total / steps
    return total


@torch.no_grad()
def allreduce_gradients(module_or_params, group=None, params: Iterable[torch.Tensor] | None = None) -> None:
    """Sum the gradients of ``params`` (default: all parameters of ``module_or_params``) over the time ranks.

    Call it after ``backward()``: each rank's gradient covers only its time block. Bucketed into one all-reduce
    per dtype/device. Parameters without a gradient are skipped; leave out the ones used only after
    :func:`time_reduce`, whose gradients are complete on every rank already.
    """
    _, size = _group_info(group)
    if size == 1:
        return
    if params is None:
        params = module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params
    grads = [p.grad for p in params if p.grad is not None]
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


# ------------------------------------------------------------------------------------------ the time-split chain


@dataclass
class _Plan:
    """How one call splits its neurons: ``dim`` of ``x_local`` (>= 1; the same dim of the stacked states
    ``[S, ...]``) and the chunk sizes along it."""

    dim: int | None
    sizes: list[int]
    split_channels: bool  # the chunks cut the channel dim of the per-channel parameters

    @property
    def chunks(self) -> int:
        return len(self.sizes)


def _check_chunks(chunks) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    return chunks


def _plan(shape: torch.Size, chunks: int, channels: int) -> _Plan:
    if len(shape) < 2 or chunks == 1 or math.prod(shape[1:]) == 0:
        return _Plan(None, [1], False)
    dims = range(1, len(shape))
    dim = next((d for d in dims if shape[d] >= chunks), max(dims, key=lambda d: shape[d]))
    m = min(chunks, shape[dim])
    base, extra = divmod(shape[dim], m)
    sizes = [base + (1 if j < extra else 0) for j in range(m)]
    channel_dim = 2 if len(shape) >= 3 else 1
    return _Plan(dim, sizes, channels > 1 and dim == channel_dim)


def _split(t: torch.Tensor | None, plan: _Plan) -> list:
    if t is None:
        return [None] * plan.chunks
    if plan.dim is None:
        return [t]
    return list(t.split(plan.sizes, plan.dim))


def _chunk_params(params: tuple, plan: _Plan) -> list[tuple]:
    """The parameter tensors of each chunk: per-channel ones cut with the channels when the chunks cut them."""
    if not plan.split_channels:
        return [params] * plan.chunks
    parts = [p.reshape(-1).split(plan.sizes) if p.numel() > 1 else [p] * plan.chunks for p in params]
    return [tuple(part[j] for part in parts) for j in range(plan.chunks)]


#: Runs one block ``[t, ...]`` of the neurons: ``(x, start states (a tuple, or None for the neuron's own start),
#: parameter tensors) -> (spikes, final states (a tuple))``, differentiably.
_BlockRunner = Callable[[torch.Tensor, tuple | None, tuple], tuple[torch.Tensor, tuple]]


@dataclass
class _Chain:
    """One call's settings: the block runner, the number of states, the group and the neighbour ranks."""

    run_block: _BlockRunner
    n_states: int
    group: object
    rank: int
    size: int
    plan: _Plan

    def peer(self, group_rank: int) -> int:
        """Global rank of a group rank (isend/irecv take global ranks in every torch version we support)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


def _run_chain(chain: _Chain, x_local, start, params: tuple, build_graph: bool):
    """The forward pipeline. ``start``: the stacked start states ``[S, ...]`` (first rank) or None. Returns
    ``(spikes, final states stacked [S, ...], saved)``; ``saved`` holds the per-chunk graphs."""
    plan = chain.plan
    first, last = chain.rank == 0, chain.rank == chain.size - 1
    xs, starts = _split(x_local, plan), _split(start, plan)
    recvs = []
    if not first:  # post every receive at once: chunk j+1 arrives while chunk j computes
        for j, xj in enumerate(xs):
            buf = torch.empty((chain.n_states, *xj.shape[1:]), dtype=compute_dtype(x_local.dtype), device=xj.device)
            recvs.append((buf, dist.irecv(buf, src=chain.peer(chain.rank - 1), group=chain.group, tag=_FWD_TAG + j)))
    param_leaves = tuple(p.detach().requires_grad_(build_graph and p.requires_grad) for p in params)
    sends, spikes, finals, saved = [], [], [], []
    with torch.set_grad_enabled(build_graph):
        chunk_params = _chunk_params(param_leaves, plan)  # inside: the slices must be recorded for their gradient
        for j in range(plan.chunks):
            xj = xs[j].detach().requires_grad_(build_graph and x_local.requires_grad)
            if first:
                start_j = starts[j]
                if start_j is not None:
                    start_j = start_j.detach().requires_grad_(build_graph and start.requires_grad)
            else:
                start_j, work = recvs[j]
                work.wait()
                start_j.requires_grad_(build_graph)
            spikes_j, final_states = chain.run_block(
                xj, None if start_j is None else tuple(start_j.unbind(0)), chunk_params[j]
            )
            final_j = torch.stack(final_states)  # one message per chunk however many states the neuron has
            if not last:
                out = final_j.detach()
                sends.append(
                    (out, dist.isend(out, dst=chain.peer(chain.rank + 1), group=chain.group, tag=_FWD_TAG + j))
                )
            spikes.append(spikes_j)
            finals.append(final_j)
            saved.append((xj, start_j, spikes_j, final_j))
    for _, work in sends:
        work.wait()
    if plan.dim is None:
        spikes_out, final_out = spikes[0].detach(), finals[0].detach()
    else:
        spikes_out = torch.cat([s.detach() for s in spikes], plan.dim)
        final_out = torch.cat([f.detach() for f in finals], plan.dim)
    return spikes_out, final_out, (saved, param_leaves)


def _block_gradients(outputs: tuple, grads: tuple, leaves: list) -> tuple:
    """Gradients of ``leaves`` through one chunk's graph (zeros for a leaf the outputs do not depend on)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(t) for t in leaves)
    return torch.autograd.grad(
        [o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True, materialize_grads=True
    )


class _TimeSplitFunction(torch.autograd.Function):
    """The whole pipelined chain of one layer on one rank as one autograd node (deterministic message order)."""

    @staticmethod
    def forward(ctx, chain: _Chain, x_local, start, *params):
        spikes, final, saved = _run_chain(chain, x_local, start, params, build_graph=True)
        ctx.chain, ctx.saved = chain, saved
        ctx.x_dtype = x_local.dtype
        return spikes, final

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_spikes, grad_final):
        chain, (chunks, param_leaves) = ctx.chain, ctx.saved
        ctx.saved = None  # free the graphs as soon as possible
        plan = chain.plan
        first, last = chain.rank == 0, chain.rank == chain.size - 1
        grad_spikes_chunks, grad_final_chunks = _split(grad_spikes, plan), _split(grad_final, plan)
        recvs = []
        if not last:
            for j, (_, _, _, final_j) in enumerate(chunks):
                buf = torch.empty_like(final_j, memory_format=torch.contiguous_format)
                recvs.append(
                    (buf, dist.irecv(buf, src=chain.peer(chain.rank + 1), group=chain.group, tag=_BWD_TAG + j))
                )
        sends, grad_x, grad_start = [], [], []
        grad_params = [None] * len(param_leaves)
        for j, (xj, start_j, spikes_j, final_j) in enumerate(chunks):
            g_final = grad_final_chunks[j]
            if not last:
                buf, work = recvs[j]
                work.wait()
                g_final = g_final + buf
            leaves = [t for t in (xj, start_j, *param_leaves) if t is not None and t.requires_grad]
            got = dict(
                zip(map(id, leaves), _block_gradients((spikes_j, final_j), (grad_spikes_chunks[j], g_final), leaves))
            )
            g_start = got.get(id(start_j))
            if not first:
                out = g_start.contiguous()
                sends.append(
                    (out, dist.isend(out, dst=chain.peer(chain.rank - 1), group=chain.group, tag=_BWD_TAG + j))
                )
            grad_x.append(got.get(id(xj)))
            grad_start.append(g_start)
            for i, leaf in enumerate(param_leaves):
                if id(leaf) in got:
                    grad_params[i] = got[id(leaf)] if grad_params[i] is None else grad_params[i] + got[id(leaf)]
        for _, work in sends:
            work.wait()

        def joined(parts: list, needed: bool):
            if not needed:
                return None
            return parts[0] if plan.dim is None else torch.cat(parts, plan.dim)

        gx = joined(grad_x, ctx.needs_input_grad[1])
        return (
            None,
            None if gx is None else gx.to(ctx.x_dtype),
            joined(grad_start, ctx.needs_input_grad[2]),  # only the first rank has start states
            *grad_params,
        )


def _check_block(x_local, group) -> None:
    """This rank's block is a tensor of at least one time step (more ranks than steps leave some without)."""
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
    if x_local.ndim >= 1 and x_local.shape[0] == 0:
        raise ValueError(
            f"this rank (group rank {_group_info(group)[0]}) holds no time steps (x_local has shape "
            f"{tuple(x_local.shape)}): use at most T ranks"
        )


def _timesplit(run_block: _BlockRunner, x_local, start, params: tuple, n_states: int, group, chunks: int):
    """The chain over this rank's block: ``(spikes_local, final states stacked [S, ...])``. ``start``: the
    stacked start states ``[S, ...]`` in the compute dtype (read on the first rank only) or None; ``params``: the
    parameter tensors (scalar or per channel), handed to ``run_block`` cut to each chunk."""
    rank, size = _group_info(group)
    channels = max((p.numel() for p in params), default=1)
    chain = _Chain(run_block, n_states, group, rank, size, _plan(x_local.shape, _check_chunks(chunks), channels))
    if rank != 0:
        start = None
    tensors = [t for t in (x_local, start, *params) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _TimeSplitFunction.apply(chain, x_local, start, *params)
    spikes, final, _ = _run_chain(chain, x_local, start, params, build_graph=False)
    return spikes, final


def _from_last_rank(states: tuple, group) -> tuple:
    """The states at the end of the whole sequence (the last rank's), detached, on every rank: what a stateful
    layer starts its next call from."""
    stacked = torch.stack([s.detach() for s in states])
    _, size = _group_info(group)
    if size > 1:
        last = size - 1 if group is None else dist.get_global_rank(group, size - 1)
        dist.broadcast(stacked, src=last, group=group)
    return tuple(stacked.unbind(0))


def timesplit_neuron(
    x_local: torch.Tensor,
    model: NeuronModel,
    *,
    surrogate: Surrogate | str = DEFAULT_SURROGATE,
    detach_reset: bool = False,
    state=None,
    return_state: bool = False,
    backend: str = "auto",
    memory: str = "potential",
    group=None,
    chunks: int = 4,
    **params,
):
    """:func:`spikefuse.neuron` of any :class:`~spikefuse.neurons.NeuronModel` on the time block ``x_local``
    ``[T_r, *]`` that this rank of ``group`` holds.

    Every rank calls it with its own block (same ``*`` shape everywhere, blocks in rank order) and the same
    arguments; the result equals the matching block of ``spikefuse.neuron`` over the whole sequence, forward and
    backward: each rank receives all the model's states at the start of its block from the rank before and sends
    their gradients back. ``state`` (a tuple in ``model.states`` order or a dict) is the start of global step 0,
    read on rank 0 only. ``chunks`` splits the neurons for pipelining (see the module docstring). With
    ``return_state=True`` also returns the states at the end of this rank's block (a tuple). The other arguments
    are :func:`spikefuse.neuron`'s; the gradients of tensor parameters cover this rank's block only (sum them with
    :func:`allreduce_gradients`).
    """
    refuse_active(surrogate, "the time split (timesplit_neuron)")
    _check_block(x_local, group)
    check_input(x_local)
    check_memory_mode(memory)
    _, surrogate, _, _, init = resolve_neuron(x_local, model, surrogate, state, backend, params)
    start = None if state is None else torch.stack(init).view(len(init), *x_local.shape[1:])
    tensor_names = [name for name, value in params.items() if isinstance(value, torch.Tensor)]
    fixed = {name: value for name, value in params.items() if name not in tensor_names}

    def run_block(x, start_states, tensors):
        return neuron(
            x,
            model,
            surrogate=surrogate,
            detach_reset=detach_reset,
            state=start_states,
            return_state=True,
            backend=backend,
            memory=memory,
            **fixed,
            **dict(zip(tensor_names, tensors)),
        )

    tensors = tuple(params[name] for name in tensor_names)
    spikes, final = _timesplit(run_block, x_local, start, tensors, len(model.states), group, chunks)
    return (spikes, tuple(final.unbind(0))) if return_state else spikes


def timesplit_lif(
    x_local: torch.Tensor,
    *,
    decay=DEFAULT_DECAY,
    threshold: float = DEFAULT_THRESHOLD,
    v_reset: float | None = 0.0,
    surrogate=DEFAULT_SURROGATE,
    detach_reset: bool = False,
    v_init: torch.Tensor | None = None,
    return_state: bool = False,
    backend: str = "auto",
    memory: str = "potential",
    group=None,
    chunks: int = 4,
):
    """:func:`spikefuse.lif` on the time block ``x_local`` ``[T_r, *]`` that this rank of ``group`` holds: the
    same chain as :func:`timesplit_neuron` with LIF's one state, each block run by :func:`spikefuse.lif` itself.

    Every rank calls it with its own block (same ``*`` shape everywhere, blocks in rank order); the result equals
    the matching block of ``spikefuse.lif`` over the whole sequence, forward and backward. ``v_init`` is the state
    before global step 0 (used on rank 0 only). ``chunks`` splits the neurons for pipelining (see the module
    docstring). With ``return_state=True`` also returns the state at the end of this rank's block.
    """
    refuse_active(surrogate, "the time split (timesplit_lif)")
    _check_block(x_local, group)
    start = None
    if v_init is not None:
        check_v_init(v_init, x_local)
        start = v_init.to(compute_dtype(x_local.dtype)).unsqueeze(0)

    def run_block(x, start_states, tensors):
        spikes, state = F.lif(
            x,
            decay=tensors[0] if tensors else decay,
            threshold=threshold,
            v_reset=v_reset,
            surrogate=surrogate,
            detach_reset=detach_reset,
            v_init=None if start_states is None else start_states[0],
            return_state=True,
            backend=backend,
            memory=memory,
        )
        return spikes, (state,)

    tensors = (decay,) if isinstance(decay, torch.Tensor) else ()
    spikes, final = _timesplit(run_block, x_local, start, tensors, 1, group, chunks)
    return (spikes, final[0]) if return_state else spikes


def _time_split_copy(cls, layer: nn.Module, group, chunks: int):
    """A ``cls`` copy of the neuron layer ``layer`` sharing its options, parameters and buffers (the same names in
    the ``state_dict``), without its kept state."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for key, value in vars(layer).items():
        if not key.startswith("_"):
            setattr(new, key, value)
    new._parameters = dict(layer._parameters)
    new._buffers = dict(layer._buffers)
    new.group, new.chunks = group, _check_chunks(chunks)
    new.state = None
    return new


class TimeSplitNeuron(EngineNeuron):
    """:class:`spikefuse.nn.EngineNeuron` of any :class:`~spikefuse.neurons.NeuronModel` over a time-split
    sequence (:func:`timesplit_neuron`): this rank holds the steps ``[t_r, t_{r+1})`` and every state of the model
    travels down the ranks.

    Same arguments as :class:`~spikefuse.nn.EngineNeuron`, plus ``group`` (the time ranks, default the world) and
    ``chunks`` (neuron chunks of the pipeline); :meth:`from_neuron` makes one of a built layer
    (:class:`~spikefuse.nn.CubaLIF`, :class:`~spikefuse.nn.ALIF`, a user's ``EngineNeuron``). Gradients of
    learnable parameters cover only the local block: sum them with :func:`allreduce_gradients`. With
    ``stateful=True`` the states at the end of the whole sequence (last rank) are broadcast to all ranks after each
    call and start the next call on rank 0.
    """

    def __init__(self, model: NeuronModel, *, group=None, chunks: int = 4, **kwargs):
        super().__init__(model, **kwargs)
        self.group = group
        self.chunks = _check_chunks(chunks)

    @classmethod
    def from_neuron(cls, layer: EngineNeuron, group=None, chunks: int = 4) -> "TimeSplitNeuron":
        """A time-split copy of the neuron layer ``layer`` sharing its parameters and buffers (the same names in the
        ``state_dict``) and its parameter range checks."""
        if not isinstance(layer, EngineNeuron):
            raise TypeError(
                f"layer must be a spikefuse.nn.EngineNeuron (LIF, CubaLIF, ALIF, ...), got {type(layer).__name__}"
            )
        if isinstance(layer, Recurrent):
            raise TypeError(
                f"{type(layer).__name__} feeds its spikes back through weights: the time split hands on the "
                "neuron states only, so a recurrent layer cannot be time-split"
            )
        new = _time_split_copy(cls, layer, group, chunks)
        new.unit_interval = layer.unit_interval  # a class attribute of CubaLIF and ALIF
        return new

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        spikes, final = timesplit_neuron(
            x_local,
            self.model,
            return_state=True,
            memory=self.memory,
            group=self.group,
            chunks=self.chunks,
            **self.call_arguments(x_local),
        )
        if self.stateful:
            self.keep_state(_from_last_rank(final, self.group))
        return spikes

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunks={self.chunks}"


class TimeSplitLIF(LIF):
    """:class:`spikefuse.nn.LIF` over a time-split sequence (:func:`timesplit_lif`): this rank holds the steps
    ``[t_r, t_{r+1})``.

    Same options as :class:`~spikefuse.nn.LIF`, plus ``group`` (the time ranks, default the world) and ``chunks``
    (neuron chunks of the pipeline). Gradients of a learnable decay cover only the local block: sum them with
    :func:`allreduce_gradients`. With ``stateful=True`` the state at the end of the whole sequence (last rank) is
    broadcast to all ranks after each call and starts the next call on rank 0.
    """

    def __init__(self, *args, group=None, chunks: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group
        self.chunks = _check_chunks(chunks)

    @classmethod
    def from_lif(cls, lif: LIF, group=None, chunks: int = 4) -> "TimeSplitLIF":
        """A time-split copy of ``lif`` sharing its learnable decay parameter (if any)."""
        return _time_split_copy(cls, lif, group, chunks)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        spikes, state = timesplit_lif(
            x_local, memory=self.memory, group=self.group, chunks=self.chunks, **self.lif_arguments(x_local)
        )
        if self.stateful:
            (self.state,) = _from_last_rank((state,), self.group)
        return spikes

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunks={self.chunks}"


# ---------------------------------------------------------------------------------------------------- BatchNorm


class TimeSplitBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics are taken over the samples of every rank of ``group``.

    Input ``[T_local, B, C, ...]`` (``channel_dim=2``, the default: this rank's time block of a ``[T, B, C, ...]``
    activation) or ``[N, C, ...]`` (``channel_dim=1``). In training the per-channel mean and (biased) variance
    are computed over all samples of all ranks -- an all-reduce of the sums and counts, then of the centred sums
    of squares, which is as accurate as the single-process two-pass statistics; autograd through the two
    all-reduces gives the matching backward. The running statistics (unbiased variance over the global count)
    are updated identically on every rank. In eval mode it is plain BatchNorm with the running statistics.

    Over the time ranks this equals ``SeqToBatch(nn.BatchNormNd(C))`` on the whole ``[T, B, C, ...]`` sequence;
    over the data-parallel group it is a ``SyncBatchNorm`` that also runs on CPU/gloo. Parameter and buffer names
    are those of ``nn.BatchNormNd``. Weight/bias gradients are local (sum them with :func:`allreduce_gradients`
    over time ranks; DDP averages them over data ranks).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        group=None,
        channel_dim: int = 2,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if channel_dim not in (1, 2):
            raise ValueError(f"channel_dim must be 1 ([N, C, ...]) or 2 ([T, B, C, ...]), got {channel_dim}")
        self.group = group
        self.channel_dim = channel_dim

    @classmethod
    def from_batchnorm(cls, bn: nn.modules.batchnorm._BatchNorm, group=None, channel_dim: int = 2):
        """A synchronized copy of ``bn`` sharing its parameters and buffers."""
        new = cls(
            bn.num_features,
            bn.eps,
            bn.momentum,
            bn.affine,
            bn.track_running_stats,
            group=group,
            channel_dim=channel_dim,
        )
        new._parameters = dict(bn._parameters)
        new._buffers = dict(bn._buffers)
        new.train(bn.training)
        return new

    def _check_input_dim(self, x):
        if x.dim() < self.channel_dim + 1:
            raise ValueError(
                f"expected a [{'T, B' if self.channel_dim == 2 else 'N'}, C, ...] input with C={self.num_features}, "
                f"got shape {tuple(x.shape)}"
            )
        if x.shape[self.channel_dim] != self.num_features:
            raise ValueError(
                f"expected {self.num_features} channels in dim {self.channel_dim}, got shape {tuple(x.shape)}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        factor = running_average_factor(self)
        use_batch = self.training or self.running_mean is None
        if not use_batch:
            flat = x.flatten(0, 1) if self.channel_dim == 2 else x
            y = nn.functional.batch_norm(
                flat, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
            return y.view_as(x)
        _, size = _group_info(self.group)
        c = self.channel_dim
        dims = [d for d in range(x.dim()) if d != c]
        shape = [1] * x.dim()
        shape[c] = self.num_features
        cdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        xc = x.to(cdt)
        local_count = x.numel() // self.num_features
        packed = torch.cat([xc.sum(dims), xc.new_full((1,), float(local_count))])
        packed = _all_reduce_sum(packed, self.group, size)
        total, count = packed[:-1], packed[-1]
        if float(count.detach()) < 2 and self.training:
            raise ValueError(f"expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
        mean = total / count
        centred = xc - mean.view(shape)
        var = _all_reduce_sum((centred * centred).sum(dims), self.group, size) / count
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.to(cdt).view(shape) + self.bias.to(cdt).view(shape)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                n = float(count.detach())
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                unbiased = var.detach() * (n / (n - 1))
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, channel_dim={self.channel_dim}"


class _BatchNormThenNeuron(nn.Module):
    """The call of a fused BatchNorm+neuron, ``module(x, residual=None, residual_binary=False)``, as the unfused
    ``neuron(bn(x) + residual)`` of its modules ``bn`` and ``neuron``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, residual_binary: bool = False):
        y = self.bn(x)
        return self.neuron(y if residual is None else y + residual)

    def reset_state(self) -> None:
        self.neuron.reset_state()


class TimeSplitBatchNormNeuron(_BatchNormThenNeuron):
    """A fused :class:`~spikefuse.nn.BatchNormNeuron` (BatchNorm then a CubaLIF, an ALIF, any
    :class:`~spikefuse.nn.EngineNeuron`) whose statistics are taken over the ranks of ``group``:
    :class:`TimeSplitBatchNorm` then the fused module's own neuron (which :func:`convert_timesplit` makes a
    :class:`TimeSplitNeuron`), sharing its parameters and buffers under the same names. Same call as
    :class:`TimeSplitBatchNormLIF`, and the same memory cost against the fused op."""

    def __init__(self, fused: BatchNormNeuron, group=None):
        super().__init__()
        self.bn = TimeSplitBatchNorm.from_batchnorm(fused.bn, group, channel_dim=2)
        self.neuron = fused.neuron
        self.train(fused.training)


class TimeSplitBatchNormLIF(_BatchNormThenNeuron):
    """A fused :class:`~spikefuse.nn.BatchNormLIF2d` (or ``1d``) whose statistics are taken over the ranks of
    ``group``: :class:`TimeSplitBatchNorm` then the neuron with ``memory="recompute"``, sharing the fused module's
    parameters, buffers and learnable decay. Same call, ``module(x, residual=None, residual_binary=False)``.

    The fused op normalizes inside one custom op that cannot all-reduce; this form can, at a memory cost: the
    normalized input (plus residual) is kept for backward as the neuron's input, as in the unfused network."""

    def __init__(self, fused: BatchNormLIFBase, group=None):
        super().__init__()
        self.bn = TimeSplitBatchNorm.from_batchnorm(fused, group, channel_dim=2)
        self.bn._parameters.pop("decay", None)  # the neuron's, shared with the neuron below
        learnable = isinstance(fused.decay, nn.Parameter)
        self.neuron = LIF(
            0.5 if learnable else fused.decay,
            fused.threshold,
            fused.v_reset,
            fused.surrogate,
            fused.detach_reset,
            stateful=fused.stateful,
            backend=fused.backend,
            memory="recompute",
        )
        if learnable:
            self.neuron.decay = fused.decay
        self.train(fused.training)


# ---------------------------------------------------------------------------------------------------- converters


def convert_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """Replace ``SeqToBatch(nn.BatchNormNd)`` and bare ``nn.BatchNormNd`` by :class:`TimeSplitBatchNorm`, and the
    fused BatchNorm+neuron modules of the lean form by :class:`TimeSplitBatchNormLIF` (LIF) and
    :class:`TimeSplitBatchNormNeuron` (any other neuron), over ``group`` (sharing parameters and buffers). Returns the converted module (``module`` itself is changed in place where it is a
    container)."""
    if isinstance(module, BatchNormLIFBase):
        return TimeSplitBatchNormLIF(module, group)
    if isinstance(module, BatchNormNeuron):
        return TimeSplitBatchNormNeuron(module, group)
    if isinstance(module, ConvBatchNormLIF):  # the convolution's output is kept again
        return nn.Sequential(SeqToBatch(module.conv), TimeSplitBatchNormLIF(module.bn_lif, group))
    if isinstance(module, ConvBatchNormNeuron):  # likewise
        return nn.Sequential(SeqToBatch(module.conv), TimeSplitBatchNormNeuron(module.bn_neuron, group))
    if isinstance(module, SeqToBatch) and isinstance(module.module, nn.modules.batchnorm._BatchNorm):
        return TimeSplitBatchNorm.from_batchnorm(module.module, group, channel_dim=2)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, TimeSplitBatchNorm):
        return TimeSplitBatchNorm.from_batchnorm(module, group, channel_dim=1)
    for name, child in module.named_children():
        new = convert_batchnorm(child, group)
        if new is not child:
            setattr(module, name, new)
    return module


def convert_timesplit(module: nn.Module, group=None, chunks: int = 4) -> nn.Module:
    """Make a network time-split: every :class:`~spikefuse.nn.LIF` (and ``IF``) becomes a :class:`TimeSplitLIF`,
    every other neuron layer (:class:`~spikefuse.nn.EngineNeuron`: CubaLIF, ALIF, a user's) a
    :class:`TimeSplitNeuron`, every BatchNorm a :class:`TimeSplitBatchNorm` and every fused BatchNorm+neuron a
    :class:`TimeSplitBatchNormLIF` or :class:`TimeSplitBatchNormNeuron` (whose neuron is time-split in turn) over
    ``group``, sharing parameters and buffers. A recurrent layer (:class:`~spikefuse.nn.Recurrent`) raises: its
    spikes feed back through weights, which the chain does not hand on.

    Layers without memory across time steps (conv, linear, pooling applied through ``SeqToBatch``) need no change.
    Layers that mix time steps any other way (attention over time, a readout of the last step) are not handled.
    """
    if isinstance(module, LIF) and not isinstance(module, TimeSplitLIF):
        return TimeSplitLIF.from_lif(module, group, chunks)
    if isinstance(module, EngineNeuron) and not isinstance(module, (TimeSplitNeuron, TimeSplitLIF)):
        return TimeSplitNeuron.from_neuron(module, group, chunks)
    if isinstance(module, BatchNormLIFBase):
        module = TimeSplitBatchNormLIF(module, group)  # its neuron is converted below
    if isinstance(module, BatchNormNeuron):
        module = TimeSplitBatchNormNeuron(module, group)  # likewise
    if isinstance(module, ConvBatchNormLIF):
        module = nn.Sequential(SeqToBatch(module.conv), module.bn_lif)  # converted below
    if isinstance(module, ConvBatchNormNeuron):
        module = nn.Sequential(SeqToBatch(module.conv), module.bn_neuron)  # likewise
    is_bn = isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, TimeSplitBatchNorm)
    if is_bn or (isinstance(module, SeqToBatch) and isinstance(module.module, nn.modules.batchnorm._BatchNorm)):
        return convert_batchnorm(module, group)
    for name, child in module.named_children():
        new = convert_timesplit(child, group, chunks)
        if new is not child:
            setattr(module, name, new)
    return module
