"""``spikefuse bench sparse --quick``: the result files, the crossover, the checks before timing."""

import csv

import pytest

from spikefuse.bench import sparse
from spikefuse.cli import main


def test_bench_sparse_quick_writes_every_product_and_rate(tmp_path):
    assert (
        main(["bench", "sparse", "--quick", "--threads", "1", "--products", "shd", "step", "--out", str(tmp_path)]) == 0
    )
    rows = list(csv.DictReader((tmp_path / "sparse_quick.csv").open()))
    assert list(rows[0]) == sparse.COLUMNS
    assert [(r["product"], float(r["rate_pct"])) for r in rows] == [
        (p, r) for p in ("shd", "step") for r in sparse.QUICK["rates"]
    ]
    assert [int(r["rows"]) for r in rows] == [64, 64, 32, 32]
    assert all(float(r[c]) > 0 for r in rows for c in ("dense_fwd_ms", "sparse_fwd_ms", "sparse_wgrad_ms"))
    text = (tmp_path / "sparse_quick.md").read_text()
    assert "Machine:" in text and "Command:" in text and "| shd | 64 | 700 | 256 | 5" in text
    assert "- shd, 64 rows: forward " in text and "- step, 32 rows: forward " in text


def test_crossover_interpolates_the_first_crossing():
    assert sparse.crossover([10, 20, 50], [0.5, 0.8, 1.4]) == pytest.approx(30.0)
    assert sparse.crossover([5, 50], [0.2, 0.9]) == "above the rates measured"
    assert sparse.crossover([5, 50], [1.2, 1.5]) == "none: sparse is slower at every rate measured"


def test_bench_sparse_stops_where_the_sparse_product_differs(monkeypatch, tmp_path):
    from spikefuse.ops.spike_layers import cpu as sparse_cpu

    linear = sparse_cpu.linear
    monkeypatch.setattr(sparse_cpu, "linear", lambda *a: linear(*a) + 1)
    with pytest.raises(SystemExit, match=r"the sparse forward of \[64 x 700\] @ \[700 x 256\] at 5% differs"):
        main(["bench", "sparse", "--quick", "--threads", "1", "--products", "shd", "--out", str(tmp_path)])


def test_bench_sparse_arguments_are_checked(tmp_path):
    with pytest.raises(SystemExit, match="--repeats must be at least 1, got 0"):
        main(["bench", "sparse", "--repeats", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--rates are percentages from 0 to 100, got \[5.0, 150.0\]"):
        main(["bench", "sparse", "--rates", "5", "150", "--out", str(tmp_path)])


def test_bench_sparse_rows_sweep(tmp_path):
    argv = ["bench", "sparse", "--quick", "--threads", "1", "--products", "recurrent", "--rows", "16", "40"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "sparse_quick.csv").open()))
    assert [int(r["rows"]) for r in rows] == [16, 16, 40, 40]
    text = (tmp_path / "sparse_quick.md").read_text()
    assert "- recurrent, 16 rows: forward " in text and "- recurrent, 40 rows: forward " in text
