"""``spikefuse bench memory --quick``: result files and columns (the conversion itself: tests/nn/test_lean.py)."""

import csv

import pytest

from spikefuse.bench import memory
from spikefuse.cli import main


def test_bench_memory_quick_files_and_columns(tmp_path, capsys):
    code = main(["bench", "memory", "--quick", "--in-process", "--models", "resnet18", "--forms", "fused", "lean", "floor",
                 "--threads", "1", "--rounds", "2", "--results-dir", str(tmp_path)])
    assert code == 0
    assert "resnet18 / lean (round 2 of 2)" in capsys.readouterr().err
    md, csv_path = tmp_path / "bench-memory-quick.md", tmp_path / "bench-memory-quick.csv"
    assert md.exists() and csv_path.exists()
    rows = list(csv.DictReader(csv_path.open()))
    assert list(rows[0]) == memory.COLUMNS
    forms = [r["form"] for r in rows]
    assert forms == ["vanilla", "fused", "lean", "floor"]  # vanilla is always run: it is the reference
    by_form = {r["form"]: r for r in rows}
    # same weights and input: the losses agree; the lean stack saves far less than vanilla
    for r in rows[:3]:
        assert float(r["loss_rel_diff"]) < 1e-5 and float(r["grad_max_rel_diff"]) < 1e-5
        assert float(r["saved_total_MiB"]) > 0
    floor = by_form["floor"]  # another network: timed, not compared
    assert floor["loss_rel_diff"] == "" and floor["grad_max_rel_diff"] == "" and float(floor["step_vs_floor"]) == 1.0
    assert float(by_form["lean"]["stack_vs_vanilla"]) < 0.6
    text = md.read_text()
    assert "Machine:" in text and "Command:" in text and "| resnet18 | lean |" in text
    assert "then the median over 2 rounds, the forms taking turns" in text


def test_bench_memory_rounds_must_be_positive(tmp_path):
    with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
        main(["bench", "memory", "--quick", "--in-process", "--rounds", "0", "--results-dir", str(tmp_path)])
