"""The public functions: validate, then dispatch to a backend. No arithmetic of the neuron lives here."""

from __future__ import annotations

import math
import numbers

import torch

from . import ops
from .ops import autograd as _autograd  # registers the spikefuse:: custom ops
from . import params as P
from .ops import reference
from .ops.common import compute_dtype
from .surrogate import Sigmoid, resolve

__all__ = ["lif", "if_neuron", "spiking_neuron", "channel_layout"]


def channel_layout(shape: torch.Size, channels: int) -> int:
    """``inner`` for a per-channel leak of ``channels`` entries on an input of ``shape`` ``[T, *]``.

    The channel dimension is dim 2 of ``[T, B, C, ...]`` inputs and dim 1 of ``[T, C]`` inputs; ``inner`` is the
    number of neurons that follow one channel entry in memory (H*W for ``[T, B, C, H, W]``).
    """
    if channels == 1:
        return 1
    if len(shape) < 2:
        raise ValueError(f"a per-channel parameter of {channels} entries needs an input of rank >= 2, got {tuple(shape)}")
    dim = 2 if len(shape) >= 3 else 1
    if shape[dim] != channels:
        raise ValueError(
            f"per-channel parameter has {channels} entries but the input {tuple(shape)} has {shape[dim]} channels "
            f"in dim {dim} (inputs are [T, B, C, ...] or [T, C])"
        )
    return math.prod(shape[dim + 1 :])


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must have a floating-point dtype (float32, float64, float16, bfloat16), got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("x must have a time dimension first: shape [T, *], got a 0-dim tensor")
    if x.shape[0] == 0:
        raise ValueError(f"x has T=0 time steps (shape {tuple(x.shape)}); a spiking layer needs T >= 1")


def _checks_values(t: torch.Tensor | None = None) -> bool:
    """Whether to look at tensor values (a sync on GPUs): not while torch.compile traces, nor in meta tensors,
    which have none."""
    return not torch.compiler.is_compiling() and (t is None or t.device.type != "meta")


def _leak_tensor(leak, x: torch.Tensor, name: str) -> torch.Tensor:
    cdt = compute_dtype(x.dtype)
    if isinstance(leak, torch.Tensor):
        if not leak.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {leak.dtype}")
        if leak.device != x.device:
            raise ValueError(f"{name} is on {leak.device} but x is on {x.device}: put both on the same device")
        if leak.ndim > 1:
            raise ValueError(f"{name} must be a scalar or a 1-D per-channel tensor, got shape {tuple(leak.shape)}")
        _check_finite(leak, name)
        return leak.reshape(-1).to(cdt).contiguous()
    if isinstance(leak, bool) or not isinstance(leak, numbers.Real) or not math.isfinite(leak):
        raise TypeError(f"{name} must be a finite number or a tensor, got {leak!r}")
    return torch.full((1,), float(leak), dtype=cdt, device=x.device)


def _first_bad(values: torch.Tensor, bad: torch.Tensor) -> str:
    """``"channel i: value"`` of the first flagged entry (``"value"`` for a scalar), for error messages."""
    flat, flags = values.detach().reshape(-1), bad.reshape(-1)
    i = int(flags.nonzero()[0, 0])
    return f"{flat[i].item()}" if flat.numel() == 1 else f"channel {i}: {flat[i].item()}"


def _check_finite(values: torch.Tensor, name: str) -> None:
    if _checks_values(values) and not bool(torch.isfinite(values).all()):
        raise ValueError(
            f"{name} holds NaN or inf ({_first_bad(values, ~torch.isfinite(values))}); a learnable {name} gets "
            "there when training diverges: lower the learning rate"
        )


def check_decay(decay, name: str = "decay") -> None:
    """The paper's leak ``k`` lies in ``[0, 1]``: 0 forgets at every step, 1 integrates without leak (IF).

    Outside that range the membrane grows without bound (``k > 1``) or flips sign every step (``k < 0``): no
    dynamics of the papers or peers, so it is rejected, for numbers and tensors alike (a learnable decay too, at
    forward time; NaN and inf with their own message). Non-finite numbers are left to :func:`_leak_tensor`.
    """
    if isinstance(decay, torch.Tensor):
        if not _checks_values(decay) or not decay.numel():
            return
        bad = ~((decay >= 0) & (decay <= 1))  # NaN too: every comparison with it is False
        if bool(bad.any()):  # the only sync when the values are fine
            _check_finite(decay, name)
            raise ValueError(
                f"{name} must lie in [0, 1], got {_first_bad(decay, bad)}; keep a learnable {name} in range, e.g. "
                f"with `{name}.data.clamp_(0, 1)` after each optimizer step"
            )
    elif isinstance(decay, numbers.Real) and math.isfinite(decay) and not 0.0 <= decay <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1] (0: no memory, 1: no leak), got {decay}")


