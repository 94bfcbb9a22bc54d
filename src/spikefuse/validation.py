"""Input checks shared by the functional entry points (:mod:`spikefuse.functional`, :mod:`spikefuse.bn_functional`,
:mod:`spikefuse.neuron_functional`, :mod:`spikefuse.recurrent_functional`) and the ``nn`` modules: one place for each
message, beneath the entry points, which do not import each other."""

from __future__ import annotations

import math
import numbers

import torch

from .neurons.model import NeuronModel
from .neurons.spec import MEMORY_MODES, check_memory_mode
from .ops import resolve_backend
from .ops.numerics import compute_dtype, finite, in_compute_dtype
from .ops.engine import DTYPES as ENGINE_DTYPES
from .surrogate import resolve

__all__ = [
    "channel_layout",
    "check_input",
    "check_v_init",
    "checks_values",
    "leak_tensor",
    "check_finite",
    "check_decay",
    "check_no_functorch",
    "check_memory_mode",
    "resolve_neuron",
    "MEMORY_MODES",
]


def channel_layout(shape: torch.Size, channels: int) -> int:
    """``inner`` for a per-channel leak of ``channels`` entries on an input of ``shape`` ``[T, *]``.

    The channel dimension is dim 2 of ``[T, B, C, ...]`` inputs and dim 1 of ``[T, C]`` inputs; ``inner`` is the
    number of neurons that follow one channel entry in memory (H*W for ``[T, B, C, H, W]``).
    """
    if channels == 1:
        return 1
    if len(shape) < 2:
        raise ValueError(
            f"a per-channel parameter of {channels} entries needs an input of rank >= 2, got {tuple(shape)}"
        )
    dim = 2 if len(shape) >= 3 else 1
    if shape[dim] != channels:
        raise ValueError(
            f"per-channel parameter has {channels} entries but the input {tuple(shape)} has {shape[dim]} channels "
            f"in dim {dim} (inputs are [T, B, C, ...] or [T, C])"
        )
    return math.prod(shape[dim + 1 :])


def check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must have a floating-point dtype (float32, float64, float16, bfloat16), got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("x must have a time dimension first: shape [T, *], got a 0-dim tensor")
    if x.shape[0] == 0:
        raise ValueError(f"x has T=0 time steps (shape {tuple(x.shape)}); a spiking layer needs T >= 1")


def check_v_init(v_init, x: torch.Tensor) -> None:
    """A start state given as ``v_init``: a floating-point tensor of shape ``x.shape[1:]`` on ``x``'s device."""
    if not isinstance(v_init, torch.Tensor) or not v_init.is_floating_point():
        raise TypeError("v_init must be a floating-point tensor of shape x.shape[1:]")
    if v_init.shape != x.shape[1:]:
        raise ValueError(f"v_init has shape {tuple(v_init.shape)} but x.shape[1:] is {tuple(x.shape[1:])}")
    if v_init.device != x.device:
        raise ValueError(f"v_init is on {v_init.device} but x is on {x.device}: put both on the same device")


def checks_values(t: torch.Tensor | None = None) -> bool:
    """Whether to look at tensor values (a sync on GPUs): not while torch.compile traces, nor in meta tensors,
    which have none."""
    return not torch.compiler.is_compiling() and (t is None or t.device.type != "meta")


def leak_tensor(leak, x: torch.Tensor, name: str) -> torch.Tensor:
    cdt = compute_dtype(x.dtype)
    if isinstance(leak, torch.Tensor):
        if not leak.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {leak.dtype}")
        if leak.device != x.device:
            raise ValueError(f"{name} is on {leak.device} but x is on {x.device}: put both on the same device")
        if leak.ndim > 1:
            raise ValueError(f"{name} must be a scalar or a 1-D per-channel tensor, got shape {tuple(leak.shape)}")
        check_finite(leak, name)
        return leak.reshape(-1).to(cdt).contiguous()
    if isinstance(leak, bool) or not isinstance(leak, numbers.Real) or not finite(leak):
        raise TypeError(f"{name} must be a finite number or a tensor, got {leak!r}")
    if not torch.compiler.is_compiling() and not math.isfinite(in_compute_dtype(float(leak), cdt)):
        raise ValueError(
            f"{name} must be finite in {str(cdt).removeprefix('torch.')}, the dtype the neurons compute "
            f"in, got {leak!r}"
        )
    return torch.full((1,), float(leak), dtype=cdt, device=x.device)


def first_bad(values: torch.Tensor, bad: torch.Tensor) -> str:
    """``"channel i: value"`` of the first flagged entry (``"value"`` for a scalar), for error messages."""
    flat, flags = values.detach().reshape(-1), bad.reshape(-1)
    i = int(flags.nonzero()[0, 0])
    return f"{flat[i].item()}" if flat.numel() == 1 else f"channel {i}: {flat[i].item()}"


def check_finite(values: torch.Tensor, name: str) -> None:
    if checks_values(values) and not bool(torch.isfinite(values).all()):
        raise ValueError(
            f"{name} holds NaN or inf ({first_bad(values, ~torch.isfinite(values))}); a learnable {name} gets "
            "there when training diverges: lower the learning rate"
        )


