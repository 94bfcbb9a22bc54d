"""The LIF neurons of the temporal-fusion paper (Eq. (1)-(2)) and snnTorch's ``Leaky`` as neuron definitions, with
the operations in the order of :mod:`spikefuse.params`, so the engine's kernels give the spikes and states of the
spec's reference (:mod:`spikefuse.ops.reference`) bit for bit::

    paper, hard reset:      v[t] = where(s, v_reset, decay*v[t-1]) + x[t]
    paper, soft reset:      v[t] = decay*where(s, v[t-1] - threshold, v[t-1]) + x[t]
    no reset:               v[t] = decay*v[t-1] + x[t]
    snnTorch, subtract:     v[t] = (decay*v[t-1] + x[t]) - where(s, threshold, 0)      (fires on v > threshold)
    snnTorch, zero:         v[t] = where(s, 0, decay*v[t-1]) + x[t]                    (fires on v > threshold)

``s`` is the previous step's spike; the state is the pre-reset membrane. SpikingJelly's neurons
(:data:`SPIKINGJELLY_MODELS`) hand on the membrane after the reset, ``u``, and charge from it by one of five
formulas, with ``r = v_reset`` (0 with the soft reset) and ``decay`` the ``k`` of :mod:`spikefuse.params`
(``tau``, or PLIF's ``sigmoid(w)``)::

    u = where(s, v_reset, v)   (hard)      u = where(s, v - threshold, v)   (soft)      u = v   (none)
    IF:         v[t] = u + x[t]
    DIV_INPUT:  v[t] = u + (x[t] - (u - r)) / decay
    DIV:        v[t] = u - (u - r) / decay + x[t]
    MUL_INPUT:  v[t] = u + (x[t] - (u - r)) * decay
    MUL:        v[t] = u - (u - r) * decay + x[t]

with ``u`` as the handoff (the states handed between calls are post-reset; the first step sees no spike), or
(:data:`SPIKINGJELLY_PRE_RESET_MODELS`, ``NeuronSpec(state_post_reset=False)``) without one.
:func:`spikefuse.lif` and the layers built on it (``spikefuse.nn.LIF``, ``IF``, learnable-decay ``LIF``,
``compat.snntorch.Leaky``, ``compat.spikingjelly``'s nodes, the NIR modules) run these on the CPU and on Triton
(:func:`engine_model`), and so does the fused BatchNorm+LIF (:func:`spikefuse.batchnorm_lif`).
"""

from __future__ import annotations

import functools
import math

import torch

from .. import params as P
from ..ops.common import compute_dtype, in_compute_dtype
from .model import NeuronModel

__all__ = ["LIF_MODELS", "RLEAKY_ZERO", "SPIKINGJELLY_MODELS", "SPIKINGJELLY_PRE_RESET_MODELS", "engine_model", "engine_params",
           "initial_potential"]

_PARAMS = ("decay", "threshold", "v_reset")
_DEFAULTS = (("threshold", 1.0), ("v_reset", 0.0))


def _lif(name: str, step: str, strict: bool = False) -> NeuronModel:
    return NeuronModel(name=name, states=("v",), params=_PARAMS, step=(("v", step),), fire="v - threshold",
                       strict=strict, defaults=_DEFAULTS, equations=f"v[t] = {step};  s[t] = H(v[t] - threshold)")


#: By (dynamics, reset) as :mod:`spikefuse.params` names them.
LIF_MODELS = {
    ("paper", "hard"): _lif("lif_hard", "where(s, v_reset, decay*v) + x"),
    ("paper", "soft"): _lif("lif_soft", "decay*where(s, v - threshold, v) + x"),
    ("paper", "none"): _lif("lif_no_reset", "decay*v + x"),
    ("snntorch", "soft"): _lif("leaky_subtract", "(decay*v + x) - where(s, threshold, 0)", strict=True),
    ("snntorch", "hard"): _lif("leaky_zero", "where(s, 0, decay*v) + x", strict=True),
    ("snntorch", "none"): _lif("leaky_no_reset", "decay*v + x", strict=True),
}

#: snnTorch's ``RLeaky(reset_mechanism="zero")``: the whole membrane of a step after a spike is 0, its input too
#: (``Leaky``'s "zero" zeroes the previous membrane only, before the input is added).
RLEAKY_ZERO = _lif("rleaky_zero", "where(s, 0, decay*v + x)", strict=True)

_SJ_RESETS = {"hard": "where(s, v_reset, v)", "soft": "where(s, v - threshold, v)", "none": "v"}
_SJ_CHARGES = {  # of v = u, the post-reset membrane
    "if": (P.CHARGE_IF, "v + x"),
    "div_input": (P.CHARGE_DIV_INPUT, "v + (x - (v - v_reset)) / decay"),
    "div": (P.CHARGE_DIV, "v - (v - v_reset) / decay + x"),
    "mul_input": (P.CHARGE_MUL_INPUT, "v + (x - (v - v_reset)) * decay"),
    "mul": (P.CHARGE_MUL, "v - (v - v_reset) * decay + x"),
}


