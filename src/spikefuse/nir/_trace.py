"""Which layers a network calls on a sample input, and how their outputs feed each other.

The network runs once. Forward pre-hooks record every call of a *layer* (a module that is one NIR node, chosen by
the caller) with the shape of its input, and a :class:`~torch.overrides.TorchFunctionMode` watches the tensors that
pass between layers: the one operation NIR can express there is the sum of layer outputs (NIR sums all edges into
a node: a residual add), so any other operation on them raises, naming the operation. Containers (modules with
children that are not layers, e.g. ``nn.Sequential`` or a ResNet block) are traced through; ``nn.Identity`` passes
its input on; a module that is neither raises before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

INPUT, OUTPUT = "input", "output"

_ADDS = {
    torch.add,
    torch.Tensor.add,
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.add_,
    torch.Tensor.__iadd__,
}


def _tensors(value):
    """The tensors in ``value``, looking into lists, tuples and dicts (torch functions' argument containers)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


@dataclass
class LayerCall:
    """One call of a layer: its node ``name``, the nodes whose outputs are summed into its input (``sources``),
    and what ``visit`` returned for it."""

    name: str
    module: nn.Module
    sources: tuple[str, ...]
    node: Any


@dataclass
class Trace:
    calls: list[LayerCall]
    input_shape: tuple[int, ...]
    output_sources: tuple[str, ...]
    output_shape: tuple[int, ...]


class _Tracer(TorchFunctionMode):
    def __init__(self, model: nn.Module, is_layer: Callable[[nn.Module], bool], visit: Callable):
        super().__init__()
        self.is_layer, self.visit = is_layer, visit
        self.names = {id(m): name for name, m in model.named_modules()}
        self.sources: dict[int, tuple[str, ...]] = {}
        self.alive: list[torch.Tensor] = []  # keeps traced tensors alive, so their ids are not reused
        self.calls: list[LayerCall] = []
        self.taken = {INPUT, OUTPUT}
        self.active: nn.Module | None = None  # the layer running now: its inner operations are not traced

    def mark(self, tensor: torch.Tensor, sources: tuple[str, ...]) -> None:
        self.sources[id(tensor)] = sources
        self.alive.append(tensor)

    def traced(self, value) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in self.sources

    def describe(self, module: nn.Module) -> str:
        name = self.names.get(id(module)) or "the network itself"
        return f"{name} ({type(module).__name__})"

    def unique_name(self, module: nn.Module) -> str:
        base = self.names.get(id(module)) or type(module).__name__.lower()
        name, i = base, 1
        while name in self.taken:  # a layer called twice becomes two nodes
            i += 1
            name = f"{base}#{i}"
        self.taken.add(name)
        return name

    def pre_hook(self, module: nn.Module, args) -> None:
        if self.active is not None:
            return
        if not self.is_layer(module):
            if isinstance(module, nn.Identity) or next(module.children(), None) is not None:
                return
            raise ValueError(f"{self.describe(module)} has no NIR node")
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise ValueError(f"{self.describe(module)} must be called with one tensor, got {len(args)} arguments")
        x = args[0]
        if not self.traced(x):
            raise ValueError(
                f"the input of {self.describe(module)} is not computed from the network input (a constant or a "
                "parameter?): a NIR node's input comes from the graph's input or from other nodes"
            )
        name = self.unique_name(module)
        node = self.visit(module, name, tuple(x.shape[2:]))
        self.calls.append(LayerCall(name, module, self.sources[id(x)], node))
        self.active = module

    def hook(self, module: nn.Module, args, output) -> None:
        if module is not self.active:
            return
        self.active = None
        if not isinstance(output, torch.Tensor):
            raise ValueError(f"{self.describe(module)} must return one tensor, got {type(output).__name__}")
        self.mark(output, (self.calls[-1].name,))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.active is not None:
            return out
        inputs = list(_tensors((args, kwargs)))
        if not any(self.traced(a) for a in inputs) or not isinstance(out, torch.Tensor):
            return out  # not on the signal path (parameters, constants) or a query (x.shape, x.ndim)
        name = getattr(func, "__name__", repr(func))
        if func in _ADDS and len(args) == 2 and not kwargs:
            a, b = args
            if self.traced(a) and self.traced(b) and a.shape == b.shape:
                self.mark(out, self.sources[id(a)] + self.sources[id(b)])
                return out
            raise ValueError(
                f"{name}: NIR can add the outputs of two layers of one shape (edges into one node are summed), "
                f"not a constant or a broadcast; got shapes {[tuple(t.shape) for t in inputs]}"
            )
        raise ValueError(
            f"{name}() is applied between layers: NIR has no node for it (only sums of layer outputs are allowed "
            "there); put the operation in a layer that has a NIR node"
        )


def trace(model: nn.Module, sample_input: torch.Tensor, is_layer: Callable[[nn.Module], bool], visit: Callable):
    """Run ``model`` on ``sample_input`` ``[T, B, ...]`` and return its :class:`Trace`.

    ``visit(module, name, in_shape)`` is called before each layer call runs (it may raise to refuse the layer);
    its result is kept in :attr:`LayerCall.node`.
    """
    tracer = _Tracer(model, is_layer, visit)
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(tracer.pre_hook))
        handles.append(module.register_forward_hook(tracer.hook))
    x = sample_input.detach().clone()
    tracer.mark(x, (INPUT,))
    try:
        with torch.no_grad(), tracer:
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    if not tracer.traced(out):
        raise ValueError(f"the network must return one tensor computed from its input, got {type(out).__name__}")
    return Trace(tracer.calls, tuple(x.shape[2:]), tracer.sources[id(out)], tuple(out.shape[2:]))
