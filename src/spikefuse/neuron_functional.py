"""``spikefuse.neuron``: any :class:`~spikefuse.neurons.NeuronModel` over all T steps in one fused call.

Exported as :func:`spikefuse.neuron`; the backends are :mod:`spikefuse.ops.engine`.
"""

from __future__ import annotations

import torch

from .validation import channel_layout, check_input, check_memory_mode, check_no_functorch, leak_tensor
from .neurons import NeuronModel
from .ops import resolve_backend
from .ops.common import compute_dtype
from .ops.engine import DTYPES as ENGINE_DTYPES, autograd as engine_autograd
from .surrogate import Surrogate, resolve

__all__ = ["neuron", "resolve_neuron"]


def _param_tensor(model: NeuronModel, name: str, value, x: torch.Tensor) -> torch.Tensor:
    """A parameter as ``[1]`` or ``[C]`` (per channel) in x's dtype, differentiable when it is a tensor: the checks
    and conversion of LIF's leak, then the channel layout."""
    tensor = leak_tensor(value, x, f"{model.name}: {name}")
    channel_layout(x.shape, tensor.numel())
    return tensor


def resolve_neuron(x: torch.Tensor, model: NeuronModel, surrogate, state, backend: str, params: dict) -> tuple:
    """The checks of :func:`neuron`'s neuron arguments for the input ``x`` (already checked by ``check_input``);
    returns ``(concrete backend, surrogate, parameter tensors, inner, initial states)`` as the engine takes them:
    parameters ``[1]`` or ``[C]`` with ``inner`` neurons per channel run, initial states ``[N]`` or ``[1]`` (the
    model's initial value, shared by every neuron)."""
    if not isinstance(model, NeuronModel):
        raise TypeError(f"model must be a spikefuse.neurons.NeuronModel, got {type(model).__name__}")
    if x.dtype not in ENGINE_DTYPES:
        raise TypeError(f"{model.name} neurons run in float32, float64, float16 or bfloat16, got x of {x.dtype}: "
                        "cast x first")
    concrete = resolve_backend(backend, x.device)
    if concrete != "reference":
        check_no_functorch(f"the fused {model.name} kernels")
    surrogate = resolve(surrogate)
    unknown = set(params) - set(model.params)
    if unknown:
        raise TypeError(f"{model.name} has no parameter {sorted(unknown)[0]!r}; its parameters: "
                        f"{', '.join(model.params)}")
    defaults = dict(model.defaults)
    missing = [p for p in model.params if p not in params and p not in defaults]
    if missing:
        raise TypeError(f"{model.name} needs the parameter {missing[0]!r} (no default)")
    tensors = [_param_tensor(model, p, params.get(p, defaults.get(p)), x) for p in model.params]
    channels = {t.numel() for t in tensors if t.numel() > 1}
    if len(channels) > 1:
        raise ValueError(f"{model.name}: per-channel parameters must have one length, got {sorted(channels)}")
    inner = channel_layout(x.shape, channels.pop()) if channels else 1
    trailing, cdt = x.shape[1:], compute_dtype(x.dtype)
    if state is None:
        init = [torch.full((1,), model.initial_value(k), dtype=cdt, device=x.device) for k in model.states]
    else:
        if isinstance(state, dict):
            missing = [k for k in model.states if k not in state]
            if missing or set(state) - set(model.states):
                raise ValueError(f"{model.name}: state must hold exactly {', '.join(model.states)}, "
                                 f"got {sorted(state)}")
            state = [state[k] for k in model.states]
        if not isinstance(state, (tuple, list)) or len(state) != len(model.states):
            raise ValueError(f"{model.name}: state must be a tuple of {len(model.states)} tensors "
                             f"({', '.join(model.states)}) or a dict, got {type(state).__name__}")  # fmt: skip
        init = []
        for k, v in zip(model.states, state):
            if not isinstance(v, torch.Tensor) or v.shape != trailing:
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"{model.name}: state {k} must be a tensor of shape {tuple(trailing)} "
                                 f"(x.shape[1:]), got {got}")
            if v.device != x.device:
                raise ValueError(f"{model.name}: state {k} is on {v.device} but x is on {x.device}")
            init.append(v.reshape(-1).to(cdt).contiguous())
    return concrete, surrogate, tensors, inner, init


def neuron(
    x: torch.Tensor,
    model: NeuronModel,
    *,
    surrogate: Surrogate | str = "atan",
    detach_reset: bool = False,
    state=None,
    return_state: bool = False,
    backend: str = "auto",
    memory: str = "recompute",
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
    device). ``memory``: "recompute" (backward recomputes the states from ``x``: nothing but the input is kept) or
    "potential" (forward keeps every step's states, ``T x`` the input's size per state, and backward reads them:
    faster, more memory)."""
    check_input(x)
    check_memory_mode(memory)
    concrete, surrogate, tensors, inner, init = resolve_neuron(x, model, surrogate, state, backend, params)
    t_steps = x.shape[0]
    x2 = x.reshape(t_steps, -1)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = engine_autograd.neuron(x2, tensors, init, inner, model, surrogate, bool(detach_reset), concrete,
                                 memory == "potential")  # fmt: skip
    spikes = out[0].reshape(x.shape)
    if not return_state:
        return spikes
    return spikes, tuple(v.reshape(x.shape[1:]) for v in out[1:])
