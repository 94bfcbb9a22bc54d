"""Recurrent spiking layers: :class:`Recurrent` for any :class:`~spikefuse.neurons.NeuronModel` (a user's too), and
:class:`RecurrentLIF`, :class:`RecurrentCubaLIF`, :class:`RecurrentALIF`. Each runs all T steps forward and backward
in one autograd operation (:func:`spikefuse.recurrent`)."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from ..neurons import ALIF_MODEL, CUBA_LIF_MODELS, LIF_MODELS, NeuronModel
from ..neurons.lif import DEFAULT_DECAY, DEFAULT_THRESHOLD
from ..recurrent_functional import recurrent
from .engine_neurons import ALIF, CubaLIF, EngineNeuron

__all__ = ["Recurrent", "RecurrentLIF", "RecurrentCubaLIF", "RecurrentALIF"]


class Recurrent(EngineNeuron):
    """A recurrent layer of ``hidden_size`` of ``model``'s neurons over input currents ``[T, B, hidden_size]``: at
    every step the neurons' input is ``x[t]`` plus the recurrent current of the previous step's spikes,
    ``self.recurrent(s[t-1])`` (an ``nn.Linear(hidden_size, hidden_size)``, all to all) or ``weight * s[t-1] + bias``
    (``all_to_all=False``: each neuron's own spike, ``weight`` and ``bias`` of ``[hidden_size]``). Returns the spikes
    ``[T, B, hidden_size]``.

    ``model``, ``surrogate``, ``detach_reset``, ``learnable``, ``channels``, ``backend`` and the model's parameters
    as :class:`EngineNeuron` (``channels=hidden_size`` for one learnable value per neuron).

    Args:
        all_to_all: the recurrent connection (see above).
        bias: whether the recurrent current has a bias.
        stateful: keep the final states (the model's and the last spikes) between calls; :meth:`reset_state`.
        memory: "potential" (the default: every step's states the backward reads are kept) or "recompute" (the
            backward computes every step again from the input and the spikes, kept as bits).
        sparse: True: each step's recurrent current and the recurrent weight's gradient read only the neurons that
            spiked (CPU, all to all; :func:`spikefuse.recurrent`); the same spikes as the default dense product except
            at threshold ties. "auto": per call, the sparse product where the previous call's spike rate was below
            ``spikefuse.ops.recurrent.CROSSOVER_RECURRENT`` (the first call, and where the sparse one cannot run,
            dense).
        sparse_grad: True: the backward reads only the nonzero entries of the gradient of each step's input current
            (each step's product with the recurrent weight and the weight's gradient; CPU, all to all, a surrogate of
            compact support such as :class:`~spikefuse.surrogate.Rectangle` to make them zero;
            :func:`spikefuse.recurrent`); the same gradients as the dense backward to rounding. "auto": per call, the
            sparse backward where the previous backward's share of nonzero gradients was below
            ``spikefuse.ops.recurrent.CROSSOVER_GRAD_RECURRENT`` (the first call, and where it cannot run, dense).
    """

    def __init__(
        self,
        model: NeuronModel,
        hidden_size: int,
        *,
        all_to_all: bool = True,
        bias: bool = True,
        sparse: bool | str = False,
        sparse_grad: bool | str = False,
        **options,
    ):
        for name, value in (("sparse", sparse), ("sparse_grad", sparse_grad)):
            if not (isinstance(value, bool) or value == "auto"):
                raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, numbers.Integral) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        super().__init__(model, **options)
        self.hidden_size = int(hidden_size)
        self.all_to_all = bool(all_to_all)
        self.sparse = sparse
        self.sparse_grad = sparse_grad
        if self.all_to_all:
            self.recurrent = nn.Linear(self.hidden_size, self.hidden_size, bias=bias)
        else:  # the scale of nn.Linear's default initialization for one input
            self.weight = nn.Parameter(torch.empty(self.hidden_size).uniform_(-1, 1))
            self.bias = nn.Parameter(torch.zeros(self.hidden_size)) if bias else None

    def recurrent_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` of the recurrent current: ``[H, H]`` (all to all) or ``[H]``, and ``[H]`` or None."""
        if self.all_to_all:
            return self.recurrent.weight, self.recurrent.bias
        return self.weight, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        if x.ndim == 2 and x.shape[1] == self.hidden_size:
            raise ValueError(
                f"{name} takes input currents [T, B, {self.hidden_size}], time first, got one step "
                f"{tuple(x.shape)}: pass x.unsqueeze(0) for a sequence of one step"
            )
        if x.ndim != 3 or x.shape[2] != self.hidden_size:
            raise ValueError(f"{name} takes input currents [T, B, {self.hidden_size}], got {tuple(x.shape)}")
        kept = self.state[0] if self.stateful and self.state is not None else None
        if kept is not None and kept.shape[0] == x.shape[0] != x.shape[1]:
            # the kept state's batch is x's first dimension: most likely a batch-first [B, T, H] sequence
            raise ValueError(
                f"{name} takes input currents time first, [T, B, {self.hidden_size}]; x {tuple(x.shape)} has the "
                f"kept state's batch of {kept.shape[0]} first: batch-first input? Use x.transpose(0, 1), or collate "
                "with spikefuse.data.time_major"
            )
        weight, bias = self.recurrent_weights()
        arguments = self.call_arguments(x)
        spikes, final = recurrent(
            x,
            self.model,
            weight,
            bias,
            return_state=True,
            memory=self.memory,
            sparse=self.sparse,
            sparse_grad=self.sparse_grad,
            **arguments,
        )
        self.keep_state(final)
        return spikes

    def extra_repr(self) -> str:
        sparse = "".join(
            f", {name}={value!r}"
            for name, value in (("sparse", self.sparse), ("sparse_grad", self.sparse_grad))
            if value is not False
        )
        return f"hidden_size={self.hidden_size}, all_to_all={self.all_to_all}{sparse}, {super().extra_repr()}"


class RecurrentLIF(Recurrent):
    """Recurrent LIF neurons of the temporal-fusion paper's dynamics: ``v[t] = decay * v[t-1] + x[t] + rec[t]``,
    spikes where ``v >= threshold``, reset to ``v_reset`` at the next step (``v_reset=None``: subtract the
    threshold there). ``learnable`` may name "decay" and "threshold"."""

    unit_interval = ("decay",)

    def __init__(
        self,
        hidden_size: int,
        decay: float = DEFAULT_DECAY,
        threshold: float = DEFAULT_THRESHOLD,
        v_reset: float | None = 0.0,
        **options,
    ):
        if not (isinstance(threshold, numbers.Real) and threshold > 0):
            raise ValueError(f"threshold must be a positive number, got {threshold!r}")
        model = LIF_MODELS[("paper", "soft" if v_reset is None else "hard")]
        params = dict(decay=decay, threshold=threshold, **({} if v_reset is None else {"v_reset": v_reset}))
        super().__init__(model, hidden_size, **options, **params)

    def extra_repr(self) -> str:
        soft = "v_reset" not in self.model.params_read  # the constructor's v_reset=None, a parameter no more
        return super().extra_repr() + (", v_reset=None" if soft else "")


class RecurrentCubaLIF(Recurrent):
    """Recurrent current-based LIF neurons (:class:`~spikefuse.nn.CubaLIF`'s dynamics and arguments): the recurrent
    current joins the synaptic current, ``i[t] = alpha * i[t-1] + x[t] + rec[t]`` (snnTorch's ``RSynaptic``)."""

    unit_interval = CubaLIF.unit_interval

    def __init__(
        self,
        hidden_size: int,
        alpha: float,
        beta: float,
        threshold: float = 1.0,
        reset: str = "subtract",
        **options,
    ):
        if reset not in CUBA_LIF_MODELS:
            raise ValueError(f"unknown reset {reset!r}: use one of {', '.join(CUBA_LIF_MODELS)}")
        self.reset = reset
        super().__init__(
            CUBA_LIF_MODELS[reset],
            hidden_size,
            alpha=alpha,
            beta=beta,
            threshold=threshold,
            **options,
        )


class RecurrentALIF(Recurrent):
    """Recurrent adaptive-threshold LIF neurons (:class:`~spikefuse.nn.ALIF`'s dynamics and arguments), the hidden
    layer of Bellec et al. 2018's LSNN."""

    unit_interval = ALIF.unit_interval

    def __init__(
        self,
        hidden_size: int,
        decay: float,
        rho: float,
        b0: float = 1.0,
        beta: float = 1.8,
        **options,
    ):
        super().__init__(ALIF_MODEL, hidden_size, decay=decay, rho=rho, b0=b0, beta=beta, **options)
