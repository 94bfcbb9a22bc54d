"""``spikefuse bench profile --quick``: the result files, each form's own ops, the totals, bad arguments."""

import csv

import pytest

from spikefuse.cli import main


def test_bench_profile_quick_lists_each_forms_ops(tmp_path, capsys):
    code = main(["bench", "profile", "--quick", "--threads", "1", "--min-ms", "0", "--results-dir", str(tmp_path)])
    assert code == 0
    rows = list(csv.DictReader((tmp_path / "bench-profile-quick.csv").open()))
    assert list(rows[0]) == ["op", "fused_ms", "lean_ms", "floor_ms"]
    *ops, total = rows
    assert total["op"] == "all ops"
    for form in ("fused", "lean", "floor"):
        column = f"{form}_ms"
        assert float(total[column]) == pytest.approx(sum(float(r[column]) for r in ops), rel=1e-2, abs=0.01)
    by_op = {r["op"]: r for r in ops}
    # the lean form's fused BatchNorm+LIF and bit-saving convolutions, the default's torch BatchNorm, the floor's
    # ReLU, each only in its own form
    assert float(by_op["_EagerBatchNormNeuron"]["lean_ms"]) > 0 == float(by_op["_EagerBatchNormNeuron"]["fused_ms"])
    assert float(by_op["_SpikeConvFnBackward"]["lean_ms"]) > 0 == float(by_op["_SpikeConvFnBackward"]["floor_ms"])
    assert (
        float(by_op["aten::native_batch_norm"]["fused_ms"]) > 0 == float(by_op["aten::native_batch_norm"]["floor_ms"])
    )
    assert float(by_op["aten::relu"]["floor_ms"]) > 0 == float(by_op["aten::relu"]["fused_ms"])
    text = (tmp_path / "bench-profile-quick.md").read_text()
    assert "Machine:" in text and "Command:" in text and "| **all ops** |" in text


@pytest.mark.parametrize("flag", ["--steps", "--rounds"])
def test_bench_profile_counts_must_be_positive(tmp_path, flag):
    with pytest.raises(SystemExit, match=f"{flag} must be at least 1, got 0"):
        main(["bench", "profile", flag, "0", "--results-dir", str(tmp_path)])
