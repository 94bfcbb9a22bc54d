"""``spikefuse bench gpu-static``: the committed report is what its committed JSON renders to (no compilation here:
``tests/ops/test_triton_aot.py`` compiles), and its case sets cover what the report's sections read."""

from pathlib import Path

from spikefuse.bench import gpu_static
from spikefuse.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_committed_report_renders_from_its_json(tmp_path):
    assert (
        main(["bench", "gpu-static", "--render", str(RESULTS / "gpu_static.json"), "--results-dir", str(tmp_path)]) == 0
    )
    assert (tmp_path / "gpu_static.md").read_text() == (RESULTS / "gpu_static.md").read_text()


def test_case_sets():
    """The shipped neurons in every dtype, kernel and memory mode (the LIF also without the decay's gradient, for the
    SpikingJelly comparison); every LIF definition once per kernel, or with every surrogate."""
    shipped = gpu_static.shipped_cases(1_000_000)
    assert {(c["model"]["name"], c["xdt"], c["kernel"], gpu_static._mode(c)) for c in shipped} == {
        (m, d, k, mode)
        for m in gpu_static.SHIPPED
        for d in ("fp32", "fp16", "bf16", "fp64")
        for k in ("engine-fwd", "engine-bwd")
        for mode in ("potential", "recompute")
    }
    assert sum(c["group"].endswith("-fixed") for c in shipped) == 8
    assert len({c["id"] for c in shipped}) == len(shipped) == 56
    once = gpu_static.definition_cases(1_000_000)
    every = gpu_static.definition_cases(1_000_000, every_surrogate=True)
    assert len(every) == 5 * len(once) and len({c["id"] for c in every}) == len(every)
    assert {c["model"]["name"] for c in once} >= {"lif_hard", "leaky_subtract", "sj_hard_div_input"}
