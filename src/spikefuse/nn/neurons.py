"""Multi-step spiking neuron modules on ``[T, ...]`` inputs, backed by the fused kernels."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch
from torch import nn

from .. import functional as F
from ..registry import arguments
from ..surrogate import DEFAULT as DEFAULT_SURROGATE, Surrogate
from ..neurons.lif import DEFAULT_DECAY, DEFAULT_THRESHOLD, paper_lif
from .engine_neurons import EngineNeuron, NeuronSettings

__all__ = ["LIF", "IF", "LIFOptions", "LIFSettings"]


@dataclass(frozen=True)
class LIFOptions:
    """A LIF layer's settings as a value, for the :mod:`spikefuse.models` (every neuron of a model made from it)
    and checkpoints (:meth:`to_dict`); checked as the :class:`LIF` it makes (see there for the meaning of each
    field).

    The defaults are the temporal-fusion paper's (Table 1): decay ``k = 0.2``, threshold 0.3, ``V_rest = 0``,
    sigmoid surrogate with alpha 4.
    """

    decay: float = DEFAULT_DECAY
    threshold: float = DEFAULT_THRESHOLD
    v_reset: float | None = 0.0
    surrogate: Surrogate = DEFAULT_SURROGATE
    detach_reset: bool = False
    backend: str = "auto"
    memory: str = "potential"

    def __post_init__(self):
        # checked, and its numbers normalised, as the layer it makes: one set of checks for the LIF family
        layer = self.make()
        object.__setattr__(self, "decay", float(self.decay))
        for name in ("threshold", "v_reset", "surrogate", "detach_reset"):
            object.__setattr__(self, name, getattr(layer, name))

    def make(self) -> "LIF":
        """A new :class:`LIF` module with these options."""
        return LIF(**arguments(self))

    def with_backend(self, backend: str | None) -> "LIFOptions":
        return self if backend is None else replace(self, backend=backend)

    def to_dict(self) -> dict:
        """Plain values (the surrogate as ``{"name": ..., **params}``), for checkpoints and logs."""
        d = arguments(self)
        d["surrogate"] = {"name": type(self.surrogate).__name__, **arguments(self.surrogate)}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LIFOptions":
        from .. import surrogate as S

        d = dict(d)
        sg = dict(d.pop("surrogate"))
        d["surrogate"] = getattr(S, sg.pop("name"))(**sg)
        return cls(**d)


class LIFSettings(NeuronSettings):
    """The LIF preset of :class:`~spikefuse.nn.NeuronSettings`: the paper's LIF model (a hard reset to ``v_reset``,
    soft for None) with its parameters ``decay``, ``threshold`` and ``v_reset`` as attributes, for :class:`LIF` /
    :class:`IF` and the BatchNorm+LIF modules. ``v_reset`` reads None for the soft reset (the soft model ignores
    it); the kept ``state`` is the membrane tensor. Call :meth:`_set_lif` after ``nn.Module.__init__``."""

    unit_interval = ("decay",)
    state_is_tensor = True

    def _set_lif(
        self,
        decay,
        threshold,
        v_reset,
        surrogate,
        detach_reset,
        learnable_decay,
        channels,
        stateful,
        backend,
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
