"""spikefuse's layers that the benchmarks time beside the public API and the peers: spikefuse's definition of Norse's
LSNN started as Norse starts it. Each builder returns ``run(x)``, spikes of ``x`` ``[T, ...]``."""

from __future__ import annotations

from typing import Callable

import torch

Run = Callable[[torch.Tensor], torch.Tensor]


def norse_lsnn(device: str = "cpu") -> Run:
    """:data:`spikefuse.compat.norse.NORSE_LSNN` with Norse's default parameters, its threshold starting at
    ``v_th`` as Norse's ``LSNN`` starts it."""
    import spikefuse
    from spikefuse.compat.norse import NORSE_LSNN, SUPERSPIKE, lsnn_params

    params = {k: v.to(device) for k, v in lsnn_params().items()}
    v_th = float(params["v_th"])

    def run(x):
        state = (torch.zeros_like(x[0]), torch.zeros_like(x[0]), torch.full_like(x[0], v_th))
        return spikefuse.neuron(x, NORSE_LSNN, surrogate=SUPERSPIKE, state=state, memory="recompute", **params)

    return run
