"""Multi-step spiking neuron modules on ``[T, ...]`` inputs, backed by the fused kernels."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch
from torch import nn

from .. import functional as F
from ..ops import check_backend_name
from ..registry import arguments
from ..surrogate import DEFAULT as DEFAULT_SURROGATE, Surrogate
from ..neurons.lif import DEFAULT_DECAY, DEFAULT_THRESHOLD, paper_lif
from ..validation import check_decay, check_memory_mode

__all__ = ["LIF", "IF", "LIFOptions", "LIFModuleOptions"]


@dataclass(frozen=True)
class LIFOptions:
    """The options of the LIF family, checked once here: :class:`LIF` / :class:`IF`, ``BatchNormLIF1d/2d``,
    ``ConvBatchNormLIF``, ``TimeSplitLIF`` and every neuron of the :mod:`spikefuse.models` (see :class:`LIF` for
    the meaning of each field; ``memory`` applies to :class:`LIF`).

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
        decay = self.decay
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not math.isfinite(decay):
            raise ValueError(f"decay must be a finite number, got {decay!r}")
        check_decay(decay)
        lif = paper_lif(self.threshold, self.v_reset, self.surrogate, self.detach_reset)
        check_backend_name(self.backend)
        check_memory_mode(self.memory)
        object.__setattr__(self, "decay", float(decay))
        object.__setattr__(self, "threshold", lif.constant("threshold"))
        object.__setattr__(self, "v_reset", None if self.v_reset is None else lif.constant("v_reset"))
        object.__setattr__(self, "surrogate", lif.surrogate)
        object.__setattr__(self, "detach_reset", lif.detach_reset)

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


class LIFModuleOptions:
    """The :class:`LIFOptions` and the stored state of the modules of the LIF family (:class:`LIF`,
    ``BatchNormLIF``, ``TimeSplitLIF``), as attributes: a mixin for ``nn.Module`` subclasses; call
    :meth:`_set_neuron_options` after ``nn.Module.__init__``."""

    def _set_neuron_options(
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
        device=None,
        memory="potential",
    ) -> None:
        # Checked where the options are set, so a bad option fails at construction, not at the first call.
        options = LIFOptions(decay, threshold, v_reset, surrogate, detach_reset, backend, memory)
        self.threshold = options.threshold
        self.v_reset = options.v_reset
        self.surrogate = options.surrogate
        self.detach_reset = options.detach_reset
        self.stateful = bool(stateful)
        self.backend = options.backend
        if channels is not None and not learnable_decay:
            raise ValueError("channels sets the size of a learnable per-channel decay: pass learnable_decay=True")
        if channels is not None and (isinstance(channels, bool) or not isinstance(channels, int) or channels < 1):
            raise ValueError(f"channels must be a positive int, got {channels!r}")
        if learnable_decay:
            shape = () if channels is None else (int(channels),)
            self.decay = nn.Parameter(torch.full(shape, options.decay, device=device))
        else:
            self.decay = options.decay
        self.state: torch.Tensor | None = None

    def reset_state(self) -> None:
        self.state = None

    def _stored_state(self, x: torch.Tensor) -> torch.Tensor | None:
        """The state to continue from (stateful mode), checked against the trailing shape of ``x``; else None."""
        v_init = self.state if self.stateful else None
        if v_init is not None and v_init.shape != x.shape[1:]:
            raise ValueError(
                f"stored state has shape {tuple(v_init.shape)} but this input's x.shape[1:] is {tuple(x.shape[1:])}; "
                "call reset_state() before feeding inputs of another shape"
            )
        return v_init

    def _neuron_call_kwargs(self, x: torch.Tensor) -> dict:
        """The keyword arguments of :func:`spikefuse.lif` (and its fused variants) for this module on ``x``."""
        return dict(
            decay=self.decay,
            threshold=self.threshold,
            v_reset=self.v_reset,
            surrogate=self.surrogate,
            detach_reset=self.detach_reset,
            v_init=self._stored_state(x),
            return_state=True,
            backend=self.backend,
        )

    def _neuron_options_repr(self) -> str:
        decay = self.decay if isinstance(self.decay, float) else f"learnable{tuple(self.decay.shape)}"
        return (
            f"decay={decay}, threshold={self.threshold}, v_reset={self.v_reset}, surrogate={self.surrogate}, "
            f"detach_reset={self.detach_reset}, stateful={self.stateful}, backend={self.backend!r}"
        )


class LIF(LIFModuleOptions, nn.Module):
    """LIF neurons of the temporal-fusion paper, Eq. (1)-(2), over all T steps in one fused call.

    A bare ``LIF()`` has the paper's settings (Table 1): decay 0.2, threshold 0.3, a hard reset to 0 and the sigmoid
    surrogate with alpha 4 (:data:`spikefuse.neurons.lif.DEFAULT_DECAY`, ``DEFAULT_THRESHOLD``,
    :data:`spikefuse.surrogate.DEFAULT`): the one set of defaults of every native LIF (:func:`spikefuse.lif`, the
    fused BatchNorm+LIF, ``RecurrentLIF``, the time split, the models), so that a layer swapped for another form
    keeps its dynamics.

    Args:
        decay: the paper's ``k_tau`` (``1 - 1/tau``); ``decay=1`` integrates without leak.
        threshold: as in :func:`spikefuse.lif`.
        v_reset: as in :func:`spikefuse.lif` (``None``: soft reset).
        surrogate: as in :func:`spikefuse.lif`.
        detach_reset: as in :func:`spikefuse.lif`.
        learnable_decay: make ``decay`` an ``nn.Parameter`` (PLIF-style), one value, or one per channel when
            ``channels`` is given (channel = dim 2 of ``[T, B, C, ...]``, dim 1 of ``[T, C]``).
        stateful: keep the final membrane state between calls (streaming, time chunks); clear it with
            :meth:`reset_state`. The state is detached between calls, like truncated BPTT.
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
        super().__init__()
        self._set_neuron_options(
            decay,
            threshold,
            v_reset,
            surrogate,
            detach_reset,
            learnable_decay,
            channels,
            stateful,
            backend,
            memory=memory,
        )
        self.memory = memory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spikes, state = F.lif(x, memory=self.memory, **self._neuron_call_kwargs(x))
        if self.stateful:
            self.state = state.detach()
        return spikes

    def extra_repr(self) -> str:
        return f"{self._neuron_options_repr()}, memory={self.memory!r}"


class IF(LIF):
    """Integrate-and-fire neurons: :class:`LIF` without leak (``decay=1``)."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, v_reset: float | None = 0.0, **kwargs):
        if "decay" in kwargs or kwargs.get("learnable_decay"):
            raise ValueError("IF has no decay; use LIF for a leaky or learnable decay")
        super().__init__(decay=1.0, threshold=threshold, v_reset=v_reset, **kwargs)
