"""The oracle of a :class:`~spikefuse.neurons.NeuronModel`: its step, evaluated as written on PyTorch tensors, in a
serial loop over time, differentiated by autograd (the spike through :class:`_Fire`, the surrogate derivative's
Function). :func:`run` is what ``backend="reference"`` runs: plain ops, so double backward and torch.func transforms
(grad, vmap, jacrev) work through it.

Entry points shared by the engine's backends, each taking the neuron with its settings (``neuron``, a
:class:`~spikefuse.neurons.NeuronSpec`: the model, surrogate and ``detach_reset`` are read from it) and one call's
tensors (``inputs``, a :class:`~spikefuse.ops.engine.NeuronInputs`: ``x`` the input viewed as ``[T, N]`` in the
compute dtype, or in float16 / bfloat16 for a backend with ``READS_HALF``, then also ``grad_spikes``; ``params``
one tensor per parameter of ``[1]`` or ``[C]`` values, neuron ``n`` using index ``(n // inner) % C``; ``init`` one
tensor per state of ``[N]``, or ``[1]``: one value shared by every neuron, which gets no gradient):

- ``forward(neuron, inputs, *, save=False, spike_dtype=None) -> (spikes [T, N], final states [N] each, saved)``:
  ``save`` (memory="potential") asks for every step's states, ``[T, N]`` each (``saved``, empty without ``save``),
  for backward to read instead of recomputing them (this backend's backward recomputes anyway); ``spike_dtype``:
  the spikes' dtype (default x's: a half-precision input's);
- ``backward(neuron, inputs, grad_spikes, grad_final, need_param_grads, *, saved=(), overwrite_saved=False,
  overwrite_x=False) -> (grad_x, grad_init per state (None for a shared one), grad_params per parameter (None where
  not needed))``; ``overwrite_saved``: the caller will not read ``saved`` again (a backend may write grad_x over
  it); ``overwrite_x``: likewise for ``x`` (a transient of the caller's) when nothing is saved.
"""

from __future__ import annotations

import functools

import torch

from ...neurons.model import HEAVISIDE, RECURRENT_INPUT, WHERE
from ...surrogate import Active, Surrogate
from ..nonfinite import check_inputs_finite

#: Whether ``forward`` and ``backward`` take half-precision streams as they are (see :mod:`spikefuse.ops.engine`).
READS_HALF = False


