"""The LIF spec and its serial loop: the formulas the LIF definitions of :mod:`spikefuse.neurons.lif` were written
from, kept as an independent oracle of them (``tests/neurons/test_lif_definitions.py`` proves the definitions
bit-identical to this loop; ``tests/ops/test_cpu.py`` tests the fused kernels of every LIF form against it).

Every form is one pre-reset recursion over time: ``h[t]`` is the membrane compared with the threshold at step ``t``,
``s[t] = fire(h[t] - threshold)`` its spike, and ``h[t] = step(h[t-1], s[t-1], x[t])``, each written with its exact
order of floating-point operations (``k`` is the leak, scalar or per channel)::

    PAPER (temporal-fusion paper, Eq. (1); leaks toward 0, resets to v_reset)
        hard:  h = k*h*(1 - s) + v_reset*s + x        soft:  h = k*(h - threshold*s) + x        none:  h = k*h + x
    SNNTORCH (snnTorch Leaky; fires on >)
        subtract:  h = (k*h + x) - s*threshold         zero:  h = k*((1 - s)*h) + x             none:  h = k*h + x
    SPIKINGJELLY (the state is the post-reset u; r = v_reset)
        u = s*v_reset + (1 - s)*h (hard) or h - s*threshold (soft), then by charge:
        IF: h = u + x    DIV_INPUT: h = u + (x - (u - r))/k    DIV: h = u - (u - r)/k + x
        MUL_INPUT: h = u + (x - (u - r))*k    MUL: h = u - (u - r)*k + x
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from spikefuse.functional import run_lif
from spikefuse.neurons import LIF_MODELS, SPIKINGJELLY_MODELS, SPIKINGJELLY_PRE_RESET_MODELS
from spikefuse.neurons.lif import lif_spec
from spikefuse.neurons.spec import NeuronSpec
from spikefuse.ops.numerics import compute_dtype
from spikefuse.ops.engine.reference import _Fire
from spikefuse.surrogate import Sigmoid, Surrogate
from spikefuse.validation import channel_layout

PAPER, SNNTORCH, SPIKINGJELLY = "paper", "snntorch", "spikingjelly"
HARD, SOFT, NONE = "hard", "soft", "none"
CHARGE_MUL, CHARGE_IF, CHARGE_DIV_INPUT, CHARGE_DIV, CHARGE_MUL_INPUT = "mul", "if", "div_input", "div", "mul_input"


@dataclass(frozen=True)
class LIFCase:
    threshold: float = 1.0
    v_reset: float = 0.0
    reset: str = HARD
    surrogate: Surrogate = field(default_factory=Sigmoid)
    detach_reset: bool = False
    dynamics: str = PAPER
    charge: str = CHARGE_MUL
    state_post_reset: bool = False

    @property
    def fire_strict(self) -> bool:
        return self.dynamics == SNNTORCH

    def neuron(self, backend: str = "auto", memory: str = "potential") -> NeuronSpec:
        """The library's LIF definition of this spec, with its constants and settings."""
        if self.dynamics == SPIKINGJELLY:
            models = SPIKINGJELLY_MODELS if self.state_post_reset else SPIKINGJELLY_PRE_RESET_MODELS
            model = models[(self.reset, self.charge)]
        else:
            model = LIF_MODELS[(self.dynamics, self.reset)]
        return lif_spec(
            model,
            self.threshold,
            self.v_reset,
            self.reset == HARD,
            self.surrogate,
            self.detach_reset,
            backend=backend,
            memory=memory,
        )


def fire(h: torch.Tensor, spec: LIFCase) -> torch.Tensor:
    return _Fire.apply(h - spec.threshold, spec.surrogate, spec.fire_strict)


def post_reset(h: torch.Tensor, s: torch.Tensor, spec: LIFCase) -> torch.Tensor:
    if spec.reset == HARD:
        return s * spec.v_reset + (1 - s) * h
    if spec.reset == SOFT:
        return h - s * spec.threshold
    return h


def step(h: torch.Tensor, s: torch.Tensor, x: torch.Tensor, k: torch.Tensor, spec: LIFCase) -> torch.Tensor:
    """One step of ``h[t] = step(h[t-1], s[t-1], x[t])``."""
    if spec.detach_reset:
        s = s.detach()
    if spec.dynamics == PAPER:
        if spec.reset == HARD:
            return k * h * (1 - s) + spec.v_reset * s + x
        if spec.reset == SOFT:
            return k * (h - spec.threshold * s) + x
        return k * h + x
    if spec.dynamics == SNNTORCH:
        if spec.reset == SOFT:
            return (k * h + x) - s * spec.threshold
        if spec.reset == HARD:
            return k * ((1 - s) * h) + x
        return k * h + x
    u = post_reset(h, s, spec)
    r = spec.v_reset
    if spec.charge == CHARGE_IF:
        return u + x
    if spec.charge == CHARGE_DIV_INPUT:
        return u + (x - (u - r)) / k
    if spec.charge == CHARGE_DIV:
        return u - (u - r) / k + x
    if spec.charge == CHARGE_MUL_INPUT:
        return u + (x - (u - r)) * k
    return u - (u - r) * k + x


def loop(x2: torch.Tensor, leak: torch.Tensor, inner: int, v_init: torch.Tensor, spec: LIFCase):
    """Differentiable serial loop over ``x2 [T, N]`` (``leak [C]``, neuron ``n`` using ``leak[(n // inner) % C]``;
    ``v_init`` ``[N]`` or ``[1]``): ``(spikes [T, N] in x2.dtype, state [N], h [T, N])``."""
    cdt = compute_dtype(x2.dtype)
    n = x2.shape[1]
    channels = leak.numel()
    groups = n // (channels * inner) if channels else 0
    k = leak.to(cdt).reshape(1, channels, 1).expand(groups, channels, inner).reshape(n)
    h = v_init.to(cdt).expand(n)
    s = torch.zeros_like(h) if spec.state_post_reset else fire(h, spec)
    spikes, potentials = [], []
    for x_t in x2.unbind(0):
        h = step(h, s, x_t.to(cdt), k, spec)
        s = fire(h, spec)
        spikes.append(s.to(x2.dtype))
        potentials.append(h)
    state = post_reset(h, s.detach() if spec.detach_reset else s, spec) if spec.state_post_reset else h
    return torch.stack(spikes), state, torch.stack(potentials)


def run(x, leak, spec: LIFCase, *, v_init=None, backend: str = "spec", memory: str = "potential"):
    """``(spikes, state)`` of ``spec`` over ``x [T, *]``: the loop of this module for ``backend="spec"``, else the
    library's runner of the spec's LIF definition on ``backend``."""
    if backend != "spec":
        return run_lif(x, leak, spec.neuron(backend, memory), v_init=v_init)
    cdt = compute_dtype(x.dtype)
    k = leak.reshape(-1).to(cdt) if isinstance(leak, torch.Tensor) else torch.full((1,), float(leak), dtype=cdt)
    n = math.prod(x.shape[1:])
    v0 = (
        torch.full((1,), spec.v_reset if spec.reset == HARD else 0.0, dtype=cdt)
        if v_init is None
        else v_init.reshape(n)
    )
    spikes, state, _ = loop(x.reshape(x.shape[0], n), k, channel_layout(x.shape, k.numel()), v0, spec)
    return spikes.reshape(x.shape), state.reshape(x.shape[1:])
