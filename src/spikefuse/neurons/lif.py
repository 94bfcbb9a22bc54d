"""The LIF neurons as neuron definitions: the temporal-fusion paper's (Eq. (1)-(2)), snnTorch's ``Leaky`` and
SpikingJelly's ``LIFNode`` / ``ParametricLIFNode`` / ``IFNode``, each operation in the order the peer computes it, so
that the spikes and states equal theirs bit for bit::

    paper, hard reset:      v[t] = where(s, v_reset, decay*v[t-1]) + x[t]
    paper, soft reset:      v[t] = decay*where(s, v[t-1] - threshold, v[t-1]) + x[t]
    no reset:               v[t] = decay*v[t-1] + x[t]
    snnTorch, subtract:     v[t] = (decay*v[t-1] + x[t]) - where(s, threshold, 0)      (fires on v > threshold)
    snnTorch, zero:         v[t] = where(s, 0, decay*v[t-1]) + x[t]                    (fires on v > threshold)
    snnTorch Lapicque:      v[t] = x[t]*R*(1/(R*C))*dt + (1 - dt/(R*C))*v[t-1], reset as snnTorch's (LAPICQUE_MODELS)

``s`` is the previous step's spike; the state is the pre-reset membrane. SpikingJelly's neurons
(:data:`SPIKINGJELLY_MODELS`) hand on the membrane after the reset, ``u``, and charge from it by one of five
formulas, with ``r = v_reset`` (0 with the soft reset) and ``decay`` SpikingJelly's ``tau`` (LIF) or ``sigmoid(w)``
(PLIF)::

    u = where(s, v_reset, v)   (hard)      u = where(s, v - threshold, v)   (soft)      u = v   (none)
    if:         v[t] = u + x[t]
    div_input:  v[t] = u + (x[t] - (u - r)) / decay
    div:        v[t] = u - (u - r) / decay + x[t]
    mul_input:  v[t] = u + (x[t] - (u - r)) * decay
    mul:        v[t] = u - (u - r) * decay + x[t]

with ``u`` as the handoff (the states handed between calls are post-reset; the first step sees no spike), or
(:data:`SPIKINGJELLY_PRE_RESET_MODELS`) without one. :func:`lif_spec` makes one of these definitions with its
threshold, reset value, surrogate and ``detach_reset`` a :class:`~spikefuse.neurons.NeuronSpec`: what :func:`spikefuse.lif`, the fused BatchNorm+LIF
(:func:`spikefuse.batchnorm_lif`), ``compat.spikingjelly``'s nodes and the NIR modules run on the engine.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from ..ops.numerics import compute_dtype, finite, in_compute_dtype
from ..surrogate import Surrogate, resolve
from .model import NeuronModel
from .spec import NeuronSpec, keep, neuron_spec

__all__ = [
    "DEFAULT_DECAY",
    "DEFAULT_THRESHOLD",
    "LAPICQUE_MODELS",
    "LIF_MODELS",
    "RLEAKY_ZERO",
    "SNNTORCH_NO_DELAY_MODELS",
    "SPIKINGJELLY_MODELS",
    "SPIKINGJELLY_PRE_RESET_MODELS",
    "lif_initial",
    "lif_params",
    "lif_spec",
    "paper_lif",
]

#: The LIF settings of every native entry point given none (:func:`spikefuse.lif`, ``nn.LIF`` / ``IF``, the fused
#: BatchNorm+LIF functions and modules, ``nn.RecurrentLIF``, the time split, the models' ``PAPER_NEURON``): the
#: temporal-fusion paper's Table 1 -- decay ``k = 0.2``, threshold 0.3, a hard reset to ``V_rest = 0`` -- with its
#: surrogate, :data:`spikefuse.surrogate.DEFAULT`.
DEFAULT_DECAY, DEFAULT_THRESHOLD = 0.2, 0.3

_PARAMS = ("decay", "threshold", "v_reset")
_DEFAULTS = (("threshold", 1.0), ("v_reset", 0.0))


def _lif(name: str, step: str, strict: bool = False, initial: tuple = ()) -> NeuronModel:
    return NeuronModel(
        name=name,
        states=("v",),
        params=_PARAMS,
        step=(("v", step),),
        fire="v - threshold",
        strict=strict,
        defaults=_DEFAULTS,
        initial=initial,
        equations=f"v[t] = {step};  s[t] = H(v[t] - threshold)",
    )


# The paper's V_rest, SpikingJelly's v_reset: a hard-reset membrane starts where a spike resets it.
_AT_REST = (("v", "v_reset"),)

#: By (dynamics, reset): dynamics "paper" or "snntorch", reset "hard", "soft" (snnTorch's "zero" and "subtract") or
#: "none".
LIF_MODELS = {
    ("paper", "hard"): _lif("lif_hard", "where(s, v_reset, decay*v) + x", initial=_AT_REST),
    ("paper", "soft"): _lif("lif_soft", "decay*where(s, v - threshold, v) + x"),
    ("paper", "none"): _lif("lif_no_reset", "decay*v + x"),
    ("snntorch", "soft"): _lif("leaky_subtract", "(decay*v + x) - where(s, threshold, 0)", strict=True),
    ("snntorch", "hard"): _lif("leaky_zero", "where(s, 0, decay*v) + x", strict=True),
    ("snntorch", "none"): _lif("leaky_no_reset", "decay*v + x", strict=True),
}

#: snnTorch's ``RLeaky(reset_mechanism="zero")``: the whole membrane of a step after a spike is 0, its input too
#: (``Leaky``'s "zero" zeroes the previous membrane only, before the input is added).
RLEAKY_ZERO = _lif("rleaky_zero", "where(s, 0, decay*v + x)", strict=True)


def _lapicque(reset: str, step: str) -> NeuronModel:
    return NeuronModel(
        name=f"lapicque_{reset}",
        states=("v",),
        params=("R", "C", "time_step", "threshold"),
        step=(("v", step),),
        fire="v - threshold",
        strict=True,
        defaults=(("threshold", 1.0),),
        equations=f"v[t] = {step};  s[t] = H(v[t] - threshold)",
    )


# snnTorch's Lapicque charge as it writes it: the RC terms are evaluated from R, C and time_step at every step, not
# from beta (which only derives a missing R or C at construction), so the decay is snnTorch's rounding of them.
_LAPICQUE_CHARGE = "x*R*(1/(R*C))*time_step + (1 - time_step/(R*C))*v"

#: snnTorch's ``Lapicque`` by reset mechanism (its detached reset of the step after a spike; "zero" zeroes the whole
#: charged membrane, input included, as snnTorch's ``base - reset*base``).
LAPICQUE_MODELS = {
    "subtract": _lapicque("subtract", f"({_LAPICQUE_CHARGE}) - where(s, threshold, 0)"),
    "zero": _lapicque("zero", f"where(s, 0, {_LAPICQUE_CHARGE})"),
    "none": _lapicque("none", _LAPICQUE_CHARGE),
}


def snntorch_no_delay(
    name: str, reset: str, charge: str, params: tuple[str, ...] = ("decay", "threshold"), before: tuple = ()
) -> NeuronModel:
    """snnTorch's ``reset_delay=False``: the membrane ``v`` of a step, before its own spike's reset; the state ``r``,
    the detached reset signal ``heaviside(m - threshold)`` of the membrane ``m`` after that reset, which the next
    step's charge subtracts (snnTorch's "avoid double reset"). ``reset``: ``m`` of ``v``, the spike ``s`` (with its
    gradient) and ``r``; ``before``: the assignments of other states ahead of the charge (``Synaptic``'s current);
    handed out: ``m`` and ``r = 0``, what a call's first step, which sees no spike, reads."""
    step = (("v", reset), ("r", "heaviside(v - threshold)"), *before, ("v", charge))
    return NeuronModel(
        name=name,
        states=(*(target for target, _ in before), "v", "r"),
        params=params,
        step=step,
        fire="v - threshold",
        strict=True,
        defaults=(("threshold", 1.0),),
        handoff=(("v", reset), ("r", "0")),
        equations="m = "
        + reset
        + ";  r = H(m - threshold);  "
        + "".join(f"{target}[t] = {e};  " for target, e in before)
        + f"v[t] = {charge.replace('v', 'm')};  s[t] = H(v[t] - threshold);  handed on: m",
    )


#: snnTorch's ``Leaky`` and ``RLeaky`` with ``reset_delay=False`` (the membrane reset in the step of its spike), by
#: (neuron, reset mechanism), in snnTorch's operations: the states are the membrane before the in-step reset and
#: the detached reset signal of the membrane after it (see :func:`snntorch_no_delay`).
SNNTORCH_NO_DELAY_MODELS = {
    ("leaky", "subtract"): snntorch_no_delay(
        "leaky_subtract_no_delay", "v - (s - r)*threshold", "(decay*v + x) - r*threshold"
    ),
    ("leaky", "zero"): snntorch_no_delay("leaky_zero_no_delay", "v - (s - r)*v", "decay*((1 - r)*v) + x"),
    ("rleaky", "zero"): snntorch_no_delay("rleaky_zero_no_delay", "v - (s - r)*v", "(decay*v + x) - r*(decay*v + x)"),
}
SNNTORCH_NO_DELAY_MODELS[("rleaky", "subtract")] = SNNTORCH_NO_DELAY_MODELS[("leaky", "subtract")]

_SJ_RESETS = {"hard": "where(s, v_reset, v)", "soft": "where(s, v - threshold, v)", "none": "v"}
_SJ_CHARGES = {  # of v = u, the post-reset membrane
    "if": "v + x",
    "div_input": "v + (x - (v - v_reset)) / decay",
    "div": "v - (v - v_reset) / decay + x",
    "mul_input": "v + (x - (v - v_reset)) * decay",
    "mul": "v - (v - v_reset) * decay + x",
}


def _spikingjelly(reset: str, charge: str, post_reset: bool) -> NeuronModel:
    u, formula = _SJ_RESETS[reset], _SJ_CHARGES[charge]
    handoff = post_reset and reset != "none"  # with no reset the post-reset membrane is the membrane: one model
    return NeuronModel(
        name=f"sj_{reset}_{charge}" + ("_pre_reset" if not post_reset and reset != "none" else ""),
        states=("v",),
        params=_PARAMS,
        step=(("v", u), ("v", formula)),
        fire="v - threshold",
        defaults=_DEFAULTS,
        initial=_AT_REST if reset == "hard" else (),
        handoff=(("v", u),) if handoff else (),
        equations=f"v = {u};  v[t] = {formula};  s[t] = H(v[t] - threshold);  handed on: {u if handoff else 'v'}",
    )


#: SpikingJelly's LIF / PLIF / IF forms, by (reset, charge).
SPIKINGJELLY_MODELS = {
    (reset, charge): _spikingjelly(reset, charge, True) for reset in _SJ_RESETS for charge in _SJ_CHARGES
}
#: The same forms handing on the membrane before the reset: the reset of
#: the last step is left to the next call, which applies it to its initial state.
SPIKINGJELLY_PRE_RESET_MODELS = {
    (reset, charge): _spikingjelly(reset, charge, False) for reset in _SJ_RESETS for charge in _SJ_CHARGES
}


@functools.lru_cache(maxsize=1024)  # a layer checks the same values at every call
def _check_reset_in_compute_dtype(threshold: float, v_reset: float, dtype: torch.dtype) -> None:
    if in_compute_dtype(v_reset, dtype) >= in_compute_dtype(threshold, dtype):
        raise ValueError(
            f"v_reset {v_reset} is not below the threshold {threshold} in {str(dtype).removeprefix('torch.')}, the "
            "dtype the neurons compute in: a neuron reset to v_reset would fire again at once"
        )


def lif_spec(
    model: NeuronModel,
    threshold: float,
    v_reset: float,
    hard_reset: bool,
    surrogate: Surrogate,
    detach_reset: bool = False,
    *,
    backend: str = "auto",
    memory: str = "potential",
) -> NeuronSpec:
    """A LIF definition of this module (``model``, whose parameters are ``decay``, ``threshold`` and ``v_reset``)
    as a :class:`~spikefuse.neurons.NeuronSpec` with its constants: ``threshold``, ``v_reset`` (the reset value of
    a hard reset, 0 otherwise) and ``hard_reset`` (whether the membrane starts at ``v_reset``; else at 0). ``decay``
    stays a tensor argument (:func:`lif_params`): it may be learnable."""
    for name, value in (("threshold", threshold), ("v_reset", v_reset)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not finite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not hard_reset and v_reset != 0.0:
        # SpikingJelly's charge leaks toward v_reset, which is 0 without a hard reset.
        raise ValueError(f"v_reset must be 0.0 without a hard reset, got {v_reset}")
    return neuron_spec(
        model,
        surrogate,
        detach_reset,
        constants=(("threshold", float(threshold)), ("v_reset", float(v_reset))),
        initial=(("v", float(v_reset)),) if hard_reset else (),
        backend=backend,
        memory=memory,
    )


def paper_lif(threshold, v_reset, surrogate, detach_reset=False, *, backend="auto", memory="potential") -> NeuronSpec:
    """The paper's LIF (hard reset to ``v_reset``, or soft for None), with its parameter ranges: Eq. (1) leaks toward
    0, so the resting potential is 0 and a threshold <= 0 would fire at rest; a hard reset to ``v_reset >=
    threshold`` would fire forever."""
    key = None
    if not torch.compiler.is_compiling():
        # a layer asks at every call: the record of arguments seen before, by value and type (True is not 1 here)
        key = (type(threshold), threshold, type(v_reset), v_reset, surrogate, detach_reset, backend, memory)
        try:
            made = _PAPER_LIFS.get(key)
        except TypeError:  # an unhashable argument, refused below
            made = key = None
        if made is not None:
            return made
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        raise TypeError(f"threshold must be a number, got {threshold!r}")
    if v_reset is not None and (isinstance(v_reset, bool) or not isinstance(v_reset, numbers.Real)):
        raise TypeError(f"v_reset must be a number or None (soft reset), got {v_reset!r}")
    if finite(threshold) and threshold <= 0:
        raise ValueError(f"threshold must be > 0 (the membrane rests at 0 and would fire at rest), got {threshold}")
    if v_reset is not None and finite(v_reset) and finite(threshold) and v_reset >= threshold:
        raise ValueError(
            f"v_reset must be below the threshold ({threshold}), got {v_reset}: a neuron reset to "
            "v_reset would fire again at once"
        )
    hard = v_reset is not None
    spec = lif_spec(
        LIF_MODELS[("paper", "hard" if hard else "soft")],
        threshold,
        v_reset if hard else 0.0,
        hard,
        resolve(surrogate),
        detach_reset,
        backend=backend,
        memory=memory,
    )
    return spec if key is None else keep(_PAPER_LIFS, key, spec)


_PAPER_LIFS: dict[tuple, NeuronSpec] = {}


def lif_params(neuron: NeuronSpec, decay: torch.Tensor) -> list[torch.Tensor]:
    """The parameters of a :func:`lif_spec` neuron as the backends take them: ``decay`` (``[1]`` or per channel) and
    the threshold and v_reset as ``[1]`` tensors of its dtype and device, checked in that dtype (a threshold of 1e40
    is inf in float32, a hard reset's v_reset just below the threshold rounds onto it)."""
    if neuron.initial and not torch.compiler.is_compiling():  # (symbolic while torch.compile traces)
        _check_reset_in_compute_dtype(neuron.constant("threshold"), neuron.constant("v_reset"), decay.dtype)
    return neuron.params({"decay": decay})


def lif_initial(neuron: NeuronSpec, v_init: torch.Tensor | None, x: torch.Tensor) -> list[torch.Tensor]:
    """The membrane to start from for the input ``x [T, ...]``, as every backend takes it, in the compute dtype:
    ``v_init`` flattened to ``[N]``, or for None one value shared by every neuron (``v_reset`` with the hard
    reset, else 0), so that nothing of size N is read."""
    if v_init is None:
        return neuron.initial_states(x)
    return [v_init.reshape(math.prod(x.shape[1:])).to(compute_dtype(x.dtype)).contiguous()]
