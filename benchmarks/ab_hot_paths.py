"""Two checkouts of spikefuse timed side by side on the hot paths that per-call checks touch: the LIF layer at
`spikefuse bench neuron`'s size, a small layer (where per-call costs show), and a lean ResNet18 training step (the
path `spikefuse bench memory` times). Each round runs one process per checkout, alternating, after one untimed
round; the table has each case's median over rounds and the ratio of medians.

    python benchmarks/ab_hot_paths.py OLD_SRC NEW_SRC [--rounds 7] [--out FILE.md]

OLD_SRC / NEW_SRC: the `src` folders of the two checkouts (e.g. a `git worktree` of the older commit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

#: What every side-by-side script's cases start with: two threads, a seed, and ``median_time(fn, repeats)``.
PRELUDE = r"""
import json, time, torch
import spikefuse
torch.manual_seed(0)
torch.set_num_threads(2)


def median_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
"""

#: Cases the side-by-side scripts share: ``train_step()``, a lean ResNet18's training step (the path `spikefuse bench
#: memory` times), and ``recurrent()``, the recurrent LIF layer at the SHD size, forward+backward.
LEAN_RESNET_STEP = r"""
from spikefuse.models import build_model

model = build_model("resnet18", 3, 10, memory="lean", stem="cifar")
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
images, labels = torch.rand(4, 8, 3, 32, 32).round(), torch.randint(0, 10, (8,))


def train_step():
    loss = torch.nn.functional.cross_entropy(model(images).mean(0), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
RECURRENT_LAYER = r"""
from spikefuse.neurons import LIF_MODELS

T, B, H = 250, 32, 256
xr = (torch.rand(T, B, H) * 0.6).requires_grad_()
w = (torch.randn(H, H) * 0.05).requires_grad_()


def recurrent():
    spikefuse.recurrent(xr, LIF_MODELS[("snntorch", "soft")], w, decay=0.9, threshold=1.0).sum().backward()
    xr.grad = w.grad = None
"""

#: ``layer(T, n, repeats, cuba=False, **options)``: the median time of a LIF layer's (``cuba``: a CubaLIF layer's)
#: forward+backward on ``[T, n]``; ``options`` go to the call (a surrogate).
LAYER = r"""
from spikefuse.neurons import CUBA_LIF


def layer(T, n, repeats, cuba=False, **options):
    x = torch.rand(T, n, requires_grad=True)
    g = torch.rand(T, n)

    def step():
        if cuba:
            spikefuse.neuron(x, CUBA_LIF, alpha=0.8, beta=0.7, **options).backward(g)
        else:
            spikefuse.lif(x, decay=0.8, threshold=0.5, **options).backward(g)
        x.grad = None

    return median_time(step, repeats)
"""

CASES = (
    PRELUDE
    + LEAN_RESNET_STEP
    + LAYER
    + r"""


print(json.dumps({
    "LIF layer T=32 N=1M fwd+bwd (ms)": 1e3 * layer(32, 1_000_000, 15),
    "LIF layer T=8 N=4096 fwd+bwd (us)": 1e6 * layer(8, 4096, 300),
    "lean ResNet18 train step T=4 B=8 32x32 (ms)": 1e3 * median_time(train_step, 5),
}))
"""
)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def run(cases: str, src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", cases], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(cases: str = CASES, title: str = "Hot paths", script: str = "ab_hot_paths.py", rounds: int = 7) -> None:
    """Time ``cases`` (code printing one JSON object of numbers) in one process per checkout, alternating, after an
    untimed round; print (and with ``--out`` write) a table of each case's median over rounds."""
    p = argparse.ArgumentParser(description=f"{title}: two checkouts of spikefuse timed side by side")
    p.add_argument("old_src")
    p.add_argument("new_src")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    for src in (args.old_src, args.new_src):  # untimed: kernel caches, page cache
        run(cases, src)
    results = {"old": [], "new": []}
    for r in range(args.rounds):
        order = [("old", args.old_src), ("new", args.new_src)]
        for name, src in order if r % 2 == 0 else order[::-1]:
            results[name].append(run(cases, src))
    rows = []
    for case in results["old"][0]:
        old = statistics.median(x[case] for x in results["old"])
        new = statistics.median(x[case] for x in results["new"])
        rows.append(f"| {case} | {old:.3f} | {new:.3f} | {new / old:.3f} |")
    text = "\n".join(
        [
            f"# {title}, two checkouts side by side ({cpu_name()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()})",
            "",
            f"Command: `python benchmarks/{script} {args.old_src} {args.new_src} --rounds {args.rounds}`",
            "",
            "| case | old | new | new / old |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
