"""Objects that the ``torch.library`` custom ops take by key: custom ops take tensors, numbers and strings only, so
a :class:`~spikefuse.neurons.NeuronModel`, a surrogate or the fused BatchNorm op's neuron travels as a string into
:data:`OBJECTS`.

:class:`Registered` objects register themselves when built (and when unpickled) and keep their key in the field
``op_key``, which ``torch.compile`` reads as a constant (:func:`key_of`); calling :func:`register` on a frozen
dataclass inside a compiled function fails on torch 2.11 (dynamo cannot hand such an object to a function it runs
as Python).
"""

from __future__ import annotations

import dataclasses

import torch

OBJECTS: dict[str, object] = {}


def register(obj) -> str:
    """Put ``obj`` (a frozen dataclass: its repr holds every field) into :data:`OBJECTS`; returns its key."""
    key = f"{type(obj).__module__}.{type(obj).__qualname__}:{obj!r}"
    OBJECTS.setdefault(key, obj)
    return key


def key_of(obj) -> str:
    """The key of ``obj`` for a custom op: its ``op_key`` (set when it was built; a constant to dynamo inside a
    compiled function), else :func:`register` (an object whose class skipped :class:`Registered`'s
    ``__post_init__``). Eager calls take the key every call, and a repr of every field costs more than a small
    layer's kernel: a registered object keeps its key."""
    key = getattr(obj, "op_key", "")
    if torch.compiler.is_compiling():
        return key
    return key if key and key in OBJECTS else register(obj)


def arguments(obj) -> dict:
    """The constructor arguments of a dataclass (its ``init`` fields, values as they are): what rebuilds it, without
    the ``op_key`` that ``dataclasses.asdict`` would include."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


@dataclasses.dataclass(frozen=True)
class Registered:
    """A base of frozen dataclasses that custom ops take by key: ``op_key``, set in ``__post_init__`` (a subclass
    that defines its own calls this one last)."""

    op_key: str = dataclasses.field(init=False, repr=False, compare=False, default="")

    def __post_init__(self):
        object.__setattr__(self, "op_key", register(self))

    def __setstate__(self, state):  # unpickled in another process: registered there too
        self.__dict__.update(state)
        register(self)
