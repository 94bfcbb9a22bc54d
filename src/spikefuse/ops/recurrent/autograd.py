"""A recurrent layer over all T steps as one autograd operation, on a generated backend (:mod:`.cpu`, :mod:`.triton`):
``torch.library`` custom ops with fake kernels (``spikefuse::recurrent_forward`` / ``recurrent_backward``, so that
``torch.compile(fullgraph=True)`` traces a recurrent network without tracing into the kernels), and the same
implementation as a plain ``autograd.Function`` for eager calls, as :mod:`spikefuse.ops.engine.autograd` does.

Forward: per step, the recurrent current of the previous spikes (:func:`~spikefuse.ops.recurrent.current`, the
reference's own torch call) into one ``[B, H]`` buffer, then one kernel call for the rest of the step. With
``sparse=True`` (CPU), one kernel call for all steps, which sums each current from the previous spikes' bits
(:func:`.cpu.forward_sparse`); the weight's gradient then reads the same bits. Kept for
backward: the spikes as bits (1/32 of a float each) and, with ``memory="potential"``, every step's states that the
backward reads (:func:`.source.kept_states`), else the input only (``"recompute"``: the backward computes the currents
of the kept spikes again, one product per step as the forward did, then replays every step in one kernel).

With one state to keep (LIF's membrane), keeping it takes no more memory than keeping the input, and both modes
keep it.

Backward: once through time in reverse, one kernel call per step and the product that carries the gradient of a
step's input back to the previous spikes (``grad @ W``); then the weight's gradient as one product over all
``T*B`` rows (``G.T @ S_prev``), the bias's as one sum, the parameters' as per-neuron sums reduced once. With
``sparse_grad`` (CPU, all to all): the whole reverse loop one kernel call, each step's ``G[t] @ W`` summed from the
nonzero entries of ``G[t]`` only (:func:`.cpu.backward_sparse`), and the weight's gradient, where it is not read from
the spikes' bits (``sparse=True``), from ``G``'s CSR over all steps
(:func:`~spikefuse.ops.spike_layers.cpu.csr_t_matmul`, the spike layers' ``sparse_grad`` product).
"""

from __future__ import annotations

import dataclasses
import importlib
import weakref

import torch

from torch import Tensor

from .. import bitpack, buffers
from ..spike_layers import cpu as sparse_cpu
from ..bit_layout import packed_numel
from ..autograd_guards import refuse_double_backward, saved_tensors
from ..nonfinite import refuse_flagged
from ...neurons.spec import registered_key
from ...registry import OBJECTS
from ..engine.reference import initial_spike
from . import GradBuffers, StepBuffers, current, current_backward, record_grad_rate


#: What else a recurrent layer's neurons read: the error's words where the input and the states are finite.
RECURRENT_NON_FINITE = "the recurrent current (the recurrent weight, its bias or the initial spikes) holds NaN or inf"
#: Why the sparse product refuses initial spikes: it reads them as bits.
NOT_BINARY = "the initial spikes of state hold a value other than 0 and 1"


def binary(spikes: Tensor) -> bool:
    return bool(((spikes == 0) | (spikes == 1)).all())


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """A ``[T, B, H]``-sized buffer on ``like``'s device: on the CPU from the buffer cache, whose reused pages are
    not faulted in again (a fresh 200 MB buffer, written a row per step, ran the forward at a third of its speed)."""
    if like.device.type == "cpu":
        return buffers.empty(tuple(shape), like.dtype)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def backend_module(backend: str):
    return importlib.import_module(f"{__package__}.{backend}")


