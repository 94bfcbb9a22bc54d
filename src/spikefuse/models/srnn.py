"""Recurrent spiking networks for long sequences (sequential MNIST, SHD/SSC, N-MNIST in fine time bins): the
architectures of Bellec et al. 2018 (LSNN: recurrent adaptive neurons) and Yin et al. 2021 (SRNN: recurrent LIF
layers), with a leaky-integrator readout.

Input ``[T, B, ...]`` (trailing dimensions flattened into F features), then ``layers`` times a ``Linear`` into
``hidden`` recurrent neurons (:class:`spikefuse.nn.RecurrentLIF`, :class:`spikefuse.nn.RecurrentCubaLIF` or
:class:`spikefuse.nn.RecurrentALIF`, all to all), then a ``Linear`` readout into :class:`LeakyReadout`; returns
``[T, B, num_classes]``, the readout's membrane at every step (the training loop averages it over T).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..nn import LIF, NeuronFactory, RecurrentALIF, RecurrentCubaLIF, RecurrentLIF, SpikeLinear
from ..surrogate import Sigmoid

__all__ = ["SRNN", "LeakyReadout", "SRNN_NEURON", "CELLS", "srnn"]

#: The LIF cell's default neuron: a membrane time constant of ~10 steps, soft reset.
SRNN_NEURON = NeuronFactory(LIF, dict(decay=0.9, threshold=0.5, v_reset=None, surrogate=Sigmoid(4.0)))
#: The hidden neurons an SRNN can have (``spikefuse train --cell``).
CELLS = ("lif", "cubalif", "alif")


class LeakyReadout(nn.Module):
    """A leaky integrator without spikes over ``[T, ...]``: ``v[t] = decay * v[t-1] + x[t]`` from ``v[-1] = 0``,
    every step's ``v`` returned. Computed as one product with the ``[T, T]`` matrix of ``decay^(t-k)`` (t >= k)."""

    def __init__(self, decay: float = 0.9):
        super().__init__()
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must lie in [0, 1], got {decay}")
        self.decay = float(decay)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t_steps = x.shape[0]
        steps = torch.arange(t_steps, device=x.device)
        lag = steps[:, None] - steps[None, :]
        weights = torch.where(
            lag >= 0, self.decay ** lag.clamp(min=0).to(x.dtype), torch.zeros((), dtype=x.dtype, device=x.device)
        )
        return (weights @ x.reshape(t_steps, -1)).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"decay={self.decay}"


