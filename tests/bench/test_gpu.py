"""``spikefuse bench gpu``: without a GPU it says so; with one (not on CI) the quick harness runs, writes its files,
and the implementations of each dynamics give the same spikes where they are configured to."""

import csv

import pytest
import torch

from spikefuse.bench import ours
from spikefuse.bench.gpu import floor_bytes
from spikefuse.bench.peers import ALPHA, DECAY, THRESHOLD
from spikefuse.cli import main
from tests.triton_on_cuda import GPU_TEST_MODE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is visible")
def test_bench_gpu_without_a_gpu_says_so(tmp_path):
    with pytest.raises(SystemExit, match="spikefuse bench gpu needs a CUDA GPU: none is visible to PyTorch here"):
        main(["bench", "gpu", "--quick", "--out", str(tmp_path)])


@pytest.mark.skipif(not (torch.cuda.is_available() and GPU_TEST_MODE),
                    reason="needs a CUDA GPU (CI has none) and SPIKEFUSE_TEST_TRITON=cuda")
def test_bench_gpu_quick(tmp_path):
    assert main(["bench", "gpu", "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "gpu_quick.csv")))
    mismatch = {r["implementation"]: float(r["spike_mismatch"]) for r in rows}
    ours = [name for name in mismatch if name.startswith("spikefuse")]
    assert {"spikefuse.lif (potential)", "spikefuse CubaLIF", "spikefuse ALIF",
            "spikefuse LIF fp16, generated kernels (recompute)"} <= set(ours)
    assert all(mismatch[name] == 0.0 for name in ours)
    text = (tmp_path / "gpu_quick.md").read_text()
    assert "Machine:" in text and "Command: `" in text


def test_floor_bytes():
    """The documented floors: fp32 12 / 24 (potential) and 8 / 20 (recompute); fp16 halves every stream but the
    float32 membrane."""
    assert [floor_bytes(m, 4) for m in ("potential", "recompute")] == [(12, 24), (8, 20)]
    assert [floor_bytes(m, 2) for m in ("potential", "recompute")] == [(8, 16), (4, 10)]


@pytest.mark.parametrize("memory", ["potential", "recompute"])
def test_the_fp16_group_runs_one_lif_on_both_kernel_families(memory):
    """The LIF the fp16 group times on the hand-written kernels and on the generated ones: the same spikes and input
    gradients within a float16 rounding (through Triton's interpreter, or on the GPU with
    SPIKEFUSE_TEST_TRITON=cuda)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.rand(5, 3, 700, generator=gen) * 0.6).half()
    g = torch.rand(x.shape, generator=gen).half()
    runs = []
    for build in (ours.hand_written_lif, ours.generated_lif):
        leaf = x.clone().requires_grad_()
        spikes = build(DECAY, THRESHOLD, ALPHA, memory)(leaf)
        spikes.backward(g)
        runs.append((spikes, leaf.grad))
    (s1, g1), (s2, g2) = runs
    assert s1.dtype == s2.dtype == torch.float16 and 0 < float(s1.detach().float().mean()) < 1 and torch.equal(s1, s2)
    # each family rounds its float32 gradient to float16; their float32 values may differ in the last bit (another
    # order of operations), which moves a float16 result by one unit in the last place
    torch.testing.assert_close(g1, g2, rtol=2.0**-10, atol=1e-7)
