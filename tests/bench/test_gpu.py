"""``spikefuse bench gpu``: without a GPU it says so; with one (not on CI) the quick harness runs, writes its files,
and the implementations of each dynamics give the same spikes where they are configured to."""

import csv

import pytest
import torch

from spikefuse.bench.gpu import floor_bytes
from spikefuse.cli import main
from tests.triton_on_cuda import GPU_TEST_MODE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is visible")
def test_bench_gpu_without_a_gpu_says_so(tmp_path):
    with pytest.raises(SystemExit, match="spikefuse bench gpu needs a CUDA GPU: none is visible to PyTorch here"):
        main(["bench", "gpu", "--quick", "--out", str(tmp_path)])


@pytest.mark.skipif(
    not (torch.cuda.is_available() and GPU_TEST_MODE),
    reason="needs a CUDA GPU (CI has none) and SPIKEFUSE_TEST_TRITON=cuda",
)
def test_bench_gpu_quick(tmp_path):
    assert main(["bench", "gpu", "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "gpu_quick.csv")))
    mismatch = {r["implementation"]: float(r["spike_mismatch"]) for r in rows}
    ours = [name for name in mismatch if name.startswith("spikefuse")]
    assert {
        "spikefuse.lif (potential)",
        "spikefuse CubaLIF",
        "spikefuse ALIF",
        "spikefuse.lif fp16 (recompute)",
        "spikefuse compat.spikingjelly.LIFNode fp16",
    } <= set(ours)
    assert all(mismatch[name] == 0.0 for name in ours)
    text = (tmp_path / "gpu_quick.md").read_text()
    assert "Machine:" in text and "Command: `" in text


def test_floor_bytes():
    """The documented floors: fp32 12 / 24 (potential) and 8 / 20 (recompute); fp16 halves every stream but the
    float32 membrane."""
    assert [floor_bytes(m, 4) for m in ("potential", "recompute")] == [(12, 24), (8, 20)]
    assert [floor_bytes(m, 2) for m in ("potential", "recompute")] == [(8, 16), (4, 10)]
