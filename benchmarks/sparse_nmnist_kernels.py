"""The kernels of ``SpikeLinear(sparse=True)``'s input layer in ``spikefuse train --model mlp --dataset nmnist``, on
a real batch of framed N-MNIST recordings: the CSR of the counts, the forward and the weight gradient, beside torch's
dense products, and the two copies a row-major weight costs at every call (``W.T`` for the forward, ``dW`` from the
``dW.T`` the kernel writes), which the layer's input-major weight saves; medians of ``--repeats`` rounds, every way
in turn each round (so each starts with what the others left in the caches), one process.

    python benchmarks/sparse_nmnist_kernels.py --data-dir ../shared/data/nmnist-small --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader

from spikefuse.data import load_dataset
from spikefuse.ops.spike_layers import cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ds, _ = load_dataset("nmnist", args.data_dir, train=True, T=10, seed=0)
    print("| batch | hidden | rows x inputs | nonzero % | kernel | ms | vs torch's dense |")
    print("|---|---|---|---|---|---|---|")
    for batch, hidden in ((32, 256), (128, 512)):
        x, _ = next(iter(DataLoader(ds, batch_size=batch)))
        x = x.transpose(0, 1).reshape(-1, x[0, 0].numel()).contiguous()
        g = torch.Generator().manual_seed(0)
        w = torch.randn(hidden, x.shape[1], generator=g) * 0.02
        grad = torch.randn(x.shape[0], hidden, generator=g)
        csr = cpu.to_csr(x)
        wt = w.t().contiguous()
        dw = cpu.csr_weight_grad(grad, csr)
        ways = {
            "torch: X @ W.T": lambda: x @ w.t(),
            "torch: G.T @ X": lambda: grad.t() @ x,
            "to_csr": lambda: cpu.to_csr(x),
            "csr_linear": lambda: cpu.csr_linear(csr, wt),
            "csr_weight_grad": lambda: cpu.csr_weight_grad(grad, csr),
            "copy: W.T of a row-major W": lambda: w.t().contiguous(),
            "copy: dW row-major": lambda: dw.contiguous(),
        }
        times = {name: [] for name in ways}
        for fn in ways.values():
            fn()
        for _ in range(args.repeats):
            for name, fn in ways.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        nonzero = 100 * csr.indices.numel() / x.numel()
        for name, t in ms.items():
            dense = ms["torch: G.T @ X" if "grad" in name or "dW" in name else "torch: X @ W.T"]
            ratio = "" if name.startswith("torch") else f"{t / dense:.2f}x"
            print(f"| {batch} | {hidden} | {x.shape[0]} x {x.shape[1]} | {nonzero:.1f} | {name} | {t:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
