"""Modules: multi-step neurons and helpers for ``[T, B, ...]`` tensors."""

from .containers import Flatten, SeqToBatch
from .neurons import IF, LIF

__all__ = ["LIF", "IF", "SeqToBatch", "Flatten"]
