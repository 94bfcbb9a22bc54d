"""Shared helpers of the compatibility tests: backends to run, and inputs kept away from threshold ties."""

from __future__ import annotations

import pytest
import torch

from spikefuse.neurons.lif import lif_initial, lif_params
from spikefuse.neurons.spec import NeuronSpec
from spikefuse.ops.engine import NeuronInputs, reference


# Every test runs on the oracle and on the fused CPU kernels.
BACKENDS = [pytest.param("reference", id="reference"), pytest.param("cpu", id="cpu")]

# Gradients: same formulas, summed in a different order than the peers' (autograd or hand-written) backward.
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


def away_from_threshold(
    x: torch.Tensor,
    leak,
    neuron: NeuronSpec,
    v_init: torch.Tensor | None = None,
    margin: float = 1e-3,
    nudge: float = 1e-2,
) -> torch.Tensor:
    """A copy of ``x`` ([T, *]) nudged until every pre-reset potential is more than ``margin`` from the threshold.

    Near a tie a spike flips under a rounding difference, and the hard reset's gradient (and the kinks of some
    surrogates) jump there, so gradients would not be comparable with a tight tolerance. ``leak`` is a number, a
    scalar tensor, or one value per neuron of ``x[0]`` (broadcast along leading dims as the flat index allows).
    """
    x = x.detach().clone().contiguous()
    t_steps, n = x.shape[0], x[0].numel()
    k = torch.as_tensor(leak, dtype=x.dtype).detach().reshape(-1)
    init = lif_initial(neuron, None if v_init is None else v_init.detach(), x)
    x2 = x.view(t_steps, n)
    for _ in range(200):
        with torch.no_grad():
            _, _, (h,) = reference.forward(neuron, NeuronInputs(x2, lif_params(neuron, k), init), save=True)
        close = (h - neuron.constant("threshold")).abs() <= margin
        if not close.any():
            return x
        t = int(close.any(dim=1).nonzero()[0, 0])
        x2[t, close[t]] += nudge
    raise AssertionError("could not draw inputs away from the threshold")
