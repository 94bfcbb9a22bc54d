"""``spikefuse.recurrent``: a recurrent layer of any :class:`~spikefuse.neurons.NeuronModel` over all T steps in one
autograd operation. Exported as :func:`spikefuse.recurrent`; the backends are :mod:`spikefuse.ops.recurrent`."""

from __future__ import annotations

import weakref

import torch

from .neurons import NeuronModel, neuron_spec
from .ops.nonfinite import check_inputs_finite
from .ops.numerics import compute_dtype
from .ops.engine import reference as engine_reference
from .ops.spike_layers import cpu as sparse_cpu
from .ops import recurrent as recurrent_ops
from .ops.recurrent import (
    SparseCurrent,
    SparseGradCurrent,
    current,
    last_spike_rate,
    record_spike_rate,
    use_sparse_grad,
)
from .ops.recurrent.autograd import NOT_BINARY, RECURRENT_NON_FINITE, binary, recurrent_layer
from .surrogate import DEFAULT as DEFAULT_SURROGATE, Active, Surrogate
from .validation import check_input, check_memory_mode, resolve_neuron

__all__ = ["recurrent"]


class _CountedGrad(torch.autograd.Function):
    """The identity, whose backward counts the nonzero gradients into ``holder`` as
    :class:`~spikefuse.ops.recurrent.SparseGradCurrent` does (``sparse_grad="auto"`` on the reference backend taking
    the dense backward: the gradient passes unchanged)."""

    @staticmethod
    def forward(ctx, t, holder):
        ctx.holder = holder
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        SparseGradCurrent.count(ctx.holder, grad)
        return grad, None


