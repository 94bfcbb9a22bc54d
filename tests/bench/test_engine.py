"""``spikefuse bench engine --quick``: the harness runs, writes its files, and every implementation of a model gives
the same spikes (the bench's own check)."""

import csv

import pytest

from spikefuse.cli import main


def test_bench_engine_quick(tmp_path):
    pytest.importorskip("snntorch")
    assert main(["bench", "engine", "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "engine_quick.csv")))
    names = {r["implementation"] for r in rows}
    assert {
        "spikefuse CubaLIF (cpu)",
        "snnTorch Synaptic (loop)",
        "spikefuse Norse-LSNN definition (cpu)",
        "spikefuse ALIF (cpu)",
        "spikefuse.lif (engine definition, cpu, potential)",
        "spikefuse.lif (engine definition, cpu, recompute)",
    } <= names
    assert all(float(r["spike_mismatch"]) == 0.0 for r in rows)
    text = (tmp_path / "engine_quick.md").read_text()
    assert "Machine:" in text and "Command: `" in text