def run_forward(ops, neuron, x, weight, bias, par, init, spikes0, hist, record_currents=None, words=None):
    """Run every step; returns ``(spikes [T, B, H], final states [S, B, H])``. ``hist``: where to keep the states
    the backward reads (None: keep none); ``record_currents``: a ``[T, B, H]`` tensor to keep every step's current
    in (a backward that reads the input needs them). ``words``: the sparse forward (``sparse=True``, CPU), every
    step in one kernel call that reads the previous spikes' bits from ``words`` ``[T + 1, B, W]`` (``words[0]`` the
    initial spikes', given) and writes each step's (:func:`.cpu.forward_sparse`); None: a torch product per step."""
    spikes = _empty(x.shape, x)
    cur = init.clone()
    if words is None:
        r = torch.empty_like(spikes0)  # fresh: aligned for the products (see ALIGNMENT)
        step, flags = ops.bind_forward(neuron, StepBuffers(x, r, cur, spikes, hist, par))
        previous = spikes0
        for t in range(x.shape[0]):
            current(previous, weight, bias, out=r)
            if record_currents is not None:
                record_currents[t].copy_(r)
            step(t)
            previous = spikes[t]
    else:
        buf = StepBuffers(x, None, cur, spikes, hist, par)
        flags = ops.forward_sparse(neuron, buf, weight.t().contiguous(), bias, words, record_currents)
    refuse_flagged(flags, x, init.unbind(0), otherwise=RECURRENT_NON_FINITE)
    if neuron.model.handoff:
        ops.handoff(neuron, cur, par)
    return spikes, cur


def _kept_states(backend: str, neuron, dtype: torch.dtype) -> tuple[str, ...]:
    """The states the backward reads at every step (:func:`.source.kept_states`), as the generated kernels' module
    states them: a warm process does not derive them with sympy again (0.35 s for ALIF)."""
    return backend_module(backend).kernels(neuron.model, type(neuron.surrogate), dtype).KEPT_STATES


def _keeps_potential(model, kept: tuple[str, ...], memory: str) -> bool:
    """Whether every step's ``kept`` states are kept for backward: ``memory="potential"``, or whatever the mode
    where they take no more memory than the input would (nothing to recompute then)."""
    return memory == "potential" or len(kept) + model.backward_reads_input <= 1


def _stacked(params, init, batch: int, hidden: int, like: Tensor):
    """``(par [P, H], init_all [S, B, H])``: the parameters and initial states as the kernels read them."""
    par = torch.stack([p.expand(hidden) for p in params]) if params else like.new_zeros(0, hidden)
    return par.contiguous(), torch.stack([v.expand(batch, hidden) for v in init]).contiguous()


def _initial_spikes(model, par: Tensor, init_all: Tensor) -> Tensor:
    """The spikes ``[B, H]`` of the initial states, which the first step's current reads where none are given:
    computed inside the ops, as the fire expression is evaluated in Python, which ``torch.compile`` does not trace."""
    batch, hidden = init_all.shape[1:]
    init = [v.reshape(-1) for v in init_all]
    return initial_spike(model, list(par), 1, init, batch * hidden).reshape(batch, hidden)


def _sparse_words(spikes0: Tensor, t_steps: int) -> Tensor:
    """The words ``[T + 1, B, W]`` the sparse forward's kernel writes each step's spike bits into, the initial spikes'
    packed in ``[0]``: a row per row of spikes from a word boundary
    (:func:`~spikefuse.ops.spike_layers.cpu.pack_spike_rows`), so that the threads, which split the rows, write words of
    their own; ``[:T]`` are the rows that each step's current and the weight's gradient read."""
    batch, hidden = spikes0.shape
    words = torch.empty(t_steps + 1, batch, sparse_cpu.words_per_row(hidden), dtype=torch.int64)
    words[0] = sparse_cpu.pack_spike_rows(spikes0)
    return words


@dataclasses.dataclass(frozen=True)
class _Call:
    """What the custom ops take by key (:data:`spikefuse.registry.OBJECTS`) besides tensors: the neurons (the
    :attr:`~spikefuse.neurons.NeuronSpec.op_key` of their record, memory mode included), the concrete backend, whether
    each step's current is summed from the previous spikes' bits (``sparse``) and whether the backward's products read
    only ``G``'s nonzero entries (``sparse_grad``)."""

    neuron: str
    backend: str
    sparse: bool
    sparse_grad: bool

    def __iter__(self):  # unpacked where read: (neuron, backend, sparse, sparse_grad)
        return iter((self.neuron, self.backend, self.sparse, self.sparse_grad))


def _call_key(neuron: str, backend: str, sparse: bool, sparse_grad: bool) -> str:
    """The key of the :class:`_Call` of these settings, kept by them (a bounded cache, as the neuron records')."""
    return registered_key(_CALL_KEYS, _Call, (neuron, backend, sparse, sparse_grad))


_CALL_KEYS: dict[tuple, str] = {}
# torch.compile calls this as Python and takes its result as a constant (strings and bools), as it does the neuron
# record's op key
_call_key._dynamo_marked_constant = True


