"""``spikefuse bench models --quick``: result files, columns, the four forms from the same weights (the models
themselves: tests/models)."""

import csv

import pytest
import torch

from spikefuse.bench import models
from spikefuse.cli import main


def test_bench_models_quick_files_columns_and_agreement(tmp_path, capsys):
    pytest.importorskip("spikingjelly")
    assert main(["bench", "models", "--quick", "--threads", "1", "--results-dir", str(tmp_path)]) == 0
    assert "sew_resnet18: step times, every form side by side" in capsys.readouterr().err
    md, csv_path = tmp_path / "bench-models-quick.md", tmp_path / "bench-models-quick.csv"
    rows = list(csv.DictReader(csv_path.open()))
    assert list(rows[0]) == models.COLUMNS
    assert [(r["model"], r["form"]) for r in rows] == [(m, f) for m in models.MODELS for f in models.FORMS]
    for r in rows:
        # the same weights and batch: the same spikes into the head, outputs and gradients to rounding
        assert r["head_input_equal"] == "True", (r["model"], r["form"])
        assert float(r["output_max_abs_diff"]) < 1e-6 and float(r["grad_diff"]) < 1e-5
        assert float(r["saved_MiB"]) > 0 and float(r["step_s"]) > 0
        if r["form"] == models.REFERENCE:
            assert float(r["speedup"]) == 1.0 and float(r["saved_vs_spikingjelly"]) == 1.0
        if r["form"] == "lean":
            assert float(r["saved_vs_spikingjelly"]) < 0.6
    text = md.read_text()
    assert "Machine:" in text and "Command:" in text and "| sdt_tiny | lean |" in text
    assert "SpikingJelly's SEW-ResNet imports torchvision" in text


def test_gradient_difference_is_relative_to_the_largest_gradient():
    reference = [("w", torch.tensor([4.0, -2.0])), ("bias_before_bn", torch.tensor([1e-9])), ("unused", None)]
    grads = [("w", torch.tensor([4.0, -1.0])), ("bias_before_bn", torch.tensor([-1e-9])), ("unused", None)]
    assert models.gradient_difference(grads, reference) == 0.25
    assert models.gradient_difference(grads[:1], reference) == float("inf")
    assert models.gradient_difference([("w", torch.zeros(3)), *grads[1:]], reference) == float("inf")


def test_bench_models_repeats_must_be_positive(tmp_path):
    with pytest.raises(SystemExit, match="--repeats must be at least 1, got 0"):
        main(["bench", "models", "--repeats", "0", "--results-dir", str(tmp_path)])
