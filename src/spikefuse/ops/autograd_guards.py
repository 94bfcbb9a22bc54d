"""What the fused ops' autograd Functions check in backward: a gradient of the gradient they cannot give, a graph
an earlier backward freed, whether the running backward keeps the graph."""

from __future__ import annotations

import torch


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
