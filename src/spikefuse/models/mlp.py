"""A feed-forward spiking MLP for event frames (N-MNIST) or images, one step at a time: ``[T, B, C, H, W]`` (or
``[T, B, F]``) flattened to ``F`` features a step, then ``Linear(F -> hidden)`` -> LIF -> ``Linear(hidden ->
hidden)`` -> LIF -> ``Linear(hidden -> num_classes)``, a plain readout returning ``[T, B, num_classes]`` (the
training loop averages it over T).

``sparse`` (``spikefuse train --sparse``): ``False`` builds torch's ``nn.Linear`` layers; ``True`` or ``"auto"``
:class:`spikefuse.nn.SpikeLinear` layers with that ``sparse``, whose products read only the nonzero inputs: the
hidden layer the spikes of the neuron before it, the first layer its input, framed events being counts (the CSR with
values, :mod:`spikefuse.ops.spike_layers.cpu`). The readout is torch's ``nn.Linear`` in every form: its few
outputs leave each active input too little of the product to pay for the sparse kernels' costs per input (``hidden
-> 10`` at 1280 rows of 45% spikes: 1.7 against 0.4 ms forward and weight gradient), and keeping its input as bits
to unpack in backward costs more than the product (``SpikeLinear(512, 10, sparse="auto")`` behind a LIF, forward and
backward: 1.9 against ``nn.Linear``'s 1.2 ms).

``sparse_grad`` (``spikefuse train --sparse-grad``): a width ``w``, for gradients only through the neurons near the
threshold: the LIF's surrogate is zero where ``|v - threshold| > w`` (:class:`spikefuse.surrogate.Windowed`), and
the layers before the neurons read only the nonzero entries of their output gradients
(:class:`~spikefuse.nn.SpikeLinear`'s ``sparse_grad="auto"``; the input layer with ``sparse=False`` stays torch's
``nn.Linear``, as it takes counts).
"""

from __future__ import annotations

import math
import torch
from torch import nn

from ..batchnorm.lean import spike_layer_from
from ..nn import NeuronFactory, SpikeLinear
from ..surrogate import Windowed

__all__ = ["SpikingMLP", "mlp"]


class SpikingMLP(nn.Module):
    """See the module docstring. ``neuron``: the LIF options of both hidden layers (the library's default LIF where
    None); ``sparse_grad``: None, or the width of the window around the threshold."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: int = 256,
        neuron: NeuronFactory | None = None,
        neuron_backend: str | None = None,
        sparse: bool | str = False,
        sparse_grad: float | None = None,
    ):
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        if not (isinstance(sparse, bool) or sparse == "auto"):
            raise ValueError(f"sparse must be True, False or 'auto', got {sparse!r}")
        neuron = (neuron or NeuronFactory()).with_backend(neuron_backend)
        if sparse_grad is not None:
            neuron = neuron.with_arguments(surrogate=Windowed(neuron.make().surrogate, sparse_grad))
        before_neuron = False if sparse_grad is None else "auto"  # the readout's gradient is the loss's: dense

        def linear(n_in: int, n_out: int, sparse_grad: bool | str = False, takes_counts: bool = False) -> nn.Linear:
            if sparse is False and (sparse_grad is False or takes_counts):
                return nn.Linear(n_in, n_out)  # torch's product: SpikeLinear(sparse=False) takes spikes only
            return SpikeLinear(n_in, n_out, sparse=sparse, sparse_grad=sparse_grad)

        self.layers = nn.Sequential(
            linear(in_features, hidden, before_neuron, takes_counts=True),
            neuron.make(),
            linear(hidden, hidden, before_neuron),
            neuron.make(),
            nn.Linear(hidden, num_classes),
        )
        self.in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 3 or math.prod(x.shape[2:]) != self.in_features:
            raise ValueError(
                f"SpikingMLP takes [T, B, ...] inputs of {self.in_features} features a step, got {tuple(x.shape)}"
            )
        return self.layers(x.reshape(*x.shape[:2], self.in_features))

    def convert_to_lean(self, counts: dict) -> None:
        """:func:`spikefuse.nn.to_lean`'s hook: torch's layers fed by spikes keep their input as bits
        (:class:`~spikefuse.nn.SpikeLinear`, the same parameters under the same names); the input layer reads
        counts, and a sparse model's layers are spike layers already."""
        for i in (2, 4):
            new = spike_layer_from(self.layers[i])
            if new is not None:
                self.layers[i] = new
                counts["spike_layers"] += 1


def mlp(
    in_channels: int,
    num_classes: int,
    neuron: NeuronFactory | None = None,
    neuron_backend: str | None = None,
    image_size: int | tuple[int, int] = 34,
    **kw,
) -> SpikingMLP:
    """:class:`SpikingMLP` on ``[T, B, in_channels, H, W]`` inputs of ``image_size`` (N-MNIST's 34x34 by default),
    the registry's builder; keywords ``hidden``, ``sparse`` and ``sparse_grad``."""
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    return SpikingMLP(in_channels * h * w, num_classes, neuron=neuron, neuron_backend=neuron_backend, **kw)
