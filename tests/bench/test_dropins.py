"""``spikefuse bench dropins --quick``: the harness runs, writes its files, and every drop-in, called as its peer's
users call it and fused, gives its peer's outputs, and a snnTorch model's loop, with the drop-ins and fused, its
losses (the bench's own checks, which raise otherwise)."""

import csv

import pytest

from spikefuse.cli import main

PEERS = {
    **{
        f"snnTorch {name}": "loop"
        for name in (
            "Leaky",
            "Synaptic",
            "Lapicque",
            "Alpha",
            "RLeaky",
            "RSynaptic",
            "RLeaky conv2d",
            "RSynaptic conv2d",
        )
    },
    "snnTorch StateLeaky": "sequence",
    "snnTorch LinearLeaky": "sequence",
    **{f"SpikingJelly {name}": "loop" for name in ("LIFNode", "ParametricLIFNode", "IFNode")},
    **{f"Norse {name}": "loop" for name in ("LIFCell", "LSNNCell", "LIFRecurrentCell", "LSNNRecurrentCell", "LICell")},
}


def test_bench_dropins_quick(tmp_path):
    for peer in ("snntorch", "spikingjelly", "norse"):
        pytest.importorskip(peer)
    assert main(["bench", "dropins", "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "dropins_quick.csv")))
    assert [p for p in dict.fromkeys(r["peer"] for r in rows)] == [*PEERS, "snnTorch model"]
    for peer, baseline in PEERS.items():
        forms = [r["implementation"] for r in rows if r["peer"] == peer]
        ours = peer.replace("snnTorch ", "compat.snntorch.").replace("SpikingJelly ", "compat.spikingjelly.")
        ours = ours.replace("Norse ", "compat.norse.")
        assert forms[:3] == [f"{peer}, {baseline}", f"{ours}, {baseline}", f"{ours}, fused"] or (
            baseline == "sequence"
            and forms == [f"{peer}, sequence", f"{ours}, sequence", f"{ours}, sequence, recursive=True"]
        ), forms
    assert [r["implementation"] for r in rows if r["peer"] == "snnTorch RLeaky"][3:] == [
        "compat.snntorch.RLeaky, fused, sparse=True"
    ]
    for r in rows:
        if r["peer"] in PEERS and r["peer"] != "Norse LICell":
            assert 0 < float(r["spike_rate"]) < 1, r
            tie_form = r["implementation"].endswith(("sparse=True", "recursive=True"))
            assert tie_form or r["spikes_differing"] == "0", r
    model = [r["implementation"] for r in rows if r["peer"] == "snnTorch model"]
    assert model == ["snnTorch model, loop", "same model with compat.snntorch imported, loop", "compat.fuse(model)"]
    text = (tmp_path / "dropins_quick.md").read_text()
    assert "Machine:" in text and "Command: `" in text
