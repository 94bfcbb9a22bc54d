"""What a Triton launch needs on the host: grid arithmetic, the surrogate's parameters made on the device once, the
device context."""

from __future__ import annotations

import contextlib
import functools

import torch


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
