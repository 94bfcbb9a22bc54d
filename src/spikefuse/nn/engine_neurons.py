"""``nn`` modules of the engine's neuron models (:mod:`spikefuse.neurons`): :class:`CubaLIF`, :class:`ALIF`, and
:class:`EngineNeuron` for any :class:`~spikefuse.neurons.NeuronModel`, including one defined in user code."""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from ..validation import check_decay, check_memory_mode
from ..neuron_functional import neuron
from ..neurons import ALIF_MODEL, CUBA_LIF_MODELS, NeuronModel
from ..ops import check_backend_name
from ..surrogate import DEFAULT as DEFAULT_SURROGATE, resolve

__all__ = ["NeuronSettings", "EngineNeuron", "CubaLIF", "ALIF"]


class NeuronSettings:
    """The settings and kept state of a layer of neurons, as attributes, for ``nn.Module`` subclasses: one way to
    check them, to make a parameter learnable and to keep a state, shared by :class:`EngineNeuron` (and its presets
    :class:`~spikefuse.nn.LIF`, :class:`CubaLIF`, :class:`ALIF`, the recurrent layers) and the BatchNorm+LIF modules
    (``BatchNormLIF1d/2d``, which are BatchNorms). Call :meth:`_set_neuron` after ``nn.Module.__init__``."""

    #: Parameters that must lie in [0, 1] (decays), checked at construction and, when learnable, at every call.
    unit_interval: tuple[str, ...] = ()
    #: Keep a one-state model's state as that tensor, not a tuple of one (the LIF family's ``state``, the membrane).
    state_is_tensor: bool = False

    def _set_neuron(
        self,
        model: NeuronModel,
        *,
        surrogate=DEFAULT_SURROGATE,
        detach_reset: bool = False,
        learnable=(),
        channels: int | None = None,
        stateful: bool = False,
        backend: str = "auto",
        memory: str = "potential",
        device=None,
        params: dict,
    ) -> None:
        if not isinstance(model, NeuronModel):
            raise TypeError(f"model must be a spikefuse.neurons.NeuronModel, got {type(model).__name__}")
        check_backend_name(backend)
        check_memory_mode(memory)
        self.memory = memory
        self.model = model
        self.surrogate = resolve(surrogate)
        self.detach_reset = bool(detach_reset)
        self.stateful = bool(stateful)
        self.backend = backend
        learnable = tuple(learnable)
        unknown = (set(params) | set(learnable)) - set(model.params)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: no parameter {sorted(unknown)[0]!r}; the parameters of "
                f"{model.name}: {', '.join(model.params)}"
            )
        if channels is not None and (
            not learnable or isinstance(channels, bool) or not isinstance(channels, int) or channels < 1
        ):
            raise ValueError(
                f"channels sets the size of learnable per-channel parameters: a positive int with "
                f"learnable=..., got channels={channels!r}, learnable={learnable}"
            )
        values = {**dict(model.defaults), **params}
        for name in model.params:
            if name not in values:
                raise TypeError(f"{type(self).__name__} needs the parameter {name!r}")
            value = values[name]
            if isinstance(value, torch.Tensor):  # fixed values, one or one per channel (a loaded network's)
                value = value.detach().to(torch.float32).reshape(-1).clone()
                if name in self.unit_interval:
                    check_decay(value, name)
                if name in learnable:
                    setattr(self, name, nn.Parameter(value))
                else:
                    self.register_buffer(name, value)
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if name in self.unit_interval:
                check_decay(value, name)
            if name in learnable:
                shape = () if channels is None else (channels,)
                setattr(self, name, nn.Parameter(torch.full(shape, float(value), device=device)))
            else:
                setattr(self, name, float(value))
        self.state = None

    def reset_state(self) -> None:
        self.state = None

    def kept_state(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The states a stateful layer continues from on input ``x`` (checked against ``x.shape[1:]``), else None."""
        state = self.state if self.stateful else None
        if state is None:
            return None
        state = (state,) if self.state_is_tensor else state
        if state[0].shape != x.shape[1:]:
            raise ValueError(
                f"stored state has shape {tuple(state[0].shape)} but this input's x.shape[1:] is "
                f"{tuple(x.shape[1:])}; call reset_state() before feeding inputs of another shape"
            )
        return state

    def call_arguments(self, x: torch.Tensor) -> dict:
        """The neuron's keyword arguments of :func:`spikefuse.neuron` for input ``x`` (parameters checked, the kept
        state of a stateful layer); what :class:`~spikefuse.nn.BatchNormNeuron` calls the fused op with."""
        params = {}
        for name in self.model.params:
            value = getattr(self, name)
            if value is None:  # a parameter the preset's dynamics ignore (the soft-reset LIF's v_reset)
                continue
            if name in self.unit_interval and isinstance(value, torch.Tensor):
                check_decay(value, name)
            params[name] = value
        return dict(
            surrogate=self.surrogate,
            detach_reset=self.detach_reset,
            state=self.kept_state(x),
            backend=self.backend,
            **params,
        )

    def keep_state(self, final: tuple) -> None:
        """Keep the final states of a call (a stateful layer), detached."""
        if self.stateful:
            self.state = final[0].detach() if self.state_is_tensor else tuple(v.detach() for v in final)

    def _settings_repr(self) -> str:
        params = ", ".join(
            f"{p}={getattr(self, p)}"
            if isinstance(getattr(self, p), float)
            else f"{p}=learnable{tuple(getattr(self, p).shape)}"
            if isinstance(getattr(self, p), nn.Parameter)
            else f"{p}=fixed{tuple(getattr(self, p).shape)}"
            for p in self.model.params_read  # not a parameter the dynamics ignore (a soft reset's v_reset)
        )
        return (
            f"{params}, surrogate={self.surrogate}, detach_reset={self.detach_reset}, stateful={self.stateful}, "
            f"backend={self.backend!r}"
        )


class EngineNeuron(NeuronSettings, nn.Module):
    """A layer of ``model``'s neurons over ``[T, ...]`` inputs, all T steps in one fused call
    (:func:`spikefuse.neuron`).

    Args:
        model: the :class:`~spikefuse.neurons.NeuronModel`.
        surrogate: the spike's derivative in backward (a :mod:`spikefuse.surrogate` instance or name; default
            :data:`spikefuse.surrogate.DEFAULT`, the paper's sigmoid, as every native neuron's).
        detach_reset: no gradient through the previous step's spike in the step.
        learnable: names of parameters to learn (``nn.Parameter``), one value each, or one per channel (dim 2 of
            ``[T, B, C, ...]``, dim 1 of ``[T, C]``) when ``channels`` is given.
        stateful: keep the final states between calls (streaming); :meth:`reset_state` clears them.
        backend: "auto" (the generated kernels for the input's device), "cpu", "triton" or "reference".
        memory: "potential" (the default: forward keeps every step's states for backward) or "recompute"
            (backward recomputes the states from the input: less memory, slower).
        **params: the model's parameters as numbers, or tensors of one value or one per channel (kept as buffers;
            those with a default may be left out).
    """

    def __init__(
        self,
        model: NeuronModel,
        *,
        surrogate=DEFAULT_SURROGATE,
        detach_reset: bool = False,
        learnable=(),
        channels: int | None = None,
        stateful: bool = False,
        backend: str = "auto",
        memory: str = "potential",
        **params,
    ):
        super().__init__()
        self._set_neuron(
            model,
            surrogate=surrogate,
            detach_reset=detach_reset,
            learnable=learnable,
            channels=channels,
            stateful=stateful,
            backend=backend,
            memory=memory,
            params=params,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spikes, final = neuron(x, self.model, return_state=True, memory=self.memory, **self.call_arguments(x))
        self.keep_state(final)
        return spikes

    def extra_repr(self) -> str:
        return f"{self._settings_repr()}, memory={self.memory!r}"


class CubaLIF(EngineNeuron):
    """Current-based LIF neurons (:mod:`spikefuse.neurons.cuba_lif`): synaptic current decay ``alpha``, membrane
    decay ``beta`` (both in [0, 1]), spikes where ``v > threshold``; ``reset`` "subtract" (the threshold, at the
    next step), "zero" (the membrane of the next step is 0) or "hard" (the membrane is 0 right after the spike,
    NIR's reset). ``options``: :class:`EngineNeuron`'s (surrogate, learnable, stateful, backend, memory, ...);
    ``learnable`` may name "alpha", "beta" and "threshold". Threshold and reset default to snnTorch's
    ``Synaptic``'s; the surrogate to every native neuron's, :data:`spikefuse.surrogate.DEFAULT` (snnTorch's is
    ``ATan(2)``, which :mod:`spikefuse.compat.snntorch`'s ``Synaptic`` keeps)."""

    unit_interval = ("alpha", "beta")

    def __init__(
        self,
        alpha: float,
        beta: float,
        threshold: float = 1.0,
        reset: str = "subtract",
        **options,
    ):
        if reset not in CUBA_LIF_MODELS:
            raise ValueError(f"unknown reset {reset!r}: use one of {', '.join(CUBA_LIF_MODELS)}")
        if not (isinstance(threshold, numbers.Real) and threshold > 0):
            raise ValueError(f"threshold must be a positive number, got {threshold!r}")
        self.reset = reset
        super().__init__(CUBA_LIF_MODELS[reset], alpha=alpha, beta=beta, threshold=threshold, **options)


class ALIF(EngineNeuron):
    """Adaptive-threshold LIF neurons (Bellec et al. 2018; :mod:`spikefuse.neurons.alif`): membrane decay
    ``decay``, threshold ``b0 + beta * a`` where ``a`` decays by ``rho`` and jumps by one on each spike (``decay``
    and ``rho`` in [0, 1]); a spike subtracts the threshold it crossed. ``options``: :class:`EngineNeuron`'s."""

    unit_interval = ("decay", "rho")

    def __init__(
        self,
        decay: float,
        rho: float,
        b0: float = 1.0,
        beta: float = 1.8,
        **options,
    ):
        if not (isinstance(b0, numbers.Real) and b0 > 0):
            raise ValueError(f"b0 (the baseline threshold) must be a positive number, got {b0!r}")
        super().__init__(ALIF_MODEL, decay=decay, rho=rho, b0=b0, beta=beta, **options)
