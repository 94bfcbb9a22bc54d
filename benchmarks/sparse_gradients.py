"""The backward of SpikeLinear with ``sparse_grad=True`` (the input and weight gradients read from the CSR of the
output gradient, building it included) against ``sparse_grad=False`` (torch's dense products), at rising shares of
nonzero output gradients: the input gradient and the weight and bias gradients of a layer of the SHD input size
and of N-MNIST's, and a small hidden layer, fed by 5% spikes (``sparse=False``: the weight gradient unpacks the input's bits in both forms).
The forward is not timed; the two forms alternate in one process; medians. Behind
``spikefuse.ops.spike_layers.cpu.CROSSOVER_GRAD``.

    python benchmarks/sparse_gradients.py --threads 2 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spikefuse.bench.common import machine_info
from spikefuse.nn import SpikeLinear

# (rows T*B, in_features, out_features): the SHD input product, N-MNIST's input layer (2x34x34 -> 512), and the
# hidden layer of `spikefuse train --model mlp` on N-MNIST at T=10, batch 32 (its small products' per-call costs)
PRODUCTS = [(8000, 700, 256), (8000, 2 * 34 * 34, 512), (320, 256, 256)]
DENSITIES = [0.01, 0.05, 0.10, 0.20, 0.50]
INPUT_RATE = 0.05


def backward_seconds(layer: SpikeLinear, x: torch.Tensor, grad: torch.Tensor) -> float:
    layer.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    y = layer(leaf)
    start = time.perf_counter()
    y.backward(grad)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_info()}")
    print("| rows x in -> out | nonzero gradients | dense ms | sparse_grad ms | sparse_grad / dense |")
    print("|---|---|---|---|---|")
    for rows, k_in, n_out in PRODUCTS:
        torch.manual_seed(0)
        dense = SpikeLinear(k_in, n_out)
        sparse = SpikeLinear(k_in, n_out, sparse_grad=True)
        sparse.load_state_dict(dense.state_dict())
        g = torch.Generator().manual_seed(rows + k_in)
        x = (torch.rand(1, rows, k_in, generator=g) < INPUT_RATE).float()
        for density in DENSITIES:
            grad = torch.randn(1, rows, n_out, generator=g) * (torch.rand(1, rows, n_out, generator=g) < density)
            for layer in (dense, sparse):  # compile and warm
                backward_seconds(layer, x, grad)
            times = {"dense": [], "sparse": []}
            for _ in range(args.repeats):
                times["dense"].append(backward_seconds(dense, x, grad))
                times["sparse"].append(backward_seconds(sparse, x, grad))
            d, s = (1e3 * statistics.median(times[k]) for k in ("dense", "sparse"))
            print(f"| {rows} x {k_in} -> {n_out} | {density:.0%} | {d:.2f} | {s:.2f} | {s / d:.2f} |", flush=True)


if __name__ == "__main__":
    main()
