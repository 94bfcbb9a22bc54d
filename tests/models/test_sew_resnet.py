"""SEW-ResNets (spikefuse.models.sew_resnet): SpikingJelly's connect functions, the blocks' structure, the lean form
equal to the plain one for every connect function (spikes kept as bits only where they are spikes), and the
training command's --cnf."""

from __future__ import annotations

import pytest
import torch

from spikefuse.models import build_model
from spikefuse.models.sew_resnet import CONNECT_FUNCTIONS, SEWBasicBlock, connect
from spikefuse.nn import SpikeConv2d, to_lean
from spikefuse.train.config import ConfigError, TrainConfig
from tests.batchnorm.test_lean import _assert_same_training, _pair


def test_connect_functions_are_spikingjellys():
    """``sew_function(identity, out, cnf)`` of SpikingJelly 2.0 (its model module imports torchvision, which cannot
    run here: the formulas are its source's)."""
    a, b = (torch.rand(64) < 0.5).float(), (torch.rand(64) < 0.5).float()
    assert torch.equal(connect(a, b, "ADD"), a + b)
    assert torch.equal(connect(a, b, "AND"), a * b)
    assert torch.equal(connect(a, b, "IAND"), a * (1.0 - b))
    with pytest.raises(ValueError, match="unknown connect function cnf='OR': use one of ADD, AND, IAND"):
        build_model("sew_resnet_tiny", 3, 10, cnf="OR")


@pytest.mark.parametrize("cnf", CONNECT_FUNCTIONS)
def test_blocks_join_spikes_and_the_shortcut_neuron(cnf):
    torch.manual_seed(0)
    model = build_model("sew_resnet18", 2, 5, width=4, stem="cifar", cnf=cnf)
    blocks = [m for m in model.modules() if isinstance(m, SEWBasicBlock)]
    assert len(blocks) == 8 and all(b.cnf == cnf for b in blocks)
    assert [b.downsample_sn is not None for b in blocks] == [False, False, True, False, True, False, True, False]
    outs = {}
    for i, b in enumerate(blocks):
        b.register_forward_hook(lambda m, args, out, i=i: outs.__setitem__(i, out))
    y = model(torch.rand(2, 3, 2, 8, 8) * 3)
    assert y.shape == (2, 3, 5)
    values = torch.cat([o.flatten() for o in outs.values()]).unique()
    if cnf == "ADD":
        assert values.max() > 1  # spike counts after the first block
    else:
        assert set(values.tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("cnf", ["AND", "IAND"])
def test_lean_form_equals_the_plain_one(cnf):
    """(ADD: ``tests/batchnorm/test_lean.py::test_every_registered_model``.)"""
    plain, lean = _pair("sew_resnet18", width=4, stem="cifar", cnf=cnf)
    x = torch.rand(3, 2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    saved_p, saved_l = _assert_same_training(plain, lean, x, torch.tensor([1, 7]))
    assert saved_l < 0.45 * saved_p


@pytest.mark.parametrize("cnf, spike_convs", [("ADD", 8 + 1), ("IAND", 2 * 8 + 3)])
def test_lean_form_keeps_bits_only_of_spikes(cnf, spike_convs):
    """Every block's second conv reads spikes; its first conv and shortcut conv read the block's input, spikes
    for AND/IAND and for ADD's first block, counts after it (kept as they are: bits could not hold them)."""
    torch.manual_seed(0)
    model = build_model("sew_resnet18", 3, 10, width=4, stem="cifar", cnf=cnf)
    counts = to_lean(model)
    assert counts["spike_layers"] == spike_convs
    assert sum(isinstance(m, SpikeConv2d) for m in model.modules()) == spike_convs
    assert counts["bn_lif"] == 1 + 2 * 8 + 3  # the stem's, two per block, three shortcuts'


def test_training_command_takes_cnf():
    TrainConfig(model="sew_resnet_tiny", cnf="IAND").check_settings()
    with pytest.raises(ConfigError, match="--cnf sets a SEW-ResNet's connect function"):
        TrainConfig(model="resnet-tiny", cnf="AND").check_settings()
    with pytest.raises(ConfigError, match="--cnf must be one of ADD, AND, IAND"):
        TrainConfig(model="sew_resnet18", cnf="XOR").check_settings()
