"""``spikefuse bench memory --quick``: result files and columns (the conversion itself: tests/batchnorm/test_lean.py)."""

import csv

import pytest
import torch

from spikefuse.bench import memory
from spikefuse.cli import main


def test_bench_memory_quick_files_and_columns(tmp_path, capsys):
    code = main(
        [
            "bench",
            "memory",
            "--quick",
            "--in-process",
            "--models",
            "resnet18",
            "--forms",
            "fused",
            "lean",
            "floor",
            "--threads",
            "1",
            "--rounds",
            "2",
            "--results-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    assert "resnet18: step times, every form side by side (round 2 of 2)" in capsys.readouterr().err
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
    assert float(by_form["fused"]["step_vs_fused"]) == 1.0 and float(by_form["lean"]["step_vs_fused"]) > 0
    assert float(by_form["lean"]["stack_vs_vanilla"]) < 0.6
    # every timed step, by round and cycle; the table's ratios are the medians of the cycles' ratios, their quartiles
    # beside them
    cycles = list(csv.DictReader((tmp_path / "bench-memory-quick-cycles.csv").open()))
    assert list(cycles[0]) == memory.CYCLE_COLUMNS
    assert [(c["round"], c["cycle"]) for c in cycles if c["form"] == "lean"] == [("1", "1"), ("2", "1")]
    steps = {(c["round"], c["form"]): float(c["step_s"]) for c in cycles}
    lean_vs_fused = sorted(steps[(r, "lean")] / steps[(r, "fused")] for r in ("1", "2"))
    lean = by_form["lean"]
    assert float(lean["step_vs_fused"]) == pytest.approx(sum(lean_vs_fused) / 2, rel=2e-3)
    assert float(lean["step_vs_fused_q1"]) <= float(lean["step_vs_fused"]) <= float(lean["step_vs_fused_q3"])
    text = md.read_text()
    assert "Machine:" in text and "Command:" in text and "| resnet18 | lean |" in text
    assert "2 rounds of 1 cycle, a cycle one step of every form in turn" in text
    assert f"| {lean['step_vs_fused']} ({lean['step_vs_fused_q1']}-{lean['step_vs_fused_q3']}) |" in text


def test_ratio_quartiles_pair_the_cycles():
    assert memory.ratio_quartiles([2.0, 3.0, 5.0, 4.0, 6.0], [1.0, 1.0, 1.0, 2.0, 2.0]) == (
        2.0,
        3.0,
        3.0,
    )  # ratios 2, 3, 5, 2, 3
    assert memory.ratio_quartiles([3.0], [2.0]) == (1.5, 1.5, 1.5)


def test_bench_memory_rounds_must_be_positive(tmp_path):
    with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
        main(["bench", "memory", "--quick", "--in-process", "--rounds", "0", "--results-dir", str(tmp_path)])


def test_side_by_side_timing_alternates_the_forms(monkeypatch):
    """Cycle i runs one step of every form, starting at form i mod n: each form's i-th time comes from the same
    cycle as the others' (their ratio is paired), and no form always runs first."""
    order = []

    def fake_training(cfg, make):
        return None, lambda: order.append(cfg["form"]), lambda: None

    monkeypatch.setattr(memory, "_training", fake_training)
    monkeypatch.setattr(memory, "_set_malloc_thresholds", lambda nbytes: None)
    times = memory.time_side_by_side({"repeats": 4, "threads": None}, ["a", "b", "c"])
    assert order == ["a", "b", "c"] + ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert {form: len(t) for form, t in times.items()} == {"a": 4, "b": 4, "c": 4}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a CUDA GPU")
def test_bench_memory_on_cuda_without_a_gpu_says_so(tmp_path):
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA GPU .*leave --device out for the CPU"):
        main(["bench", "memory", "--quick", "--in-process", "--device", "cuda", "--results-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir()), "no result files written"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
def test_bench_memory_quick_on_cuda(tmp_path):
    code = main(
        [
            "bench",
            "memory",
            "--quick",
            "--in-process",
            "--device",
            "cuda",
            "--models",
            "resnet18",
            "--forms",
            "fused",
            "lean",
            "floor",
            "--results-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    rows = {r["form"]: r for r in csv.DictReader((tmp_path / "bench-memory-cuda-quick.csv").open())}
    assert float(rows["lean"]["stack_vs_vanilla"]) < 0.6 and float(rows["lean"]["step_peak_MiB"]) > 0
    assert rows["lean"]["maxrss_MiB"] == ""  # the host's RSS says nothing of the GPU's memory
    assert float(rows["fused"]["grad_max_rel_diff"]) < 1e-4
    assert "step peak: `torch.cuda.max_memory_allocated()`" in (tmp_path / "bench-memory-cuda-quick.md").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
def test_bench_memory_times_cuda_graph_replays(tmp_path):
    """--cuda-graph: every spikefuse form's training step (forward, backward, Adam) captured and replayed; the
    vanilla form's serial reference reads a value to refuse NaN (a host sync): reported as not captured."""
    argv = ["bench", "memory", "--quick", "--in-process", "--device", "cuda", "--models", "resnet18", "--forms"]
    assert main([*argv, "fused", "lean", "floor", "--cuda-graph", "--results-dir", str(tmp_path)]) == 0
    rows = {r["form"]: r for r in csv.DictReader((tmp_path / "bench-memory-cuda-graph-quick.csv").open())}
    assert all(float(rows[form]["step_s"]) > 0 for form in ("fused", "lean", "floor"))
    report = (tmp_path / "bench-memory-cuda-graph-quick.md").read_text()
    assert "replays of one CUDA graph" in report
    assert [line[2:].split(":")[0] for line in report.splitlines() if "could not be captured" in line] == ["vanilla"]


def test_cuda_graph_needs_a_gpu_in_this_process(tmp_path):
    with pytest.raises(SystemExit, match="--cuda-graph captures steps on a GPU in this process"):
        main(["bench", "memory", "--quick", "--cuda-graph", "--results-dir", str(tmp_path)])
