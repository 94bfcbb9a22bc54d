"""Spiking-ResNets with SpikingJelly 2.0's structure (``spikingjelly.activation_based.model.spiking_resnet``).

Same layers in the same order as SpikingJelly's multi-step ``SpikingResNet``: conv-BN-neuron, ``BasicBlock`` (two
3x3 convs) and ``Bottleneck`` (1x1-3x3-1x1, stride on the 3x3 as in torchvision's ResNet v1.5), a 1x1 conv + BN
shortcut when the shape changes, the block's last neuron *after* the residual add, global average pooling and a
linear readout. Initialisation as there (Kaiming-normal fan-out convs, BN weight 1 / bias 0, optional zero-init of
each residual branch's last BN). Differences: ``in_channels`` is a parameter (SpikingJelly hard-codes 3), and
``stem="cifar"`` replaces the ImageNet stem (7x7 stride-2 conv + 3x3 stride-2 max-pool) with a 3x3 stride-1 conv
and no max-pool, for small images (8x8 digits, 28x28 MNIST, 32x32 CIFAR).

Inputs ``[T, B, C, H, W]``, outputs ``[T, B, num_classes]``.

The lean form (:func:`spikefuse.nn.to_lean`, ``build_model(..., memory="lean")``): every conv reads spikes and saves
them as bits, every BN feeding a neuron is fused with it, and each block's ``LIF(BN(conv(x)) + shortcut)`` is one
:class:`~spikefuse.nn.BatchNormLIF2d` call with the shortcut as residual (saved as bits when it is the block's
input spikes, as is when it comes from the downsample branch).
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn import Flatten, SeqToBatch
from ..batchnorm.lean import conv_batchnorm_neuron_from, fused_batchnorm_from, spike_layer_from, spike_max_pool_from

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "SpikingResNet",
    "spiking_resnet18",
    "spiking_resnet34",
    "spiking_resnet50",
    "resnet_tiny",
]

STEMS = ("imagenet", "cifar")


def _neuron_options(neuron, neuron_backend, default):
    opts = default if neuron is None else neuron
    return opts.with_backend(neuron_backend)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> SeqToBatch:
    return SeqToBatch(nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False))


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> SeqToBatch:
    return SeqToBatch(nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False))


def bn(planes: int) -> SeqToBatch:
    return SeqToBatch(nn.BatchNorm2d(planes))


def _fuse_bn_neuron(parent: nn.Module, bn_name: str, sn_name: str, counts: dict, key: str = "bn_lif") -> bool:
    """``parent.<bn_name>`` becomes one fused BatchNorm+neuron module, ``parent.<sn_name>`` an ``nn.Identity``;
    whether it did."""
    fused = fused_batchnorm_from(getattr(parent, bn_name), getattr(parent, sn_name))
    if fused is not None:
        setattr(parent, bn_name, fused)
        setattr(parent, sn_name, nn.Identity())
        counts[key] += 1
    return fused is not None


def _convert_block(
    block: nn.Module,
    convs: tuple[str, ...],
    pairs: tuple[tuple[str, str], ...],
    last: tuple[str, str] | None,
    counts: dict,
    input_spikes: bool = True,
) -> None:
    """Lean form of a residual block (see the module docstring): ``convs`` read spikes, and so does the downsample
    conv where the block's input is spikes (``input_spikes``); each pair of ``pairs`` fused; ``last`` the BN and
    neuron of the block's tail, fused with the residual add (None: a SEW block, whose tail is a pair)."""
    for name in convs:
        new = spike_layer_from(getattr(block, name))
        if new is not None:
            setattr(block, name, new)
            counts["spike_layers"] += 1
    if block.downsample is not None and input_spikes:
        new = spike_layer_from(block.downsample[0])
        if new is not None:
            block.downsample[0] = new
            counts["spike_layers"] += 1
    for bn_name, sn_name in pairs:
        _fuse_bn_neuron(block, bn_name, sn_name, counts)
    if last is not None and _fuse_bn_neuron(block, *last, counts, key="bn_add_lif"):
        block.fused_tail = True


