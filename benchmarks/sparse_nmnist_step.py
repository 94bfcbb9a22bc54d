"""One training step (forward, backward, Adam) of ``spikefuse train --model mlp`` on a batch of real N-MNIST frames
(T=10), ``--sparse false / true / auto`` side by side in one process, alternating, medians of 20 steps: the model's
share of ``benchmarks/results/sparse_nmnist.md``'s end-to-end runs, without the data loading.

    python benchmarks/sparse_nmnist_step.py --data-dir ../shared/data/nmnist-small --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spikefuse.data import load_dataset
from spikefuse.models import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ds, _ = load_dataset("nmnist", args.data_dir, train=True, T=10, seed=0)
    print("| batch | hidden | sparse | step ms (median) | dense / this |")
    print("|---|---|---|---|---|")
    for batch, hidden in ((32, 256), (128, 512)):
        x = torch.stack([ds[i][0] for i in range(batch)]).transpose(0, 1).contiguous()
        y = torch.tensor([ds[i][1] for i in range(batch)])
        runs = {}
        for sparse in (False, True, "auto"):
            torch.manual_seed(0)
            model = build_model("mlp", 2, 10, image_size=34, hidden=hidden, sparse=sparse)
            runs[sparse] = (model, torch.optim.Adam(model.parameters()), [])
        for i in range(25):
            for model, optimizer, times in runs.values():
                start = time.perf_counter()
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x).mean(0), y).backward()
                optimizer.step()
                if i >= 5:  # the first steps compile and warm
                    times.append(time.perf_counter() - start)
        dense = statistics.median(runs[False][2])
        for sparse, (_, _, times) in runs.items():
            ms = statistics.median(times)
            print(f"| {batch} | {hidden} | {str(sparse).lower()} | {1e3 * ms:.1f} | {dense / ms:.2f}x |")


if __name__ == "__main__":
    main()
