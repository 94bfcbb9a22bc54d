"""Host time of one LIF layer call (forward+backward) through the Triton launchers, the kernel launches stubbed: the
Python a GPU's host runs per call, measured on any machine (Triton's interpreter only builds the kernel objects).
Side by side in one process: the launch grids computed with ``triton.cdiv`` (a constexpr function in Triton 3.9)
and with ``ops.launch.ceil_div``; 7 rounds of 300 calls each, the median of the rounds' medians.

    python benchmarks/ab_triton_host_cost.py
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import statistics
import time

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

import spikefuse
import spikefuse.ops
import spikefuse.ops.engine.triton as engine_triton
from spikefuse.ops.launch import ceil_div


def main() -> None:
    spikefuse.ops.triton_interpreted = lambda: True  # the Triton backend on CPU tensors
    x = torch.rand(32, 64, requires_grad=True)
    g = torch.rand(32, 64)

    def call():
        spikefuse.lif(x, decay=0.2, threshold=0.3, backend="triton").backward(g)
        x.grad = None

    call()  # the kernels built once for real
    InterpretedFunction.run = lambda self, *args, **kwargs: None  # from here on: no kernel runs
    engine_triton.refuse_flagged = lambda *args, **kwargs: None  # as on a GPU: the (unwritten) flags are not read
    rounds = {"triton.cdiv": [], "ceil_div": []}
    for _ in range(7):
        for name, grid in (("triton.cdiv", triton.cdiv), ("ceil_div", ceil_div)):
            engine_triton.ceil_div = grid
            for _ in range(30):
                call()
            times = []
            for _ in range(300):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            rounds[name].append(statistics.median(times) * 1e6)
    for name, values in rounds.items():
        print(
            f"{name:12s} {statistics.median(values):7.1f} us per forward+backward (rounds: "
            f"{', '.join(f'{v:.0f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
