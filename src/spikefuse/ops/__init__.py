"""Backends. The neuron engine (:mod:`spikefuse.ops.engine`) runs every neuron from its definition, one module per
backend, imported lazily: numba and Triton are only loaded by the first call that needs them; its reference
(:mod:`spikefuse.ops.engine.reference`) is the oracle of them all. Beside it: the fused pieces beside the neurons
(max pooling, bit-packed spikes) and the recurrent layers (:mod:`spikefuse.ops.recurrent`); the BatchNorm fused with
the neurons is :mod:`spikefuse.batchnorm`.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "reference", "cpu", "triton")


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(repr(b) for b in BACKENDS)}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn ``backend`` into a concrete one that can run on ``device``, or raise an error that says what to do."""
    check_backend_name(backend)
    if backend == "auto":
        if device.type == "cpu":
            return "cpu"
        if device.type == "cuda":
            return "triton"
        raise ValueError(
            f"no fused backend for device type {device.type!r}: use backend='reference' (plain PyTorch) on it"
        )
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(
            f"backend='cpu' needs CPU tensors, got a tensor on {device}: move it with .cpu() or use backend='triton'"
        )
    if backend == "triton":
        if device.type == "cpu" and not triton_interpreted():
            raise ValueError(
                "backend='triton' needs CUDA tensors; to run the Triton kernels on the CPU (slowly, for testing) "
                "set TRITON_INTERPRET=1 before importing triton, or use backend='cpu'"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' runs on CUDA devices, not {device}")
    return backend
