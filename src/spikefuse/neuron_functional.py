"""``spikefuse.neuron``: any :class:`~spikefuse.neurons.NeuronModel` over all T steps in one fused call.

Exported as :func:`spikefuse.neuron`; the backends are :mod:`spikefuse.ops.engine`.
"""

from __future__ import annotations

import torch

from .neurons import NeuronModel
from .neurons.spec import neuron_spec
from .ops.engine import autograd as engine_autograd
from .surrogate import DEFAULT as DEFAULT_SURROGATE, Surrogate
from .validation import check_input, check_memory_mode, resolve_neuron

__all__ = ["neuron"]


def neuron(
    x: torch.Tensor,
    model: NeuronModel,
    *,
    surrogate: Surrogate | str = DEFAULT_SURROGATE,
    detach_reset: bool = False,
    state=None,
    return_state: bool = False,
    backend: str = "auto",
    memory: str = "potential",
    **params,
):
    """Run ``model``'s neurons over ``x`` of shape ``[T, *]`` (``[T, B, C, ...]`` or ``[T, C]`` for per-channel
    parameters); returns the spikes (shape and dtype of ``x``) and, with ``return_state=True``, a tuple of the final
    states (``model.states`` order, each of shape ``x.shape[1:]``), which continue the sequence exactly when passed
    back as ``state``. A float16 / bfloat16 ``x`` runs in float32, its parameters and states float32.

    ``params``: every parameter of the model (those with a default may be left out): a number, or a tensor of one
    value or one per channel that may require grad. ``state``: None (the model's initial values) or the states, as
    a tuple in ``model.states`` order or a dict, each of shape ``x.shape[1:]``. ``surrogate``: the spike's
    derivative in backward (a :mod:`spikefuse.surrogate` instance or name). ``detach_reset``: no gradient through
    the previous step's spike ``s`` in the step. ``backend``: "auto" (the fused kernels generated for the tensors'
    device: numba on the CPU, Triton on CUDA), "cpu", "triton" or "reference" (the serial PyTorch loop, any
    device). ``memory``: "potential" (the default, as :func:`spikefuse.lif`: forward keeps every step's states, ``T x``
    the input's size per state, and backward reads them) or "recompute" (backward recomputes the states from ``x``:
    nothing but the input is kept; less memory, slower)."""
    check_input(x)
    check_memory_mode(memory)
    concrete, surrogate, tensors, inner, init = resolve_neuron(x, model, surrogate, state, backend, params)
    spec = neuron_spec(model, surrogate, detach_reset, backend=backend, memory=memory)
    t_steps = x.shape[0]
    x2 = x.reshape(t_steps, -1)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = engine_autograd.neuron(x2, tensors, init, inner, spec, concrete)
    spikes = out[0].reshape(x.shape)
    if not return_state:
        return spikes
    return spikes, tuple(v.reshape(x.shape[1:]) for v in out[1:])
