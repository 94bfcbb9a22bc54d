"""What every backend shares: compute dtypes, the leak-per-neuron layout, the checks of double backward and freed
graphs."""

from __future__ import annotations

import contextlib
import math
import struct

import torch


def finite(value) -> bool:
    """``math.isfinite(value)`` for a real number, also while torch.compile traces it as a symbolic float: a module's
    float option becomes one once a second module with another value compiles the same code, and ``math.isfinite``
    cannot take it (a comparison can)."""
    return abs(value) < math.inf


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Membrane potentials are kept in float32 for half-precision inputs, in the input's dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def in_compute_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` as the kernels see it in the compute ``dtype`` (float32 or float64; an overflow is inf), rounded on
    the host: checking a parameter in that dtype costs no GPU sync."""
    if dtype == torch.float64:
        return value
    try:  # C's double -> float conversion, round to nearest (numpy's, under np.errstate, costs ~10x more)
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def reduce_leak_grad(per_neuron: torch.Tensor, channels: int, inner: int) -> torch.Tensor:
    """Sum a per-neuron leak gradient ``[N]`` into the leak's ``[C]`` (neuron n uses ``(n // inner) % C``)."""
    return per_neuron.reshape(-1, channels, inner).sum(dim=(0, 2))


def keeps_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph`` / ``create_graph``); True when unknown."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def refuse_double_backward(what: str, remedy: str) -> None:
    """Raise when a backward runs with ``create_graph=True``: a fused backward is a kernel, not differentiable
    ops, so a gradient of it would silently miss every term through the neuron."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            f"double backward (create_graph=True: gradient penalties, Hessians, MAML) through {what} is not "
            f"supported: its backward is a fused kernel, not differentiable ops; {remedy}"
        )


def saved_tensors(ctx, what: str) -> tuple:
    """``ctx.saved_tensors``, or where an earlier backward freed them, an error that says why that happens with
    spiking layers and what to do: a state kept from the previous batch leads the new backward into the old graph."""
    try:
        return ctx.saved_tensors
    except RuntimeError as err:
        if "a second time" not in str(err):
            raise
        raise RuntimeError(
            f"backward reached {what} through a graph that an earlier backward already freed: a neuron state kept "
            "from the previous batch (layers that keep their states between calls, such as spikefuse.compat's "
            "snnTorch modules, carry them over). Reset the states between batches (spikefuse.nn.reset_states(net), "
            "or each layer's reset_mem()), or detach them (detach_hidden()) for truncated BPTT"
        ) from None


def device_guard(device: torch.device):
    """The CUDA device context a Triton launch on ``device`` needs (its kernels run on the current device, which need
    not be the tensors'); no context for CPU tensors (Triton's interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
