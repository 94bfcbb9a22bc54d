"""``spikefuse bench layers --quick``: the sites it finds, the result files, the spike check."""

import csv

import pytest

from spikefuse.bench import layers
from spikefuse.cli import main


def test_bench_layers_quick_finds_every_site_of_resnet18(tmp_path, capsys):
    code = main(["bench", "layers", "--quick", "--threads", "1", "--results-dir", str(tmp_path)])
    assert code == 0
    rows = list(csv.DictReader((tmp_path / "bench-layers-quick.csv").open()))
    assert list(rows[0]) == layers.COLUMNS
    *sites, total = rows
    # ResNet18: the stem, then per stage two BN+LIF and two BN+add+LIF (the first of a downsampling stage: a float
    # shortcut), 17 sites in all
    assert sum(int(r["count"]) for r in sites) == int(total["count"]) == 17
    kinds = {(r["site"], r["residual"]) for r in sites}
    assert kinds == {("conv+BN+LIF", "-"), ("BN+LIF", "-"), ("BN+add+LIF", "spikes (bits)"), ("BN+add+LIF", "float")}
    for form in layers.FORMS:
        assert all(float(r[f"{form}_ms"]) > 0 for r in sites)
        # the sites are written to 4 decimals, the total to 3: their roundings bound the difference
        assert float(total[f"{form}_ms"]) == pytest.approx(
            sum(int(r["count"]) * float(r[f"{form}_ms"]) for r in sites), rel=1e-3, abs=5e-4 + 17 * 5e-5
        )
    text = (tmp_path / "bench-layers-quick.md").read_text()
    assert "Machine:" in text and "Command:" in text and "| conv+BN+LIF | 2x2x3x8x8 |" in text


def test_bench_layers_stops_when_lean_and_default_spikes_differ(monkeypatch, tmp_path):
    make = layers._bn_forms

    def default_off_by_one(*args):
        forms = make(*args)
        default = forms["default"]
        forms["default"] = lambda: 1 - default()
        return forms

    monkeypatch.setattr(layers, "_bn_forms", default_off_by_one)
    with pytest.raises(SystemExit, match=r"lean and default forms of the conv\+BN\+LIF site .* different spikes"):
        main(["bench", "layers", "--quick", "--threads", "1", "--results-dir", str(tmp_path)])


def test_bench_layers_repeats_must_be_positive(tmp_path):
    with pytest.raises(SystemExit, match="--repeats must be at least 1, got 0"):
        main(["bench", "layers", "--repeats", "0", "--results-dir", str(tmp_path)])