def _tail(block: nn.Module, bn_out: nn.Module, conv_out: torch.Tensor, sn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``sn(bn(conv_out) + shortcut)``, in one op when the block is lean (``bn_out`` fused with its neuron, which
    the data-parallel and time-split converters may replace by an equivalent module of the same call)."""
    identity = x if block.downsample is None else block.downsample(x)
    if block.fused_tail:
        # The identity shortcut is the block's input, spikes: saved as bits.
        return bn_out(conv_out, identity, residual_binary=block.downsample is None)
    return sn(bn_out(conv_out) + identity)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: nn.Module | None, neuron):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = bn(planes)
        self.sn1 = neuron.make()
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = bn(planes)
        self.sn2 = neuron.make()
        self.downsample = downsample
        self.fused_tail = False  # the lean form: bn2 is BatchNorm + residual add + LIF, sn2 an identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.sn1(self.bn1(self.conv1(x)))
        return _tail(self, self.bn2, self.conv2(out), self.sn2, x)

    def convert_to_lean(self, counts: dict) -> None:
        _convert_block(self, ("conv1", "conv2"), (("bn1", "sn1"),), ("bn2", "sn2"), counts)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: nn.Module | None, neuron):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = bn(planes)
        self.sn1 = neuron.make()
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = bn(planes)
        self.sn2 = neuron.make()
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = bn(planes * self.expansion)
        self.sn3 = neuron.make()
        self.downsample = downsample
        self.fused_tail = False  # the lean form: bn3 is BatchNorm + residual add + LIF, sn3 an identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.sn1(self.bn1(self.conv1(x)))
        out = self.sn2(self.bn2(self.conv2(out)))
        return _tail(self, self.bn3, self.conv3(out), self.sn3, x)

    def convert_to_lean(self, counts: dict) -> None:
        _convert_block(self, ("conv1", "conv2", "conv3"), (("bn1", "sn1"), ("bn2", "sn2")), ("bn3", "sn3"), counts)


class SpikingResNet(nn.Module):
    """A multi-step Spiking-ResNet.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: number of blocks in each of the four stages.
        in_channels: input channels.
        num_classes: classes.
        neuron: the record every neuron is made from: :class:`spikefuse.nn.NeuronFactory` (CubaLIF, ALIF, a user's neuron).
        width: channels of the first stage (64 in SpikingJelly; stages use width, 2x, 4x, 8x).
        stem: ``"imagenet"`` (7x7/2 conv + 3x3/2 max-pool, as SpikingJelly) or ``"cifar"`` (3x3/1 conv, no pool).
        zero_init_residual: zero the last BN weight of every residual branch (SpikingJelly's option, off by default).
        block_kwargs: more keyword arguments of every block (:mod:`spikefuse.models.sew_resnet`'s ``cnf``).
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        in_channels: int,
        num_classes: int,
        neuron,
        width: int = 64,
        stem: str = "imagenet",
        zero_init_residual: bool = False,
        block_kwargs: dict | None = None,
    ):
        super().__init__()
        self._block_kwargs = dict(block_kwargs or {})  # for each block's constructor (SEW-ResNet's connect function)
        if stem not in STEMS:
            raise ValueError(f"unknown stem {stem!r}: use one of {STEMS}")
        if len(layers) != 4:
            raise ValueError(f"layers must list the blocks of 4 stages, got {layers}")
        self.inplanes = width
        if stem == "imagenet":
            self.conv1 = SeqToBatch(nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False))
        else:
            self.conv1 = SeqToBatch(nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False))
        self.bn1 = bn(width)
        self.sn1 = neuron.make()
        self.maxpool = (
            SeqToBatch(nn.MaxPool2d(kernel_size=3, stride=2, padding=1)) if stem == "imagenet" else nn.Identity()
        )
        self.layer1 = self._make_layer(block, width, layers[0], 1, neuron)
        self.layer2 = self._make_layer(block, width * 2, layers[1], 2, neuron)
        self.layer3 = self._make_layer(block, width * 4, layers[2], 2, neuron)
        self.layer4 = self._make_layer(block, width * 8, layers[3], 2, neuron)
        self.avgpool = SeqToBatch(nn.AdaptiveAvgPool2d((1, 1)))
        self.flatten = Flatten()
        self.fc = SeqToBatch(nn.Linear(width * 8 * block.expansion, num_classes))

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.module.weight, 0)
                elif isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.module.weight, 0)

    def _make_layer(self, block, planes: int, blocks: int, stride: int, neuron) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride), bn(planes * block.expansion)
            )
        layers = [block(self.inplanes, planes, stride, downsample, neuron, **self._block_kwargs)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, 1, None, neuron, **self._block_kwargs) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def convert_to_lean(self, counts: dict) -> None:
        """The stem's conv, BN and neuron fused (its conv reads the input, not spikes: it is recomputed in backward
        from that input, which it keeps anyway), its max-pooling saving the spikes as bits; the blocks convert
        themselves."""
        _fuse_bn_neuron(self, "bn1", "sn1", counts)
        stem = conv_batchnorm_neuron_from(self.conv1, self.bn1)
        if stem is not None:
            self.conv1, self.bn1 = nn.Identity(), stem
            counts["conv_bn_lif"] += 1
        pool = spike_max_pool_from(self.maxpool)
        if pool is not None:
            self.maxpool = pool
            counts["pools"] += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5:
            raise ValueError(f"SpikingResNet expects [T, B, C, H, W] input, got shape {tuple(x.shape)}")
        x = self.maxpool(self.sn1(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.avgpool(x)))


def _build(
    block, layers, in_channels, num_classes, neuron, neuron_backend, network=SpikingResNet, **kw
) -> SpikingResNet:
    from . import PAPER_NEURON

    opts = _neuron_options(neuron, neuron_backend, PAPER_NEURON)
    kw.pop("image_size", None)  # size-agnostic (global average pooling); accepted so every builder takes it
    return network(block, layers, in_channels, num_classes, opts, **kw)


def spiking_resnet18(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """Spiking-ResNet18: BasicBlock x [2, 2, 2, 2]. Keywords: ``width`` (64), ``stem``, ``zero_init_residual``."""
    return _build(BasicBlock, [2, 2, 2, 2], in_channels, num_classes, neuron, neuron_backend, **kw)


def spiking_resnet34(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """Spiking-ResNet34: BasicBlock x [3, 4, 6, 3]."""
    return _build(BasicBlock, [3, 4, 6, 3], in_channels, num_classes, neuron, neuron_backend, **kw)


def spiking_resnet50(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """Spiking-ResNet50: Bottleneck x [3, 4, 6, 3]."""
    return _build(Bottleneck, [3, 4, 6, 3], in_channels, num_classes, neuron, neuron_backend, **kw)


def resnet_tiny(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """A small Spiking-ResNet: width 16 (stages 16-32-64-128), one BasicBlock per stage. The CLI's default model."""
    kw.setdefault("width", 16)
    return _build(BasicBlock, [1, 1, 1, 1], in_channels, num_classes, neuron, neuron_backend, **kw)
