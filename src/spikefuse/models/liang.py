"""The CIFAR-10 networks of the memory-lean BPTT paper (Liang et al., "Accelerating spatiotemporal supervised
training of large-scale SNNs on GPU", Table I):

    small   I - 128C - 256C - 512C - 1024FC - 512FC - 10FC
    medium  I - 128C - 128C - 128C - 256C - 256C - 512C - 512C - 1024FC - 512FC - 10FC
    large   I - 128C - 128C - 128C - 256C - 256C - 256C - 512C - 512C - 512C - 1024FC - 512FC - 10FC

with LIF neurons of decay alpha = 0.25, threshold 0.25 and the rectangle surrogate on (-0.25, 0.75) around it
(:data:`spikefuse.models.LIANG_NEURON`). Every layer is, as the paper's Fig. 2, Conv/FC -> BN -> LIF.

Choices the table leaves open (documented here, not in the paper):

- convolutions are 3x3, stride 1, padding 1 (no bias when BN follows);
- **pooling**: the conv layers form stages of equal width (128, 256, 512 channels); a 2x2 average pooling
  (stride 2, ``ceil_mode=True`` so tiny maps never vanish) follows the neuron of the last conv of each stage.
  On 32x32 CIFAR images that gives 32 -> 16 -> 8 -> 4, so the first FC layer sees 512*4*4 = 8192 features,
  the usual layout of the STBP/tdBN CIFAR nets the paper builds on. Average pooling of spikes passes rates
  (multiples of 1/4) to the next conv, as in those nets;
- the hidden FC layers have BatchNorm1d (over T*B samples) and LIF; the last 10FC is a plain linear readout
  whose outputs the training loop averages over time (rather than counting output spikes), so it trains with
  cross-entropy like the ResNets;
- ``bn=False`` builds the paper's "Net. with LIF" variant (bias in conv/FC, no BN).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..nn import Flatten, SeqToBatch

__all__ = ["LiangNet", "CONFIGS", "liang_small", "liang_medium", "liang_large"]

#: conv channels per stage; a 2x2 average pooling follows each stage.
CONFIGS = {
    "small": [[128], [256], [512]],
    "medium": [[128, 128, 128], [256, 256], [512, 512]],
    "large": [[128, 128, 128], [256, 256, 256], [512, 512, 512]],
}
HIDDEN_FC = (1024, 512)


class LiangNet(nn.Module):
    """Plain conv stack -> FC stack for ``[T, B, C, H, W]`` inputs; see the module docstring for the layout.

    Args:
        stages: conv output channels per stage (2x2 average pooling after each stage).
        in_channels: input channels.
        num_classes: classes.
        neuron: the record every neuron is made from: :class:`spikefuse.nn.NeuronFactory`.
        image_size: ``(H, W)`` (or an int) of the input, to size the first FC layer (default 32x32, CIFAR-10).
        hidden: widths of the hidden FC layers (``(1024, 512)`` in the paper).
        bn: BatchNorm after every conv/hidden FC layer (the paper's "with BN" nets).
    """

    def __init__(
        self,
        stages: list[list[int]],
        in_channels: int,
        num_classes: int,
        neuron,
        image_size: int | tuple[int, int] | None = None,
        hidden: tuple[int, ...] = HIDDEN_FC,
        bn: bool = True,
    ):
        super().__init__()
        h, w = (
            (32, 32)
            if image_size is None
            else ((image_size, image_size) if isinstance(image_size, int) else image_size)
        )
        layers: list[nn.Module] = []
        c = in_channels
        for stage in stages:
            for out in stage:
                layers.append(SeqToBatch(nn.Conv2d(c, out, kernel_size=3, padding=1, bias=not bn)))
                if bn:
                    layers.append(SeqToBatch(nn.BatchNorm2d(out)))
                layers.append(neuron.make())
                c = out
            layers.append(SeqToBatch(nn.AvgPool2d(2, stride=2, ceil_mode=True)))
            h, w = math.ceil(h / 2), math.ceil(w / 2)
        self.features = nn.Sequential(*layers)
        self.flatten = Flatten()
        fc: list[nn.Module] = []
        f = c * h * w
        for width in hidden:
            fc.append(SeqToBatch(nn.Linear(f, width, bias=not bn)))
            if bn:
                fc.append(SeqToBatch(nn.BatchNorm1d(width)))
            fc.append(neuron.make())
            f = width
        fc.append(SeqToBatch(nn.Linear(f, num_classes)))
        self.classifier = nn.Sequential(*fc)
        self.in_features = c * h * w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5:
            raise ValueError(f"LiangNet expects [T, B, C, H, W] input, got shape {tuple(x.shape)}")
        return self.classifier(self.flatten(self.features(x)))


def _build(size, in_channels, num_classes, neuron, neuron_backend, **kw) -> LiangNet:
    from . import LIANG_NEURON

    opts = (LIANG_NEURON if neuron is None else neuron).with_backend(neuron_backend)
    kw.pop("stem", None)  # ResNet-only option; the plain nets have no stem
    return LiangNet(CONFIGS[size], in_channels, num_classes, opts, **kw)


def liang_small(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """128C-AP-256C-AP-512C-AP-1024FC-512FC-10FC. Keywords: ``image_size`` (32), ``hidden``, ``bn``."""
    return _build("small", in_channels, num_classes, neuron, neuron_backend, **kw)


def liang_medium(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """128C-128C-128C-AP-256C-256C-AP-512C-512C-AP-1024FC-512FC-10FC."""
    return _build("medium", in_channels, num_classes, neuron, neuron_backend, **kw)


def liang_large(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """128C-128C-128C-AP-256C-256C-256C-AP-512C-512C-512C-AP-1024FC-512FC-10FC."""
    return _build("large", in_channels, num_classes, neuron, neuron_backend, **kw)
