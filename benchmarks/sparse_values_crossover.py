"""The crossover of SpikeLinear(sparse=...) on inputs with values (framed events are counts): one training call of the
layer -- forward, then backward to the weight and bias (the input, data, needs no gradient) -- on count inputs at
rising shares of nonzero entries, ``sparse=True`` (the CSR with values, every per-call cost included: the failed
binary check of the packing, the count, the CSR, the weight's transpose) against ``nn.Linear``, alternating, medians.
Behind ``spikefuse.ops.sparse_cpu.CROSSOVER_VALUES``.

    python benchmarks/sparse_values_crossover.py --threads 2 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from spikefuse.bench.common import machine_info
from spikefuse.nn import SpikeLinear

# (rows T*B, in_features, out_features): the N-MNIST input layer of `spikefuse train --model mlp` at T=10 and
# batches 32 and 128, at two widths, and an SHD-size input layer
PRODUCTS = [(320, 2312, 256), (320, 2312, 512), (1280, 2312, 512), (1280, 700, 256)]
DENSITIES = [0.02, 0.05, 0.10, 0.20, 0.30, 0.40, 0.50]


def counts(rows: int, cols: int, density: float, seed: int) -> torch.Tensor:
    """Nonzero with probability ``density``, then 1, 2 or 3 (framed events: many pixels see a few events a bin)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, cols, generator=g) < density) * torch.randint(1, 4, (rows, cols), generator=g).float()


def step_seconds(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    layer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    layer(x).backward(grad)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_info()}")
    print("| rows x in -> out | nonzero | dense ms | sparse ms | sparse / dense |")
    print("|---|---|---|---|---|")
    for rows, k_in, n_out in PRODUCTS:
        torch.manual_seed(0)
        dense = nn.Linear(k_in, n_out)
        sparse = SpikeLinear(k_in, n_out, sparse=True)
        sparse.load_state_dict(dense.state_dict())
        grad = torch.randn(1, rows, n_out)
        for density in DENSITIES:
            x = counts(rows, k_in, density, seed=rows + k_in).unsqueeze(0)
            for layer in (dense, sparse):  # compile and warm
                step_seconds(layer, x, grad)
            times = {"dense": [], "sparse": []}
            for _ in range(args.repeats):
                times["dense"].append(step_seconds(dense, x, grad))
                times["sparse"].append(step_seconds(sparse, x, grad))
            d, s = (1e3 * statistics.median(times[k]) for k in ("dense", "sparse"))
            print(f"| {rows} x {k_in} -> {n_out} | {density:.0%} | {d:.2f} | {s:.2f} | {s / d:.2f} |", flush=True)


if __name__ == "__main__":
    main()
