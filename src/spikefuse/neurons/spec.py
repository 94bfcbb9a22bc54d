"""A neuron with its settings, :class:`NeuronSpec`: the one record that the entry points (:func:`spikefuse.lif`,
:func:`spikefuse.neuron`, the ``nn`` modules, the fused BatchNorm, the drop-ins, NIR) make and check once, and hand
whole to the engine's backends (:mod:`spikefuse.ops.engine`) and the ops built on them. Norse's typed parameter
records are its model: one frozen value per layer, not a list of loose arguments through every call.

What varies per call stays out of it: the parameters that are tensors (a learnable decay), the initial states,
the input.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..ops import check_backend_name
from ..ops.numerics import compute_dtype, finite, in_compute_dtype
from ..registry import OBJECTS, key_of, register
from ..surrogate import Surrogate
from .model import NeuronModel

__all__ = ["MEMORY_MODES", "NeuronSpec", "check_memory_mode", "neuron_spec"]

#: ``memory=`` of the neuron layers: keep every step's states for backward, or only the input and recompute them.
MEMORY_MODES = ("potential", "recompute")


def check_memory_mode(memory: str) -> None:
    if memory not in MEMORY_MODES:
        raise ValueError(f"unknown memory mode {memory!r}: use one of {sorted(MEMORY_MODES)}")


def _check_constants(constants: tuple, name: str, dtype: torch.dtype) -> None:
    for param, value in constants:
        if not math.isfinite(in_compute_dtype(value, dtype)):
            raise ValueError(
                f"{name}: {param} {value} is not finite in {str(dtype).removeprefix('torch.')}, the dtype the "
                "neurons compute in"
            )


@dataclass(frozen=True)
class NeuronSpec:
    """``model``'s neurons as a layer runs them.

    A custom op takes it by :attr:`op_key`: the key of the record with what the kernels read (the model, the
    surrogate, ``detach_reset``, the memory mode) in :data:`spikefuse.registry.OBJECTS`; the constants and initial
    values become the op's tensors (:meth:`params`, :meth:`initial_states`), so a record made inside
    ``torch.compile`` may hold symbolic numbers.

    Args:
        model: the dynamics (:class:`~spikefuse.neurons.NeuronModel`).
        surrogate: the spike's derivative in backward.
        detach_reset: no gradient through the previous step's spike in the step.
        constants: ``(name, value)`` of the parameters fixed here, as numbers (a LIF's threshold and reset value);
            the others are tensors of each call (:meth:`params`).
        initial: ``(state, value)`` where a state starts elsewhere than the model's initial value (a hard reset's
            membrane starts at its reset value).
        backend: "auto" (the fused kernels of the input's device), "cpu", "triton" or "reference"; resolved per
            call (:func:`spikefuse.ops.resolve_backend`).
        memory: "potential" (forward keeps every step's states for backward) or "recompute" (backward recomputes
            them from the input).
    """

    model: NeuronModel
    surrogate: Surrogate
    detach_reset: bool = False
    constants: tuple[tuple[str, float], ...] = ()
    initial: tuple[tuple[str, float], ...] = ()
    backend: str = "auto"
    memory: str = "potential"

    def __post_init__(self):
        if not isinstance(self.model, NeuronModel):
            raise TypeError(f"model must be a spikefuse.neurons.NeuronModel, got {type(self.model).__name__}")
        if not isinstance(self.surrogate, Surrogate):
            raise TypeError(f"surrogate must be a spikefuse.surrogate.Surrogate, got {self.surrogate!r}")
        for what, pairs, names in (
            ("parameter", self.constants, self.model.params),
            ("state", self.initial, self.model.states),
        ):
            for name, value in pairs:
                if name not in names:
                    raise ValueError(f"{self.model.name} has no {what} {name!r}; its {what}s: {', '.join(names)}")
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (numbers.Real, torch.SymFloat))
                    or not finite(value)
                ):
                    raise ValueError(f"{name} must be a finite number, got {value!r}")
        check_backend_name(self.backend)
        check_memory_mode(self.memory)
        object.__setattr__(self, "detach_reset", bool(self.detach_reset))
        # what every call reads, worked out once (not fields: no part of the record's equality)
        start, values = dict(self.initial), dict(self.constants)
        for k in self.model.states:
            value = start.get(k, self.model.initial_value(k))
            start[k] = values.get(value) if isinstance(value, str) else value  # None: a parameter not fixed here
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_start", tuple(start[k] for k in self.model.states))
        object.__setattr__(self, "_checked", set())  # the dtypes its constants were checked in

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def op_key(self) -> str:
        """The key of this record's kernel part (constants, initial values and backend left out) for a custom op."""
        if torch.compiler.is_compiling():
            return _op_key(key_of(self.model), key_of(self.surrogate), self.detach_reset, self.memory)
        key = self.__dict__.get("_op_key")
        if key is None:
            parts = (key_of(self.model), key_of(self.surrogate), self.detach_reset, self.memory)
            key = _OP_KEYS.get(parts)
            if key is None:
                key = _OP_KEYS[parts] = _op_key(*parts)
            self.__dict__["_op_key"] = key
        return key

    @property
    def save(self) -> bool:
        """Whether forward keeps every step's states for backward (``memory="potential"``)."""
        return self.memory == "potential"

    def constant(self, name: str) -> float:
        return self._values[name]

    def params(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Every parameter of the model in its order, as the backends take them: ``tensors`` (``[1]`` or per channel,
        in the compute dtype) and the constants as ``[1]`` tensors of their dtype and device, checked in that dtype
        (a threshold of 1e40 is inf in float32)."""
        like = next(iter(tensors.values()))
        # (symbolic while torch.compile traces)
        if self.constants and like.dtype not in self._checked and not torch.compiler.is_compiling():
            _check_constants(self.constants, self.model.name, like.dtype)
            self._checked.add(like.dtype)
        values = self._values
        return [tensors[p] if p in tensors else like.new_full((1,), values[p]) for p in self.model.params]

    def initial_states(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The states to start from for the input ``x [T, ...]``, one value shared by every neuron (``[1]`` each, in
        the compute dtype), as every backend takes them: nothing of size N is read."""
        if None in self._start:
            k = self.model.states[self._start.index(None)]
            raise ValueError(
                f"{self.model.name}: state {k} starts at the parameter {self.model.initial_value(k)}, which this "
                "record does not fix: give its value in constants or initial"
            )
        cdt = compute_dtype(x.dtype)
        return [torch.full((1,), v, dtype=cdt, device=x.device) for v in self._start]


def neuron_spec(
    model: NeuronModel,
    surrogate: Surrogate,
    detach_reset: bool = False,
    constants: tuple = (),
    initial: tuple = (),
    backend: str = "auto",
    memory: str = "potential",
) -> NeuronSpec:
    """The :class:`NeuronSpec` of these settings, made and checked once per distinct settings in eager mode (a
    functional call or a drop-in's step asks for one at every call)."""
    if torch.compiler.is_compiling():
        return NeuronSpec(model, surrogate, detach_reset, tuple(constants), tuple(initial), backend, memory)
    parts = (key_of(model), key_of(surrogate), bool(detach_reset), tuple(constants), tuple(initial), backend, memory)
    spec = _SPECS.get(parts)
    if spec is None:
        spec = keep(_SPECS, parts, NeuronSpec(model, surrogate, detach_reset, parts[3], parts[4], backend, memory))
    return spec


def keep(cache: dict, key, record):
    """``record``, kept in ``cache`` under ``key`` (a cache of records by the settings that made them); a cache grown
    to :data:`MAX_KEPT` starts afresh, so settings that keep changing (a threshold annealed as a number) do not
    pile up."""
    if len(cache) >= MAX_KEPT:
        cache.clear()
    cache[key] = record
    return record


def registered_key(cache: dict, make, parts: tuple) -> str:
    """The :data:`~spikefuse.registry.OBJECTS` key of ``make(*parts)`` (a frozen dataclass that custom ops take by
    key: a call's settings), made and registered once per ``parts`` and kept in ``cache`` (:func:`keep`)."""
    key = cache.get(parts)
    return key if key is not None else keep(cache, parts, register(make(*parts)))


def _op_key(model: str, surrogate: str, detach_reset: bool, memory: str) -> str:
    return register(NeuronSpec(OBJECTS[model], OBJECTS[surrogate], detach_reset, memory=memory))


# Eager calls' records and op keys by their parts (the keys of registered objects, which stay registered, and
# numbers).
_SPECS: dict[tuple, NeuronSpec] = {}
#: The most records a cache of them holds (:func:`keep`).
MAX_KEPT = 4096
_OP_KEYS: dict[tuple, str] = {}

# torch.compile calls this as Python and takes its result as a constant (its arguments are strings and bools:
# dynamo cannot hand a frozen dataclass to such a function, nor register one it builds itself).
_op_key._dynamo_marked_constant = True
