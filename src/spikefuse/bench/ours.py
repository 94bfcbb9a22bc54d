"""spikefuse's layers that the benchmarks time beside the public API and the peers: the paper's LIF on the
hand-written Triton kernels it ran before the neuron engine (which still run half-precision inputs on a GPU) and on
the engine's generated kernels whatever the input's dtype, and spikefuse's definition of Norse's LSNN started as
Norse starts it. Each builder returns ``run(x)``, spikes of ``x`` ``[T, ...]``."""

from __future__ import annotations

from typing import Callable

import torch

Run = Callable[[torch.Tensor], torch.Tensor]


def hand_written_lif(decay: float, threshold: float, alpha: float, memory: str) -> Run:
    """Eq. (1)-(2) with a sigmoid surrogate of slope ``alpha`` on the hand-written Triton kernels
    (:mod:`spikefuse.ops.autograd`), in ``memory`` mode."""
    from spikefuse import params as P
    from spikefuse.ops import autograd
    from spikefuse.surrogate import Sigmoid
    from spikefuse.validation import paper_spec

    ints, floats = paper_spec(threshold, 0.0, Sigmoid(alpha), False).kernel_lists()

    def run(x):
        x2 = x.reshape(x.shape[0], -1)
        leak, v_init = torch.full((1,), decay, device=x.device), torch.zeros(1, device=x.device)
        spikes, _, _ = autograd.neuron(x2, leak, v_init, 1, ints, floats, "triton", P.MEMORY_MODES[memory])
        return spikes.reshape(x.shape)

    return run


def generated_lif(decay: float, threshold: float, alpha: float, memory: str) -> Run:
    """The LIF of :func:`hand_written_lif` on the neuron engine's kernels generated from its definition
    (:func:`spikefuse.neurons.lif.engine_model`), also for the half-precision inputs that ``spikefuse.lif`` runs on
    the hand-written ones."""
    from spikefuse.neurons.lif import engine_model, engine_params
    from spikefuse.ops.engine.autograd import neuron
    from spikefuse.surrogate import Sigmoid
    from spikefuse.validation import paper_spec

    spec = paper_spec(threshold, 0.0, Sigmoid(alpha), False)
    model = engine_model(spec, torch.float32, "triton")

    def run(x):
        x2 = x.reshape(x.shape[0], -1)
        params = engine_params(spec, torch.full((1,), decay, device=x.device))
        spikes, _ = neuron(x2, params, [torch.zeros(1, device=x.device)], 1, model, spec.surrogate,
                           spec.detach_reset, "triton", save=memory == "potential")  # fmt: skip
        return spikes.reshape(x.shape)

    return run


def norse_lsnn(device: str = "cpu") -> Run:
    """:data:`spikefuse.compat.norse.NORSE_LSNN` with Norse's default parameters, its threshold starting at
    ``v_th`` as Norse's ``LSNN`` starts it."""
    import spikefuse
    from spikefuse.compat.norse import NORSE_LSNN, SUPERSPIKE, lsnn_params

    params = {k: v.to(device) for k, v in lsnn_params().items()}
    v_th = float(params["v_th"])

    def run(x):
        state = (torch.zeros_like(x[0]), torch.zeros_like(x[0]), torch.full_like(x[0], v_th))
        return spikefuse.neuron(x, NORSE_LSNN, surrogate=SUPERSPIKE, state=state, **params)

    return run
