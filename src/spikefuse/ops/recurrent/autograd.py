"""A recurrent layer over all T steps as one autograd operation, on a generated backend (:mod:`.cpu`, :mod:`.triton`).

Forward: per step, the recurrent current of the previous spikes (:func:`~spikefuse.ops.recurrent.current`, the
reference's own torch call) into one ``[B, H]`` buffer, then one kernel call for the rest of the step. Kept for
backward: the spikes as bits (1/32 of a float each) and, with ``memory="potential"``, every step's states that the
backward reads (:func:`.source.kept_states`), else the input only (``"recompute"``: the backward computes the currents
of the kept spikes again, one product per step as the forward did, then replays every step in one kernel).

With one state to keep (LIF's membrane), keeping it takes no more memory than keeping the input, and both modes
keep it.

Backward: once through time in reverse, one kernel call per step and the product that carries the gradient of a
step's input back to the previous spikes (``grad @ W``); then the weight's gradient as one product over all
``T*B`` rows (``G.T @ S_prev``), the bias's as one sum, the parameters' as per-neuron sums reduced once.
"""

from __future__ import annotations

import importlib

import torch

from .. import bitpack, buffers
from ..common import refuse_double_backward, refuse_flagged, saved_tensors
from . import current, current_backward


#: What else a recurrent layer's neurons read: the error's words where the input and the states are finite.
RECURRENT_NON_FINITE = "the recurrent current (the recurrent weight, its bias or the initial spikes) holds NaN or inf"


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """A ``[T, B, H]``-sized buffer on ``like``'s device: on the CPU from the buffer cache, whose reused pages are
    not faulted in again (a fresh 200 MB buffer, written a row per step, ran the forward at a third of its speed)."""
    if like.device.type == "cpu":
        return buffers.empty(tuple(shape), like.dtype)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def backend_module(backend: str):
    return importlib.import_module(f"{__package__}.{backend}")


def run_forward(ops, model, surrogate, x, weight, bias, par, init, spikes0, hist, record_currents=None):
    """Run every step; returns ``(spikes [T, B, H], final states [S, B, H])``. ``hist``: where to keep the states
    the backward reads (None: keep none); ``record_currents``: a ``[T, B, H]`` tensor to keep every step's current
    in (a backward that reads the input needs them)."""
    t_steps = x.shape[0]
    spikes = _empty(x.shape, x)
    cur = init.clone()
    r = torch.empty_like(spikes0)  # fresh: aligned for the products (see ALIGNMENT)
    step, flags = ops.bind_forward(model, surrogate, x, r, cur, spikes, hist, par)
    previous = spikes0
    for t in range(t_steps):
        current(previous, weight, bias, out=r)
        if record_currents is not None:
            record_currents[t].copy_(r)
        step(t)
        previous = spikes[t]
    refuse_flagged(flags, x, init.unbind(0), otherwise=RECURRENT_NON_FINITE)
    if model.handoff:
        ops.handoff(model, surrogate, cur, par)
    return spikes, cur


