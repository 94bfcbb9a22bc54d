"""Where a training step of `spikefuse bench models` goes: torch.profiler's self CPU time of one step's ops, summed
into groups (convolutions, BatchNorm, max-pooling, neurons, the attention's matrix products, the optimizer, the
rest), per model and form, at the bench's size (T=4, batch 8, 32x32, the bench's forms and weights).

    python benchmarks/profile_models_step.py [--models ...] [--forms spikingjelly fused] [--steps 10] [--out FILE.md]

The profiler adds its own cost per op (most to the many small ops): the groups' shares, not their sums, compare to
the bench's step times. SpikingJelly's neurons (its forms') are elementwise torch ops, counted in "other".
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

#: Op-name fragments of each group, first match wins (names as torch.profiler reports them, lower-cased).
GROUPS = {
    "convolution": ("convolution",),
    "BatchNorm": ("batch_norm",),
    "max-pool": ("max_pool", "maxpool"),
    "neurons": ("neuron", "multistep", "lif"),
    "matrix products": ("bmm", "aten::mm", "matmul", "addmm"),
    "optimizer": ("optimizer", "adam", "sqrt", "lerp_", "addcdiv_", "addcmul_"),
}


def group_of(name: str) -> str:
    low = name.lower()
    for group, fragments in GROUPS.items():
        if any(f in low for f in fragments):
            return group
    return "other"


def profile(model: str, form: str, steps: int) -> dict[str, float]:
    """Milliseconds of self CPU time per step by group, over ``steps`` profiled steps after three untimed ones."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from spikefuse.bench import models as bench_models
    from spikefuse.bench.memory import _training

    cfg = {**bench_models.DEFAULTS, "batch_size": 8, "seed": 0, "threads": 2, "model": model, "form": form}
    _, step, update = _training(cfg, bench_models.make_form)
    for _ in range(3):
        step()
        update()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
            update()
    per_group = defaultdict(float)
    for event in prof.key_averages():
        per_group[group_of(event.key)] += event.self_cpu_time_total / 1e3 / steps
    return dict(per_group)


def main() -> None:
    from spikefuse.bench import models as bench_models
    from spikefuse.threads import set_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(bench_models.MODELS))
    parser.add_argument("--forms", nargs="+", default=["spikingjelly", "fused"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args()
    set_threads(2)
    load_before = os.getloadavg()
    groups = [*GROUPS, "other"]
    rows = []
    for model in args.models:
        for form in args.forms:
            ms = profile(model, form, args.steps)
            total = sum(ms.values())
            cells = [f"{ms.get(g, 0.0):.2f} ({ms.get(g, 0.0) / total:.0%})" for g in groups]
            rows.append(f"| {model} | {form} | {total:.1f} | " + " | ".join(cells) + " |")
    load = ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in zip(load_before, os.getloadavg()))
    lines = [
        f"Self CPU ms per step by group (share of the step), {args.steps} profiled steps, 2 threads; load average "
        f"(1, 5, 15 min) {load}",
        "",
        "| model | form | step ms | " + " | ".join(groups) + " |",
        "|---|---|---|" + "---|" * len(groups),
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