def _forward_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    spikes0: Tensor | None,
    params: list[Tensor],
    init: list[Tensor],
    call: str,
) -> list[Tensor]:
    """``[spikes [T, B, H], *final states [B, H], bits, *kept]``: the spikes as bits and what else the backward reads
    (every step's states, and the currents where the derivatives read the input: memory "potential"; nothing else
    with "recompute", which keeps the input; ``call``: the key of a :class:`_Call`). ``sparse``: each step's current
    from the previous spikes' bits in the step kernel, the bits kept row-padded with the initial spikes' first
    (:func:`_sparse_words`); else packed by :func:`spikefuse.ops.bitpack.pack`."""
    neuron, backend, sparse, _ = OBJECTS[call]
    spec = OBJECTS[neuron]
    model = spec.model
    if sparse and spikes0 is not None and not binary(spikes0):  # (the caller's check, where a compiled graph has none)
        raise ValueError(
            f"recurrent {model.name}: sparse=True reads the initial spikes as bits, but {NOT_BINARY}; pass the spikes "
            "a layer made, or sparse=False"
        )
    ops = backend_module(backend)
    t_steps, batch, hidden = x.shape
    par, init_all = _stacked(params, init, batch, hidden, x)
    if spikes0 is None:
        spikes0 = _initial_spikes(model, par, init_all)
    kept = _kept_states(backend, spec, x.dtype)
    potential = _keeps_potential(model, kept, spec.memory)
    hist = _empty((t_steps, len(kept), batch, hidden), x) if potential else None
    currents = _empty(x.shape, x) if potential and model.backward_reads_input else None
    words = _sparse_words(spikes0, t_steps) if sparse else None
    with torch.no_grad():
        spikes, final = run_forward(ops, spec, x, weight, bias, par, init_all, spikes0, hist, currents, words)
    if currents is not None:
        currents += x  # the steps' inputs, which the derivatives read
    bits = words if sparse else bitpack.pack(spikes, reuse=False)[0]
    # a custom op's outputs may not alias each other: each final state a tensor of its own
    return [spikes, *(v.clone() for v in final.unbind(0)), bits, *(t for t in (hist, currents) if t is not None)]


recurrent_forward = torch.library.custom_op("spikefuse::recurrent_forward", mutates_args=())(_forward_impl)


@recurrent_forward.register_fake
def _(x, weight, bias, spikes0, params, init, call):
    neuron, backend, sparse, _ = OBJECTS[call]
    spec = OBJECTS[neuron]
    model = spec.model
    t_steps, batch, hidden = x.shape
    names = _kept_states(backend, spec, x.dtype)
    kept = []
    if _keeps_potential(model, names, spec.memory):
        kept.append(x.new_empty(t_steps, len(names), batch, hidden))
        if model.backward_reads_input:
            kept.append(torch.empty_like(x))
    if sparse:
        bits = x.new_empty(t_steps + 1, batch, sparse_cpu.words_per_row(hidden), dtype=torch.int64)
    else:
        bits = x.new_empty(packed_numel(x.numel()), dtype=torch.uint8)
    return [torch.empty_like(x), *(x.new_empty(batch, hidden) for _ in init), bits, *kept]


