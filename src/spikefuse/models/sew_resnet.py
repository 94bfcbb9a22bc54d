"""SEW-ResNets (Fang et al., "Deep Residual Learning in Spiking Neural Networks", NeurIPS 2021) with SpikingJelly 2.0's
structure (``spikingjelly.activation_based.model.sew_resnet``), on :class:`~spikefuse.models.resnet.SpikingResNet`'s
stems, stages and initialisation.

A spike-element-wise block joins its residual branch's spikes ``out`` (each conv-BN-neuron, the last one too) and
its shortcut ``identity`` (the block's input, or ``neuron(BN(conv1x1(x)))`` when the shape changes) by a connect
function, SpikingJelly's ``sew_function(identity, out, cnf)``: ``ADD`` ``identity + out`` (spike counts, not spikes,
after the first block), ``AND`` ``identity * out``, ``IAND`` ``identity * (1 - out)`` (spikes).

The lean form (:func:`spikefuse.nn.to_lean`): every BN fused with its neuron (the shortcut's too), the convs that
read spikes save them as bits: a block's second conv always, its first conv and shortcut conv where the block's
input is spikes (``AND``/``IAND``, and the first block after the stem); ``ADD``'s counts are kept as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from ..batchnorm.lean import fused_batchnorm_from
from .resnet import BasicBlock, Bottleneck, SpikingResNet, _build, _convert_block

__all__ = ["CONNECT_FUNCTIONS", "SEWBasicBlock", "SEWBottleneck", "sew_resnet18", "sew_resnet34", "sew_resnet_tiny"]

#: SpikingJelly's connect functions of the residual and the shortcut.
CONNECT_FUNCTIONS = ("ADD", "AND", "IAND")


def connect(identity: torch.Tensor, out: torch.Tensor, cnf: str) -> torch.Tensor:
    """SpikingJelly's ``sew_function(identity, out, cnf)``."""
    if cnf == "ADD":
        return identity + out
    if cnf == "AND":
        return identity * out
    return identity * (1.0 - out)


def _check_cnf(cnf: str) -> str:
    if cnf not in CONNECT_FUNCTIONS:
        raise ValueError(f"unknown connect function cnf={cnf!r}: use one of {', '.join(CONNECT_FUNCTIONS)}")
    return cnf


class _SEW:
    """What the SEW blocks share: the shortcut's neuron, the connect function, the lean conversion."""

    def _sew_init(self, downsample, neuron, cnf: str) -> None:
        self.cnf = _check_cnf(cnf)
        self.downsample_sn = neuron.make() if downsample is not None else None
        self.input_spikes = True  # the network says otherwise where the block's input is counts (ADD)

    def _join(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample_sn(self.downsample(x))
        return connect(identity, out, self.cnf)

    def _convert(self, input_convs: tuple[str, ...], spike_convs: tuple[str, ...], pairs, counts: dict) -> None:
        convs = spike_convs + (input_convs if self.input_spikes else ())
        _convert_block(self, convs, pairs, None, counts, input_spikes=self.input_spikes)
        if self.downsample is not None:  # the shortcut's BN and neuron
            fused = fused_batchnorm_from(self.downsample[1], self.downsample_sn)
            if fused is not None:
                self.downsample[1], self.downsample_sn = fused, nn.Identity()
                counts["bn_lif"] += 1


class SEWBasicBlock(_SEW, BasicBlock):
    """Two 3x3 conv-BN-neuron layers joined with the shortcut by ``cnf``."""

    def __init__(self, inplanes: int, planes: int, stride: int, downsample, neuron, cnf: str = "ADD"):
        BasicBlock.__init__(self, inplanes, planes, stride, downsample, neuron)
        self._sew_init(downsample, neuron, cnf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.sn1(self.bn1(self.conv1(x)))
        return self._join(x, self.sn2(self.bn2(self.conv2(out))))

    def convert_to_lean(self, counts: dict) -> None:
        self._convert(("conv1",), ("conv2",), (("bn1", "sn1"), ("bn2", "sn2")), counts)


class SEWBottleneck(_SEW, Bottleneck):
    """1x1-3x3-1x1 conv-BN-neuron layers (stride on the 3x3) joined with the shortcut by ``cnf``."""

    def __init__(self, inplanes: int, planes: int, stride: int, downsample, neuron, cnf: str = "ADD"):
        Bottleneck.__init__(self, inplanes, planes, stride, downsample, neuron)
        self._sew_init(downsample, neuron, cnf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.sn1(self.bn1(self.conv1(x)))
        out = self.sn2(self.bn2(self.conv2(out)))
        return self._join(x, self.sn3(self.bn3(self.conv3(out))))

    def convert_to_lean(self, counts: dict) -> None:
        self._convert(("conv1",), ("conv2", "conv3"), (("bn1", "sn1"), ("bn2", "sn2"), ("bn3", "sn3")), counts)


class SEWResNet(SpikingResNet):
    """A multi-step SEW-ResNet: :class:`~spikefuse.models.resnet.SpikingResNet`'s arguments with SEW blocks and
    ``cnf``, the connect function (default ``"ADD"``)."""

    def __init__(self, block, layers, in_channels, num_classes, neuron, cnf: str = "ADD", **kw):
        super().__init__(block, layers, in_channels, num_classes, neuron, block_kwargs={"cnf": _check_cnf(cnf)}, **kw)
        self.cnf = cnf

    def convert_to_lean(self, counts: dict) -> None:
        """The stem as :class:`SpikingResNet`'s; each block told whether its input is spikes before it converts
        itself (:func:`spikefuse.nn.to_lean` converts a parent before its children)."""
        super().convert_to_lean(counts)
        blocks = [b for stage in (self.layer1, self.layer2, self.layer3, self.layer4) for b in stage]
        for i, b in enumerate(blocks):
            b.input_spikes = self.cnf != "ADD" or i == 0  # ADD's blocks after the first read counts


def _sew(block, layers, in_channels, num_classes, neuron, neuron_backend, cnf="ADD", **kw) -> SEWResNet:
    return _build(block, layers, in_channels, num_classes, neuron, neuron_backend, cnf=cnf, network=SEWResNet, **kw)


def sew_resnet18(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """SEW-ResNet18: SEW BasicBlock x [2, 2, 2, 2]. Keywords: ``cnf`` ("ADD"), ``width`` (64), ``stem``,
    ``zero_init_residual``."""
    return _sew(SEWBasicBlock, [2, 2, 2, 2], in_channels, num_classes, neuron, neuron_backend, **kw)


def sew_resnet34(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """SEW-ResNet34: SEW BasicBlock x [3, 4, 6, 3]."""
    return _sew(SEWBasicBlock, [3, 4, 6, 3], in_channels, num_classes, neuron, neuron_backend, **kw)


def sew_resnet_tiny(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """A small SEW-ResNet: width 16, one SEW BasicBlock per stage."""
    kw.setdefault("width", 16)
    return _sew(SEWBasicBlock, [1, 1, 1, 1], in_channels, num_classes, neuron, neuron_backend, **kw)