class _Fire(torch.autograd.Function):
    """Heaviside of ``u`` (``u > 0`` for a strict model, else ``u >= 0``) forward, the surrogate derivative
    backward, in torch ops with a separate ``setup_context`` so that torch.func can transform it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(u: torch.Tensor, surrogate: Surrogate, strict: bool):
        return (u > 0 if strict else u >= 0).to(u.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        u, surrogate, _ = inputs
        ctx.save_for_backward(u)
        ctx.surrogate = surrogate

    @staticmethod
    def backward(ctx, grad):
        (u,) = ctx.saved_tensors
        return grad * ctx.surrogate.derivative(u), None, None


class _Where(torch.autograd.Function):
    """``where(s, a, b)`` of a step: ``a`` where the spike ``s`` is 1, else ``b``, selected exactly; differentiated
    as ``s*a + (1-s)*b`` (what the kernels' derivatives are)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(s, a, b):
        return torch.where(s != 0, a, b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        s, a, b = ctx.saved_tensors
        return g * (a - b), g * s, g * (1 - s)


class _Masked(torch.autograd.Function):
    """The identity forward; backward, the gradient where ``keep``, else 0 (:class:`~spikefuse.surrogate.Active`:
    the states' gradients of the neurons inactive at a step)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(v, keep):
        return v.view_as(v)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, g, torch.zeros((), dtype=g.dtype, device=g.device)), None


def _where(s, a, b):
    a, b = (v if isinstance(v, torch.Tensor) else s.new_tensor(float(v)) for v in (a, b))
    return _Where.apply(s, a, b)


def _heaviside(a):
    return (a > 0).to(a.dtype)  # a comparison: no gradient


_TORCH_FUNCTIONS = {"exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, WHERE: _where, HEAVISIDE: _heaviside}


@functools.lru_cache(maxsize=None)
def _compiled(expression: str):
    return compile(expression, "<neuron expression>", "eval")


def per_neuron(t: torch.Tensor, n: int, inner: int) -> torch.Tensor:
    """``[1]`` or ``[C]`` values -> ``[N]`` (neuron ``n`` gets ``t[(n // inner) % C]``)."""
    c = t.numel()
    if c == 1:
        return t.expand(n)
    if n == 0:  # a layer of no neurons (and maybe no channels)
        return t[:0]
    return t.reshape(1, c, 1).expand(n // (c * inner), c, inner).reshape(n)


def initial_spike(model, params, inner, init, n: int) -> torch.Tensor:
    """The spike ``[N]`` the first step's reset sees: that of the initial states, none with a handoff."""
    if model.handoff:
        return init[0].new_zeros(n)
    env = {name: per_neuron(p, n, inner) for name, p in zip(model.params, params)}
    env.update({name: v.expand(n) for name, v in zip(model.states, init)})
    u = eval(_compiled(model.fire), {"__builtins__": {}}, {**_TORCH_FUNCTIONS, **env})
    return ((u > 0) if model.strict else (u >= 0)).to(init[0].dtype)


def run(
    model,
    x2,
    params,
    inner,
    init,
    surrogate: Surrogate,
    detach_reset: bool,
    history: list | None = None,
    recurrent=None,
):
    """Differentiable serial loop: ``(spikes [T, N], [final state [N] per state])``; appends each step's states to
    ``history`` when given. ``recurrent``: ``(current, spikes)`` for a recurrent layer: each step runs
    :attr:`~spikefuse.neurons.NeuronModel.recurrent_step` with ``x_rec = current(previous spikes)`` (``[N]`` to
    ``[N]``), the previous spikes of the first step being ``spikes``; the reset's spike ``s`` stays the model's."""
    n = x2.shape[1]
    env_params = {name: per_neuron(p, n, inner) for name, p in zip(model.params, params)}
    states = {name: v.expand(n) for name, v in zip(model.states, init)}

    def fire(states):
        u = eval(_compiled(model.fire), {"__builtins__": {}}, {**_TORCH_FUNCTIONS, **env_params, **states})
        return _Fire.apply(u, surrogate, model.strict)

    def masked(states) -> dict:
        """``states`` (a step's new ones), their gradients zero where the neuron is not active (Active only)."""
        with torch.no_grad():
            u = eval(_compiled(model.fire), {"__builtins__": {}}, {**_TORCH_FUNCTIONS, **env_params, **states})
            keep = surrogate.active(u).expand(n)
        return {name: _Masked.apply(v, keep) for name, v in states.items()}

    active = isinstance(surrogate, Active)

    def assign(assignments, env) -> dict:
        """Run ``assignments`` (a step or the handoff) in ``env``; the states after them."""
        for target, expression in assignments:
            value = eval(_compiled(expression), {"__builtins__": {}}, env)
            env[target] = value if isinstance(value, torch.Tensor) else x2.new_full((n,), value)  # a constant
        return {name: env[name] for name in model.states}

    s = x2.new_zeros(n) if model.handoff else fire(states)  # post-reset initial states: no spike
    step, (current, fed_back) = (model.step, (None, None)) if recurrent is None else (model.recurrent_step, recurrent)
    spikes = []
    for x_t in x2.unbind(0):  # unbind, not x2[t]: indexing makes autograd's backward quadratic in T
        env = {**_TORCH_FUNCTIONS, **env_params, **states, "x": x_t, "s": s.detach() if detach_reset else s}
        if current is not None:
            env[RECURRENT_INPUT] = current(fed_back)
        states = assign(step, env)
        if active:
            states = masked(states)
        if history is not None:
            history.append([states[name] for name in model.states])
        s = fire(states)
        spikes.append(s)
        fed_back = s
    if model.handoff:  # the states handed out: after the last step's reset
        states = assign(
            model.handoff, {**_TORCH_FUNCTIONS, **env_params, **states, "s": s.detach() if detach_reset else s}
        )
    return torch.stack(spikes), [states[name] for name in model.states]


def forward(neuron, inputs, *, save=False, spike_dtype=None):
    model, (x2, params, init, inner) = neuron.model, inputs
    check_inputs_finite(x2, init)
    history = [] if save else None
    with torch.no_grad():
        spikes, final = run(model, x2, params, inner, init, neuron.surrogate, neuron.detach_reset, history)
    spikes = spikes.to(spike_dtype or x2.dtype)
    if not save:
        return spikes, final, []
    n = x2.shape[1]
    return spikes, final, [torch.stack([step[i].expand(n) for step in history]) for i in range(len(model.states))]


def backward(
    neuron, inputs, grad_spikes, grad_final, need_param_grads, *, saved=(), overwrite_saved=False, overwrite_x=False
):
    x2, params, init, inner = inputs
    n = x2.shape[1]
    with torch.enable_grad():
        x2 = x2.detach().requires_grad_(True)
        init = [v.detach().requires_grad_(v.numel() == n) for v in init]
        params = [p.detach().requires_grad_(bool(need)) for p, need in zip(params, need_param_grads)]
        spikes, final = run(neuron.model, x2, params, inner, init, neuron.surrogate, neuron.detach_reset)
        leaves = [x2] + [v for v in init if v.requires_grad] + [p for p in params if p.requires_grad]
        # a final state may not depend on any leaf (ALIF's adaptation with detach_reset from a shared initial value)
        outputs = [
            (v, g)
            for v, g in zip((spikes, *final), (grad_spikes, *(g.expand(n) for g in grad_final)))
            if v.requires_grad
        ]
        grads = torch.autograd.grad([v for v, _ in outputs], leaves, [g for _, g in outputs], allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]
    grad_x, rest = grads[0], iter(grads[1:])
    grad_init = [next(rest) if v.requires_grad else None for v in init]
    grad_params = [next(rest) if p.requires_grad else None for p in params]
    return grad_x, grad_init, grad_params
