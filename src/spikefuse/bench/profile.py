"""``spikefuse bench profile``: where one training step's time goes, operation by operation, in every form.

The step of ``spikefuse bench memory`` (forward, cross-entropy of the time-averaged output, backward, Adam update),
in the forms it compares, built the same way and run in one process, profiled with ``torch.profiler`` (CPU
activities): per operation its self time per step -- an aten op's own time, and for spikefuse's autograd Functions
(``_EagerBatchNormNeuron``, ``_SpikeConvFnBackward``, ...) the time spent in their Python code and the numba kernels
they call, which the profiler does not see as ops of their own. Every round profiles ``--steps`` steps of each
form in turn, the order rotating from round to round, after one untimed step of each; an op's time is the median
over the rounds. The table lists the ops that take at least ``--min-ms`` in some form, plus every form's total.

Numbers are the profiler's, which adds a few microseconds to every op: use ``bench memory`` for step times and
ratios, this for which ops make the difference between forms.

Writes ``bench-profile[-quick].md`` and ``.csv`` with the machine and the exact command.
"""

from __future__ import annotations

import argparse
import statistics

from .common import (
    add_training_step_args,
    command_line,
    machine_info,
    markdown_table,
    training_step_line,
    write_csv,
)
from .memory import FORMS as MEMORY_FORMS

FORMS = ("fused", "lean", "floor")  # the default forms
QUICK = {"T": 2, "batch_size": 2, "image_size": 8, "resnet_width": 8, "rounds": 1, "steps": 1}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile",
        help="self time per operation of one training step, every form side by side (torch.profiler)",
        description=__doc__.split("\n\n")[1],
    )
    add_training_step_args(p, QUICK)
    p.add_argument(
        "--forms",
        nargs="+",
        choices=list(MEMORY_FORMS),
        default=list(FORMS),
        help="the forms profiled (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=5, help="steps profiled per form and round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=9, help="rounds of every form in turn (default: %(default)s)")
    p.add_argument(
        "--min-ms",
        type=float,
        default=0.5,
        help="list the ops taking at least this many ms per step in some form (default: %(default)s)",
    )
    return p


def run(args) -> int:
    from ..threads import threads_while

    cfg = {
        "model": args.model,
        "T": args.T,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "resnet_width": args.resnet_width,
        "stem": args.stem,
        "seed": args.seed,
        "threads": args.threads,
        "rounds": args.rounds,
        "steps": args.steps,
    }
    if args.quick:
        cfg.update(QUICK)
    for name in ("rounds", "steps"):
        if cfg[name] < 1:
            raise SystemExit(f"bench profile: --{name} must be at least 1, got {cfg[name]}")
    with threads_while(args.threads):
        return _run(args, cfg)


def profile_forms(cfg: dict, forms: list[str]) -> dict[str, dict[str, float]]:
    """Per form, per operation: milliseconds of self time per step, the median over ``cfg['rounds']`` rounds of
    ``cfg['steps']`` steps, the forms alternating as :func:`spikefuse.bench.memory.side_by_side` runs them."""
    from torch.profiler import ProfilerActivity, profile

    from .memory import side_by_side

    def profiled_steps(train_step) -> dict[str, float]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(cfg["steps"]):
                train_step()
        per_op: dict[str, float] = {}
        for event in prof.key_averages():
            per_op[event.key] = per_op.get(event.key, 0.0) + event.self_cpu_time_total / 1e3 / cfg["steps"]
        return per_op

    samples = side_by_side(cfg, forms, cfg["rounds"], profiled_steps)
    result = {}
    for form, rounds in samples.items():
        ops = {op for per_op in rounds for op in per_op}
        result[form] = {op: statistics.median(per_op.get(op, 0.0) for per_op in rounds) for op in ops}
    return result


def _run(args, cfg: dict) -> int:
    import sys
    from pathlib import Path

    forms = list(dict.fromkeys(args.forms))
    print(
        f"bench profile: {cfg['model']}, forms {', '.join(forms)}: {cfg['rounds']} rounds of {cfg['steps']} steps",
        file=sys.stderr,
    )
    ms = profile_forms(cfg, forms)
    listed = sorted(
        {op for per_op in ms.values() for op, t in per_op.items() if t >= args.min_ms},
        key=lambda op: -max(ms[form].get(op, 0.0) for form in forms),
    )
    rows = [{"op": op, **{f"{form}_ms": round(ms[form].get(op, 0.0), 3) for form in forms}} for op in listed]
    rows.append({"op": "all ops", **{f"{form}_ms": round(sum(ms[form].values()), 3) for form in forms}})
    columns = ["op", *(f"{form}_ms" for form in forms)]
    tag = "-quick" if args.quick else ""
    out = Path(args.results_dir)
    write_csv(out / f"bench-profile{tag}.csv", rows)
    table = [[row[c] for c in columns] for row in rows]
    table[-1] = [f"**{v}**" for v in table[-1]]
    text = (
        "\n\n".join(
            [
                "# bench profile",
                f"Machine: {machine_info()}",
                f"Command: `{command_line()}`",
                f"{training_step_line(cfg)}; one training step (forward, loss, backward, Adam update) of each form, self "
                f"CPU time per step of every operation taking at least {args.min_ms} ms in some form, in ms "
                f"(`torch.profiler`), medians over "
                f"{cfg['rounds']} rounds of {cfg['steps']} steps, the forms in turn. A spikefuse autograd Function's self "
                "time holds the numba kernels it calls. The profiler adds a few microseconds to every op: `bench memory` "
                "times the steps.",
                markdown_table(columns, table),
            ]
        )
        + "\n"
    )
    (out / f"bench-profile{tag}.md").write_text(text)
    print(text)
    return 0
