"""``spikefuse.lif`` and ``if_neuron``: validate, then dispatch to a backend. No arithmetic of the neuron lives here.
Their siblings: :mod:`spikefuse.bn_functional` (BatchNorm fused with a neuron), :mod:`spikefuse.neuron_functional`
(any neuron definition), :mod:`spikefuse.recurrent_functional` (recurrent layers)."""

from __future__ import annotations

import math

import torch

from . import ops
from .neurons.lif import DEFAULT_DECAY, DEFAULT_THRESHOLD, lif_initial, lif_params, paper_lif
from .neurons.spec import NeuronSpec
from .ops.engine import autograd as _engine_autograd
from .surrogate import DEFAULT as DEFAULT_SURROGATE
from .validation import (
    channel_layout,
    check_decay,
    check_input,
    check_no_functorch,
    check_v_init,
    leak_tensor,
)

__all__ = ["lif", "if_neuron", "run_lif"]


def run_lif(x, decay, neuron: NeuronSpec, *, v_init=None):
    """Run the LIF ``neuron`` (a :func:`~spikefuse.neurons.lif.lif_spec`: one of the paper's, snnTorch's or
    SpikingJelly's LIF definitions with its constants and settings) over ``x`` of shape ``[T, *]``; returns
    ``(spikes, state)``. The runner of :func:`lif` and of the modules that hold another LIF form
    (``compat.spikingjelly``, the NIR modules).

    ``decay`` is the definition's ``decay`` (a number, or a scalar / per-channel tensor that may require grad).
    ``state`` has shape ``x.shape[1:]`` and continues the sequence exactly when passed back as ``v_init``.
    """
    check_input(x)
    concrete = ops.resolve_backend(neuron.backend, x.device)
    if concrete != "reference":
        check_no_functorch(f"the fused {concrete!r} kernels")
    k = leak_tensor(decay, x, "decay")
    t_steps, trailing = x.shape[0], x.shape[1:]
    inner = channel_layout(x.shape, k.numel())
    if v_init is not None:
        check_v_init(v_init, x)
    init = lif_initial(neuron, v_init, x)
    params = lif_params(neuron, k)  # also checks the threshold and v_reset in the dtype the neurons compute in
    x2 = x.reshape(t_steps, math.prod(trailing))
    spikes, state = _engine_autograd.neuron(x2.contiguous(), params, init, inner, neuron, concrete)
    return spikes.reshape(x.shape), state.reshape(trailing)


def lif(
    x: torch.Tensor,
    *,
    decay=DEFAULT_DECAY,
    threshold: float = DEFAULT_THRESHOLD,
    v_reset: float | None = 0.0,
    surrogate=DEFAULT_SURROGATE,
    detach_reset: bool = False,
    v_init: torch.Tensor | None = None,
    return_state: bool = False,
    backend: str = "auto",
    memory: str = "potential",
):
    """Multi-step LIF neurons of the temporal-fusion paper, Eq. (1)-(2), over ``x`` of shape ``[T, *]``.

    ``v[t] = decay * v[t-1] * (1 - y[t-1]) + v_reset * y[t-1] + x[t]`` and ``y[t] = (v[t] >= threshold)``;
    ``v_reset=None`` subtracts the threshold instead (soft reset: ``v[t] = decay*(v[t-1] - threshold*y[t-1]) + x[t]``).
    ``decay`` is a number or a learnable tensor (scalar, or per channel: dim 2 of ``[T, B, C, ...]``, dim 1 of
    ``[T, C]``) in ``[0, 1]``; ``decay=1`` is an integrate-and-fire neuron. ``threshold`` must be > 0 and a hard
    ``v_reset`` below it; NaN and inf are rejected everywhere (:func:`check_decay` says why). ``v_init`` is
    ``v[0]`` of Eq. (1) (default ``v_reset``, the paper's V_rest; 0 for soft reset), and the returned state is
    ``v[T]``: passing it as ``v_init`` of a later call continues the sequence exactly. ``memory='recompute'``
    saves nothing but ``x`` for backward.

    Returns the spikes (dtype and shape of ``x``), and with ``return_state=True`` also the state.
    """
    neuron = paper_lif(threshold, v_reset, surrogate, detach_reset, backend=backend, memory=memory)
    check_decay(decay)
    spikes, state = run_lif(x, decay, neuron, v_init=v_init)
    return (spikes, state) if return_state else spikes


def if_neuron(x: torch.Tensor, *, threshold: float, **kwargs):
    """Integrate-and-fire neurons: :func:`lif` with ``decay=1``."""
    return lif(x, decay=1.0, threshold=threshold, **kwargs)
