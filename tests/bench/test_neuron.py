"""`spikefuse bench neuron --quick` writes its table, CSV and plot with the expected columns (no timing asserted)."""

import csv

from spikefuse.cli import main


def test_bench_neuron_quick_writes_results(tmp_path):
    assert main(["bench", "neuron", "--quick", "--neurons", "2000", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "neuron_quick.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) >= {
        "T",
        "N",
        "implementation",
        "forward_ms",
        "forward_backward_ms",
        "spike_mismatch",
        "floor_12B_ms",
    }
    names = {row["implementation"] for row in rows}
    assert {"spikefuse cpu (fused)", "spikefuse reference", "PyTorch eager (unbind loop)"} <= names
    assert {row["T"] for row in rows} == {"4", "8"}
    fused = [row for row in rows if row["implementation"] == "spikefuse cpu (fused)"]
    assert all(float(row["spike_mismatch"]) == 0.0 for row in fused)
    assert all(
        float(row[k]) > 0
        for row in fused
        for k in ("kernel_forward_ms", "kernel_backward_ms", "kernel_backward_separate_grad_x_ms")
    )
    text = (tmp_path / "neuron_quick.md").read_text()
    assert "Command:" in text and "Machine:" in text
    assert "backward kernel ms (floor / kernel)" in text
    assert (tmp_path / "neuron_quick.png").stat().st_size > 0
