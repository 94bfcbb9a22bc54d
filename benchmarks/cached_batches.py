"""Data time per batch in a loop as ``spikefuse train``'s (the N-MNIST MLP at batch 128, T=10, a training step
between batches, the cache filled by a first epoch): torch's DataLoader over the cached samples, then the loop's
time-major copy (``transpose(0, 1).contiguous()``), against ``spikefuse.data.cache.batch_loader`` (each batch built
whole into a reused time-major buffer, which the copy then leaves as it is); three epochs of each in turn, four
rounds, the first a warm-up; medians over the batches.

    python benchmarks/cached_batches.py --data-dir ../shared/data/nmnist-small --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from spikefuse.data import load_dataset
from spikefuse.data.cache import batch_loader
from spikefuse.train.config import TrainConfig
from spikefuse.train.loop import _info_dict, _to_time_major, make_model, make_optimizer, reset_states


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ds, info = load_dataset("nmnist", args.data_dir, train=True, T=10, seed=0, cache="memory")
    torch.manual_seed(0)
    model = make_model(TrainConfig(model="mlp", dataset="nmnist", T=10, batch_size=args.batch_size), _info_dict(info))
    optimizer = make_optimizer(model, 1e-3)
    for _ in DataLoader(ds, batch_size=args.batch_size):  # the first epoch fills the cache
        pass

    def epochs(loader_of, n: int) -> tuple[list[float], list[float]]:
        generator, data, step = torch.Generator().manual_seed(0), [], []
        for _ in range(n):
            start = time.perf_counter()
            for x, y in loader_of(generator):
                x = _to_time_major(x, "event", 10, "direct", None)
                ready = time.perf_counter()
                data.append(ready - start)
                loss = F.cross_entropy(model(x).mean(0), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                reset_states(model)
                start = time.perf_counter()
                step.append(start - ready)
        return data, step

    loaders = {
        "DataLoader + time-major copy": lambda g: DataLoader(ds, batch_size=args.batch_size, shuffle=True, generator=g),
        "batch_loader": lambda g: batch_loader(ds, args.batch_size, shuffle=True, generator=g, stack_dim=1),
    }
    times = {name: ([], []) for name in loaders}
    for round_ in range(4):
        for name, loader_of in loaders.items():
            data, step = epochs(loader_of, 3)
            if round_:  # round 0: a warm-up
                times[name][0].extend(data)
                times[name][1].extend(step)
    print("| loader | batches | data ms, median | p10 | p90 | training step ms, median |")
    print("|---|---|---|---|---|---|")
    for name, (data, step) in times.items():
        data = sorted(data)
        n = len(data)
        print(
            f"| {name} | {n} | {1e3 * statistics.median(data):.2f} | {1e3 * data[n // 10]:.2f} | "
            f"{1e3 * data[9 * n // 10]:.2f} | {1e3 * statistics.median(step):.2f} |"
        )


if __name__ == "__main__":
    main()
