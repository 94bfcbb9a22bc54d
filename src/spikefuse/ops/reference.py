"""The oracle: a serial PyTorch loop over time steps, differentiated by autograd through ordinary ops.

Every fused backend is tested against this file. It follows the formulas of :mod:`spikefuse.params` literally,
in the same floating-point order, and knows nothing about how the kernels derive their backward pass.

Entry points shared by every backend (``x2`` is the input viewed as ``[T, N]``, ``leak`` has shape ``[C]`` and
neuron ``n`` uses ``leak[(n // inner) % C]``; ``v_init`` and ``grad_state`` are ``[N]`` in the compute dtype, or
``[1]``: one value shared by every neuron, as for the default initial state and an unused final state, which spares
a fused kernel reading ``N`` values; a shared ``v_init`` gets no gradient):

- ``forward(x2, leak, inner, v_init, spec_args, save) -> (spikes, state, saved)``
- ``backward(grad_spikes, grad_state, x2, leak, inner, v_init, saved, spec_args, save, need_leak_grad)
  -> (grad_x, grad_v_init, grad_leak)`` with ``grad_leak`` of shape ``[C]`` (None unless ``need_leak_grad``) and
  ``grad_v_init`` None for a shared ``v_init``
"""

from __future__ import annotations

import torch

from .. import params as P
from ..surrogate import Surrogate
from .common import SpecArgs, compute_dtype, surrogate_from_args


class _Fire(torch.autograd.Function):
    """Heaviside of ``u = h - threshold`` forward, the surrogate derivative backward. Written in torch ops with a
    separate ``setup_context`` so that torch.func (grad, vmap, jacrev) can transform the reference backend."""

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


def fire(h: torch.Tensor, spec: SpecArgs, surrogate: Surrogate) -> torch.Tensor:
    return _Fire.apply(h - spec.threshold, surrogate, bool(spec.fire_strict))


def post_reset(h: torch.Tensor, s: torch.Tensor, spec: SpecArgs) -> torch.Tensor:
    """SpikingJelly's reset: ``s*v_reset + (1-s)*h`` (hard) or ``h - s*threshold`` (soft)."""
    if spec.reset == P.HARD:
        return s * spec.v_reset + (1 - s) * h
    if spec.reset == P.SOFT:
        return h - s * spec.threshold
    return h


def step(h: torch.Tensor, s: torch.Tensor, x: torch.Tensor, k: torch.Tensor, spec: SpecArgs) -> torch.Tensor:
    """One step of the recursion ``h[t] = step(h[t-1], s[t-1], x[t])`` (see :mod:`spikefuse.params`)."""
    if spec.detach_reset:
        s = s.detach()
    if spec.dynamics == P.PAPER:
        if spec.reset == P.HARD:
            return k * h * (1 - s) + spec.v_reset * s + x
        if spec.reset == P.SOFT:
            return k * (h - spec.threshold * s) + x
        return k * h + x
    if spec.dynamics == P.SNNTORCH:
        if spec.reset == P.SOFT:
            return (k * h + x) - s * spec.threshold
        if spec.reset == P.HARD:
            return k * ((1 - s) * h) + x
        return k * h + x
    u = post_reset(h, s, spec)
    r = spec.v_reset
    if spec.charge == P.CHARGE_IF:
        return u + x
    if spec.charge == P.CHARGE_DIV_INPUT:
        return u + (x - (u - r)) / k
    if spec.charge == P.CHARGE_DIV:
        return u - (u - r) / k + x
    if spec.charge == P.CHARGE_MUL_INPUT:
        return u + (x - (u - r)) * k
    return u - (u - r) * k + x


def run(x2: torch.Tensor, leak: torch.Tensor, inner: int, v_init: torch.Tensor, spec_args: tuple,
        surrogate: Surrogate | None = None):
    """Differentiable serial loop. Returns ``(spikes [T, N] in x2.dtype, state [N], h [T, N])``. ``surrogate``: the
    spec's own object (any :class:`Surrogate`, also one of the user's), else rebuilt from the surrogate code and
    parameters in ``spec_args``."""
    spec = SpecArgs(*spec_args)
    surrogate = surrogate or surrogate_from_args(spec)
    cdt = compute_dtype(x2.dtype)
    n = x2.shape[1]
    channels = leak.numel()
    groups = n // (channels * inner) if channels else 0  # no channels: no neurons (n = 0)
    k = leak.to(cdt).reshape(1, channels, 1).expand(groups, channels, inner).reshape(n)
    h = v_init.to(cdt).expand(n)
    if spec.state_post_reset:
        s = torch.zeros_like(h)
    else:
        s = fire(h, spec, surrogate)
    spikes, potentials = [], []
    for x_t in x2.unbind(0):  # unbind, not x2[t]: indexing makes autograd's backward quadratic in T
        h = step(h, s, x_t.to(cdt), k, spec)
        s = fire(h, spec, surrogate)
        spikes.append(s.to(x2.dtype))
        potentials.append(h)
    state = post_reset(h, s.detach() if spec.detach_reset else s, spec) if spec.state_post_reset else h
    return torch.stack(spikes), state, torch.stack(potentials)


def forward(x2, leak, inner, v_init, spec_args, save, *, surrogate=None):
    with torch.no_grad():
        spikes, state, _ = run(x2, leak, inner, v_init, spec_args, surrogate)
    return spikes, state, None


def backward(grad_spikes, grad_state, x2, leak, inner, v_init, saved, spec_args, save, need_leak_grad, *,
             overwrite_saved=False, overwrite_x=False, surrogate=None):
    """Recompute the loop with autograd and differentiate it (the reference has no hand-written backward).

    ``overwrite_saved`` / ``overwrite_x`` allow writing grad_x over ``saved`` / ``x``; autograd gives the reference
    fresh tensors, so it overwrites nothing (the arguments keep the backends' entry points alike)."""
    n = grad_spikes.shape[1]
    with torch.enable_grad():
        x2 = x2.detach().requires_grad_(True)
        v_init = v_init.detach().requires_grad_(True)
        k = leak.detach().requires_grad_(need_leak_grad)
        spikes, state, _ = run(x2, k, inner, v_init, spec_args, surrogate)
        inputs = [x2, v_init] + ([k] if need_leak_grad else [])
        grads = torch.autograd.grad(
            (spikes, state), inputs, (grad_spikes.to(spikes.dtype), grad_state.expand(n)), allow_unused=True
        )
    grad_x = grads[0] if grads[0] is not None else torch.zeros_like(x2)
    grad_v = None
    if v_init.numel() == n:  # a shared v_init gets no gradient
        grad_v = grads[1] if grads[1] is not None else torch.zeros_like(v_init)
    grad_leak = None
    if need_leak_grad:  # an IF charge does not use the leak: its gradient is zero, not missing
        grad_leak = grads[2] if grads[2] is not None else torch.zeros_like(leak)
    return grad_x, grad_v, grad_leak
