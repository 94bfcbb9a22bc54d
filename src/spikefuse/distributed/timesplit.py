"""Time-split execution of the temporal-fusion paper, Sec. 3.3 (Eq. 4-5, Fig. 1(b) and 6), on ``torch.distributed``.

What each rank holds
--------------------
The ``k`` ranks of a process group (``group``, default the whole world) split the time axis of one sequence into
``k`` contiguous blocks, in rank order: rank ``r`` holds the time steps ``[t_r, t_{r+1})`` of *every* tensor shaped
``[T, B, ...]`` in the network (inputs, activations, spikes, their gradients) -- the same batch ``B`` and the same
neurons on every rank, only other time steps. :func:`time_partition` gives the usual near-equal split; any split
works as long as the blocks are contiguous and ordered by rank. Every rank holds a full replica of the weights.

- :class:`TimeSplitLIF` / :func:`timesplit_lif`: the LIF recursion is serial in time, so rank ``r`` needs the
  membrane state at ``t_r``. It receives it from rank ``r-1`` (as ``v_init`` of its block), runs its block with the
  fused kernel and sends its final state to rank ``r+1``. Backward runs the chain in reverse: rank ``r`` receives
  the gradient of its final state from rank ``r+1``, runs the block's backward and sends the gradient of its
  ``v_init`` to rank ``r-1``. To keep the ranks busy at the same time (the pipelining Eq. (4b) assumes), the
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
from ..batchnorm.modules import BatchNormLIFBase, ConvBatchNormLIF, running_average_factor
from ..nn.containers import SeqToBatch
from ..nn.neurons import LIF
from ..ops.common import compute_dtype
from ..surrogate import Sigmoid

__all__ = [
    "TimeSplitLIF",
    "TimeSplitBatchNorm",
    "TimeSplitBatchNormLIF",
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
    """How one call splits its neurons: ``dim`` of ``x_local`` (>= 1) and the chunk sizes along it."""

    dim: int | None
    sizes: list[int]
    split_leak: bool  # the chunks cut the per-channel leak's channel dim

    @property
    def chunks(self) -> int:
        return len(self.sizes)


def _plan(shape: torch.Size, chunks: int, leak_channels: int) -> _Plan:
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if len(shape) < 2 or chunks == 1 or math.prod(shape[1:]) == 0:
        return _Plan(None, [1], False)
    dims = range(1, len(shape))
    dim = next((d for d in dims if shape[d] >= chunks), max(dims, key=lambda d: shape[d]))
    m = min(chunks, shape[dim])
    base, extra = divmod(shape[dim], m)
    sizes = [base + (1 if j < extra else 0) for j in range(m)]
    channel_dim = 2 if len(shape) >= 3 else 1
    return _Plan(dim, sizes, leak_channels > 1 and dim == channel_dim)


def _split(t: torch.Tensor | None, plan: _Plan, dim: int) -> list:
    if t is None:
        return [None] * plan.chunks
    if plan.dim is None:
        return [t]
    return list(t.split(plan.sizes, dim))


@dataclass
class _Chain:
    """One call's settings: the neuron function, the group and the neighbour ranks."""

    neuron: Callable  # (x [T, ...], v_init or None, leak or None) -> (spikes, state)
    group: object
    rank: int
    size: int
    plan: _Plan

    def peer(self, group_rank: int) -> int:
        """Global rank of a group rank (isend/irecv take global ranks in every torch version we support)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


def _chunk_leak(leak: torch.Tensor | None, chain: _Chain) -> list:
    if leak is None or not chain.plan.split_leak:
        return [leak] * chain.plan.chunks
    return list(leak.split(chain.plan.sizes))


def _run_chain(chain: _Chain, x_local, v_init, leak, build_graph: bool):
    """The forward pipeline. Returns ``(spikes, state, saved)``; ``saved`` holds the per-chunk graphs."""
    plan = chain.plan
    first, last = chain.rank == 0, chain.rank == chain.size - 1
    xs = _split(x_local, plan, plan.dim or 0)
    state_dim = (plan.dim or 1) - 1
    vs = _split(v_init, plan, state_dim) if first else [None] * plan.chunks
    sdt = compute_dtype(x_local.dtype)
    recvs = []
    if not first:  # post every receive at once: chunk j+1 arrives while chunk j computes
        for j, xj in enumerate(xs):
            buf = torch.empty(xj.shape[1:], dtype=sdt, device=x_local.device)
            recvs.append((buf, dist.irecv(buf, src=chain.peer(chain.rank - 1), group=chain.group, tag=_FWD_TAG + j)))
    leak_leaf = None
    if leak is not None:
        leak_leaf = leak.detach().requires_grad_(build_graph and leak.requires_grad)
    sends, spikes, states, saved = [], [], [], []
    with torch.set_grad_enabled(build_graph):
        leaks = _chunk_leak(leak_leaf, chain)  # inside: the slices must be recorded for the leak's gradient
        for j in range(plan.chunks):
            xj = xs[j].detach().requires_grad_(build_graph and x_local.requires_grad)
            if first:
                vj = vs[j]
                if vj is not None:
                    vj = vj.detach().requires_grad_(build_graph and v_init.requires_grad)
            else:
                buf, work = recvs[j]
                work.wait()
                vj = buf.requires_grad_(build_graph)
            sj, stj = chain.neuron(xj, vj, leaks[j])
            if not last:
                out = stj.detach().contiguous()
                sends.append(
                    (out, dist.isend(out, dst=chain.peer(chain.rank + 1), group=chain.group, tag=_FWD_TAG + j))
                )
            spikes.append(sj)
            states.append(stj)
            saved.append((xj, vj, sj, stj))
    for _, work in sends:
        work.wait()
    if plan.dim is None:
        spikes_out, state_out = spikes[0].detach(), states[0].detach()
    else:
        spikes_out = torch.cat([s.detach() for s in spikes], plan.dim)
        state_out = torch.cat([s.detach() for s in states], state_dim)
    return spikes_out, state_out, (saved, leak_leaf)


class _TimeSplitFunction(torch.autograd.Function):
    """The whole pipelined chain of one layer on one rank as one autograd node (deterministic message order)."""

    @staticmethod
    def forward(ctx, chain: _Chain, x_local, v_init, leak):
        spikes, state, saved = _run_chain(chain, x_local, v_init, leak, build_graph=True)
        ctx.chain, ctx.saved = chain, saved
        ctx.x_meta = (x_local.shape, x_local.dtype, x_local.device)
        ctx.v_meta = None if v_init is None else (v_init.shape, v_init.dtype)
        return spikes, state

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_spikes, grad_state):
        chain, (chunks, leak_leaf) = ctx.chain, ctx.saved
        ctx.saved = None  # free the graphs as soon as possible
        plan = chain.plan
        first, last = chain.rank == 0, chain.rank == chain.size - 1
        state_dim = (plan.dim or 1) - 1
        gs = _split(grad_spikes, plan, plan.dim or 0)
        gst = _split(grad_state, plan, state_dim)
        recvs = []
        if not last:
            for j, (_, _, _, stj) in enumerate(chunks):
                buf = torch.empty_like(stj, memory_format=torch.contiguous_format)
                recvs.append(
                    (buf, dist.irecv(buf, src=chain.peer(chain.rank + 1), group=chain.group, tag=_BWD_TAG + j))
                )
        sends, grad_x, grad_v = [], [], []
        grad_leak = None
        for j, (xj, vj, sj, stj) in enumerate(chunks):
            g_state = gst[j]
            if not last:
                buf, work = recvs[j]
                work.wait()
                g_state = buf if g_state is None else g_state + buf
            inputs = [t for t in (xj, vj, leak_leaf) if t is not None and t.requires_grad]
            if inputs and (sj.requires_grad or stj.requires_grad):
                outs = [(o, g) for o, g in ((sj, gs[j]), (stj, g_state)) if o.requires_grad and g is not None]
                grads = torch.autograd.grad([o for o, _ in outs], inputs, [g for _, g in outs], allow_unused=True)
                got = dict(zip(map(id, inputs), grads))
            else:
                got = {}
            gx = got.get(id(xj))
            gv = got.get(id(vj)) if vj is not None else None
            gl = got.get(id(leak_leaf)) if leak_leaf is not None else None
            for name, t, gt in (("x", xj, gx), ("v_init", vj, gv), ("decay", leak_leaf, gl)):
                if t is not None and t.requires_grad and gt is None:  # the state always feeds the outputs
                    raise RuntimeError(
                        f"time split: the neuron returned no gradient for its {name} (rank {chain.rank}, chunk {j}); "
                        "its backend does not differentiate the state/decay, so the chain's gradient would be wrong"
                    )
            if not first:
                out = (gv if gv is not None else torch.zeros_like(stj)).contiguous()
                sends.append(
                    (out, dist.isend(out, dst=chain.peer(chain.rank - 1), group=chain.group, tag=_BWD_TAG + j))
                )
            grad_x.append(gx if gx is not None else torch.zeros_like(xj))
            grad_v.append(gv)
            if gl is not None:
                grad_leak = gl if grad_leak is None else grad_leak + gl
        for _, work in sends:
            work.wait()
        x_shape, x_dtype, _ = ctx.x_meta
        gx = grad_x[0] if plan.dim is None else torch.cat(grad_x, plan.dim)
        gv = None
        if first and ctx.v_meta is not None and ctx.needs_input_grad[2]:
            parts = [g if g is not None else torch.zeros_like(c[3]) for g, c in zip(grad_v, chunks)]
            gv = (parts[0] if plan.dim is None else torch.cat(parts, state_dim)).to(ctx.v_meta[1])
        return (
            None,
            gx.to(x_dtype) if ctx.needs_input_grad[1] else None,
            gv,
            grad_leak if ctx.needs_input_grad[3] else None,
        )


def timesplit_neuron(
    neuron: Callable,
    x_local: torch.Tensor,
    *,
    v_init: torch.Tensor | None = None,
    leak: torch.Tensor | None = None,
    group=None,
    chunks: int = 4,
):
    """Run a stateful neuron over a time-split sequence; returns ``(spikes_local, state_local)``.

    ``neuron(x, v_init, leak) -> (spikes, state)`` runs a block ``[t, ...]`` from state ``v_init`` (None: the
    neuron's default start) with the leak tensor ``leak`` (None when the leak is a number) and returns the block's
    spikes and final state, differentiably. ``v_init`` here is the state before the first global step and is used
    on the first rank only. ``state_local`` is the state at the end of this rank's block (on the last rank: the
    end of the sequence).
    """
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
    rank, size = _group_info(group)
    channels = 1 if leak is None else leak.numel()
    chain = _Chain(neuron, group, rank, size, _plan(x_local.shape, int(chunks), channels))
    if rank != 0:
        v_init = None
    if x_local.ndim >= 1 and x_local.shape[0] == 0:
        raise ValueError(
            f"this rank (group rank {rank}) holds no time steps (x_local has shape {tuple(x_local.shape)}): "
            "use at most T ranks"
        )
    tensors = [t for t in (x_local, v_init, leak) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _TimeSplitFunction.apply(chain, x_local, v_init, leak)
    spikes, state, _ = _run_chain(chain, x_local, v_init, leak, build_graph=False)
    return spikes, state


def timesplit_lif(
    x_local: torch.Tensor,
    *,
    decay,
    threshold: float,
    v_reset: float | None = 0.0,
    surrogate=Sigmoid(4.0),
    detach_reset: bool = False,
    v_init: torch.Tensor | None = None,
    return_state: bool = False,
    backend: str = "auto",
    memory: str = "potential",
    group=None,
    chunks: int = 4,
):
    """:func:`spikefuse.lif` on the time block ``x_local`` ``[T_r, *]`` that this rank of ``group`` holds.

    Every rank calls it with its own block (same ``*`` shape everywhere, blocks in rank order); the result equals
    the matching block of ``spikefuse.lif`` over the whole sequence, forward and backward. ``v_init`` is the state
    before global step 0 (used on rank 0 only). ``chunks`` splits the neurons for pipelining (see the module
    docstring). With ``return_state=True`` also returns the state at the end of this rank's block.
    """
    leak = decay if isinstance(decay, torch.Tensor) else None

    def neuron(x, v0, k):
        return F.lif(
            x,
            decay=decay if k is None else k,
            threshold=threshold,
            v_reset=v_reset,
            surrogate=surrogate,
            detach_reset=detach_reset,
            v_init=v0,
            return_state=True,
            backend=backend,
            memory=memory,
        )

    spikes, state = timesplit_neuron(neuron, x_local, v_init=v_init, leak=leak, group=group, chunks=chunks)
    return (spikes, state) if return_state else spikes


class TimeSplitLIF(LIF):
    """:class:`spikefuse.nn.LIF` over a time-split sequence: this rank holds the steps ``[t_r, t_{r+1})``.

    Same options as :class:`~spikefuse.nn.LIF`, plus ``group`` (the time ranks, default the world) and ``chunks``
    (neuron chunks of the pipeline). Gradients of a learnable decay cover only the local block: sum them with
    :func:`allreduce_gradients`. With ``stateful=True`` the state at the end of the whole sequence (last rank) is
    broadcast to all ranks after each call and starts the next call on rank 0.
    """

    def __init__(self, *args, group=None, chunks: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.group = group
        self.chunks = int(chunks)

    @classmethod
    def from_lif(cls, lif: LIF, group=None, chunks: int = 4) -> "TimeSplitLIF":
        """A time-split copy of ``lif`` sharing its learnable decay parameter (if any)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for key, value in vars(lif).items():
            if not key.startswith("_"):
                setattr(new, key, value)
        new._parameters = dict(lif._parameters)
        new.group, new.chunks = group, int(chunks)
        new.state = None
        return new

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        spikes, state = timesplit_lif(
            x_local, memory=self.memory, group=self.group, chunks=self.chunks, **self._neuron_call_kwargs(x_local)
        )
        if self.stateful:
            state = state.detach().contiguous()
            _, size = _group_info(self.group)
            if size > 1:
                last = size - 1 if self.group is None else dist.get_global_rank(self.group, size - 1)
                dist.broadcast(state, src=last, group=self.group)
            self.state = state
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


