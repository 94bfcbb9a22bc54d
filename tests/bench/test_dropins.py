"""``spikefuse bench dropins --quick``: the harness runs, writes its files, and every drop-in, called step by step and
fused, gives its peer's spikes, and a snnTorch model's loop, with the drop-ins and fused, its losses (the bench's own
checks, which raise otherwise)."""

import csv

import pytest

from spikefuse.cli import main


def test_bench_dropins_quick(tmp_path):
    for peer in ("snntorch", "spikingjelly", "norse"):
        pytest.importorskip(peer)
    assert main(["bench", "dropins", "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "dropins_quick.csv")))
    peers = {r["peer"] for r in rows}
    assert {"snnTorch RLeaky", "SpikingJelly LIFNode", "Norse LSNNCell", "snnTorch model"} <= peers
    for peer in peers - {"snnTorch model"}:
        forms = [r["implementation"] for r in rows if r["peer"] == peer]
        assert len(forms) == 3 and forms[0].endswith(", loop") and forms[2].endswith(", fused"), forms
    assert all(0 < float(r["spike_rate"]) < 1 for r in rows if r["peer"] != "snnTorch model")
    model = [r["implementation"] for r in rows if r["peer"] == "snnTorch model"]
    assert model == ["snnTorch model, loop", "same model with compat.snntorch imported, loop", "compat.fuse(model)"]
    text = (tmp_path / "dropins_quick.md").read_text()
    assert "Machine:" in text and "Command: `" in text
