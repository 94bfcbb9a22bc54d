"""What every backend shares: the flat spec tuple, compute dtypes, and the leak-per-neuron layout."""

from __future__ import annotations

import contextlib
import math
import struct
from typing import NamedTuple

import torch

from ..surrogate import ATan, FastSigmoid, Rectangle, Sigmoid, Surrogate, Triangle


class SpecArgs(NamedTuple):
    """:meth:`spikefuse.params.NeuronSpec.kernel_args` with names; the order is the kernels' argument order."""

    dynamics: int
    reset: int
    charge: int
    state_post_reset: int
    fire_strict: int
    detach_reset: int
    surrogate_code: int
    sg_p1: float
    sg_p2: float
    threshold: float
    v_reset: float


def unknown_surrogate(code: int) -> ValueError:
    """The error of a surrogate code that :func:`surrogate_from_args` does not know."""
    return ValueError(f"unknown surrogate code {code}: a spec tuple names the built-in surrogates only "
                      "(spikefuse.surrogate.SURROGATES); pass a surrogate of your own as the object itself")


def surrogate_from_args(spec: SpecArgs) -> Surrogate:
    """Rebuild the surrogate object from its code and parameters (the inverse of ``Surrogate.params``)."""
    code, p1, p2 = spec.surrogate_code, spec.sg_p1, spec.sg_p2
    if code == Sigmoid.code:
        return Sigmoid(p1)
    if code == ATan.code:
        return ATan(p1)
    if code == Rectangle.code:
        return Rectangle(width=2 * p1, height=p2)
    if code == Triangle.code:
        return Triangle(p1)
    if code == FastSigmoid.code:
        return FastSigmoid(p1)
    raise unknown_surrogate(code)


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