def _backward_impl(
    grad_spikes: Tensor,
    grad_final: list[Tensor],
    layer: list[Tensor | None],
    params: list[Tensor],
    init: list[Tensor],
    kept: list[Tensor],
    call: str,
    need: list[bool],
) -> list[Tensor]:
    """``[grad_x, grad_weight, grad_bias, grad_spikes0, *per-neuron grad per parameter [H], grad_init [S, B, H]]``
    from the gradients of the spikes and the final states; ``need``: whether the weight, the bias, the initial spikes
    and each parameter need theirs (an empty tensor where not). ``layer``: ``[x, weight, bias, spikes0, bits]``, the
    input (memory "recompute"; empty otherwise), the recurrent weight and bias (None: none), the initial spikes
    (None: those of the initial states) and the spikes' bits; ``kept``: what the forward kept besides the bits;
    ``call``: the key of a :class:`_Call`.
    ``sparse``: ``bits`` are the sparse forward's words, from which the recomputed currents and the weight's gradient
    read the previous spikes (the products of :mod:`spikefuse.ops.spike_layers.cpu`, the forward's order).
    ``sparse_grad`` (CPU backend, all to all): every step's ``G[t] @ W`` from ``G[t]``'s nonzero entries
    (:func:`.cpu.backward_sparse`, the reverse loop in one call), and the weight's gradient from ``G``'s CSR where
    ``sparse`` does not read it from the bits."""
    x, weight, bias, spikes0, bits = layer
    neuron, backend, sparse, sparse_grad = OBJECTS[call]
    spec = OBJECTS[neuron]
    model = spec.model
    ops = backend_module(backend)
    shape = t_steps, batch, hidden = grad_spikes.shape
    dtype, device = grad_spikes.dtype, grad_spikes.device
    par, init_all = _stacked(params, init, batch, hidden, grad_spikes)
    if spikes0 is None:
        spikes0 = _initial_spikes(model, par, init_all)
    if sparse_grad and (weight.dim() != 2 or not hasattr(ops, "backward_sparse")):  # (the caller's check)
        raise ValueError(
            f"recurrent {model.name}: sparse_grad=True runs on the CPU backend for an all-to-all weight, not on the "
            f"{backend!r} backend with a {'one-to-one' if weight.dim() == 1 else 'all-to-all'} weight; use "
            "sparse_grad='auto' or False"
        )
    if sparse:  # the rows of the previous spikes, which each step's current read
        previous_words = bits.reshape(-1, bits.shape[2])[: t_steps * batch]
    else:
        spikes = bitpack.unpack(bits, shape, dtype)
        previous = torch.cat([spikes0[None], spikes[:-1]])  # each step's current reads these
    if kept:  # memory "potential" (the forward kept every step's states)
        hist = kept[0]
        xin = kept[1] if model.backward_reads_input else None
    else:
        if sparse:
            currents = sparse_cpu.row_linear(previous_words, weight.t().contiguous(), bias).view(shape)
        else:
            currents = _empty(shape, spikes0)
            r = torch.empty_like(spikes0)  # fresh: aligned, as the forward's (see ALIGNMENT)
            for t in range(t_steps):
                currents[t].copy_(current(previous[t], weight, bias, out=r))
        hist = _empty((t_steps, len(_kept_states(backend, spec, dtype)), batch, hidden), spikes0)
        ops.replay(spec, StepBuffers(x, currents, init_all.clone(), _empty(shape, spikes0), hist, par))
        xin = x + currents if model.backward_reads_input else None
    gS = torch.stack([g.to(dtype).expand(batch, hidden) for g in grad_final]).contiguous()
    gs = torch.zeros(batch, hidden, dtype=dtype, device=device)
    grec = torch.zeros_like(gs)
    need_weight, need_bias, need_spikes0, *need_params = need
    acc = torch.zeros(len(need_params) if any(need_params) else 1, batch, hidden, dtype=dtype, device=device)
    G = _empty(shape, spikes0)
    grads = GradBuffers(need_params, grad_spikes, grec, G, gS, gs, hist, init_all, G if xin is None else xin, par, acc)
    if model.handoff:
        ops.handoff_grad(spec, grads)
    if sparse_grad:
        ops.backward_sparse(spec, grads, weight)
    else:
        step = ops.bind_backward(spec, grads)
        for t in range(t_steps - 1, -1, -1):
            step(t)
            current_backward(G[t], weight, out=grec)
    ginit = torch.empty_like(gS)
    ops.initial(spec, grads, ginit)

    none = spikes0.new_empty(0)
    flat_g = G.reshape(-1, hidden)
    # each output its own tensor: a compiled graph refuses an op whose outputs alias one another
    grad_weight, grad_bias = none, torch.empty_like(none)
    if need_weight:
        if sparse:
            grad_weight = sparse_cpu.row_weight_grad(flat_g, previous_words, hidden).contiguous()  # the op's: row-major
        elif sparse_grad:  # G.T @ S_prev over all T*B rows from G's nonzero entries
            grad_weight = sparse_cpu.csr_t_matmul(
                sparse_cpu.output_grad_csr(flat_g, True), previous.reshape(-1, hidden)
            )
        elif weight.dim() == 2:
            grad_weight = flat_g.t() @ previous.reshape(-1, hidden)
        else:
            grad_weight = (flat_g * previous.reshape(-1, hidden)).sum(0)
    if bias is not None and need_bias:
        grad_bias = flat_g.sum(0)
    grad_params = [acc[i].sum(0) if n else torch.empty_like(none) for i, n in enumerate(need_params)]
    return [G, grad_weight, grad_bias, grec.clone() if need_spikes0 else torch.empty_like(none), *grad_params, ginit]