class SRNN(nn.Module):
    """See the module docstring. ``cell``: "lif" (``neuron``'s decay, threshold, reset and surrogate), "cubalif"
    (current-based LIF: synaptic decay 0.8, membrane decay 0.9 as the LIF's, threshold 1) or "alif"
    (Bellec et al.'s adaptive threshold: decay 0.95, adaptation decay 0.99, b0 0.5, beta 0.2). ``memory``:
    "fused" (the recurrent layers keep their states for backward) or "lean" (they recompute them, and every layer
    fed by spikes keeps its input as bits: :class:`spikefuse.nn.SpikeLinear`). ``spike_inputs``: the input holds
    only 0 and 1, so the first layer may keep it as bits too (framed events, SHD's and N-MNIST's, are counts per
    bin: not spikes). ``sparse`` (``True`` or ``"auto"``): every linear layer, the readout and the input layer
    included, is a :class:`spikefuse.nn.SpikeLinear` with that ``sparse``, its products reading only the nonzero
    inputs (the input layer's counts by their values), and the recurrent layers take it too, each step's recurrent
    current reading only the neurons that spiked (:func:`spikefuse.recurrent`'s ``sparse``); ``False`` keeps the
    layers above, dense. ``sparse_grad`` (``True`` or ``"auto"``): the recurrent layers' backward reads only the
    nonzero gradients of their input currents (:func:`spikefuse.recurrent`'s ``sparse_grad``; they are mostly zero
    only with a surrogate of compact support, as ``neuron=NeuronFactory(LIF, {"surrogate": Rectangle()})``)."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: int = 256,
        layers: int = 1,
        cell: str = "lif",
        neuron: NeuronFactory | None = None,
        neuron_backend: str | None = None,
        memory: str = "fused",
        spike_inputs: bool = False,
        readout_decay: float = 0.9,
        sparse: bool | str = False,
        sparse_grad: bool | str = False,
    ):
        super().__init__()
        if cell not in CELLS:
            raise ValueError(f"unknown cell {cell!r}: use one of {', '.join(CELLS)}")
        if neuron is not None and not (isinstance(neuron, NeuronFactory) and neuron.module is LIF):
            got = neuron.module.__name__ if isinstance(neuron, NeuronFactory) else type(neuron).__name__
            raise TypeError(
                f"SRNN's neuron= is the LIF cell's settings, a NeuronFactory of LIF, got {got}: cell='cubalif' or "
                "'alif' picks the other neurons"
            )
        if hidden < 1 or layers < 1:
            raise ValueError(f"hidden and layers must be >= 1, got {hidden} and {layers}")
        neuron = (neuron or SRNN_NEURON).with_backend(neuron_backend).make()  # the LIF cell's settings, checked
        lean = memory == "lean"
        mode = "recompute" if lean else "potential"
        blocks = []
        if not (isinstance(sparse, bool) or sparse == "auto"):
            raise ValueError(f"sparse must be True, False or 'auto', got {sparse!r}")
        if not (isinstance(sparse_grad, bool) or sparse_grad == "auto"):
            raise ValueError(f"sparse_grad must be True, False or 'auto', got {sparse_grad!r}")

        def linear(n_in: int, n_out: int, fed_spikes: bool) -> nn.Linear:
            if sparse is not False:
                return SpikeLinear(n_in, n_out, sparse=sparse)
            return SpikeLinear(n_in, n_out) if lean and fed_spikes else nn.Linear(n_in, n_out)

        shared = dict(backend=neuron.backend, memory=mode, sparse=sparse, sparse_grad=sparse_grad)  # every cell's
        for i in range(layers):
            blocks.append(linear(in_features if i == 0 else hidden, hidden, fed_spikes=i > 0 or spike_inputs))
            if cell == "lif":
                layer = RecurrentLIF(
                    hidden,
                    decay=neuron.decay,
                    threshold=neuron.threshold,
                    v_reset=neuron.v_reset,
                    surrogate=neuron.surrogate,
                    detach_reset=neuron.detach_reset,
                    **shared,
                )
            elif cell == "cubalif":
                layer = RecurrentCubaLIF(hidden, alpha=0.8, beta=0.9, threshold=1.0, **shared)
            else:
                layer = RecurrentALIF(hidden, decay=0.95, rho=0.99, b0=0.5, beta=0.2, **shared)
            blocks.append(layer)
        self.layers = nn.Sequential(*blocks)
        self.readout = linear(hidden, num_classes, fed_spikes=True)
        self.integrator = LeakyReadout(readout_decay)
        self.in_features = in_features
        for layer in self.layers:
            if isinstance(layer, (RecurrentLIF, RecurrentCubaLIF, RecurrentALIF)):  # recurrent weights of unit gain
                nn.init.orthogonal_(layer.recurrent.weight, gain=1.0 / math.sqrt(2))
                nn.init.zeros_(layer.recurrent.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, B, ...]``, time first. A batch-first ``[B, T, ...]`` (a ``DataLoader``'s default collate of
        ``[T, F]`` samples) has the same sizes and cannot be told apart here: collate such samples with
        :func:`spikefuse.data.time_major`."""
        if x.ndim < 3 or math.prod(x.shape[2:]) != self.in_features:
            one_step = x.ndim == 2 and x.shape[1] == self.in_features
            raise ValueError(
                f"SRNN takes whole sequences [T, B, ...] (time first) of {self.in_features} features a step, got "
                f"{tuple(x.shape)}"
                + (": one step [B, F]? Pass x.unsqueeze(0) for a sequence of one step" if one_step else "")
                + ". A DataLoader of [T, ...] samples gives [B, T, ...] by default: collate with "
                "spikefuse.data.time_major"
            )
        h = self.layers(x.reshape(*x.shape[:2], self.in_features))
        return self.integrator(self.readout(h))


def srnn(
    in_channels: int, num_classes: int, neuron: NeuronFactory | None = None, neuron_backend: str | None = None, **kw
) -> SRNN:
    """:class:`SRNN` with ``in_channels`` input features a step (the registry's builder)."""
    return SRNN(in_channels, num_classes, neuron=neuron, neuron_backend=neuron_backend, **kw)
