"""``spikefuse bench memory --quick``: result files and columns, and the lean conversion of both networks."""

import csv

import pytest
import torch

from spikefuse.bench import memory
from spikefuse.cli import main


def test_bench_memory_quick_files_and_columns(tmp_path, capsys):
    code = main(["bench", "memory", "--quick", "--in-process", "--models", "resnet18", "--forms", "fused", "lean",
                 "--threads", "1", "--results-dir", str(tmp_path)])
    assert code == 0
    md, csv_path = tmp_path / "bench-memory-quick.md", tmp_path / "bench-memory-quick.csv"
    assert md.exists() and csv_path.exists()
    rows = list(csv.DictReader(csv_path.open()))
    assert list(rows[0]) == memory.COLUMNS
    forms = [r["form"] for r in rows]
    assert forms == ["vanilla", "fused", "lean"]  # vanilla is always run: it is the reference
    by_form = {r["form"]: r for r in rows}
    # same weights and input: the losses agree; the lean stack saves far less than vanilla
    for r in rows:
        assert float(r["loss_rel_diff"]) < 1e-5
        assert float(r["saved_total_MiB"]) > 0
    assert float(by_form["lean"]["stack_vs_vanilla"]) < 0.6
    text = md.read_text()
    assert "Machine:" in text and "Command:" in text and "| resnet18 | lean |" in text


def test_to_lean_liang_medium_structure_and_gradients():
    """The conversion of the paper's medium net: 9 BN+LIF pairs fused, spike-fed layers as bit-saving layers,
    and the same loss and gradients as the vanilla form."""
    from spikefuse.nn.bn_lif import BatchNormLIF1d, BatchNormLIF2d
    from spikefuse.nn.spike_layers import SpikeConv2d, SpikeLinear

    cfg = {"model": "liang-medium", "seed": 0, "image_size": 8, "resnet_width": 8}
    vanilla = memory._build(cfg)
    lean = memory._build(cfg)
    counts = memory.to_lean(lean)
    assert counts["bn_lif"] == 9 and counts["recompute_lif"] == 0
    fused = [m for m in lean.modules() if isinstance(m, (BatchNormLIF1d, BatchNormLIF2d))]
    assert len(fused) == 9
    # spike-fed: convs 2, 3 (stage 1), 5 (stage 2), 7 (stage 3); FC 2 and the readout
    assert sum(isinstance(m, SpikeConv2d) for m in lean.modules()) == 4
    assert sum(isinstance(m, SpikeLinear) for m in lean.modules()) == 2
    assert counts["spike_layers"] == 6 and counts["pools"] == 3
    x = torch.rand(2, 2, 3, 8, 8)
    y = torch.tensor([1, 7])
    grads = []
    for model in (vanilla, lean):
        loss = torch.nn.functional.cross_entropy(model(x).mean(0), y)
        loss.backward()
        grads.append({memory._param_name(n): p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    rel, name = memory._max_rel(grads[1], grads[0])
    assert rel < 1e-5, name


def test_to_lean_rejects_other_models():
    with pytest.raises(TypeError, match="LiangNet and SpikingResNet"):
        memory.to_lean(torch.nn.Linear(2, 2))
