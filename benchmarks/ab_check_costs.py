"""Two checkouts of spikefuse side by side on what a per-call check touches: the LIF layer's forward alone and with
backward at `spikefuse bench neuron`'s size and at a small size (where per-call costs show), and the recurrent
layer at the SHD size. Each round runs one fresh process per checkout, alternating; each case's median over rounds.

    python benchmarks/ab_check_costs.py OLD_SRC NEW_SRC [--rounds 5]

OLD_SRC / NEW_SRC: the `src` folders of the two checkouts (e.g. a `git worktree` of the older commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = r"""
import json, time, torch, spikefuse
from spikefuse.neurons import LIF_MODELS
torch.set_num_threads(2)
torch.manual_seed(0)


def median_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def lif(T, n):
    x, g = torch.rand(T, n, requires_grad=True), torch.rand(T, n)

    def both():
        spikefuse.lif(x, decay=0.8, threshold=0.5).backward(g)
        x.grad = None

    def forward():
        with torch.no_grad():
            spikefuse.lif(x, decay=0.8, threshold=0.5)

    return forward, both


T, B, H = 250, 32, 256
xr = (torch.rand(T, B, H) * 0.6).requires_grad_()
w = (torch.randn(H, H) * 0.05).requires_grad_()


def recurrent():
    spikefuse.recurrent(xr, LIF_MODELS[("snntorch", "soft")], w, decay=0.9, threshold=1.0).sum().backward()
    xr.grad = w.grad = None


big_forward, big_both = lif(32, 1_000_000)
small_forward, small_both = lif(8, 4096)
print(json.dumps({
    "LIF layer T=32 N=1M forward, no grad (ms)": 1e3 * median_time(big_forward, 15),
    "LIF layer T=32 N=1M forward+backward (ms)": 1e3 * median_time(big_both, 15),
    "LIF layer T=8 N=4096 forward, no grad (us)": 1e6 * median_time(small_forward, 400),
    "LIF layer T=8 N=4096 forward+backward (us)": 1e6 * median_time(small_both, 400),
    "recurrent LIF T=250 B=32 H=256 forward+backward (ms)": 1e3 * median_time(recurrent, 7),
}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old_src")
    p.add_argument("new_src")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    results = {src: [] for src in (args.old_src, args.new_src)}
    for _ in range(args.rounds):
        for src in results:
            env = {**os.environ, "PYTHONPATH": src}
            out = subprocess.run([sys.executable, "-c", CASES], env=env, capture_output=True, text=True, check=True)
            results[src].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| case | old | new | new / old |\n|---|---|---|---|")
    for case in results[args.old_src][0]:
        old, new = (statistics.median(r[case] for r in results[src]) for src in results)
        print(f"| {case} | {old:.3f} | {new:.3f} | {new / old:.3f} |")


if __name__ == "__main__":
    main()