class TimeSplitBatchNormLIF(nn.Module):
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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, residual_binary: bool = False):
        y = self.bn(x)
        return self.neuron(y if residual is None else y + residual)

    def reset_state(self) -> None:
        self.neuron.reset_state()


# ---------------------------------------------------------------------------------------------------- converters


def convert_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """Replace ``SeqToBatch(nn.BatchNormNd)`` and bare ``nn.BatchNormNd`` by :class:`TimeSplitBatchNorm`, and the
    fused BatchNorm+LIF modules of the lean form by :class:`TimeSplitBatchNormLIF`, over ``group`` (sharing
    parameters and buffers). Returns the converted module (``module`` itself is changed in place where it is a
    container)."""
    if isinstance(module, BatchNormLIFBase):
        return TimeSplitBatchNormLIF(module, group)
    if isinstance(module, ConvBatchNormLIF):  # the convolution's output is kept again
        return nn.Sequential(SeqToBatch(module.conv), TimeSplitBatchNormLIF(module.bn_lif, group))
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
    every BatchNorm a :class:`TimeSplitBatchNorm` and every fused BatchNorm+LIF a :class:`TimeSplitBatchNormLIF`
    (whose neuron is time-split in turn) over ``group``, sharing parameters and buffers.

    Layers without memory across time steps (conv, linear, pooling applied through ``SeqToBatch``) need no change.
    Layers that mix time steps any other way (attention over time, a readout of the last step) are not handled.
    """
    if isinstance(module, LIF) and not isinstance(module, TimeSplitLIF):
        return TimeSplitLIF.from_lif(module, group, chunks)
    if isinstance(module, BatchNormLIFBase):
        module = TimeSplitBatchNormLIF(module, group)  # its neuron is converted below
    if isinstance(module, ConvBatchNormLIF):
        module = nn.Sequential(SeqToBatch(module.conv), module.bn_lif)  # converted below
    is_bn = isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, TimeSplitBatchNorm)
    if is_bn or (isinstance(module, SeqToBatch) and isinstance(module.module, nn.modules.batchnorm._BatchNorm)):
        return convert_batchnorm(module, group)
    for name, child in module.named_children():
        new = convert_timesplit(child, group, chunks)
        if new is not child:
            setattr(module, name, new)
    return module
