"""One call that resets every neuron state a network keeps between calls."""

from __future__ import annotations

from torch import nn

__all__ = ["reset_states"]


def reset_states(net: nn.Module) -> None:
    """Reset the kept states of every module of ``net`` (``net`` itself included, at any depth): ``reset_mem()`` of
    the snnTorch-style modules (:mod:`spikefuse.compat.snntorch`), ``reset_state()`` of spikefuse's stateful layers.
    Call it between batches of a training loop whose layers keep their states."""
    for module in net.modules():
        for name in ("reset_mem", "reset_state"):
            method = getattr(module, name, None)
            if callable(method):
                method()
                break
