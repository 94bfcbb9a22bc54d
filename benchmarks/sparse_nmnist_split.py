"""Where a training batch of ``spikefuse train --model mlp --dataset nmnist`` spends its time, with the framed samples
cached (``--cache-frames``, the default) and without: the data (the loader's batch and its time-major copy), the
forward with the loss, the backward, Adam's step; ``--sparse false / true / auto`` alternating batch by batch in one
process on the same batches, medians over ``--epochs`` epochs after a first that fills the cache and compiles. The
split of ``benchmarks/results/sparse_nmnist_cached.md``.

    python benchmarks/sparse_nmnist_split.py --data-dir ../shared/data/nmnist-small --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from spikefuse.data import load_dataset
from spikefuse.models import build_model

FORMS = {"false": False, "true": True, "auto": "auto"}
PARTS = ("data", "forward", "backward", "optimizer")


def _ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs after the first (default: %(default)s)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "| batch | hidden | sparse | data ms | forward ms | backward ms | optimizer ms | batch ms | samples/s | "
        "vs dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, hidden in ((32, 256), (128, 512)):
        times = {}
        for cache in ("memory", None):
            ds, _ = load_dataset("nmnist", args.data_dir, train=True, T=10, seed=0, cache=cache)
            loader = DataLoader(ds, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
            if cache is None:  # the data only: one epoch, the model's times are the cached run's
                data = []
                start = time.perf_counter()
                for x, _ in loader:
                    x.transpose(0, 1).contiguous()
                    data.append(time.perf_counter() - start)
                    start = time.perf_counter()
                times["uncached"] = data
                continue
            models = {}
            for name, sparse in FORMS.items():
                torch.manual_seed(0)
                model = build_model("mlp", 2, 10, image_size=34, hidden=hidden, sparse=sparse)
                models[name] = (model, torch.optim.Adam(model.parameters(), lr=1e-3))
                times[name] = {part: [] for part in PARTS}
            for epoch in range(1 + args.epochs):
                it = iter(loader)
                while True:
                    start = time.perf_counter()
                    try:
                        x, y = next(it)
                    except StopIteration:
                        break
                    x = x.transpose(0, 1).contiguous()
                    data_s = time.perf_counter() - start
                    for name, (model, optimizer) in models.items():
                        t0 = time.perf_counter()
                        loss = F.cross_entropy(model(x).mean(0), y)
                        t1 = time.perf_counter()
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        t2 = time.perf_counter()
                        optimizer.step()
                        t3 = time.perf_counter()
                        if epoch and len(y) == batch:  # the first epoch fills the cache and compiles
                            for part, s in zip(PARTS, (data_s, t1 - t0, t2 - t1, t3 - t2)):
                                times[name][part].append(s)
        dense = sum(_ms(times["false"][part]) for part in PARTS)
        for name in FORMS:
            parts = [_ms(times[name][part]) for part in PARTS]
            total = sum(parts)
            cells = " | ".join(f"{v:.2f}" for v in parts)
            print(
                f"| {batch} | {hidden} | {name} | {cells} | {total:.1f} | {1e3 * batch / total:.0f} | "
                f"{dense / total:.2f}x |"
            )
        print(f"| {batch} | {hidden} | (data uncached) | {_ms(times['uncached']):.2f} | | | | | | |")


if __name__ == "__main__":
    main()
