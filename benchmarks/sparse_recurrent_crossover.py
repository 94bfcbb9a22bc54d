"""The crossover of the recurrent layer's ``sparse=`` (:func:`spikefuse.recurrent`): one training call of a recurrent
LIF layer alone -- forward, then backward to the input, the recurrent weight and the bias -- at rising spike rates
(set by the input drive), ``sparse=True`` and ``sparse="auto"`` (its rate recorded by a call before) against
``sparse=False``, the three in turn each round, each first in turn; medians, and the medians of each round's ratios
(the calls of a round run back to back, so a shared machine's load moves them together), and the ratio of the
fastest calls (the ones least slowed by other jobs). Behind ``spikefuse.ops.recurrent.CROSSOVER_RECURRENT``; the
``auto / dense`` columns are the issue's sweep (``auto`` at most 5% slower than dense at any rate).

    python benchmarks/sparse_recurrent_crossover.py --threads 1 --repeats 21
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import spikefuse
from spikefuse.bench.common import machine_info
from spikefuse.neurons import LIF_MODELS
from spikefuse.ops import recurrent as recurrent_ops
from spikefuse.threads import set_threads

# (T, B, H): the SHD-sized recurrent layer of bench recurrent (T=250, batch 32, 256 neurons), sequential MNIST row by
# row (T=28) as `spikefuse train --model srnn` builds it, and a small layer
SIZES = [(250, 32, 256), (28, 32, 256), (100, 8, 64)]
# the input drive (the mean of each step's input current, threshold 1): from no spikes to about 70%
DRIVES = [-2.0, -0.4, -0.2, -0.1, 0.0, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8]
MODEL = LIF_MODELS[("snntorch", "soft")]
PARAMS = {"decay": 0.9, "threshold": 1.0}


def step_seconds(x, weight, bias, sparse, grad) -> tuple[float, torch.Tensor]:
    for t in (x, weight, bias):
        t.grad = None
    start = time.perf_counter()
    spikes = spikefuse.recurrent(x, MODEL, weight, bias, sparse=sparse, memory="potential", **PARAMS)
    spikes.backward(grad)
    return time.perf_counter() - start, spikes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--sizes", type=int, nargs="*", help="indices into SIZES (default: all)")
    p.add_argument("--drives", type=float, nargs="*", help="input drives (default: DRIVES)")
    args = p.parse_args()
    set_threads(args.threads)
    print(f"machine: {machine_info()}")
    print(f"CROSSOVER_RECURRENT = {recurrent_ops.CROSSOVER_RECURRENT}")
    print(
        "| T x B x H | drive | spike rate | dense ms | sparse ms | auto ms | sparse / dense | auto / dense | "
        "auto / dense, fastest |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    sizes = [SIZES[i] for i in args.sizes] if args.sizes else SIZES
    worst = 0.0
    for t_steps, batch, hidden in sizes:
        g = torch.Generator().manual_seed(0)
        noise = torch.randn(t_steps, batch, hidden, generator=g) * 0.5
        weight = (torch.randn(hidden, hidden, generator=g) * (0.6 / hidden**0.5)).requires_grad_()
        bias = torch.zeros(hidden, requires_grad=True)
        grad = torch.randn(t_steps, batch, hidden, generator=g)
        for drive in args.drives or DRIVES:
            x = (noise + drive).requires_grad_()
            for sparse in (False, True, "auto", "auto"):  # compile, warm, and auto's rate recorded
                _, spikes = step_seconds(x, weight, bias, sparse, grad)
            rate = float(spikes.detach().mean())
            times = {False: [], True: [], "auto": []}
            order = list(times)
            for r in range(args.repeats):
                for k in order[r % 3 :] + order[: r % 3]:
                    times[k].append(step_seconds(x, weight, bias, k, grad)[0])
            d, s, a = (1e3 * statistics.median(times[k]) for k in order)
            rs, ra = (statistics.median(u / v for u, v in zip(times[k], times[False])) for k in (True, "auto"))
            # and of the fastest call of each way: the one least slowed by other jobs
            fastest = min(times["auto"]) / min(times[False])
            worst = max(worst, ra)
            print(
                f"| {t_steps} x {batch} x {hidden} | {drive} | {rate:.1%} | {d:.2f} | {s:.2f} | {a:.2f} | {rs:.2f} | "
                f"{ra:.3f} | {fastest:.3f} |",
                flush=True,
            )
    print(f"\nworst auto / dense (medians of the rounds' ratios): {worst:.3f}")


if __name__ == "__main__":
    main()