class RecurrentFn(torch.autograd.Function):
    """``(spikes [T, B, H], *final states [B, H])`` of ``model`` on ``x`` ``[T, B, H]`` (the compute dtype); the
    recurrent ``weight`` (``[H, H]`` or ``[H]``) and ``bias`` (``[H]`` or None); ``params`` ``[1]`` or ``[H]`` each;
    ``init`` the initial states ``[S, B, H]`` (a tensor per state); ``spikes0`` ``[B, H]`` the spikes the first
    step's current reads."""

    @staticmethod
    def forward(ctx, x, weight, bias, spikes0, model, surrogate, detach_reset, backend, memory, n_params, *tensors):
        params, init = tensors[:n_params], tensors[n_params:]
        ops = backend_module(backend)
        t_steps, batch, hidden = x.shape
        par = torch.stack([p.expand(hidden) for p in params]) if params else x.new_zeros(0, hidden)
        init_all = torch.stack([v.expand(batch, hidden) for v in init]).contiguous()
        kept = ops.kernels(model, type(surrogate), x.dtype).KEPT_STATES
        # states that take no more memory than the input are kept whatever the mode: nothing to recompute then
        potential = memory == "potential" or len(kept) + model.backward_reads_input <= 1
        hist = _empty((t_steps, len(kept), batch, hidden), x) if potential else None
        currents = _empty(x.shape, x) if potential and model.backward_reads_input else None
        with torch.no_grad():
            spikes, final = run_forward(
                ops, model, surrogate, x, weight, bias, par.contiguous(), init_all, spikes0, hist, currents
            )
        if currents is not None:
            currents += x  # the steps' inputs, which the derivatives read
        bits, _ = bitpack.pack(spikes, reuse=False)
        ctx.args = (model, surrogate, detach_reset, backend, potential, n_params, bias is not None)
        ctx.shapes = [p.shape for p in params], [v.shape for v in init]
        saved = (hist, currents) if potential else (x, None)
        ctx.save_for_backward(bits, weight, bias, spikes0, par, init_all, *(t for t in saved if t is not None))
        ctx.has_currents, ctx.t_steps = currents is not None, t_steps
        ctx.set_materialize_grads(False)
        return (spikes, *final.unbind(0))

    @staticmethod
    def backward(ctx, grad_spikes, *grad_final):
        model, surrogate, detach_reset, backend, potential, n_params, has_bias = ctx.args
        refuse_double_backward(
            f"the recurrent {model.name} layer ({backend!r} backend)",
            "use backend='reference', which runs plain PyTorch ops",
        )
        ops = backend_module(backend)
        bits, weight, bias, spikes0, par, init_all, *rest = saved_tensors(ctx, f"the recurrent {model.name} layer")
        t_steps = ctx.t_steps
        batch, hidden = spikes0.shape
        shape = (t_steps, batch, hidden)
        dtype, device = spikes0.dtype, spikes0.device
        spikes = bitpack.unpack(bits, shape, dtype)
        previous = torch.cat([spikes0[None], spikes[:-1]])  # each step's current reads these
        if potential:
            hist = rest[0]
            xin = rest[1] if ctx.has_currents else None
        else:
            x = rest[0]
            kept = ops.kernels(model, type(surrogate), dtype).KEPT_STATES
            currents = _empty(shape, spikes0)
            r = torch.empty_like(spikes0)  # fresh: aligned, as the forward's (see ALIGNMENT)
            for t in range(t_steps):
                currents[t].copy_(current(previous[t], weight, bias, out=r))
            hist = _empty((t_steps, len(kept), batch, hidden), spikes0)
            ops.replay(model, surrogate, x, currents, init_all.clone(), _empty(shape, spikes0), hist, par)
            xin = x + currents if model.backward_reads_input else None
        gy = grad_spikes.contiguous() if grad_spikes is not None else torch.zeros(shape, dtype=dtype, device=device)
        gS = torch.stack(
            [
                torch.zeros(batch, hidden, dtype=dtype, device=device)
                if g is None
                else g.to(dtype).expand(batch, hidden)
                for g in grad_final
            ]
        ).contiguous()
        gs = torch.zeros(batch, hidden, dtype=dtype, device=device)
        grec = torch.zeros_like(gs)
        need = [bool(n) for n in ctx.needs_input_grad[10 : 10 + n_params]]
        acc = torch.zeros(len(need) if any(need) else 1, batch, hidden, dtype=dtype, device=device)
        G = _empty(shape, spikes0)
        if model.handoff:
            ops.handoff_grad(model, surrogate, detach_reset, need, gS, gs, hist, par, acc)
        step = ops.bind_backward(
            model,
            surrogate,
            detach_reset,
            need,
            gy,
            grec,
            G,
            gS,
            gs,
            hist,
            init_all,
            G if xin is None else xin,
            par,
            acc,
        )
        for t in range(t_steps - 1, -1, -1):
            step(t)
            current_backward(G[t], weight, out=grec)
        ginit = torch.empty_like(gS)
        ops.initial(model, surrogate, need, gS, gs, ginit, init_all, par, acc)

        flat_g = G.reshape(-1, hidden)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            if weight.dim() == 2:
                grad_weight = flat_g.t() @ previous.reshape(-1, hidden)
            else:
                grad_weight = (flat_g * previous.reshape(-1, hidden)).sum(0)
        if has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_g.sum(0)
        param_shapes, init_shapes = ctx.shapes
        grad_params = [
            None if not need[i] else acc[i].sum().reshape(s) if s.numel() == 1 else acc[i].sum(0)
            for i, s in enumerate(param_shapes)
        ]
        need_init = ctx.needs_input_grad[10 + n_params :]
        grad_init = [
            None if not need_init[i] else ginit[i] if s == ginit[i].shape else ginit[i].sum().reshape(s)
            for i, s in enumerate(init_shapes)
        ]
        grad_spikes0 = grec.clone() if ctx.needs_input_grad[3] else None
        return (G, grad_weight, grad_bias, grad_spikes0, None, None, None, None, None, None, *grad_params, *grad_init)