recurrent_backward = torch.library.custom_op("spikefuse::recurrent_backward", mutates_args=())(_backward_impl)


@recurrent_backward.register_fake
def _(grad_spikes, grad_final, layer, params, init, kept, call, need):
    weight, bias = layer[1], layer[2]
    shape = grad_spikes.shape[1:]
    need_weight, need_bias, need_spikes0, *need_params = need
    none = grad_spikes.new_empty(0)
    return [
        torch.empty_like(grad_spikes),
        torch.empty_like(weight) if need_weight else torch.empty_like(none),
        torch.empty_like(bias) if bias is not None and need_bias else torch.empty_like(none),
        grad_spikes.new_empty(shape) if need_spikes0 else torch.empty_like(none),
        *(grad_spikes.new_empty(shape[1]) if n else torch.empty_like(none) for n in need_params),
        grad_spikes.new_empty(len(init), *shape),
    ]


def _save(ctx, x, weight, bias, spikes0, params, init, call, *, out) -> None:
    n_init = len(init)
    bits, kept = out[1 + n_init], out[2 + n_init :]
    ctx.call = call
    ctx.n_params, ctx.n_init, ctx.has_bias = len(params), n_init, bias is not None
    ctx.x_meta = x.shape, x.dtype, x.device
    ctx.shapes = [p.shape for p in params], [v.shape for v in init]
    ctx.set_materialize_grads(False)
    keep_x = x.new_empty(0) if kept else x  # the input, where the backward recomputes the states from it
    ctx.save_for_backward(keep_x, weight, bias, spikes0, bits, *params, *init, *kept)


def _gradients(ctx, grad_spikes, grad_final, need, backward_op) -> tuple:
    """``(grad_x, grad_weight, grad_bias, grad_spikes0, grads of the parameters, grads of the initial states)``,
    None where not needed; ``need``: ``needs_input_grad`` of (x, weight, bias, spikes0, *params, *init)."""
    call = ctx.call
    neuron, backend = OBJECTS[call].neuron, OBJECTS[call].backend
    name = OBJECTS[neuron].name
    refuse_double_backward(
        f"the recurrent {name} layer ({backend!r} backend)", "use backend='reference', which runs plain PyTorch ops"
    )
    x, weight, bias, spikes0, bits, *tensors = saved_tensors(ctx, f"the recurrent {name} layer")
    n_params, n_init = ctx.n_params, ctx.n_init
    params, init, kept = tensors[:n_params], tensors[n_params : n_params + n_init], tensors[n_params + n_init :]
    shape, dtype, device = ctx.x_meta
    if grad_spikes is None:  # only the final states were used
        grad_spikes = torch.zeros(shape, dtype=dtype, device=device)
    grad_final = [torch.zeros(1, dtype=dtype, device=device) if g is None else g.contiguous() for g in grad_final]
    need_params, need_init = need[4 : 4 + n_params], need[4 + n_params :]
    out = backward_op(
        grad_spikes.contiguous(),
        grad_final,
        [x, weight, bias, spikes0, bits],
        list(params),
        list(init),
        list(kept),
        call,
        [bool(n) for n in (*need[1:4], *need_params)],
    )
    grad_x, grad_weight, grad_bias, grad_spikes0, *rest = out
    per_neuron, ginit = rest[:n_params], rest[n_params]
    param_shapes, init_shapes = ctx.shapes
    grad_params = [
        None if not n else g.sum().reshape(s) if s.numel() == 1 else g
        for n, g, s in zip(need_params, per_neuron, param_shapes)
    ]
    grad_init = [
        None if not n else ginit[i] if s == ginit[i].shape else ginit[i].sum().reshape(s)
        for i, (n, s) in enumerate(zip(need_init, init_shapes))
    ]
    return (
        grad_x,
        grad_weight if need[1] else None,
        grad_bias if need[2] and ctx.has_bias else None,
        grad_spikes0 if need[3] else None,
        grad_params,
        grad_init,
    )


def _setup_context(ctx, inputs, output):
    _save(ctx, *inputs, out=output)