def _check_weights(x: torch.Tensor, weight, bias, name: str) -> None:
    hidden = x.shape[2]
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"{name}: weight must be a floating-point tensor, [H, H] (all to all) or [H] (one to one)")
    if weight.shape not in ((hidden, hidden), (hidden,)):
        raise ValueError(
            f"{name}: weight must be [H, H] (all to all) or [H] (one to one) for H = x.shape[2] = "
            f"{hidden}, got {tuple(weight.shape)}"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (hidden,)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{name}: bias must be None or a tensor of shape [H] = [{hidden}], got {got}")
    for what, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: {what} is on {t.device} but x is on {x.device}")


def _sparse_unavailable(x: torch.Tensor, weight: torch.Tensor, spikes0, backend: str) -> str | None:
    """Why the sparse recurrent product cannot run here, or None where it can."""
    if weight.dim() != 2:
        return "the weight is one to one (an elementwise current: nothing to skip)"
    if x.device.type != "cpu":
        return f"x is on {x.device}"
    if backend not in ("cpu", "reference"):
        return f"the backend is {backend!r}"
    if compute_dtype(x.dtype) not in sparse_cpu.SUPPORTED_DTYPES:
        return f"x is {x.dtype}"
    # (while torch.compile traces, the values are not there: the op checks them, spikefuse.ops.recurrent.autograd)
    if spikes0 is not None and not torch.compiler.is_compiling() and not binary(spikes0):
        return NOT_BINARY
    return None


def _check_sparse(sparse, x: torch.Tensor, weight: torch.Tensor, spikes0, backend: str, name: str):
    """``(sparse product, auto)``: whether this call takes the sparse product, and whether it counts its spike rate
    for the next (``"auto"`` where the sparse product can run, eagerly). ``True`` refuses, naming why, where it cannot
    run; ``"auto"`` takes it where it can and the weight's last spike rate
    (:func:`spikefuse.ops.recurrent.last_spike_rate`) is below :data:`~spikefuse.ops.recurrent.CROSSOVER_RECURRENT`."""
    if not (isinstance(sparse, bool) or sparse == "auto"):
        raise ValueError(f"{name}: sparse must be True, False or 'auto', got {sparse!r}")
    if sparse is False:
        return False, False
    why = _sparse_unavailable(x, weight, spikes0, backend)
    if sparse == "auto":
        if torch.compiler.is_compiling() or why is not None:
            return False, False
        rate = last_spike_rate(weight)
        return rate is not None and rate < recurrent_ops.CROSSOVER_RECURRENT, True
    if why is not None:
        raise ValueError(
            f"{name}: sparse=True runs on the CPU backend (or the reference), for an all-to-all weight, in float32 or "
            f"float64, from binary spikes; {why}. Use sparse='auto' (the dense product wherever the sparse one cannot "
            "run) or sparse=False"
        )
    return True, False


def _check_sparse_grad(sparse_grad, x: torch.Tensor, weight: torch.Tensor, backend: str, name: str):
    """``(sparse backward, auto)``: whether this call's backward reads ``G`` by its nonzero entries, and whether it
    counts their share for the next call (``"auto"`` where the sparse backward can run, eagerly, with a backward to
    run). ``True`` refuses, naming why, where it cannot run; ``"auto"`` takes it where it can and the weight's last
    share (:func:`spikefuse.ops.recurrent.last_grad_rate`) is below the recurrent layer's crossover
    (:func:`spikefuse.ops.recurrent.use_sparse_grad`)."""
    if not (isinstance(sparse_grad, bool) or sparse_grad == "auto"):
        raise ValueError(f"{name}: sparse_grad must be True, False or 'auto', got {sparse_grad!r}")
    if sparse_grad is False or not torch.is_grad_enabled():
        return False, False
    why = None
    if weight.dim() != 2:
        why = "the weight is one to one (an elementwise product: nothing to skip)"
    elif backend == "triton":
        why = (
            "the triton backend has no kernel that reads the gradient sparsely (its backward runs the dense products "
            "on the GPU); run the layer with backend='cpu' on CPU tensors for sparse gradients"
        )
    elif x.device.type != "cpu":
        why = f"x is on {x.device}"
    elif backend not in ("cpu", "reference"):
        why = f"the backend is {backend!r}"
    elif compute_dtype(x.dtype) not in sparse_cpu.SUPPORTED_DTYPES:
        why = f"x is {x.dtype}"
    if sparse_grad == "auto":
        if torch.compiler.is_compiling() or why is not None:
            return False, False
        return use_sparse_grad(weight, x.shape[0] * x.shape[1]), True
    if why is not None:
        raise ValueError(
            f"{name}: sparse_grad=True runs on the CPU backend (or the reference), for an all-to-all weight, in "
            f"float32 or float64; {why}. Use sparse_grad='auto' (the dense backward wherever the sparse one cannot "
            "run) or sparse_grad=False"
        )
    return True, False


def _split_state(model: NeuronModel, state, x: torch.Tensor):
    """``(neuron states or None, spikes or None)`` of a recurrent layer's ``state``: the model's states then the
    last spikes, as a tuple, or a dict with the states' names and ``"spikes"``."""
    if state is None:
        return None, None
    names = (*model.states, "spikes")
    if isinstance(state, dict):
        if set(state) != set(names):
            raise ValueError(f"recurrent {model.name}: state must hold exactly {', '.join(names)}, got {sorted(state)}")
        state = [state[k] for k in names]
    if not isinstance(state, (tuple, list)) or len(state) != len(names):
        raise ValueError(
            f"recurrent {model.name}: state must be a tuple of {len(names)} tensors ({', '.join(names)}) "
            f"or a dict, got {type(state).__name__}" + (f" of {len(state)}" if isinstance(state, (tuple, list)) else "")
        )
    spikes = state[-1]
    if not isinstance(spikes, torch.Tensor) or spikes.shape != x.shape[1:] or spikes.device != x.device:
        got = f"{tuple(spikes.shape)} on {spikes.device}" if isinstance(spikes, torch.Tensor) else type(spikes).__name__
        raise ValueError(
            f"recurrent {model.name}: state spikes must be a tensor of shape {tuple(x.shape[1:])} "
            f"(x.shape[1:]) on {x.device}, got {got}"
        )
    return tuple(state[:-1]), spikes


def recurrent(
    x: torch.Tensor,
    model: NeuronModel,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    surrogate: Surrogate | str = DEFAULT_SURROGATE,
    detach_reset: bool = False,
    state=None,
    return_state: bool = False,
    backend: str = "auto",
    memory: str = "potential",
    sparse: bool | str = False,
    sparse_grad: bool | str = False,
    **params,
):
    """A recurrent layer of ``model``'s neurons over ``x`` ``[T, B, H]`` (the input current of each step): the
    neurons' input at step t is ``x[t]`` plus the recurrent current of the previous step's spikes,
    ``s[t-1] @ weight.T + bias`` for an all-to-all ``weight`` ``[H, H]`` (an ``nn.Linear``'s), ``weight * s[t-1] +
    bias`` for a one-to-one ``weight`` ``[H]``; the current joins the step's input as
    :attr:`~spikefuse.neurons.NeuronModel.recurrent_step` says. Returns the spikes ``[T, B, H]`` (x's dtype) and,
    with ``return_state=True``, the state after the last step: the model's states and the last spikes, each
    ``[B, H]``, which continue the sequence exactly when passed back as ``state`` (a tuple in that order, or a dict
    with the states' names and ``"spikes"``). ``state=None``: the model's initial values, and the spikes of the
    first step's reset (none, usually).

    ``weight``, ``bias`` and tensor parameters may require grad; all T steps forward and backward are one autograd
    operation, the weight's gradient one matrix product over all steps. ``params``, ``surrogate``, ``detach_reset``
    (no gradient through the reset; the recurrent current's gradient always flows), ``backend`` as
    :func:`spikefuse.neuron`. ``memory``: "potential" (the default, as :func:`spikefuse.lif`: every step's states
    the backward reads are kept instead of the input) or "recompute" (kept for backward: the input and the spikes as
    bits; the backward computes every step's current and states again; where the backward reads one state only, as
    LIF's membrane, that state is kept instead, the same memory and no recomputation). A float16 / bfloat16 ``x`` runs in float32.

    ``sparse=True`` (CPU, all-to-all weight, float32 / float64): each step's recurrent current adds only the weights
    of the neurons that spiked at the previous step, inside the neuron's step kernel, from the bits the kernel writes
    as it makes the spikes, and the weight's gradient reads the same bits; sums from zero in increasing neuron index,
    then the bias (:class:`~spikefuse.ops.recurrent.SparseCurrent`, the reference backend's current then, gives the
    same bits). Against the dense product the currents agree to rounding, so the spikes are the same except where a
    membrane lands on the threshold within that rounding. The initial spikes of ``state`` must be 0 or 1.
    ``sparse="auto"``: the sparse layer where it can run and the previous call with the same ``weight`` tensor (the
    same object: a module's parameter) counted a spike rate below
    :data:`spikefuse.ops.recurrent.CROSSOVER_RECURRENT` in the bits its kernels wrote; the dense one otherwise (the
    first call, above the crossover, where ``True`` would be refused, under ``torch.compile``). Either way the call
    is that of ``sparse=True`` or ``False``, bit for bit, and it counts its own rate for the next.

    ``sparse_grad=True`` (CPU or reference backend, all-to-all weight, float32 / float64): the backward reads only the
    nonzero entries of ``G``, the gradient of every step's input current (mostly zero behind a surrogate of compact
    support, :class:`~spikefuse.surrogate.Rectangle`, :class:`~spikefuse.surrogate.Triangle` or a
    :class:`~spikefuse.surrogate.Windowed` one, where the leak does not carry it back over many steps): each step's
    ``G[t] @ weight`` sums the weight rows of ``G[t]``'s nonzero entries in increasing index, and the weight's gradient
    over all steps reads ``G``'s nonzero entries (with ``sparse=True``, the spikes' bits as before). The gradients
    agree with the dense backward's to rounding. ``sparse_grad="auto"``: the sparse backward where it can run and
    the previous backward with the same ``weight`` tensor had a share of nonzero ``G`` below
    ``spikefuse.ops.recurrent.CROSSOVER_GRAD_RECURRENT`` (from ``CROSSOVER_ROWS`` rows ``T*B`` on), the dense one otherwise
    (the first call, the Triton backend, under ``torch.compile``); either way that of ``True`` or ``False``. ``True``
    refuses, naming why, where it cannot run (the Triton backend included).

    ``surrogate=Active(surrogate, width)`` (:class:`~spikefuse.surrogate.Active`, backends ``cpu`` and
    ``reference``; the Triton backend refuses it): Perez-Nieves & Goodman's sparse gradient, an approximation: the
    gradients of a neuron's states after a step are zero wherever the step's fire value is farther than ``width``
    from 0, so the leak carries no gradient back past an inactive step and ``G`` is as sparse as the activity near
    the threshold (with ``sparse_grad``, the backward skips the rest). The forward is unchanged."""
    check_input(x)
    check_memory_mode(memory)
    if x.ndim != 3:
        raise ValueError(f"recurrent {getattr(model, 'name', model)}: x must be [T, B, H], got shape {tuple(x.shape)}")
    _check_weights(x, weight, bias, f"recurrent {getattr(model, 'name', model)}")
    states, spikes0 = _split_state(model, state, x) if isinstance(model, NeuronModel) else (None, None)
    concrete, surrogate, tensors, inner, init = resolve_neuron(x, model, surrogate, states, backend, params)
    if isinstance(surrogate, Active) and concrete == "triton":
        raise ValueError(
            f"recurrent {model.name}: the triton backend does not implement {surrogate!r} (Perez-Nieves & Goodman's "
            "sparse gradient, spikefuse.surrogate.Active): run the layer with backend='cpu' on CPU tensors (or "
            "backend='reference')"
        )
    user_weight = weight  # sparse="auto" keeps this tensor's spike rate
    sparse, auto = _check_sparse(sparse, x, weight, spikes0, concrete, f"recurrent {model.name}")
    sparse_grad, grad_auto = _check_sparse_grad(sparse_grad, x, weight, concrete, f"recurrent {model.name}")
    t_steps, batch, hidden = x.shape
    cdt = compute_dtype(x.dtype)
    xc, weight, bias = x.to(cdt).contiguous(), weight.to(cdt), None if bias is None else bias.to(cdt)
    if spikes0 is not None:
        spikes0 = spikes0.to(cdt).contiguous()
    if concrete == "reference":
        if spikes0 is None:
            spikes0 = engine_reference.initial_spike(model, tensors, inner, init, batch * hidden).reshape(batch, hidden)
        check_inputs_finite(
            xc.reshape(t_steps, -1),
            init,
            [t for t in (weight, bias, spikes0) if t is not None],
            otherwise=RECURRENT_NON_FINITE,
        )
        if sparse_grad or grad_auto:
            holder = [weakref.ref(user_weight), 0, 0, t_steps] if grad_auto else None
            if sparse_grad:
                product = lambda s, w, b: SparseGradCurrent.apply(s, w, b, sparse, holder)  # noqa: E731
            else:  # "auto" taking the dense backward: the same call as sparse_grad=False, counting G for the next
                product = lambda s, w, b: _CountedGrad.apply(  # noqa: E731
                    SparseCurrent.apply(s, w, b) if sparse else current(s, w, b), holder
                )
        else:
            product = SparseCurrent.apply if sparse else current
        flat = lambda s: product(s.reshape(batch, hidden), weight, bias).reshape(-1)  # noqa: E731
        spikes, final = engine_reference.run(
            model,
            xc.reshape(t_steps, -1),
            tensors,
            inner,
            init,
            surrogate,
            bool(detach_reset),
            recurrent=(flat, spikes0.reshape(-1)),
        )
        spikes = spikes.reshape(x.shape)
        final = [v.reshape(batch, hidden) for v in final]
        if auto:
            record_spike_rate(user_weight, int(torch.count_nonzero(spikes)) / max(1, spikes.numel()))
    else:
        init = [v.reshape(batch, hidden) if v.numel() > 1 else v for v in init]
        outputs = recurrent_layer(
            xc,
            weight.contiguous(),
            bias,
            spikes0,
            tensors,
            init,
            neuron_spec(model, surrogate, detach_reset, backend=backend, memory=memory),
            concrete,
            sparse,
            count_spikes=auto,
            sparse_grad=sparse_grad,
            grad_rate_of=user_weight if grad_auto else None,
        )
        if auto:
            outputs, count = outputs
            record_spike_rate(user_weight, count / max(1, x.numel()))
        spikes, *final = outputs
    spikes = spikes.to(x.dtype)
    if not return_state:
        return spikes
    return spikes, (*final, spikes[-1])
