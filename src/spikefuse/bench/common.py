"""What every benchmark shares: machine info, round-robin median timing, result files."""

from __future__ import annotations

import csv
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path("benchmarks/results")


def machine_info() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def gpu_machine_info(detail: str = "") -> str:
    """The current CUDA GPU, CUDA and Triton versions (then ``detail``), and the host's :func:`machine_info`."""
    import triton

    return (
        f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, Triton {triton.__version__}{detail}; "
        f"host {machine_info()}"
    )


def add_result_args(p) -> None:
    """``--out`` and ``--tag``, which the benchmarks take (the tag defaults to full or quick: :func:`result_tag`)."""
    p.add_argument("--out", default=str(RESULTS), help="folder of the result files (default: %(default)s)")
    p.add_argument("--tag", default=None, help="suffix of the result files (default: full or quick)")


def add_training_step_args(p, quick: dict) -> None:
    """The arguments of the one-model training step that ``bench layers`` and ``bench profile`` take apart (the step
    of ``bench memory``): the model and its input, threads, seed, ``--quick`` (``quick``: its sizes) and
    ``--results-dir``."""
    p.add_argument(
        "--model", choices=["resnet18", "liang-medium"], default="resnet18", help="the network (default: %(default)s)"
    )
    p.add_argument("-T", type=int, default=8, help="time steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="batch size (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=32, help="input height = width (default: %(default)s)")
    p.add_argument("--resnet-width", type=int, default=64, help="ResNet18 first-stage width (default: %(default)s)")
    p.add_argument(
        "--stem",
        choices=["cifar", "imagenet"],
        default="imagenet",
        help="ResNet18 stem (default: %(default)s, as the bench memory run of the README)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch/numba threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="of the weights and inputs (default: %(default)s)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"check the harness: T={quick['T']}, batch {quick['batch_size']}, "
        f"{quick['image_size']}x{quick['image_size']} images, ResNet width {quick['resnet_width']}",
    )
    p.add_argument("--results-dir", default=str(RESULTS), help="where the .md/.csv go (default: %(default)s)")


def training_step_line(cfg: dict) -> str:
    """The model and input of ``cfg`` (as :func:`add_training_step_args` makes it), for a report."""
    width = f", width {cfg['resnet_width']}, {cfg['stem']} stem" if cfg["model"] == "resnet18" else ""
    size = cfg["image_size"]
    return f"{cfg['model']}{width}, T={cfg['T']}, batch {cfg['batch_size']}, {size}x{size} inputs"


def result_tag(args) -> str:
    return args.tag or ("quick" if args.quick else "full")


def command_line() -> str:
    program = Path(sys.argv[0])
    as_cli = program.name == "spikefuse" or program.parts[-2:] == ("spikefuse", "cli.py")  # or python -m spikefuse.cli
    return "spikefuse " + " ".join(sys.argv[1:]) if as_cli else " ".join(sys.argv)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def round_robin(
    cases: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    setups: dict[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Median seconds of each case, running the cases in turn (round-robin) so drift hits all alike.
    ``setups[name]``, where given, runs untimed before every run of case ``name``."""
    setups = setups or {}
    for _ in range(warmup):
        for name, fn in cases.items():
            setups.get(name, _nothing)()
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            setups.get(name, _nothing)()
            samples[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


def _nothing() -> None:
    return None


#: What :func:`cache_evictor` reads: more than the last-level cache of the machines the benchmarks ran on (32 MB on
#: the AMD EPYC VM, 105 MB and 480 MiB reported on the Xeon VMs).
EVICT_BYTES = 1 << 30


def cache_evictor() -> Callable[[], object]:
    """An untimed setup for :func:`round_robin` that reads :data:`EVICT_BYTES`, so that the timed run after it starts
    with none of its data in cache."""
    evict = torch.zeros(EVICT_BYTES // 4)
    return evict.sum


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
