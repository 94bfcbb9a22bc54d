"""``spikefuse bench table1``: the temporal-fusion paper's Table 1 at CPU scale, on the real data files.

Spiking-ResNet18 (SpikingJelly's structure, CIFAR stem) trained from the same seed and data order once with
spikefuse's fused LIF and once with SpikingJelly 2.0's ``LIFNode`` in every neuron slot (see ``bench train``), on
MNIST (all 60k/10k), N-MNIST small (SLAYER's 1,000/100 real recordings) and the embedded 8x8 digits: best and
final test accuracy, train and test seconds per epoch, the speed-ups, and each process's peak memory, with the
paper's own numbers (A100, T=32, 5 epochs) beside them. A full-width ResNet18 epoch of MNIST does not fit in an
hour on a 2-core CPU: the benchmark measures its cost per sample and says so, and trains the network at width 16
(stages 16-32-64-128; same depth, blocks and neurons). CIFAR-10 and DVS Gesture have no data on this machine.

``--device cuda`` runs the paper's network (full width, T=32) on a GPU, each data set's epochs over a seeded subset
of its samples (``--train-subset``, ``--test-subset``), and writes ``table1-cuda.md``/``.csv``.

``--data-root`` holds ``mnist/`` (the four idx .gz files) and ``nmnist-small/`` (or ``nmnist/``: ``Train/`` and
``Test/`` of .bin recordings); a data set whose folder is missing is reported as skipped. Writes
``<results-dir>/table1.md`` and ``table1.csv`` (one row per data set, implementation and epoch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from .common import RESULTS, command_line, gpu_machine_info, machine_info, markdown_table, write_csv
from .train import IMPLEMENTATIONS, train_side_by_side

#: Per data set: the folder under --data-root, and the settings that differ from the common ones.
DATASETS = {
    "mnist": {"folders": ("mnist",), "epochs": 1, "batch_size": 100, "encoding": "poisson"},
    "nmnist": {"folders": ("nmnist-small", "nmnist"), "epochs": 5, "batch_size": 32, "encoding": "direct"},
    "digits": {"folders": (), "epochs": 5, "batch_size": 32, "encoding": "poisson"},
}
COMMON = {"model": "resnet18", "width": 16, "T": 4, "lr": 1e-3, "seed": 0, "stem": "cifar"}
QUICK = {"epochs": 1, "train_subset": 64, "test_subset": 32}
#: On a GPU: the paper's network (full width, T=32), each data set's epochs over a seeded subset of the samples
GPU = {"width": 64, "T": 32, "train_subset": 3000, "test_subset": 1000}

#: Table 1 of the paper, Spiking-ResNet18 rows: (accuracy %, train s, test s) per epoch on an A100, T=32.
PAPER = {
    "mnist": {
        "SpikingJelly (PyTorch)": (98.18, 170.31, 10.52),
        "SpikingJelly (CuPy)": (98.35, 70.91, 11.13),
        "temporal fusion (theirs)": (98.29, 65.64, 9.12),
    },
    "nmnist": {
        "SpikingJelly (PyTorch)": (98.24, 251.14, 21.44),
        "SpikingJelly (CuPy)": (98.39, 142.33, 21.83),
        "temporal fusion (theirs)": (97.13, 140.04, 20.02),
    },
}
NO_DATA = {"cifar10": "CIFAR-10", "dvsgesture": "DVS Gesture"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "table1",
        help="the temporal-fusion paper's Table 1 at CPU scale on real MNIST and N-MNIST (accuracy, time, memory)",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--data-root",
        default=os.environ.get("SPIKEFUSE_DATA"),
        help="folder holding mnist/ and nmnist-small/ (default: $SPIKEFUSE_DATA)",
    )
    p.add_argument(
        "--datasets",
        nargs="+",
        choices=list(DATASETS),
        default=list(DATASETS),
        metavar="NAME",
        help=f"data sets to run, of {', '.join(DATASETS)} (default: all)",
    )
    p.add_argument(
        "--impls",
        nargs="+",
        choices=list(IMPLEMENTATIONS),
        default=list(IMPLEMENTATIONS),
        help="neuron implementations to compare (default: both)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: the paper's full width and T=32, on a timed subset (default: %(default)s)",
    )
    p.add_argument(
        "--width", type=int, default=None, help=f"ResNet18 width (default: {COMMON['width']}; cuda {GPU['width']})"
    )
    p.add_argument("--T", type=int, default=None, help=f"time steps (default: {COMMON['T']}; cuda {GPU['T']})")
    p.add_argument(
        "--train-subset",
        type=int,
        default=None,
        help=f"training samples per epoch (default: all; cuda {GPU['train_subset']})",
    )
    p.add_argument(
        "--test-subset", type=int, default=None, help=f"test samples (default: all; cuda {GPU['test_subset']})"
    )
    p.add_argument("--epochs", type=int, default=None, help="epochs per data set (default: each data set's)")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: both implementations under torch.autocast in bfloat16 (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads per training process (default: %(default)s)")
    p.add_argument(
        "--neuron-backend",
        default="auto",
        choices=("auto", "cpu", "reference"),
        help="spikefuse's backend (default: %(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="check the harness: 1 epoch on 64 training / 32 test samples")
    p.add_argument("--results-dir", default=str(RESULTS), help="where table1.md/.csv go (default: %(default)s)")
    p.add_argument("--runs-dir", default=None, help="keep each run's files here (default: a temporary folder)")
    return p


def resolve_defaults(args) -> bool:
    """Fill the settings left unset with the device's defaults (:data:`COMMON` on the CPU, :data:`GPU` on a GPU);
    returns whether the device is a GPU."""
    gpu = args.device.startswith("cuda")
    for key in ("width", "T"):
        if getattr(args, key) is None:
            setattr(args, key, (GPU if gpu else COMMON)[key])
    if gpu and not args.quick:
        for key in ("train_subset", "test_subset"):
            if getattr(args, key) is None:
                setattr(args, key, GPU[key])
    return gpu


def _data_dir(root: str | None, folders: tuple[str, ...]) -> Path | None:
    for name in folders:
        if root is not None and (Path(root) / name).is_dir():
            return Path(root) / name
    return None


def _namespace(args, settings: dict, quick: dict, data_dir: Path | None) -> argparse.Namespace:
    """The namespace ``bench train``'s child command reads, for one data set."""
    values = {**COMMON, **settings, **quick}
    for key in ("width", "T", "train_subset", "test_subset", "epochs"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    values.update(
        threads=args.threads,
        device=args.device,
        precision=args.precision,
        compile=False,
        neuron_backend=args.neuron_backend,
        impls=args.impls,
        data_dir=None if data_dir is None else str(data_dir),
        image_size=None,
    )
    return argparse.Namespace(**values)


def full_width_cost(threads: int, T: int, repeats: int = 3) -> dict:
    """Median seconds per training sample of the full-width (64) Spiking-ResNet18 with spikefuse neurons on an
    MNIST-shaped batch (Adam step included), and the hours one epoch of the 60k training images would take."""
    import torch
    import torch.nn.functional as F

    from ..models import build_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    batch = 32
    model = build_model("resnet18", 1, 10, width=64, stem="cifar")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.rand(T, batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(repeats + 1):  # the first step compiles and pages in: not counted
        start = time.perf_counter()
        loss = F.cross_entropy(model(x).mean(0), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    per_sample = statistics.median(times[1:]) / batch
    return {"s_per_sample": per_sample, "hours_per_mnist_epoch": per_sample * 60000 / 3600}


def run(args) -> int:
    import torch

    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="spikefuse-table1-") if args.runs_dir is None else None
    runs_root = Path(tmp.name if tmp is not None else args.runs_dir)
    torch.set_num_threads(args.threads)
    gpu = resolve_defaults(args)
    info, command = (gpu_machine_info() if gpu else machine_info()), command_line()
    sections, csv_rows, status = [], [], 0
    try:
        cost = None if args.quick or gpu else full_width_cost(args.threads, args.T)
        for dataset in args.datasets:
            folders = DATASETS[dataset]["folders"]
            data_dir = _data_dir(args.data_root, folders)
            if folders and data_dir is None:
                where = f"{args.data_root}/{' or '.join(folders)}" if args.data_root else "--data-root not given"
                sections.append((dataset, None, {}, f"skipped: no data ({where})"))
                print(f"[bench table1] {dataset}: no data ({where}), skipped", flush=True)
                continue
            targs = _namespace(
                args,
                {k: v for k, v in DATASETS[dataset].items() if k != "folders"},
                QUICK if args.quick else {"train_subset": None, "test_subset": None},
                data_dir,
            )
            summaries, rows, ok = train_side_by_side(targs, dataset, runs_root)
            status = status if ok else 1
            csv_rows += rows
            sections.append((dataset, targs, summaries, ""))
    finally:
        if tmp is not None:
            tmp.cleanup()
    stem = results_dir / f"table1{'-cuda' if gpu else ''}{'-quick' if args.quick else ''}"
    stem.with_suffix(".md").write_text(_report(args, sections, cost, info, command))
    write_csv(stem.with_suffix(".csv"), csv_rows or [{"note": "no data set ran"}])
    print(f"[bench table1] wrote {stem.with_suffix('.md')} and {stem.with_suffix('.csv')}", flush=True)
    return status


def _report(args, sections, cost, info: str, command: str) -> str:
    header = [
        "data set",
        "implementation",
        "best test acc (%)",
        "final test acc (%)",
        "train s/epoch",
        "test s/epoch",
        "train ms/sample",
        "test ms/sample",
        "train speed-up",
        "test speed-up",
        "peak memory (MiB)",
    ]
    rows, settings = [], []
    for dataset, targs, summaries, note in sections:
        if note:
            rows.append([dataset, note] + [""] * (len(header) - 2))
            continue
        sub = f", subsets {targs.train_subset}/{targs.test_subset}" if targs.train_subset else ""
        settings.append(
            f"- {dataset}: {targs.epochs} epoch(s), batch {targs.batch_size}, {targs.encoding} encoding{sub}"
        )
        sj = summaries.get("spikingjelly", {})
        for impl, s in summaries.items():
            if "missing" in s:
                rows.append([dataset, s["label"], s["missing"]] + [""] * (len(header) - 3))
                continue
            up_train = up_test = ""
            if impl != "spikingjelly" and "train_s_per_epoch" in sj:
                up_train = f"{sj['train_s_per_epoch'] / s['train_s_per_epoch']:.2f}x"
                up_test = f"{sj['test_s_per_epoch'] / s['test_s_per_epoch']:.2f}x"
            rows.append(
                [
                    dataset,
                    s["label"],
                    f"{100 * s['best_test_acc']:.2f}",
                    f"{100 * s['final_test_acc']:.2f}",
                    f"{s['train_s_per_epoch']:.1f}",
                    f"{s['test_s_per_epoch']:.1f}",
                    f"{1000 / s['train_samples_per_s']:.2f}",
                    f"{1000 * s['test_s_per_epoch'] / targs.test_subset:.2f}" if targs.test_subset else "",
                    up_train,
                    up_test,
                    f"{s['peak_rss_mb'] if s['peak_cuda_mb'] is None else s['peak_cuda_mb']:.0f}",
                ]
            )
    for name, label in NO_DATA.items():
        rows.append([name, f"no data on this machine ({label} is not in the shared data)"] + [""] * (len(header) - 2))
    paper_rows = [
        [d, impl, f"{a:.2f}", f"{tr:.2f}", f"{te:.2f}", f"{tr / 60:.2f}", f"{te / 10:.2f}"]
        for d, impls in PAPER.items()
        for impl, (a, tr, te) in impls.items()
    ]
    lines = [
        f"# Table 1 {'on ' + args.device if args.device != 'cpu' else 'at CPU scale'}"
        f"{' (quick harness check)' if args.quick else ''}",
        "",
        f"Spiking-ResNet18 (SpikingJelly's structure, CIFAR stem) at width {args.width} (stages {args.width}-"
        f"{2 * args.width}-{4 * args.width}-{8 * args.width}), T={args.T}, Adam lr {COMMON['lr']}, seed "
        f"{COMMON['seed']}, precision {args.precision}, cross-entropy on the time-averaged output, neuron decay 0.2 / threshold 0.3 / V_rest 0 / "
        "sigmoid surrogate alpha 4 (SpikingJelly: tau 1.25). Same seed, initial weights and data order for both "
        "implementations; each trains in its own process. Times are medians over epochs (train includes the Adam "
        "step); the speed-up is SpikingJelly's time over spikefuse's; peak memory is the training process's maximum "
        f"{'CUDA memory allocated' if args.device != 'cpu' else 'resident set size'}. Test accuracy is on the whole test split unless a subset is listed below.",
        "",
        *settings,
        "",
        markdown_table(header, rows),
        "",
    ]
    if cost is not None:
        lines += [
            f"Why width {args.width}: the full-width (64) Spiking-ResNet18 takes {1000 * cost['s_per_sample']:.0f} ms "
            f"per training sample here (spikefuse neurons, MNIST shape, T={args.T}, median of 3 steps of 32), so one "
            f"MNIST epoch would take {cost['hours_per_mnist_epoch']:.1f} h per implementation.",
            "",
        ]
    lines += [
        "The paper's Table 1, Spiking-ResNet18 rows, for reference (one NVIDIA A100, T=32, batch 100, 5 epochs, "
        "Poisson-encoded MNIST, N-MNIST framed by event counts; accuracy is the average best over epochs, times in s per epoch). Not "
        + (
            "comparable in scale with the rows above: other hardware, 8x the time steps, full width."
            if args.device == "cpu"
            else "comparable in accuracy with the rows above, which train on subsets; the per-sample columns divide "
            "by the 60,000 training and 10,000 test samples of both data sets."
        ),
        "",
        markdown_table(
            ["data set", "implementation", "acc (%)", "train s", "test s", "train ms/sample", "test ms/sample"],
            paper_rows,
        ),
        "",
        f"Machine: {info}",
        "",
        f"Command: `{command}`",
        "",
    ]
    return "\n".join(lines)
