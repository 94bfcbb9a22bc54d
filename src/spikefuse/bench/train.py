"""``spikefuse bench train``: the temporal-fusion paper's Table 1 on this machine.

The same network (default Spiking-ResNet18, CIFAR stem), the same seed, data order, optimizer (Adam, lr 1e-3) and
loss, trained once with spikefuse's LIF neurons and once with SpikingJelly 2.0's ``LIFNode(step_mode='m',
tau=1/(1-decay), decay_input=False, v_reset=0, v_threshold=0.3, surrogate.Sigmoid(alpha=4))`` swapped into every
neuron slot (:func:`spikefuse.compat.spikingjelly.use_spikingjelly_neurons`; SpikingJelly's own model zoo imports torchvision,
so it is not used). Each implementation trains in its own ``spikefuse train`` subprocess, so peak memory (the
process's resident-set high-water mark ``VmHWM``, or ``torch.cuda.max_memory_allocated`` on CUDA) is not shared between them.

Reported per data set (digits always; MNIST and CIFAR-10 when ``--data-dir`` holds their files): best and final
test accuracy, median train and test time per epoch (the median leaves out the first epoch's one-off costs such as
numba compilation once there are 3 or more epochs), training samples/s, peak memory, and the speed-up over
SpikingJelly. Writes ``benchmarks/results/bench-train-<dataset>[-quick].md`` and ``.csv`` (one row per
implementation and epoch), with a line of machine info and the exact command.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import RESULTS, command_line, machine_info, markdown_table, write_csv

IMPLEMENTATIONS = {"spikefuse": "spikefuse LIF", "spikingjelly": "SpikingJelly 2.0 LIFNode"}
DEFAULT_DATASETS = ("digits", "mnist", "cifar10")
QUICK = {"epochs": 1, "train_subset": 64, "test_subset": 64, "T": 4}


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ..train.arguments import add_train_arguments

    p = subparsers.add_parser(
        "train",
        help="train the same network with spikefuse and SpikingJelly neurons (accuracy, time, memory)",
        description=__doc__.split("\n\n")[1],
    )
    add_train_arguments(p, defaults={"model": "resnet18", "T": 8, "epochs": 3, "batch_size": 32})
    p.set_defaults(dataset=None)
    p.add_argument(
        "--datasets",
        nargs="+",
        default=None,
        metavar="NAME",
        help="data sets to run (default: digits, plus mnist and cifar10 when --data-dir holds them; "
        "--dataset NAME runs just that one)",
    )
    p.add_argument(
        "--impls",
        nargs="+",
        choices=list(IMPLEMENTATIONS),
        default=list(IMPLEMENTATIONS),
        help="neuron implementations to compare (default: both)",
    )
    p.add_argument(
        "--quick", action="store_true", help="check the harness: 1 epoch on 64 training and 64 test samples, T <= 4"
    )
    p.add_argument("--results-dir", default=str(RESULTS), help="where the .md/.csv go (default: %(default)s)")
    p.add_argument(
        "--runs-dir",
        default=None,
        help="keep each run's metrics.csv/checkpoint/curves here (default: a temporary folder)",
    )
    return p


def _datasets(args) -> tuple[list[str], list[str]]:
    """(data sets to run, notes on skipped ones)."""
    from ..data import DataError, load_dataset
    from ..data._common import MissingRootError

    if args.datasets:
        names, explicit = list(args.datasets), True
    elif args.dataset:
        names, explicit = [args.dataset], True
    else:
        names, explicit = list(DEFAULT_DATASETS), False
    run, notes = [], []
    for name in names:
        if name in ("digits", "digits-events"):
            run.append(name)
            continue
        try:
            load_dataset(name, args.data_dir, train=False, T=args.T)
        except DataError as err:
            if isinstance(err, MissingRootError):
                err = err.naming("--data-dir")
            if explicit:
                raise err from None
            first = str(err).splitlines()[0].split("; the files must be laid out as")[0].rstrip(":; ")
            notes.append(f"{name}: skipped, no data ({first})")
            continue
        run.append(name)
    return run, notes


def _child_command(args, dataset: str, impl: str, out: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "spikefuse.cli",
        "train",
        "--model",
        args.model,
        "--dataset",
        dataset,
        "--T",
        str(args.T),
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        repr(args.lr),
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--encoding",
        args.encoding,
        "--neuron-backend",
        args.neuron_backend,
        "--stem",
        args.stem,
        "--neurons",
        impl,
        "--out",
        str(out),
        "--overwrite",
        "--no-progress",
        "--precision",
        args.precision,
    ]
    if args.compile:
        cmd.append("--compile")
    for opt in ("data_dir", "image_size", "train_subset", "test_subset", "width"):
        value = getattr(args, opt)
        if value is not None:
            cmd += [f"--{opt.replace('_', '-')}", str(value)]
    return cmd


def _read_metrics(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        row = {k: (v if k == "memory" else float(v) if v not in ("", None) else None) for k, v in r.items()}
        row["epoch"] = int(row["epoch"])
        out.append(row)
    return out


def _summary(rows: list[dict]) -> dict:
    train_times = [r["train_time_s"] for r in rows]
    test_times = [r["test_time_s"] for r in rows]
    peak_cuda = [r["peak_cuda_mb"] for r in rows if r.get("peak_cuda_mb") is not None]
    return {
        "epochs": len(rows),
        "best_test_acc": max(r["test_acc"] for r in rows),
        "final_test_acc": rows[-1]["test_acc"],
        "train_s_per_epoch": statistics.median(train_times),
        "test_s_per_epoch": statistics.median(test_times),
        "first_epoch_train_s": train_times[0],
        "train_samples_per_s": statistics.median(r["train_samples_per_s"] for r in rows),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rows),
        "peak_cuda_mb": max(peak_cuda) if peak_cuda else None,
    }


def train_side_by_side(args, dataset: str, runs_root: Path) -> tuple[dict, list[dict], bool]:
    """Train ``args.impls`` on ``dataset``, one ``spikefuse train`` subprocess each (same settings, seed and data
    order), into ``runs_root/<dataset>-<impl>``. Returns ``(summary per implementation, one csv row per
    implementation and epoch, whether every run succeeded)``; a missing or failed implementation is summarized as
    ``{"label", "missing": why}``."""
    sj_installed = importlib.util.find_spec("spikingjelly") is not None
    summaries, csv_rows, ok = {}, [], True
    for impl in args.impls:
        label = IMPLEMENTATIONS[impl] + (f" ({args.neuron_backend})" if impl == "spikefuse" else "")
        if impl == "spikingjelly" and not sj_installed:
            summaries[impl] = {"label": label, "missing": "not installed (pip install spikingjelly --no-deps)"}
            print(f"[bench] {dataset}: {label}: not installed, skipped", flush=True)
            continue
        out = runs_root / f"{dataset}-{impl}"
        cmd = _child_command(args, dataset, impl, out)
        print(f"[bench] {dataset}: {label}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.perf_counter() - start
        metrics = out / "metrics.csv"
        if proc.returncode != 0 or not metrics.exists():
            summaries[impl] = {"label": label, "missing": f"failed (exit code {proc.returncode})"}
            ok = False
            continue
        rows = _read_metrics(metrics)
        summaries[impl] = {"label": label, "wall_s": wall, **_summary(rows)}
        for r in rows:
            csv_rows.append(
                {
                    "dataset": dataset,
                    "implementation": impl,
                    "model": args.model,
                    "width": args.width,
                    "T": args.T,
                    "batch_size": args.batch_size,
                    **r,
                }
            )
    return summaries, csv_rows, ok


def run(args) -> int:
    if args.quick:
        args.epochs = QUICK["epochs"]
        args.train_subset = args.train_subset or QUICK["train_subset"]
        args.test_subset = args.test_subset or QUICK["test_subset"]
        args.T = min(args.T, QUICK["T"])
    datasets, notes = _datasets(args)
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    tmp = None
    if args.runs_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="spikefuse-bench-train-")
        runs_root = Path(tmp.name)
    else:
        runs_root = Path(args.runs_dir)
    import torch

    torch.set_num_threads(args.threads)
    info = machine_info()
    command = command_line()
    status = 0
    try:
        for dataset in datasets:
            summaries, csv_rows, ok = train_side_by_side(args, dataset, runs_root)
            status = status if ok else 1
            _write_report(args, dataset, summaries, csv_rows, results_dir, info, command, notes)
        if not datasets:
            print("[bench train] no data set to run", file=sys.stderr)
            return 2
    finally:
        if tmp is not None:
            tmp.cleanup()
    for note in notes:
        print(f"[bench train] {note}")
    return status


def _fmt_mem(s: dict) -> str:
    text = f"{s['peak_rss_mb']:.0f}"
    if s.get("peak_cuda_mb") is not None:
        text += f" (CUDA {s['peak_cuda_mb']:.0f})"
    return text


def _write_report(args, dataset, summaries, csv_rows, results_dir: Path, info, command, notes) -> None:
    suffix = "-quick" if args.quick else ""
    stem = results_dir / f"bench-train-{dataset}{suffix}"
    sj = summaries.get("spikingjelly", {})
    header = [
        "implementation",
        "best test acc (%)",
        "final test acc (%)",
        "train s/epoch",
        "test s/epoch",
        "first-epoch train s",
        "train samples/s",
        "peak memory (MiB)",
        "train speed-up vs SJ",
        "test speed-up vs SJ",
    ]
    table = []
    for impl, s in summaries.items():
        if "missing" in s:
            table.append([s["label"], s["missing"]] + [""] * (len(header) - 2))
            continue
        speed_train = speed_test = ""
        if "train_s_per_epoch" in sj and impl != "spikingjelly":
            speed_train = f"{sj['train_s_per_epoch'] / s['train_s_per_epoch']:.2f}x"
            speed_test = f"{sj['test_s_per_epoch'] / s['test_s_per_epoch']:.2f}x"
        table.append(
            [
                s["label"],
                f"{100 * s['best_test_acc']:.2f}",
                f"{100 * s['final_test_acc']:.2f}",
                f"{s['train_s_per_epoch']:.2f}",
                f"{s['test_s_per_epoch']:.2f}",
                f"{s['first_epoch_train_s']:.2f}",
                f"{s['train_samples_per_s']:.1f}",
                _fmt_mem(s),
                speed_train,
                speed_test,
            ]
        )
    subset = ""
    if args.train_subset or args.test_subset:
        subset = f", subsets train {args.train_subset or 'all'} / test {args.test_subset or 'all'}"
    lines = [
        f"# bench train: {args.model} on {dataset}{' (quick)' if args.quick else ''}",
        "",
        f"T={args.T}, {args.epochs} epoch(s), batch {args.batch_size}, Adam lr {args.lr}, seed {args.seed}, "
        f"{args.encoding} encoding, device {args.device}, precision {args.precision}"
        f"{', torch.compile' if args.compile else ''}{subset}. Same network, seed and data order; only the neurons "
        "differ. Times are medians over epochs; peak memory is each training process's maximum resident set size.",
        "",
        markdown_table(header, table),
        "",
        f"Machine: {info}",
        "",
        f"Command: `{command}`",
    ]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    write_csv(stem.with_suffix(".csv"), csv_rows or [{"dataset": dataset, "note": "no implementation ran"}])
    print("\n".join(lines[:5]))
    print(f"[bench train] wrote {stem.with_suffix('.md')} and {stem.with_suffix('.csv')}", flush=True)