def _check_no_functorch(what: str, remedy: str = "use backend='reference' (plain PyTorch ops) under torch.func") -> None:
    if _checks_values() and torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"torch.func transforms (grad, vmap, jacrev, ...) cannot look inside {what}; {remedy}")


def spiking_neuron(x, leak, spec: P.NeuronSpec, *, v_init=None, backend: str = "auto", memory: str = "potential"):
    """Run the neuron of ``spec`` over ``x`` of shape ``[T, *]``; returns ``(spikes, state)``.

    ``leak`` is the ``k`` of :mod:`spikefuse.params` (a number, or a scalar / per-channel tensor that may require
    grad). ``state`` has shape ``x.shape[1:]`` and continues the sequence exactly when passed back as ``v_init``.
    """
    _check_input(x)
    concrete = ops.resolve_backend(backend, x.device)
    if concrete != "reference":
        _check_no_functorch(f"the fused {concrete!r} kernels")
    P.check_memory_mode(memory)
    k = _leak_tensor(leak, x, "decay")
    cdt = compute_dtype(x.dtype)
    t_steps, trailing = x.shape[0], x.shape[1:]
    n = math.prod(trailing)
    inner = channel_layout(x.shape, k.numel())
    if v_init is None:  # one start value shared by every neuron: the kernels read nothing of size N for it
        v0 = torch.full((1,), spec.v_reset if spec.reset == P.HARD else 0.0, dtype=cdt, device=x.device)
    else:
        if not isinstance(v_init, torch.Tensor) or not v_init.is_floating_point():
            raise TypeError("v_init must be a floating-point tensor of shape x.shape[1:]")
        if v_init.shape != trailing:
            raise ValueError(f"v_init has shape {tuple(v_init.shape)} but x.shape[1:] is {tuple(trailing)}")
        if v_init.device != x.device:
            raise ValueError(f"v_init is on {v_init.device} but x is on {x.device}: put both on the same device")
        v0 = v_init.reshape(n).to(cdt)
    x2 = x.reshape(t_steps, n)
    if concrete == "reference" or n == 0:
        spikes, state, _ = reference.run(x2, k, inner, v0, spec.kernel_args())
    else:
        args = spec.kernel_args()
        spikes, state, _ = _autograd.neuron(
            x2.contiguous(), k, v0.contiguous(), inner, list(args[:7]), list(args[7:]), concrete, P.MEMORY_MODES[memory]
        )
    return spikes.reshape(x.shape), state.reshape(trailing)


def _paper_spec(threshold, v_reset, surrogate, detach_reset) -> P.NeuronSpec:
    """The spec of the paper's LIF, with its parameter ranges: Eq. (1) leaks toward 0, so the resting potential
    is 0 and a threshold <= 0 would fire at rest; a hard reset to ``v_reset >= threshold`` would fire forever."""
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
        raise TypeError(f"threshold must be a number, got {threshold!r}")
    if v_reset is not None and (isinstance(v_reset, bool) or not isinstance(v_reset, numbers.Real)):
        raise TypeError(f"v_reset must be a number or None (soft reset), got {v_reset!r}")
    if math.isfinite(threshold) and threshold <= 0:
        raise ValueError(f"threshold must be > 0 (the membrane rests at 0 and would fire at rest), got {threshold}")
    if v_reset is not None and math.isfinite(v_reset) and math.isfinite(threshold) and v_reset >= threshold:
        raise ValueError(f"v_reset must be below the threshold ({threshold}), got {v_reset}: a neuron reset to "
                         "v_reset would fire again at once")
    return P.NeuronSpec(
        threshold=float(threshold),
        v_reset=0.0 if v_reset is None else float(v_reset),
        reset=P.SOFT if v_reset is None else P.HARD,
        surrogate=resolve(surrogate),
        detach_reset=bool(detach_reset),
    )


def lif(
    x: torch.Tensor,
    *,
    decay,
    threshold: float,
    v_reset: float | None = 0.0,
    surrogate=Sigmoid(4.0),
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
    ``v[T]``: passing it as ``v_init`` of a later call continues the sequence exactly. ``memory='recompute'`` saves nothing but ``x`` for backward.

    Returns the spikes (dtype and shape of ``x``), and with ``return_state=True`` also the state.
    """
    spec = _paper_spec(threshold, v_reset, surrogate, detach_reset)
    check_decay(decay)
    spikes, state = spiking_neuron(x, decay, spec, v_init=v_init, backend=backend, memory=memory)
    return (spikes, state) if return_state else spikes


def if_neuron(x: torch.Tensor, *, threshold: float, **kwargs):
    """Integrate-and-fire neurons: :func:`lif` with ``decay=1``."""
    return lif(x, decay=1.0, threshold=threshold, **kwargs)

from .bn_functional import batchnorm_lif, conv_batchnorm_lif  # noqa: E402  (it builds on the functions above)

__all__ += ["batchnorm_lif", "conv_batchnorm_lif"]
