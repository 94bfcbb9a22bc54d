"""The adaptive LIF neuron (ALIF) of Bellec et al. 2018 (LSNN): the threshold ``b0 + beta * a`` rises by ``beta``
with every spike and relaxes back with the decay ``rho``; a spike subtracts the threshold it crossed::

    v[t] = decay * v[t-1] + x[t] - s[t-1] * (b0 + beta * a[t-1])
    a[t] = rho * a[t-1] + s[t-1]
    s[t] = 1 if v[t] >= b0 + beta * a[t] else 0

(``a`` counts recent spikes; the reset of a spike applies in the next step, ``v`` is the pre-reset membrane.)
"""

from .model import NeuronModel

__all__ = ["ALIF_MODEL"]

ALIF_MODEL = NeuronModel(
    name="alif",
    states=("v", "a"),
    params=("decay", "rho", "b0", "beta"),
    step=(("v", "decay*v + x - s*(b0 + beta*a)"), ("a", "rho*a + s")),
    fire="v - (b0 + beta*a)",
    defaults=(("b0", 1.0), ("beta", 1.8)),
    equations="v[t] = decay v[t-1] + x[t] - (b0 + beta a[t-1]) s[t-1];  a[t] = rho a[t-1] + s[t-1];  "
    "s[t] = H(v[t] - b0 - beta a[t])",
)
