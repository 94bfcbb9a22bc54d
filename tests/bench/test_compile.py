"""``spikefuse bench compile --quick``: the harness runs a case in fresh processes and writes its files."""

import csv

import torch

import spikefuse
from spikefuse.bench import compile as bench_compile
from spikefuse.cli import main


def test_bench_compile_quick(tmp_path):
    assert main(["bench", "compile", "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "compile_quick.csv")))
    assert [(r["case"], r["caches"]) for r in rows] == [("lif", "empty caches"), ("lif", "warm caches")]
    for r in rows:
        assert float(r["forward_s"]) > 0 and float(r["backward_s"]) > 0 and float(r["import_s"]) > 0
    text = (tmp_path / "compile_quick.md").read_text()
    assert "Machine:" in text and "Command: `" in text


def test_every_case_builds_a_layer():
    """Each case's code, run in this process: a renamed import fails here, not an hour into a benchmark run."""
    for case, code in bench_compile.CASES.items():
        scope = {"torch": torch, "spikefuse": spikefuse, "device": torch.device("cpu")}
        exec(code, scope)
        x = torch.rand(3, 5, requires_grad=True)
        scope["layer"](x).sum().backward()
        assert x.grad.shape == x.shape, case
