"""The peers' neurons as their users run them, configured to the dynamics the layer benchmarks time
(:mod:`spikefuse.bench.neuron` on the CPU, :mod:`spikefuse.bench.gpu` on a GPU): each builder returns ``run(x)``,
spikes of ``x`` ``[T, ...]``, with the peer's modules on ``device``.

The paper's LIF (Eq. 1-2): decay 0.2, threshold 0.3, V_rest 0, sigmoid surrogate of slope 4 (:data:`DECAY`,
:data:`THRESHOLD`, :data:`ALPHA`).
"""

from __future__ import annotations

from typing import Callable

import torch

DECAY, THRESHOLD, ALPHA = 0.2, 0.3, 4.0

Run = Callable[[torch.Tensor], torch.Tensor]


def spikingjelly_lif(device: str = "cpu") -> Run:
    """SpikingJelly 2.0's ``LIFNode(step_mode='m')`` (``tau = 1/(1-decay)``, no input decay; it leaks as
    ``v - v/tau``, 1-ulp apart from ``decay*v``)."""
    from spikingjelly.activation_based import functional, neuron, surrogate

    node = neuron.LIFNode(
        tau=1.0 / (1.0 - DECAY),
        decay_input=False,
        v_threshold=THRESHOLD,
        v_reset=0.0,
        surrogate_function=surrogate.Sigmoid(alpha=ALPHA),
        step_mode="m",
    ).to(device)

    def run(x):
        functional.reset_net(node)
        return node(x)

    return run


def snntorch_leaky(device: str = "cpu") -> Run:
    """A loop over snnTorch's ``Leaky`` (it fires on ``>`` and always detaches the reset)."""
    import snntorch
    from snntorch import surrogate

    leaky = snntorch.Leaky(
        beta=DECAY, threshold=THRESHOLD, reset_mechanism="zero", spike_grad=surrogate.sigmoid(slope=ALPHA)
    ).to(device)

    def run(x):
        mem, out = leaky.init_leaky(), []
        for x_t in x.unbind(0):
            spk, mem = leaky(x_t, mem)
            out.append(spk)
        return torch.stack(out)

    return run


def snntorch_synaptic(alpha: float, beta: float, device: str = "cpu") -> Run:
    """A loop over snnTorch's ``Synaptic`` (spikefuse's CubaLIF with a detached reset)."""
    import snntorch

    layer = snntorch.Synaptic(alpha=alpha, beta=beta).to(device)

    def run(x):
        syn = mem = torch.zeros_like(x[0])
        out = []
        for x_t in x.unbind(0):
            s, syn, mem = layer(x_t, syn, mem)
            out.append(s)
        return torch.stack(out)

    return run


def norse_lif_box(device: str = "cpu") -> Run:
    """A loop over Norse's ``LIFBoxCell`` (``tau_mem_inv*dt = 1-decay``, the input scaled by ``1/(1-decay)``; it
    computes ``v + dt/tau*(x - v)`` and fires on ``>``: rounding differs)."""
    from norse.torch import LIFBoxCell, LIFBoxParameters

    dt = 1e-3
    params = LIFBoxParameters(
        tau_mem_inv=torch.tensor((1.0 - DECAY) / dt),
        v_th=torch.tensor(THRESHOLD),
        v_reset=torch.tensor(0.0),
        v_leak=torch.tensor(0.0),
        method="tanh",
        alpha=torch.tensor(ALPHA / 2),
    )
    cell = LIFBoxCell(params, dt=dt).to(device)

    def run(x):
        state, out = None, []
        for x_t in (x / (1.0 - DECAY)).unbind(0):
            z, state = cell(x_t, state)
            out.append(z)
        return torch.stack(out)

    return run