def check_decay(decay, name: str = "decay") -> None:
    """The paper's leak ``k`` lies in ``[0, 1]``: 0 forgets at every step, 1 integrates without leak (IF).

    Outside that range the membrane grows without bound (``k > 1``) or flips sign every step (``k < 0``): no
    dynamics of the papers or peers, so it is rejected, for numbers and tensors alike (a learnable decay too, at
    forward time; NaN and inf with their own message). Non-finite numbers are left to :func:`leak_tensor`.
    """
    if isinstance(decay, torch.Tensor):
        if not checks_values(decay) or not decay.numel():
            return
        bad = ~((decay >= 0) & (decay <= 1))  # NaN too: every comparison with it is False
        if bool(bad.any()):  # the only sync when the values are fine
            check_finite(decay, name)
            raise ValueError(
                f"{name} must lie in [0, 1], got {first_bad(decay, bad)}; keep a learnable {name} in range, e.g. "
                f"with `{name}.data.clamp_(0, 1)` after each optimizer step"
            )
    elif isinstance(decay, numbers.Real) and finite(decay) and not 0.0 <= decay <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1] (0: no memory, 1: no leak), got {decay}")


def check_no_functorch(what: str, remedy: str = "use backend='reference' (plain PyTorch ops) under torch.func") -> None:
    if checks_values() and torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"torch.func transforms (grad, vmap, jacrev, ...) cannot look inside {what}; {remedy}")


def _param_tensor(model: NeuronModel, name: str, value, x: torch.Tensor) -> torch.Tensor:
    """A parameter as ``[1]`` or ``[C]`` (per channel) in x's dtype, differentiable when it is a tensor: the checks
    and conversion of LIF's leak, then the channel layout."""
    tensor = leak_tensor(value, x, f"{model.name}: {name}")
    channel_layout(x.shape, tensor.numel())
    return tensor


def _initial_state(model: NeuronModel, state: str, tensors: list, x: torch.Tensor, dtype) -> torch.Tensor:
    """``state``'s value before the first step, ``[1]`` (shared by every neuron) or ``[N]``: the model's number, or
    the value of the parameter it names -- per neuron when that parameter is per channel or requires grad (the
    gradient of the start then reaches it through autograd)."""
    value = model.initial_value(state)
    if not isinstance(value, str):
        return torch.full((1,), value, dtype=dtype, device=x.device)
    param = tensors[model.params.index(value)].to(dtype).reshape(-1)
    if param.numel() == 1 and not param.requires_grad:
        return param
    n = math.prod(x.shape[1:])
    inner = channel_layout(x.shape, param.numel())
    return param.repeat_interleave(inner).repeat(n // (param.numel() * inner)).contiguous()


def resolve_neuron(x: torch.Tensor, model: NeuronModel, surrogate, state, backend: str, params: dict) -> tuple:
    """The checks of :func:`neuron`'s neuron arguments for the input ``x`` (already checked by ``check_input``);
    returns ``(concrete backend, surrogate, parameter tensors, inner, initial states)`` as the engine takes them:
    parameters ``[1]`` or ``[C]`` with ``inner`` neurons per channel run, initial states ``[N]`` or ``[1]`` (the
    model's initial value, shared by every neuron)."""
    if not isinstance(model, NeuronModel):
        raise TypeError(f"model must be a spikefuse.neurons.NeuronModel, got {type(model).__name__}")
    if x.dtype not in ENGINE_DTYPES:
        raise TypeError(
            f"{model.name} neurons run in float32, float64, float16 or bfloat16, got x of {x.dtype}: cast x first"
        )
    concrete = resolve_backend(backend, x.device)
    if concrete != "reference":
        check_no_functorch(f"the fused {model.name} kernels")
    surrogate = resolve(surrogate)
    unknown = set(params) - set(model.params)
    if unknown:
        raise TypeError(
            f"{model.name} has no parameter {sorted(unknown)[0]!r}; its parameters: {', '.join(model.params)}"
        )
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
        init = [_initial_state(model, k, tensors, x, cdt) for k in model.states]
    else:
        if isinstance(state, dict):
            missing = [k for k in model.states if k not in state]
            if missing or set(state) - set(model.states):
                raise ValueError(
                    f"{model.name}: state must hold exactly {', '.join(model.states)}, got {sorted(state)}"
                )
            state = [state[k] for k in model.states]
        if not isinstance(state, (tuple, list)) or len(state) != len(model.states):
            raise ValueError(
                f"{model.name}: state must be a tuple of {len(model.states)} tensors "
                f"({', '.join(model.states)}) or a dict, got {type(state).__name__}"
            )
        init = []
        for k, v in zip(model.states, state):
            if not isinstance(v, torch.Tensor) or v.shape != trailing:
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(
                    f"{model.name}: state {k} must be a tensor of shape {tuple(trailing)} (x.shape[1:]), got {got}"
                )
            if v.device != x.device:
                raise ValueError(f"{model.name}: state {k} is on {v.device} but x is on {x.device}")
            init.append(v.reshape(-1).to(cdt).contiguous())
    return concrete, surrogate, tensors, inner, init
