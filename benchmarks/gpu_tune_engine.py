"""A sweep of the generated Triton neuron kernels' launch configuration on a CUDA GPU: neurons per program (BLOCK),
warps per program, and software pipelining of the time loop (``tl.range(..., num_stages=S)``: the loads of later
steps issued while the current one computes; "-" is the plain ``range`` the generator writes today).

For the paper's LIF (``LIF_MODELS[("paper", "hard")]``, sigmoid surrogate) at T=32 and the ALIF at N=16M, fp32,
forward and recomputing backward (memory="recompute") timed apart with CUDA events (``triton.testing.do_bench``,
median), every variant checked to give the spikes and input gradient of the generator's own kernels. Floor: the
bytes of each pass (forward: read x, write spikes, 8 per neuron-step; backward: read x and the spikes' gradient,
write grad_x, 12) over the device-to-device copy bandwidth measured in the same run. A table to stdout and
``$OUT/gpu_tune_engine.md``.

    OUT=/tmp/out python3 benchmarks/gpu_tune_engine.py
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from spikefuse.neurons import ALIF_MODEL, LIF_MODELS, neuron_spec  # noqa: E402
from spikefuse.ops.engine import NeuronInputs  # noqa: E402
from spikefuse.ops.engine import triton as engine_triton  # noqa: E402
from spikefuse.surrogate import Sigmoid  # noqa: E402


def variant(model, stages: int | None):
    """The generator's kernel module for ``model``, its time loops pipelined over ``stages`` (None: as generated)."""
    source = engine_triton.kernel_source(model, Sigmoid, torch.float32)
    if stages is not None:  # the forward's loop, the backward's recompute and its reverse loop
        assert source.count(" in range(0, T):") == 3
        source = source.replace(" in range(0, T):", f" in tl.range(0, T, num_stages={stages}):")
    path = Path(tempfile.mkdtemp()) / f"tune_{model.name}_{stages}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp"))
    torch.manual_seed(0)
    big = torch.empty(1 << 28, device="cuda")
    copy_s = do_bench(big.clone, return_mode="median") / 1e3
    bandwidth = 2 * big.nbytes / copy_s
    del big
    rows = []
    cases = [
        (LIF_MODELS[("paper", "hard")], {"decay": 0.8, "threshold": 0.5, "v_reset": 0.0}, n)
        for n in (1_000_000, 16_000_000)
    ] + [(ALIF_MODEL, {"decay": 0.9, "rho": 0.95, "b0": 0.5, "beta": 0.2}, 16_000_000)]
    original = (engine_triton.kernels, engine_triton.engine_block, dict(engine_triton.COMPILE_OPTIONS))
    for model, values, n in cases:
        t_steps = 32
        x = torch.rand(t_steps, n, device="cuda") * 0.6
        gy = torch.rand(t_steps, n, device="cuda")
        params = [torch.full((1,), float(values[p]), device="cuda") for p in model.params]
        init = [torch.zeros(1, device="cuda") for _ in model.states]
        grad_final = [torch.zeros(1, device="cuda") for _ in model.states]
        neuron, inputs = neuron_spec(model, Sigmoid(4.0)), NeuronInputs(x, params, init)
        need = [False] * len(model.params)

        def forward():
            return engine_triton.forward(neuron, inputs)[0]

        def backward():
            return engine_triton.backward(neuron, inputs, gy, grad_final, need)[0]

        want = (forward().clone(), backward().clone())
        modules = {stages: variant(model, stages) for stages in (None, 2, 3)}
        for block, warps, stages in itertools.product((256, 512, 1024, 2048), (4, 8), (None, 2, 3)):
            engine_triton.kernels = lambda *a, m=modules[stages]: m
            engine_triton.engine_block = lambda *a, b=block: b
            engine_triton.COMPILE_OPTIONS.update(num_warps=warps)
            try:
                got = (forward(), backward())
                same = torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
                fwd = do_bench(forward, return_mode="median") / 1e3
                bwd = do_bench(backward, return_mode="median") / 1e3
            except Exception as err:  # a configuration the compiler refuses (registers, shared memory)
                print(f"{model.name} N={n} BLOCK={block} warps={warps} stages={stages}: {type(err).__name__}: {err}")
                continue
            finally:
                engine_triton.kernels, engine_triton.engine_block = original[0], original[1]
                engine_triton.COMPILE_OPTIONS.clear()
                engine_triton.COMPILE_OPTIONS.update(original[2])
            floor_f = 8 * t_steps * n / bandwidth
            floor_b = 12 * t_steps * n / bandwidth
            rows.append(
                [
                    model.name,
                    f"{n:,}",
                    block,
                    warps,
                    stages or "-",
                    round(fwd * 1e3, 3),
                    round(fwd and floor_f / fwd, 3),
                    round(bwd * 1e3, 3),
                    round(floor_b / bwd, 3),
                    same,
                ]
            )
        default = engine_triton.engine_block(n, len(model.states), torch.float32)
        print(
            f"{model.name} N={n:,}: the generator's own configuration is BLOCK={default}, "
            f"warps={engine_triton.NUM_WARPS}, plain loops"
        )
    header = [
        "model",
        "N",
        "BLOCK",
        "warps",
        "stages",
        "fwd ms",
        "fwd floor fraction",
        "bwd ms",
        "bwd floor fraction",
        "same results",
    ]
    lines = [
        f"# Triton engine kernels: launch configuration sweep, T=32, fp32 ({torch.cuda.get_device_name()})",
        "",
        f"Triton {triton.__version__}, torch {torch.__version__}; copy bandwidth {bandwidth / 1e9:.0f} GB/s. "
        "Command: `OUT=... python3 benchmarks/gpu_tune_engine.py`. Floors: forward 8, backward 12 bytes per "
        "neuron-step (memory='recompute').",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    (out / "gpu_tune_engine.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
