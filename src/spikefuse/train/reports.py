"""What a run reports: ``metrics.csv`` (one row per epoch), ``curves.png``, the epoch's log line, peak memory."""

from __future__ import annotations

import csv
import io
import resource
import sys
from pathlib import Path

import torch

from .checkpoints import atomic_write

__all__ = ["METRIC_COLUMNS", "peak_memory_mb", "write_metrics", "plot_curves", "format_epoch"]

METRIC_COLUMNS = (
    "epoch",
    "train_loss",
    "train_acc",
    "test_loss",
    "test_acc",
    "train_time_s",
    "test_time_s",
    "epoch_time_s",
    "train_samples_per_s",
    "peak_rss_mb",
    "peak_cuda_mb",
    "memory",
)


def peak_rss_mb() -> float:
    """This process's resident-set high-water mark. Linux: ``VmHWM`` of ``/proc/self/status``, which starts anew
    with each program; ``ru_maxrss`` does not (it keeps the parent's mark through fork and exec, so a child of a
    big process would report the parent's peak). Elsewhere ``ru_maxrss`` (bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return kib / 1024
    except (OSError, StopIteration, ValueError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def peak_memory_mb(device: torch.device | str = "cpu") -> tuple[float, float | None]:
    """``(peak resident set size of this process, peak CUDA memory allocated on device or None)`` in MiB."""
    rss_mb = peak_rss_mb()
    device = torch.device(device)
    cuda = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return rss_mb, cuda


def max_over_ranks(rss: float, cuda: float | None, device: torch.device) -> tuple[float, float | None]:
    import torch.distributed as dist

    t = torch.tensor([rss, -1.0 if cuda is None else cuda], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), (None if cuda is None else t[1].item())


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def write_metrics(path: Path, history: list[dict]) -> None:
    """Write ``history`` (every epoch so far) to ``path``, atomically: the file always holds exactly the epochs of
    the checkpoint written with it, never rows of another run."""
    text = io.StringIO(newline="")
    w = csv.writer(text)
    w.writerow(METRIC_COLUMNS)
    for row in history:
        w.writerow([_fmt(row.get(c)) for c in METRIC_COLUMNS])
    atomic_write(path, text.getvalue().encode())


def plot_curves(path: Path, history: list[dict], title: str = "") -> None:
    """Plot the loss and accuracy curves of ``history`` (the rows of ``metrics.csv``) into the image ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(epochs, [r["train_loss"] for r in history], "o-", label="train")
    ax1.plot(epochs, [r["test_loss"] for r in history], "s-", label="test")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("cross-entropy loss")
    ax1.legend()
    ax2.plot(epochs, [100 * r["train_acc"] for r in history], "o-", label="train")
    ax2.plot(epochs, [100 * r["test_acc"] for r in history], "s-", label="test")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("accuracy (%)")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if len(epochs) <= 20:
            ax.set_xticks(epochs)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, format="png", dpi=100)
    finally:
        plt.close(fig)
    atomic_write(path, image.getbuffer())


def format_epoch(row: dict, epochs: int) -> str:
    mem = f"peak RSS {row['peak_rss_mb']:.0f} MiB"
    if row.get("peak_cuda_mb") is not None:
        mem += f", CUDA {row['peak_cuda_mb']:.0f} MiB"
    return (
        f"epoch {row['epoch']}/{epochs}: train loss {row['train_loss']:.4f} acc {100 * row['train_acc']:.2f}% | "
        f"test loss {row['test_loss']:.4f} acc {100 * row['test_acc']:.2f}% | "
        f"train {row['train_time_s']:.1f}s ({row['train_samples_per_s']:.0f} samples/s), test {row['test_time_s']:.1f}s | {mem}"
    )
