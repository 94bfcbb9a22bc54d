"""The crossover of SpikeLinear(sparse=...) on inputs with values (framed events are counts): one training call of the
layer -- forward, then backward to the weight and bias (the input, data, needs no gradient) -- on count inputs at
rising shares of nonzero entries, ``sparse=True`` (the CSR with values, every per-call cost included: the failed
binary check of the packing, the count, the CSR, the weight's transpose) and ``sparse="auto"`` (the same checks, then
the CSR below ``CROSSOVER_VALUES`` nonzero and torch's product above) against ``nn.Linear``, alternating, medians.
Behind ``spikefuse.ops.sparse_cpu.CROSSOVER_VALUES``; the ``auto / dense`` column is the issue's sweep (0-60%: ``auto``
at most 5% slower than dense at any rate).

    python benchmarks/sparse_values_crossover.py --threads 2 --repeats 15
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
# batches 32 and 128, at two widths, an SHD-size input layer, and one below CROSSOVER_ROWS (auto keeps torch's
# product there whatever the rate, after the failed binary check)
PRODUCTS = [(128, 2312, 512), (320, 2312, 256), (320, 2312, 512), (1280, 2312, 512), (1280, 700, 256)]
# 0%: an all-zero input is binary, and takes the spikes' path
DENSITIES = [0.0, 0.01, 0.02, 0.05, 0.10, 0.15, 0.20, 0.30, 0.40, 0.50, 0.60]


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
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--products", type=int, nargs="*", help="indices into PRODUCTS (default: all)")
    p.add_argument("--densities", type=float, nargs="*", help="shares of nonzero entries (default: 0-60%%)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_info()}")
    print("| rows x in -> out | nonzero | dense ms | sparse ms | auto ms | sparse / dense | auto / dense |")
    print("|---|---|---|---|---|---|---|")
    products = [PRODUCTS[i] for i in args.products] if args.products else PRODUCTS
    worst = 0.0
    for rows, k_in, n_out in products:
        torch.manual_seed(0)
        layers = {"dense": nn.Linear(k_in, n_out)}
        for mode in (True, "auto"):
            layers["sparse" if mode is True else "auto"] = SpikeLinear(k_in, n_out, sparse=mode)
            layers["sparse" if mode is True else "auto"].load_state_dict(layers["dense"].state_dict())
        grad = torch.randn(1, rows, n_out)
        for density in args.densities or DENSITIES:
            x = counts(rows, k_in, density, seed=rows + k_in).unsqueeze(0)
            for layer in layers.values():  # compile and warm
                step_seconds(layer, x, grad)
            times = {k: [] for k in layers}
            for _ in range(args.repeats):
                for k, layer in layers.items():
                    times[k].append(step_seconds(layer, x, grad))
            d, s, a = (1e3 * statistics.median(times[k]) for k in ("dense", "sparse", "auto"))
            worst = max(worst, a / d)
            print(
                f"| {rows} x {k_in} -> {n_out} | {density:.0%} | {d:.2f} | {s:.2f} | {a:.2f} | {s / d:.2f} | "
                f"{a / d:.2f} |",
                flush=True,
            )
    print(f"\nworst auto / dense: {worst:.3f}")


if __name__ == "__main__":
    main()
