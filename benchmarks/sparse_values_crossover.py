"""The crossover of SpikeLinear(sparse=...) on inputs with values (framed events are counts): one training call of the
layer -- forward, then backward to the weight and bias (the input, data, needs no gradient) -- on count inputs at
rising shares of nonzero entries, ``sparse=True`` (the CSR with values, every per-call cost included: the failed
binary check of the packing, the count, the CSR, the weight's transpose) and ``sparse="auto"`` (the same checks, then
the CSR below ``CROSSOVER_VALUES`` nonzero and torch's product above) against ``nn.Linear``, alternating, medians;
the ratios are the medians of each round's ratios (the three calls of a round run back to back, so a shared
machine's load moves them together), and the ratio of the fastest calls (the ones least slowed by other jobs).
Behind ``spikefuse.ops.spike_layers.cpu.CROSSOVER_VALUES``; the ``auto / dense`` columns are the issue's sweep (0-60%:
``auto`` at most 5% slower than dense at any rate).

    python benchmarks/sparse_values_crossover.py --threads 1 --repeats 31
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
    print(
        "| rows x in -> out | nonzero | dense ms | sparse ms | auto ms | sparse / dense | auto / dense | "
        "auto / dense, fastest |"
    )
    print("|---|---|---|---|---|---|---|---|")
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
            order = list(layers)
            for r in range(args.repeats):
                for k in order[r % 3 :] + order[: r % 3]:  # each way first in turn
                    times[k].append(step_seconds(layers[k], x, grad))
            d, s, a = (1e3 * statistics.median(times[k]) for k in ("dense", "sparse", "auto"))
            # the ratios of each round's calls, which ran back to back, then their median: another job's load on a
            # shared machine moves the three calls of a round together
            rs, ra = (statistics.median(u / v for u, v in zip(times[k], times["dense"])) for k in ("sparse", "auto"))
            # and of the fastest call of each way: the one least slowed by other jobs
            fastest = min(times["auto"]) / min(times["dense"])
            worst = max(worst, ra)
            print(
                f"| {rows} x {k_in} -> {n_out} | {density:.0%} | {d:.2f} | {s:.2f} | {a:.2f} | {rs:.2f} | {ra:.3f} | "
                f"{fastest:.3f} |",
                flush=True,
            )
    print(f"\nworst auto / dense (medians of the rounds' ratios): {worst:.3f}")


if __name__ == "__main__":
    main()
