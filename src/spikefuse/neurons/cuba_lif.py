"""The current-based LIF neuron (CubaLIF): a synaptic current ``i`` that integrates the input and a membrane ``v``
that integrates the current, each with its own decay (snnTorch ``Synaptic``, NIR ``CubaLIF``, Lava-DL CUBA)::

    i[t] = alpha * i[t-1] + x[t]
    v[t] = beta * v[t-1] + i[t] - s[t-1] * threshold        (reset="subtract")
    v[t] = m - m * s[t-1],  m = beta * v[t-1] + i[t]        (reset="zero": the membrane of a step after a spike is 0)
    v[t] = beta * (u - u * s[t-1]) + i[t],  u = v[t-1]      (reset="hard": the membrane is 0 right after the spike)
    s[t] = 1 if v[t] > threshold else 0

"hard" is NIR's CubaLIF reset (to v_reset = 0 when the neuron fires) and snnTorch's ``Synaptic(reset_mechanism="zero",
reset_delay=False)``, what snnTorch's NIR import builds: the membrane starts the step after a spike from 0, so a
neuron can fire again in that step (with "zero" it cannot).

The reset of a spike applies in the next step (``v`` is the pre-reset membrane, as in snnTorch), and the
operations are written in snnTorch's order, so :class:`spikefuse.compat.snntorch.Synaptic` gives snnTorch's
spikes and states bit for bit.
"""

from .lif import snntorch_no_delay
from .model import NeuronModel

__all__ = [
    "CUBA_LIF",
    "CUBA_LIF_ZERO",
    "CUBA_LIF_HARD",
    "CUBA_LIF_NO_RESET",
    "CUBA_LIF_EULER",
    "CUBA_LIF_MODELS",
    "SYNAPTIC_NO_DELAY_MODELS",
]

CUBA_LIF = NeuronModel(
    name="cuba_lif",
    states=("i", "v"),
    params=("alpha", "beta", "threshold"),
    step=(("i", "alpha*i + x"), ("v", "beta*v + i - s*threshold")),
    fire="v - threshold",
    strict=True,
    defaults=(("threshold", 1.0),),
    equations="i[t] = alpha i[t-1] + x[t];  v[t] = beta v[t-1] + i[t] - threshold s[t-1];  s[t] = H(v[t] - threshold)",
)

CUBA_LIF_ZERO = NeuronModel(
    name="cuba_lif_zero",
    states=("i", "v"),
    params=("alpha", "beta", "threshold"),
    step=(("i", "alpha*i + x"), ("v", "beta*v + i"), ("v", "v - v*s")),
    fire="v - threshold",
    strict=True,
    defaults=(("threshold", 1.0),),
    equations="i[t] = alpha i[t-1] + x[t];  v[t] = (beta v[t-1] + i[t]) (1 - s[t-1]);  s[t] = H(v[t] - threshold)",
)

CUBA_LIF_HARD = NeuronModel(
    name="cuba_lif_hard",
    states=("i", "v"),
    params=("alpha", "beta", "threshold"),
    step=(("i", "alpha*i + x"), ("v", "v - v*s"), ("v", "beta*v + i")),
    fire="v - threshold",
    strict=True,
    defaults=(("threshold", 1.0),),
    equations="i[t] = alpha i[t-1] + x[t];  v[t] = beta v[t-1] (1 - s[t-1]) + i[t];  s[t] = H(v[t] - threshold)",
)

CUBA_LIF_NO_RESET = NeuronModel(
    name="cuba_lif_no_reset",
    states=("i", "v"),
    params=("alpha", "beta", "threshold"),
    step=(("i", "alpha*i + x"), ("v", "beta*v + i")),
    fire="v - threshold",
    strict=True,
    defaults=(("threshold", 1.0),),
    equations="i[t] = alpha i[t-1] + x[t];  v[t] = beta v[t-1] + i[t];  s[t] = H(v[t] - threshold)",
)

#: By reset mechanism.
CUBA_LIF_MODELS = {"subtract": CUBA_LIF, "zero": CUBA_LIF_ZERO, "hard": CUBA_LIF_HARD, "none": CUBA_LIF_NO_RESET}


#: snnTorch's ``Synaptic`` with ``reset_delay=False`` (the membrane reset in the step of its spike), by reset
#: mechanism, in snnTorch's operations ("zero" leaves the synaptic current as it is).
_SYNAPTIC = dict(params=("alpha", "beta", "threshold"), before=(("i", "alpha*i + x"),))
SYNAPTIC_NO_DELAY_MODELS = {
    "subtract": snntorch_no_delay(
        "cuba_lif_subtract_no_delay", "v - (s - r)*threshold", "beta*v + i - r*threshold", **_SYNAPTIC
    ),
    "zero": snntorch_no_delay("cuba_lif_zero_no_delay", "v - (s - r)*v", "(beta*v + i) - (beta*v + i)*r", **_SYNAPTIC),
}

#: NIR's CubaLIF integrated by forward Euler as written (``a_syn = dt/tau_syn``, ``a_mem = dt/tau_mem``), with
#: Norse's arithmetic (its NIR import: a box synapse then a box LIF)::
#:
#:     i[t] = i[t-1] + a_syn * ((0 - i[t-1]) + w_in * x[t])
#:     v[t] = u + a_mem * ((v_leak - u) + r * i[t]),  u = v_reset if s[t-1] else v[t-1]
#:     s[t] = 1 if v[t] > v_threshold else 0
CUBA_LIF_EULER = NeuronModel(
    name="cuba_lif_euler",
    states=("i", "v"),
    params=("a_syn", "a_mem", "w_in", "r", "v_leak", "v_threshold", "v_reset"),
    step=(
        ("i", "i + a_syn*((0 - i) + w_in*x)"),
        ("v", "(1 - s)*v + s*v_reset"),
        ("v", "v + a_mem*((v_leak - v) + r*i)"),
    ),
    fire="v - v_threshold",
    strict=True,
    equations="i += dt/tau_syn (-i + w_in x);  v = v_reset after a spike;  v += dt/tau_mem ((v_leak - v) + r i);  "
    "s = H(v - v_threshold)",
)