def _spikingjelly(reset: str, charge: str, post_reset: bool) -> NeuronModel:
    u, (_, formula) = _SJ_RESETS[reset], _SJ_CHARGES[charge]
    handoff = post_reset and reset != "none"  # with no reset the post-reset membrane is the membrane: one model
    return NeuronModel(
        name=f"sj_{reset}_{charge}" + ("_pre_reset" if not post_reset and reset != "none" else ""), states=("v",),
        params=_PARAMS, step=(("v", u), ("v", formula)), fire="v - threshold", defaults=_DEFAULTS,
        handoff=(("v", u),) if handoff else (),
        equations=f"v = {u};  v[t] = {formula};  s[t] = H(v[t] - threshold);  handed on: {u if handoff else 'v'}",
    )  # fmt: skip


#: SpikingJelly's LIF / PLIF / IF forms, by (reset, charge).
SPIKINGJELLY_MODELS = {(reset, charge): _spikingjelly(reset, charge, True) for reset in _SJ_RESETS
                       for charge in _SJ_CHARGES}  # fmt: skip
#: The same forms handing on the membrane before the reset (``NeuronSpec(state_post_reset=False)``): the reset of
#: the last step is left to the next call, which applies it to its initial state.
SPIKINGJELLY_PRE_RESET_MODELS = {(reset, charge): _spikingjelly(reset, charge, False) for reset in _SJ_RESETS
                                 for charge in _SJ_CHARGES}  # fmt: skip

_CHARGE_NAMES = {code: name for name, (code, _) in _SJ_CHARGES.items()}
_DYNAMICS_NAMES = {code: name for name, code in P.DYNAMICS.items()}
_RESET_NAMES = {code: name for name, code in P.RESETS.items()}

def engine_model(spec: P.NeuronSpec) -> NeuronModel:
    """The definition of :data:`LIF_MODELS`, :data:`SPIKINGJELLY_MODELS` or :data:`SPIKINGJELLY_PRE_RESET_MODELS`
    that runs ``spec`` on the engine (every backend but the reference, which runs ``spec`` itself)."""
    if spec.dynamics == P.SPIKINGJELLY:
        models = SPIKINGJELLY_MODELS if spec.state_post_reset else SPIKINGJELLY_PRE_RESET_MODELS
        return models[(_RESET_NAMES[spec.reset], _CHARGE_NAMES[spec.charge])]
    return LIF_MODELS[(_DYNAMICS_NAMES[spec.dynamics], _RESET_NAMES[spec.reset])]


def initial_potential(spec: P.NeuronSpec, v_init: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The membrane to start from for the input ``x [T, ...]``, as every backend takes it, in the compute dtype:
    ``v_init`` flattened to ``[N]``, or for None one value shared by every neuron (``v_reset`` with the hard reset,
    else 0), so that nothing of size N is read."""
    cdt = compute_dtype(x.dtype)
    if v_init is None:
        return torch.full((1,), spec.v_reset if spec.reset == P.HARD else 0.0, dtype=cdt, device=x.device)
    return v_init.reshape(math.prod(x.shape[1:])).to(cdt).contiguous()


@functools.lru_cache(maxsize=1024)  # a layer checks the same values at every call
def _check_in_compute_dtype(threshold: float, v_reset: float, hard: bool, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    if not math.isfinite(in_compute_dtype(threshold, dtype)):
        raise ValueError(f"threshold {threshold} is not finite in {name}, the dtype the neurons compute in")
    if hard and in_compute_dtype(v_reset, dtype) >= in_compute_dtype(threshold, dtype):
        raise ValueError(f"v_reset {v_reset} is not below the threshold {threshold} in {name}, the dtype the neurons "
                         "compute in: a neuron reset to v_reset would fire again at once")  # fmt: skip


def engine_params(spec: P.NeuronSpec, decay: torch.Tensor) -> list[torch.Tensor]:
    """The parameters of :func:`engine_model`'s definition, in its order: ``decay`` (``[1]`` or per channel, as the
    kernels take it) and the threshold and v_reset of ``spec`` as ``[1]`` tensors of its dtype and device, checked
    in that dtype (the spec's checks ran in float64: a threshold of 1e40 is inf in float32, a v_reset just below the
    threshold rounds onto it)."""
    values = {"threshold": spec.threshold, "v_reset": spec.v_reset}
    if not torch.compiler.is_compiling():  # not while torch.compile traces (symbolic floats; the float64 checks ran)
        _check_in_compute_dtype(spec.threshold, spec.v_reset, spec.reset == P.HARD, decay.dtype)
    return [decay if name == "decay" else decay.new_full((1,), values[name]) for name in _PARAMS]
