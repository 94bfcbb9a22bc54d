"""Norse 1.1's feed-forward ``LIF`` (current-based) and ``LSNN`` (adaptive) neurons as spikefuse neuron models:
definitions only (:class:`~spikefuse.neurons.NeuronModel`), run by the engine's generated kernels.

Norse applies the reset of a spike in the step that fires it and returns post-reset states; the models below apply
the reset at the start of the next step, with Norse's operations in Norse's order, and hand out the post-reset
states after the last step (their ``handoff``), so the spikes and the returned states equal Norse's bit for bit in
float32 (``tests/compat/test_norse.py``), and Norse's states continue a sequence when passed back. Parameters come from Norse's records with :func:`lif_params` / :func:`lsnn_params`, which form
``dt * tau_inv`` as Norse does (a float32 product). Norse's default spike function ``"super"`` is, in 1.1, the
gradient ``1 / (|u| + 1)^2`` whatever its ``alpha``: :class:`spikefuse.surrogate.FastSigmoid` with slope 1.

LIF (``lif_feed_forward_step``)::

    i = i + x;  v = v + dt/tau_mem ((v_leak - v) + i);  i = i - dt/tau_syn i;  z = H(v - v_th);  v = v_reset where z

LSNN (``lsnn_feed_forward_step``; the threshold ``b`` relaxes to ``v_th`` and jumps by ``beta`` on a spike; the
input reaches the current after the spike test)::

    v = v + dt/tau_mem ((v_leak - v) + i);  i = i - dt/tau_syn i;  b = b + dt/tau_adapt (v_th - b);
    z = H(v - b);  v = v_reset where z;  b = b + beta z;  i = i + x
"""

from __future__ import annotations

import torch

from ..neurons import NeuronModel
from ..surrogate import FastSigmoid

__all__ = ["NORSE_LIF", "NORSE_LSNN", "lif_params", "lsnn_params", "SUPERSPIKE"]

#: Norse 1.1's "super" spike gradient (alpha unused there).
SUPERSPIKE = FastSigmoid(1.0)

NORSE_LIF = NeuronModel(
    name="norse_lif",
    states=("v", "i"),
    params=("dt_mem", "neg_dt_syn", "v_leak", "v_th", "v_reset"),
    step=(
        ("v", "(1 - s)*v + s*v_reset"),
        ("i", "i + x"),
        ("v", "v + dt_mem*((v_leak - v) + i)"),
        ("i", "i + neg_dt_syn*i"),
    ),
    fire="v - v_th",
    strict=True,
    handoff=(("v", "(1 - s)*v + s*v_reset"),),
)

NORSE_LSNN = NeuronModel(
    name="norse_lsnn",
    states=("v", "i", "b"),
    params=("dt_mem", "neg_dt_syn", "dt_adapt", "v_leak", "v_th", "v_reset", "beta"),
    step=(
        ("v", "(1 - s)*v + s*v_reset"),
        ("b", "b + s*beta"),
        ("v", "v + dt_mem*((v_leak - v) + i)"),
        ("i", "i + neg_dt_syn*i"),
        ("b", "b + dt_adapt*(v_th - b)"),
        ("i", "i + x"),
    ),
    fire="v - b",
    strict=True,
    handoff=(("v", "(1 - s)*v + s*v_reset"), ("b", "b + s*beta")),
)


def _scalar(value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32).reshape(())


def lif_params(p=None, dt: float = 0.001) -> dict:
    """The parameters of :data:`NORSE_LIF` from a ``norse.torch.LIFParameters`` (default: Norse's defaults)."""
    if p is None:
        from norse.torch import LIFParameters

        p = LIFParameters()
    return {"dt_mem": dt * _scalar(p.tau_mem_inv), "neg_dt_syn": -dt * _scalar(p.tau_syn_inv),
            "v_leak": _scalar(p.v_leak), "v_th": _scalar(p.v_th), "v_reset": _scalar(p.v_reset)}  # fmt: skip


def lsnn_params(p=None, dt: float = 0.001) -> dict:
    """The parameters of :data:`NORSE_LSNN` from a ``norse.torch.LSNNParameters`` (default: Norse's defaults)."""
    if p is None:
        from norse.torch import LSNNParameters

        p = LSNNParameters()
    return {"dt_mem": dt * _scalar(p.tau_mem_inv), "neg_dt_syn": -dt * _scalar(p.tau_syn_inv),
            "dt_adapt": dt * _scalar(p.tau_adapt_inv), "v_leak": _scalar(p.v_leak), "v_th": _scalar(p.v_th),
            "v_reset": _scalar(p.v_reset), "beta": _scalar(p.beta)}  # fmt: skip
