"""Multi-step spiking neuron modules on ``[T, ...]`` inputs, backed by the fused kernels."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from .. import functional as F
from ..registry import arguments as arguments_of
from ..surrogate import DEFAULT as DEFAULT_SURROGATE, SURROGATES, Active, Surrogate, Windowed
from ..neurons.lif import DEFAULT_DECAY, DEFAULT_THRESHOLD, paper_lif
from .engine_neurons import ALIF, CubaLIF, EngineNeuron, NeuronSettings

__all__ = ["LIF", "IF", "LIFSettings", "NeuronFactory", "NEURON_MODULES"]


class LIFSettings(NeuronSettings):
    """The LIF preset of :class:`~spikefuse.nn.NeuronSettings`: the paper's LIF model (a hard reset to ``v_reset``,
    soft for None) with its parameters ``decay``, ``threshold`` and ``v_reset`` as attributes, for :class:`LIF` /
    :class:`IF` and the BatchNorm+LIF modules. ``v_reset`` reads None for the soft reset (the soft model ignores
    it); the kept ``state`` is the membrane tensor. Call :meth:`_set_lif` after ``nn.Module.__init__``."""

    unit_interval = ("decay",)
    state_is_tensor = True

    def _set_lif(
        self,
        decay=DEFAULT_DECAY,
        threshold=DEFAULT_THRESHOLD,
        v_reset=0.0,
        surrogate=DEFAULT_SURROGATE,
        detach_reset=False,
        learnable_decay=False,
        channels=None,
        stateful=False,
        backend="auto",
        memory="potential",
        device=None,
    ) -> None:
        # The LIF's own checks (a threshold above rest, a reset below the threshold), then the general ones.
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not math.isfinite(decay):
            raise ValueError(f"decay must be a finite number, got {decay!r}")
        if channels is not None and not learnable_decay:
            raise ValueError("channels sets the size of a learnable per-channel decay: pass learnable_decay=True")
        lif = paper_lif(threshold, v_reset, surrogate, detach_reset)
        self._set_neuron(
            lif.model,
            surrogate=lif.surrogate,
            detach_reset=lif.detach_reset,
            learnable=("decay",) if learnable_decay else (),
            channels=channels,
            stateful=stateful,
            backend=backend,
            memory=memory,
            device=device,
            params=dict(decay=float(decay), threshold=lif.constant("threshold"), v_reset=lif.constant("v_reset")),
        )
        if v_reset is None:
            self.v_reset = None

    def lif_arguments(self, x: torch.Tensor) -> dict:
        """The keyword arguments of :func:`spikefuse.lif` (and its fused forms) for this layer on ``x``."""
        state = self.kept_state(x)
        return dict(
            decay=self.decay,
            threshold=self.threshold,
            v_reset=self.v_reset,
            surrogate=self.surrogate,
            detach_reset=self.detach_reset,
            v_init=None if state is None else state[0],
            return_state=True,
            backend=self.backend,
        )


class LIF(LIFSettings, EngineNeuron):
    """LIF neurons of the temporal-fusion paper, Eq. (1)-(2), over all T steps in one fused call: the LIF preset of
    :class:`~spikefuse.nn.EngineNeuron` (its ``model`` the paper's LIF, ``spikefuse.neurons.LIF_MODELS[("paper",
    "hard" | "soft")]``), so every feature of an engine neuron takes it (:class:`~spikefuse.nn.BatchNormNeuron`,
    the time split, the lean form).

    A bare ``LIF()`` has the paper's settings (Table 1): decay 0.2, threshold 0.3, a hard reset to 0 and the sigmoid
    surrogate with alpha 4 (:data:`spikefuse.neurons.lif.DEFAULT_DECAY`, ``DEFAULT_THRESHOLD``,
    :data:`spikefuse.surrogate.DEFAULT`): the one set of defaults of every native LIF (:func:`spikefuse.lif`, the
    fused BatchNorm+LIF, ``RecurrentLIF``, the time split, the models), so that a layer swapped for another form
    keeps its dynamics.

    Args:
        decay: the paper's ``k_tau`` (``1 - 1/tau``); ``decay=1`` integrates without leak.
        threshold: as in :func:`spikefuse.lif`.
        v_reset: as in :func:`spikefuse.lif` (``None``: soft reset); the membrane starts there.
        surrogate: as in :func:`spikefuse.lif`.
        detach_reset: as in :func:`spikefuse.lif`.
        learnable_decay: make ``decay`` an ``nn.Parameter`` (PLIF-style), one value, or one per channel when
            ``channels`` is given (channel = dim 2 of ``[T, B, C, ...]``, dim 1 of ``[T, C]``).
        stateful: keep the final membrane (``state``, a tensor) between calls (streaming, time chunks); clear it
            with :meth:`reset_state`. The state is detached between calls, like truncated BPTT.
        backend: ``"auto"`` (cpu for CPU tensors, triton for CUDA), ``"cpu"``, ``"triton"`` or ``"reference"``.
        memory: ``"potential"`` saves the pre-reset potential for backward (fastest); ``"recompute"`` saves only
            the input and recomputes it (least memory). Same results either way.
    """

    def __init__(
        self,
        decay: float = DEFAULT_DECAY,
        threshold: float = DEFAULT_THRESHOLD,
        v_reset: float | None = 0.0,
        surrogate=DEFAULT_SURROGATE,
        detach_reset: bool = False,
        learnable_decay: bool = False,
        channels: int | None = None,
        stateful: bool = False,
        backend: str = "auto",
        memory: str = "potential",
    ):
        nn.Module.__init__(self)  # EngineNeuron's __init__ is this and _set_neuron, which _set_lif calls
        self._set_lif(
            decay, threshold, v_reset, surrogate, detach_reset, learnable_decay, channels, stateful, backend, memory
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spikes, state = F.lif(x, memory=self.memory, **self.lif_arguments(x))
        self.keep_state((state,))
        return spikes


class IF(LIF):
    """Integrate-and-fire neurons: :class:`LIF` without leak (``decay=1``)."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, v_reset: float | None = 0.0, **kwargs):
        if "decay" in kwargs or kwargs.get("learnable_decay"):
            raise ValueError("IF has no decay; use LIF for a leaky or learnable decay")
        super().__init__(decay=1.0, threshold=threshold, v_reset=v_reset, **kwargs)


