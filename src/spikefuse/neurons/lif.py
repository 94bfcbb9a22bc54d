"""The LIF neurons of the temporal-fusion paper (Eq. (1)-(2)) and snnTorch's ``Leaky`` as neuron definitions, with
the operations in the order of :mod:`spikefuse.params`, so the engine's kernels give the spikes and states of the
hand-written LIF kernels (:mod:`spikefuse.ops.cpu`) bit for bit::

    paper, hard reset:      v[t] = where(s, v_reset, decay*v[t-1]) + x[t]
    paper, soft reset:      v[t] = decay*where(s, v[t-1] - threshold, v[t-1]) + x[t]
    no reset:               v[t] = decay*v[t-1] + x[t]
    snnTorch, subtract:     v[t] = (decay*v[t-1] + x[t]) - where(s, threshold, 0)      (fires on v > threshold)
    snnTorch, zero:         v[t] = where(s, 0, decay*v[t-1]) + x[t]                    (fires on v > threshold)

``s`` is the previous step's spike; the state is the pre-reset membrane. These are the first step of moving
``spikefuse.nn.LIF`` onto the engine; the layers still run the hand-written kernels.
"""

from .model import NeuronModel

__all__ = ["LIF_MODELS"]

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
}
