"""What every backend shares: compute dtypes, the leak-per-neuron layout, the checks of double backward and freed
graphs."""

from __future__ import annotations

import contextlib
import functools
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


class NonFiniteError(ValueError):
    """A NaN or an inf reached spiking neurons (their input, a state, a recurrent current): they refuse it, as a
    NaN membrane would stay silent and an infinite one fire at every step, leaving no NaN in the spikes.
    ``where``: what held it, and the first step and neuron where known."""

    def __init__(self, where: str):
        self.where = where
        super().__init__(
            f"spikefuse: {where}; the neurons refuse it: a NaN membrane would stay silent and an infinite one fire "
            "at every later step, leaving no NaN for a training loop's check to see. Find where it comes from (a "
            "diverged loss, a division by zero, a corrupt sample) or clean it first (torch.nan_to_num)"
        )


def check_inputs_finite(x2: torch.Tensor, init, others=(), otherwise: str | None = None) -> None:
    """:func:`refuse_non_finite` where the input ``x2``, a state of ``init`` or a tensor of ``others`` (what
    ``otherwise`` names) holds a NaN or an inf: the reference's check, a pass of its own (the fused kernels flag it
    as they read it). Not while torch.compile traces or a torch.func transform runs, where a value cannot decide
    control flow."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return
    if not all(bool(torch.isfinite(t).all()) for t in (x2, *init, *others)):
        refuse_non_finite(x2, init, otherwise=otherwise)


def refuse_flagged(flags: torch.Tensor, x2: torch.Tensor, init, otherwise: str | None = None) -> None:
    """:func:`refuse_non_finite` where a kernel's ``flags`` (per block or per neuron) are not all 0 and reading them
    costs nothing: CPU tensors (the numba kernels, Triton's interpreter). On a GPU that read would wait for the
    kernel (a host sync per call, which also breaks CUDA graph capture), so there the neurons' spikes carry it
    instead: a neuron that read a NaN or an inf spikes NaN from then on, so the loss becomes NaN, which a training
    loop's check sees."""
    if flags.device.type == "cpu" and bool(flags.ne(0).any()):
        refuse_non_finite(x2, init, otherwise=otherwise)


def refuse_non_finite(x2: torch.Tensor, init, otherwise: str | None = None) -> None:
    """Raise the error of a neuron that read a NaN or an inf (a kernel's flag said so): from the input ``x2``
    (``[T, ...]``) or an initial state in ``init``, saying where first; ``otherwise``: what else it can have come from
    when both are finite."""
    bad = ~torch.isfinite(x2.reshape(x2.shape[0], -1))
    if bad.any():
        t, n = (int(i) for i in bad.nonzero()[0])
        where = f"the input holds NaN or inf (first at step {t}, neuron {n} of {bad.shape[1]})"
    elif any(not bool(torch.isfinite(v).all()) for v in init):
        where = "an initial state (v_init, or a state passed back) holds NaN or inf"
    else:
        where = otherwise or "the input holds NaN or inf"
    raise NonFiniteError(where)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids: ``triton.cdiv`` is a constexpr function (Triton 3.9) that costs ~5 us per
    call on the host, several times per layer call."""
    return -(-a // b)


def surrogate_params(surrogate, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``surrogate.params()`` as a tensor of ``dtype`` on ``device``, made once: a host-to-device copy at every call
    would cost a transfer per backward and make the step impossible to capture in a CUDA graph."""
    return _surrogate_params(tuple(float(v) for v in surrogate.params()), dtype, device)


@functools.lru_cache(maxsize=256)
def _surrogate_params(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def device_guard(device: torch.device):
    """The CUDA device context a Triton launch on ``device`` needs (its kernels run on the current device, which need
    not be the tensors'); no context for CPU tensors (Triton's interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