#: The neuron modules a :class:`NeuronFactory` can write to a config and read back (:meth:`NeuronFactory.to_dict`).
NEURON_MODULES = {"LIF": LIF, "IF": IF, "CubaLIF": CubaLIF, "ALIF": ALIF}


@dataclass(frozen=True)
class NeuronFactory:
    """The neuron of every layer of a model as one value: ``module(**arguments, backend=backend)``, an engine neuron
    (:class:`LIF` is one), e.g. ``NeuronFactory(LIF, {"decay": 0.5})``, ``NeuronFactory(CubaLIF, {"alpha": 0.5,
    "beta": 0.5})``, or for a user's :class:`~spikefuse.neurons.NeuronModel` ``NeuronFactory(EngineNeuron,
    {"model": model, ...its parameters})``. Checked as the module it makes; :meth:`to_dict` / :meth:`from_dict`
    write it to a config (checkpoints, ``spikefuse train``) for the modules of :data:`NEURON_MODULES`."""

    module: Callable[..., EngineNeuron] = LIF
    arguments: dict = field(default_factory=dict)
    backend: str = "auto"

    def __post_init__(self):
        self.make()  # a bad argument fails here, not in the middle of building a model

    def make(self) -> EngineNeuron:
        """A new neuron module."""
        return self.module(**self.arguments, backend=self.backend)

    def with_backend(self, backend: str | None) -> "NeuronFactory":
        return self if backend is None else replace(self, backend=backend)

    def with_arguments(self, **arguments) -> "NeuronFactory":
        """The same neuron with ``arguments`` given or changed."""
        return replace(self, arguments={**self.arguments, **arguments})

    def to_dict(self) -> dict:
        """Plain values (a surrogate as ``{"name": ..., **params}``), for checkpoints and logs."""
        name = next((n for n, m in NEURON_MODULES.items() if m is self.module), None)
        if name is None:
            raise ValueError(
                f"a neuron of {getattr(self.module, '__name__', self.module)!r} cannot be written to a config: only "
                f"{', '.join(NEURON_MODULES)} can"
            )
        return {"module": name, "arguments": _plain(self.arguments, name), "backend": self.backend}

    @classmethod
    def from_dict(cls, d: dict) -> "NeuronFactory":
        """The factory :meth:`to_dict` wrote; a dict without ``"module"`` is a LIF's arguments (with ``backend``),
        as configs written before the one record held them."""
        d = dict(d)
        if "module" not in d:
            d = {"module": "LIF", "backend": d.pop("backend", "auto"), "arguments": d}
        if d["module"] not in NEURON_MODULES:
            raise ValueError(f"unknown neuron module {d['module']!r}: use one of {', '.join(NEURON_MODULES)}")
        arguments = {key: _surrogate_of(value) for key, value in dict(d.get("arguments", {})).items()}
        return cls(NEURON_MODULES[d["module"]], arguments, d.get("backend", "auto"))


# The surrogates that wrap another, each with a subclass per wrapped type (``WindowedSigmoid``): named by their own.
_WRAPPERS = (Windowed, Active)
#: The surrogates a config may name, by class name (none but these is built from a file).
_SURROGATE_KINDS = {cls.__name__: cls for cls in (*SURROGATES.values(), *_WRAPPERS)}


def _plain(arguments: dict, module: str) -> dict:
    """``arguments`` as plain values: a surrogate as ``{"name": ..., **its arguments}``, nested ones likewise."""
    plain = {}
    for key, value in arguments.items():
        if isinstance(value, Surrogate):
            name = next((w.__name__ for w in _WRAPPERS if isinstance(value, w)), type(value).__name__)
            value = {"name": name, **_plain(arguments_of(value), module)}
        elif value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"{module}'s {key}={value!r} cannot be written to a config: give it as a number")
        plain[key] = value
    return plain


def _surrogate_of(value):
    """The surrogate a config's ``{"name": ..., ...}`` describes (other values as they are)."""
    if not isinstance(value, dict):
        return value
    value = dict(value)
    name = value.pop("name", None)
    if name not in _SURROGATE_KINDS:
        raise ValueError(f"unknown surrogate {name!r}: use one of {', '.join(_SURROGATE_KINDS)}")
    return _SURROGATE_KINDS[name](**{k: _surrogate_of(v) for k, v in value.items()})