def _backward(ctx, grads):
    grad_spikes, grad_final = grads[0], grads[1 : 1 + ctx.n_init]  # (none for the bits and the kept states)
    need = ctx.needs_input_grad
    need = (*need[:4], *need[4], *need[5])  # params and init are lists: one flag per tensor
    grad_x, gw, gb, gs0, grad_params, grad_init = _gradients(ctx, grad_spikes, grad_final, need, recurrent_backward)
    return grad_x, gw, gb, gs0, grad_params, grad_init, None


torch.library.register_autograd("spikefuse::recurrent_forward", _backward, setup_context=_setup_context)


class _EagerRecurrent(torch.autograd.Function):
    """``recurrent_forward`` with the same autograd, without the custom-op dispatch (the first call of a custom op
    imports ``torch._dynamo``, ~2 s per process); the parameters and initial states are flat arguments, so that
    autograd sees them."""

    @staticmethod
    def forward(ctx, x, weight, bias, spikes0, call, rate_key, n_params, *tensors):
        params, init = list(tensors[:n_params]), list(tensors[n_params:])
        args = (x, weight, bias, spikes0, params, init, call)
        out = _forward_impl(*args)
        _save(ctx, *args, out=out)
        ctx.rate_key = rate_key
        ctx.mark_non_differentiable(*out[1 + len(init) :])
        return tuple(out)

    @staticmethod
    def backward(ctx, grad_spikes, *rest):
        need = ctx.needs_input_grad
        need = (*need[:4], *need[7:])
        grad_x, gw, gb, gs0, grad_params, grad_init = _gradients(
            ctx, grad_spikes, rest[: ctx.n_init], need, _backward_impl
        )
        weight = ctx.rate_key() if ctx.rate_key is not None else None
        if weight is not None:  # sparse_grad="auto": this backward's share of nonzero G, for the next call
            record_grad_rate(weight, int(torch.count_nonzero(grad_x)) / max(1, grad_x.numel()))
        return (grad_x, gw, gb, gs0, None, None, None, *grad_params, *grad_init)


def recurrent_layer(
    x,
    weight,
    bias,
    spikes0,
    params,
    init,
    neuron,
    backend: str,
    sparse=False,
    count_spikes=False,
    sparse_grad=False,
    grad_rate_of=None,
):
    """``[spikes [T, B, H], *final states [B, H]]`` of the neurons of ``neuron`` (a
    :class:`~spikefuse.neurons.NeuronSpec`: the model, surrogate, ``detach_reset`` and memory mode) on ``x``
    ``[T, B, H]`` (the compute dtype) with autograd, on the concrete ``backend``: the recurrent ``weight`` (``[H, H]``
    or ``[H]``) and ``bias`` (``[H]`` or None); ``params`` ``[1]`` or ``[H]`` each; ``init`` the initial states
    (``[B, H]`` or one value each); ``spikes0`` ``[B, H]`` the spikes the first step's current reads (None: those of
    the initial states); ``sparse``: each step's current and the weight's gradient from the previous spikes' bits
    (CPU, all to all; the caller checked). The custom op under ``torch.compile``, the plain Function in eager mode.
    ``count_spikes`` (eager, CPU): also the number of spikes, counted from the bits the forward kept
    (``sparse="auto"``'s rate), as ``(outputs, count)``. ``sparse_grad``: the backward's step products and weight
    gradient from ``G``'s nonzero entries (CPU backend, all to all; the caller checked); ``grad_rate_of`` (eager): a
    tensor whose :func:`~spikefuse.ops.recurrent.last_grad_rate` the backward sets (``sparse_grad="auto"``)."""
    call = _call_key(neuron.op_key, backend, bool(sparse), bool(sparse_grad))
    if torch.compiler.is_compiling():
        out = recurrent_forward(x, weight, bias, spikes0, list(params), list(init), call)
    else:
        rate_key = None if grad_rate_of is None else weakref.ref(grad_rate_of)
        out = _EagerRecurrent.apply(x, weight, bias, spikes0, call, rate_key, len(params), *params, *init)
    outputs = list(out[: 1 + len(init)])
    if not count_spikes:
        return outputs
    bits = out[1 + len(init)]
    if sparse:  # the steps' rows (the initial spikes' first)
        return outputs, sparse_cpu.row_spike_count(bits[1:])
    return outputs, sparse_cpu.spike_count(bits, x.numel())
