"""Helpers that run ordinary (single-step) layers on multi-step ``[T, B, ...]`` tensors."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SeqToBatch", "Flatten"]


class SeqToBatch(nn.Module):
    """Run ``module`` on ``[T, B, ...]`` by merging T into the batch: ``[T*B, ...] -> module -> [T, B, ...]``.

    Right for layers without state across samples (conv, linear, pooling, BatchNorm over T*B samples).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 2:
            raise ValueError(f"SeqToBatch expects [T, B, ...] input, got shape {tuple(x.shape)}")
        y = self.module(x.flatten(0, 1))
        return y.unflatten(0, x.shape[:2])


class Flatten(nn.Module):
    """Flatten ``[T, B, d1, d2, ...]`` to ``[T, B, d1*d2*...]``, keeping the time and batch dims."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 2:
            raise ValueError(f"Flatten expects [T, B, ...] input, got shape {tuple(x.shape)}")
        return x.flatten(2)
