"""snnTorch's ``Alpha`` neuron: an excitatory current ``syn_exc`` and an inhibitory one ``syn_inh`` driven by the
same input with opposite signs and different decays, whose sum, scaled, is the membrane (an alpha-shaped response
for ``alpha > beta``)::

    syn_exc[t] = alpha * syn_exc[t-1] + x[t]
    syn_inh[t] = beta * syn_inh[t-1] - x[t]
    v[t] = tau * (syn_exc[t] + syn_inh[t]),   tau = log(alpha) / (log(beta) - log(alpha)) + 1
    s[t] = 1 if v[t] > threshold else 0

with snnTorch's detached reset of the step after a spike (``s`` the previous step's spike): "zero" zeroes all
three states of that step; "subtract" subtracts the threshold from ``syn_exc``, zeroes ``syn_inh`` and adds the
previous ``syn_inh`` to the membrane (snnTorch's ``mem - (-syn_inh[t-1]) * reset``).

The operations are snnTorch's in its order, so :class:`spikefuse.compat.snntorch.Alpha` gives its spikes and
states bit for bit. ``tau`` is a parameter, formed in torch from the clamped ``alpha`` and ``beta`` as snnTorch
forms it (a ``log`` of the kernels' math library could round differently); the membrane is assigned first, as
snnTorch computes it from the states before the step.
"""

from .model import NeuronModel

__all__ = ["ALPHA_MODELS"]

_EXC, _INH = "alpha*syn_exc + x", "beta*syn_inh - x"
_MEM = f"tau*(({_EXC}) + ({_INH}))"


def _alpha(reset: str, mem: str, exc: str, inh: str) -> NeuronModel:
    return NeuronModel(
        name=f"snntorch_alpha_{reset}",
        states=("syn_exc", "syn_inh", "v"),
        params=("alpha", "beta", "tau", "threshold"),
        step=(("v", mem), ("syn_exc", exc), ("syn_inh", inh)),
        fire="v - threshold",
        strict=True,
        defaults=(("threshold", 1.0),),
        equations=f"v[t] = {mem};  syn_exc[t] = {exc};  syn_inh[t] = {inh};  s[t] = H(v[t] - threshold)",
    )


#: By reset mechanism.
ALPHA_MODELS = {
    "subtract": _alpha(
        "subtract", f"{_MEM} - where(s, -syn_inh, 0)", f"({_EXC}) - where(s, threshold, 0)", f"where(s, 0, {_INH})"
    ),
    "zero": _alpha("zero", f"where(s, 0, {_MEM})", f"where(s, 0, {_EXC})", f"where(s, 0, {_INH})"),
    "none": _alpha("none", _MEM, _EXC, _INH),
}
