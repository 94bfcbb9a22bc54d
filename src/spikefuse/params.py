"""The record of a neuron's dynamics, shared by every backend.

Every supported neuron is one pre-reset recursion over time: ``h[t]`` is the membrane potential compared with the
threshold at step ``t``, ``s[t] = fire(h[t] - threshold)`` its spike, and

    h[t] = step(h[t-1], s[t-1], x[t])

where ``step`` is one of the formulas below, chosen by :attr:`NeuronSpec.dynamics` and :attr:`NeuronSpec.reset`.
Each formula is written down with its exact order of floating-point operations, because the compatibility layers
promise bit-identical spikes with the peer libraries. ``k`` is the ``leak`` parameter (scalar or per channel)::

    PAPER (temporal-fusion paper, Eq. (1); leaks toward 0, resets to v_reset)
        hard:  h = (v_reset if s else k*h) + x
        soft:  h = k*((h - threshold) if s else h) + x
        none:  h = k*h + x
    SNNTORCH (snnTorch Leaky; fires on >; the reset is always detached there)
        subtract:  h = (k*h + x) - (threshold if s else 0)
        zero:      h = (x if s else k*h + x)
        none:      h = k*h + x
    SPIKINGJELLY (SpikingJelly 2.0 LIFNode/ParametricLIFNode/IFNode; the state is the post-reset u)
        u = v_reset if s else h          (hard)      u = (h - threshold) if s else h    (soft)
        then, with r = v_reset (0 for soft reset), by NeuronSpec.charge:
        IF:         h = u + x
        DIV_INPUT:  h = u + (x - (u - r)) / k          (decay_input=True, k = tau)
        DIV:        h = u - (u - r) / k + x            (decay_input=False, k = tau)
        MUL_INPUT:  h = u + (x - (u - r)) * k          (decay_input=True, k = sigmoid(w), PLIF)
        MUL:        h = u - (u - r) * k + x            (decay_input=False, k = sigmoid(w), PLIF)

The state handed between calls (``v_init`` in, final state out) is ``h`` itself (``state_post_reset=False``: the
reset of a spike in the last step is applied at the start of the next call) or, for SpikingJelly, the post-reset
``u`` (``state_post_reset=True``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from .surrogate import Sigmoid, Surrogate

# Integer codes the kernels switch on. Kept as plain ints so the records cross into numba, Triton and
# torch.library custom ops unchanged.
PAPER, SNNTORCH, SPIKINGJELLY = 0, 1, 2
DYNAMICS = {"paper": PAPER, "snntorch": SNNTORCH, "spikingjelly": SPIKINGJELLY}

HARD, SOFT, NONE = 0, 1, 2
RESETS = {"hard": HARD, "soft": SOFT, "none": NONE}

# SpikingJelly charge formulas; MUL for the other dynamics means "h = k*... + x" as listed above.
CHARGE_MUL, CHARGE_IF, CHARGE_DIV_INPUT, CHARGE_DIV, CHARGE_MUL_INPUT = 0, 1, 2, 3, 4

SAVE_POTENTIAL, SAVE_INPUT = 0, 1

_KERNEL_INTS = 7  # how many of NeuronSpec.kernel_args are ints (the rest are floats)
MEMORY_MODES = {"potential": SAVE_POTENTIAL, "recompute": SAVE_INPUT}


def finite(value) -> bool:
    """``math.isfinite(value)`` for a real number, also while torch.compile traces it as a symbolic float: a module's
    float option becomes one once a second module with another value compiles the same code, and ``math.isfinite``
    cannot take it (a comparison can)."""
    return abs(value) < math.inf


def check_memory_mode(memory: str) -> None:
    if memory not in MEMORY_MODES:
        raise ValueError(f"unknown memory mode {memory!r}: use one of {sorted(MEMORY_MODES)}")


@dataclass(frozen=True)
class NeuronSpec:
    """Everything about a neuron layer except its tensors (input, leak, initial state)."""

    threshold: float = 1.0
    v_reset: float = 0.0
    reset: int = HARD
    surrogate: Surrogate = field(default_factory=Sigmoid)
    detach_reset: bool = False
    dynamics: int = PAPER
    charge: int = CHARGE_MUL
    state_post_reset: bool = False

    def __post_init__(self):
        for name in ("threshold", "v_reset"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not finite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.reset != HARD and self.v_reset != 0.0:
            # The SpikingJelly charge uses v_reset as its leak target r, which is 0 without a hard reset.
            raise ValueError(f"v_reset must be 0.0 unless reset is HARD, got {self.v_reset}")

    @property
    def fire_strict(self) -> bool:
        """snnTorch fires on ``h > threshold``; the paper and SpikingJelly on ``h >= threshold``."""
        return self.dynamics == SNNTORCH

    def kernel_lists(self) -> tuple[list[int], list[float]]:
        """:meth:`kernel_args` split as the ``torch.library`` custom ops take it: the ints, then the floats."""
        args = self.kernel_args()
        return list(args[:_KERNEL_INTS]), list(args[_KERNEL_INTS:])

    def kernel_args(self) -> tuple:
        """The flat tuple of ints and floats that every fused kernel takes, in one fixed order."""
        p1, p2 = self.surrogate.params()
        return (
            self.dynamics,
            self.reset,
            self.charge,
            int(self.state_post_reset),
            int(self.fire_strict),
            int(self.detach_reset),
            self.surrogate.code,
            float(p1),
            float(p2),
            float(self.threshold),
            float(self.v_reset),
        )
