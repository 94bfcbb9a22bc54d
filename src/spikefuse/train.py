"""The training loop behind ``spikefuse train`` / ``spikefuse eval``: data, model, Adam + cross-entropy on the
time-averaged output, per-epoch metrics, atomic checkpoints with every RNG state, and exact resumption.

Determinism: ``seed`` seeds torch, numpy and python's ``random`` before the model is built; the training order
comes from a dedicated ``torch.Generator`` (the DataLoader's, ``num_workers=0``), Poisson encoding of training
batches from another, and every evaluation encodes the test set with a fresh generator seeded from ``seed`` (so the
test accuracy of an epoch does not depend on how the run got there, and ``spikefuse eval`` reproduces it). The
checkpoint holds the model, the optimizer, the epoch, the metric history and the states of all four RNGs plus both
generators: resuming from epoch ``e`` continues to exactly the weights and metrics of an uninterrupted run (on the
same machine, thread count and backend).

Files in ``out``: ``metrics.csv`` (one row per epoch, :data:`METRIC_COLUMNS`), ``checkpoint.pt`` (rewritten
atomically after every epoch), ``curves.png`` (loss and accuracy per epoch).

Data parallel (:func:`fit_data_parallel`, ``spikefuse train --nproc N`` or under ``torchrun``): ``batch_size`` is the
global batch, split evenly over the ranks. Every rank builds the same loader, generators and model, encodes the
same global batch and trains on its contiguous shard (:func:`spikefuse.distributed.ddp.shard`); the loss is each
rank's sum over its shard divided by the global batch size (times the world size, which DDP's gradient averaging
divides out), so a step is that of one process on the joint batch, BatchNorm included (converted to the
synchronized :class:`~spikefuse.distributed.TimeSplitBatchNorm`), up to the order of the floating-point reductions.
Evaluation is sharded the same way and the sums are all-reduced. Only rank 0 logs and writes the files; the
checkpoint holds the plain (unconverted) model's state and loads in a run with any number of processes. A final
training batch with fewer samples than ranks is skipped (each rank would otherwise get an empty shard).
"""

from __future__ import annotations

import csv
import math
import os
import random
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .models import NeuronOptions, build_model, replace_neurons
from .threads import set_threads

__all__ = [
    "TrainConfig",
    "ConfigError",
    "METRIC_COLUMNS",
    "fit",
    "fit_data_parallel",
    "evaluate_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "peak_memory_mb",
    "use_spikingjelly_neurons",
]

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.csv"
CURVES_NAME = "curves.png"
CHECKPOINT_VERSION = 1

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
)

# Settings that define the run's trajectory: a resume with different values would not continue the same run.
_TRAJECTORY_KEYS = (
    "model",
    "dataset",
    "T",
    "batch_size",
    "lr",
    "seed",
    "encoding",
    "stem",
    "neurons",
    "train_subset",
    "test_subset",
    "image_size",
)


class ConfigError(ValueError):
    """A user error in the run's settings (bad value, resume mismatch, missing checkpoint). The CLI prints the
    message and exits with code 2."""


@dataclass
class TrainConfig:
    """Everything a training run needs. The defaults train ``resnet-tiny`` on the embedded digits in about a
    minute on 2 CPU threads."""

    model: str = "resnet-tiny"
    dataset: str = "digits"
    data_dir: str | None = None
    T: int = 4
    epochs: int = 6
    batch_size: int = 32
    lr: float = 1e-3
    device: str = "cpu"
    threads: int | None = 2
    seed: int = 0
    out: str = "runs/spikefuse"
    encoding: str = "direct"  # static data sets: "direct" (analog image every step) or "poisson"
    neuron_backend: str = "auto"
    neurons: str = "spikefuse"  # or "spikingjelly" (SpikingJelly 2.0 LIFNode in every neuron slot)
    stem: str = "auto"  # ResNets: "auto" = cifar stem for images up to 64 px, else imagenet
    train_subset: int | None = None  # use only this many training samples (a seeded random subset)
    test_subset: int | None = None
    image_size: int | None = None  # resize static images (data set's ``size=``); None = native
    progress: bool = True
    neuron: dict | None = field(default=None)  # NeuronOptions.to_dict(); None = the model's paper defaults

    def validate(self) -> None:
        if self.T < 1:
            raise ConfigError(f"--T must be >= 1, got {self.T}")
        if self.epochs < 1:
            raise ConfigError(f"--epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.encoding not in ("direct", "poisson"):
            raise ConfigError(f"--encoding must be 'direct' or 'poisson', got {self.encoding!r}")
        if self.neurons not in ("spikefuse", "spikingjelly"):
            raise ConfigError(f"--neurons must be 'spikefuse' or 'spikingjelly', got {self.neurons!r}")
        if self.stem not in ("auto", "cifar", "imagenet"):
            raise ConfigError(f"--stem must be auto, cifar or imagenet, got {self.stem!r}")
        for name in ("train_subset", "test_subset"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        from .models import MODELS
        from .ops import BACKENDS

        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}: use one of {', '.join(MODELS)}")
        if self.neuron_backend not in BACKENDS:
            raise ConfigError(f"unknown neuron backend {self.neuron_backend!r}: use one of {', '.join(BACKENDS)}")
        try:
            torch.device(self.device)
        except RuntimeError as err:
            raise ConfigError(f"bad --device {self.device!r}: {err}") from None
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device} requested but CUDA is not available (this torch: {torch.__version__})")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# Helpers ---------------------------------------------------------------------------------------------------------


def peak_memory_mb(device: torch.device | str = "cpu") -> tuple[float, float | None]:
    """``(peak resident set size of this process, peak CUDA memory allocated on device or None)`` in MiB.

    ``ru_maxrss`` is the process's high-water mark since it started (KiB on Linux, bytes on macOS).
    """
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_mb = rss / 2**20 if sys.platform == "darwin" else rss / 1024
    device = torch.device(device)
    cuda = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return rss_mb, cuda


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_states(gens: dict[str, torch.Generator]) -> dict:
    np_state = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        # stored as a tensor + plain values so the checkpoint loads with torch.load(weights_only=True)
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": random.getstate(),
        "generators": {name: g.get_state() for name, g in gens.items()},
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict, gens: dict[str, torch.Generator]) -> None:
    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    py = states["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    for name, g in gens.items():
        g.set_state(states["generators"][name])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` to ``path`` atomically: temp file in the same folder, fsync, ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def load_checkpoint(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"cannot read checkpoint {path}: {err}") from None
    if not isinstance(ckpt, dict) or ckpt.get("version") != CHECKPOINT_VERSION:
        raise ConfigError(f"{path} is not a spikefuse checkpoint (version {CHECKPOINT_VERSION})")
    return ckpt


def use_spikingjelly_neurons(model: nn.Module) -> int:
    """Swap every spikefuse LIF of ``model`` for SpikingJelly 2.0's multi-step ``LIFNode`` with the same dynamics.

    Mapping of Eq. (1): ``tau = 1/(1-decay)``, ``decay_input=False``, ``v_threshold = threshold``, ``v_reset``
    (SpikingJelly decays toward ``v_reset``, Eq. (1) toward 0: they agree for ``v_reset = 0``), sigmoid surrogate
    alpha -> ``surrogate.Sigmoid(alpha)``, rectangle (width w, height h = 1/w) -> ``surrogate.Rect(alpha=h)``.
    SpikingJelly neurons keep state between calls: reset them with :func:`reset_states` after each batch.
    """
    try:
        from spikingjelly.activation_based import neuron as sj_neuron
        from spikingjelly.activation_based import surrogate as sj_surrogate
    except ImportError as err:
        raise ConfigError(f"SpikingJelly is not installed ({err}); install it with `pip install spikingjelly --no-deps`") from None
    from .surrogate import Rectangle, Sigmoid

    def factory(lif) -> nn.Module:
        if not isinstance(lif.decay, float):
            raise ConfigError("SpikingJelly's LIFNode has no learnable per-channel decay")
        if lif.decay >= 1.0:
            raise ConfigError("decay=1 (IF) has no LIFNode tau; use SpikingJelly's IFNode")
        sg = lif.surrogate
        if isinstance(sg, Sigmoid):
            sj_sg = sj_surrogate.Sigmoid(alpha=sg.alpha)
        elif isinstance(sg, Rectangle) and abs(sg.width * sg.height - 1.0) < 1e-12:
            sj_sg = sj_surrogate.Rect(alpha=sg.height)
        else:
            raise ConfigError(f"no SpikingJelly surrogate equal to {sg}")
        if lif.v_reset not in (None, 0.0):
            raise ConfigError("SpikingJelly's LIFNode decays toward v_reset; it equals Eq. (1) only for v_reset = 0")
        return sj_neuron.LIFNode(
            tau=1.0 / (1.0 - lif.decay),
            decay_input=False,
            v_threshold=lif.threshold,
            v_reset=lif.v_reset,
            surrogate_function=sj_sg,
            detach_reset=lif.detach_reset,
            step_mode="m",
        )

    return replace_neurons(model, factory)


def reset_states(model: nn.Module) -> None:
    """Reset stateful neurons between batches (SpikingJelly memory modules; stateful spikefuse LIFs)."""
    for m in model.modules():
        if hasattr(m, "reset_state") and callable(m.reset_state):
            m.reset_state()
        elif type(m).__module__.startswith("spikingjelly") and hasattr(m, "reset") and callable(m.reset):
            m.reset()


# Data ------------------------------------------------------------------------------------------------------------


def _load_data(cfg: TrainConfig):
    from . import data

    if cfg.dataset not in data.DATASETS:
        raise ConfigError(f"unknown data set {cfg.dataset!r}: use one of {', '.join(data.DATASETS)}")
    kw = {} if cfg.image_size is None else {"size": cfg.image_size}
    train_ds, info = data.load_dataset(cfg.dataset, cfg.data_dir, train=True, T=cfg.T, seed=cfg.seed, **kw)
    test_ds, _ = data.load_dataset(cfg.dataset, cfg.data_dir, train=False, T=cfg.T, seed=cfg.seed, **kw)
    train_ds = _subset(train_ds, cfg.train_subset, cfg.seed)
    test_ds = _subset(test_ds, cfg.test_subset, cfg.seed + 1)
    return train_ds, test_ds, info


def _subset(ds, n: int | None, seed: int):
    if n is None or n >= len(ds):
        return ds
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(ds), generator=g)[:n].sort().values.tolist()
    return torch.utils.data.Subset(ds, idx)


def _to_time_major(x: torch.Tensor, kind: str, T: int, encoding: str, generator: torch.Generator | None) -> torch.Tensor:
    """A batch from the loader -> ``[T, B, C, H, W]``."""
    if kind == "event":
        if x.ndim != 5:
            raise ConfigError(f"event batches must be [B, T, C, H, W], got {tuple(x.shape)}")
        return x.transpose(0, 1).contiguous()
    from .data import encode

    return encode(x, T, method=encoding, generator=generator).contiguous()


def _info_dict(info) -> dict:
    return {k: getattr(info, k) for k in ("name", "in_channels", "num_classes", "height", "width", "kind")}


# Model -----------------------------------------------------------------------------------------------------------


def _resolved_stem(cfg: TrainConfig, info: dict) -> str:
    if cfg.stem != "auto":
        return cfg.stem
    return "cifar" if max(info["height"], info["width"]) <= 64 else "imagenet"


def make_model(cfg: TrainConfig, info: dict) -> nn.Module:
    """Build ``cfg.model`` for the data set described by ``info`` (seed the RNGs first for a reproducible init)."""
    kw: dict = {"image_size": (info["height"], info["width"])}
    if cfg.model.startswith("resnet"):
        kw["stem"] = _resolved_stem(cfg, info)
    neuron = None if cfg.neuron is None else NeuronOptions.from_dict(cfg.neuron)
    model = build_model(cfg.model, info["in_channels"], info["num_classes"], neuron=neuron, neuron_backend=cfg.neuron_backend, **kw)
    if cfg.neurons == "spikingjelly":
        use_spikingjelly_neurons(model)
    return model


# Epochs ----------------------------------------------------------------------------------------------------------


def run_epoch(
    model: nn.Module,
    loader,
    *,
    kind: str,
    T: int,
    encoding: str,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
    desc: str = "",
    data_parallel: bool = False,
) -> dict:
    """One pass over ``loader``: trains when ``optimizer`` is given, else evaluates (no grad, eval-mode BN).

    Returns ``{"loss", "acc", "time_s", "samples"}``; the loss is cross-entropy of the time-averaged output.

    ``data_parallel`` (in a process group of several ranks, every rank iterating the same batches): each rank
    runs its shard of every batch and the returned metrics are all-reduced over the ranks. In training the loss
    backpropagated is the shard's summed loss times ``world_size / global batch``, so DDP's gradient average is
    the joint batch's mean gradient even when the shards are uneven; a batch smaller than the world is skipped
    in training and run whole on rank 0 in evaluation.
    """
    from .distributed import ddp

    world = ddp.world_size() if data_parallel else 1
    rank = ddp.rank() if world > 1 else 0
    training = optimizer is not None
    model.train(training)
    total_loss, correct, seen = 0.0, 0, 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(loader.dataset), desc=desc, unit="sample", leave=False, dynamic_ncols=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.set_grad_enabled(training):
        for x, y in loader:
            x = _to_time_major(x, kind, T, encoding, generator)  # the global batch (same encoding on every rank)
            if world > 1:
                n_global = y.shape[0]
                if bar is not None:
                    bar.update(n_global)
                if n_global < world:  # some shard would be empty
                    if training or rank != 0:
                        continue
                else:
                    x, y = ddp.shard(x, dim=1), ddp.shard(y)
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            out = model(x).mean(0)
            n = y.shape[0]
            if world > 1:
                loss_sum = F.cross_entropy(out, y, reduction="sum")
                loss = loss_sum * (world / n_global)  # DDP divides by world: sum over the global batch / n_global
                batch_loss = loss_sum.item()
            else:
                loss = F.cross_entropy(out, y)
                batch_loss = None
            if training:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            reset_states(model)
            total_loss += batch_loss if batch_loss is not None else loss.item() * n
            correct += int((out.argmax(1) == y).sum())
            seen += n
            if bar is not None:
                if world == 1:
                    bar.update(n)
                bar.set_postfix(loss=f"{total_loss / seen:.4f}", acc=f"{correct / seen:.3f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    if world > 1:
        import torch.distributed as dist

        sums = torch.tensor([total_loss, float(correct), float(seen)], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        total_loss, correct, seen = sums[0].item(), int(sums[1].item()), int(sums[2].item())
    return {"loss": total_loss / max(seen, 1), "acc": correct / max(seen, 1), "time_s": elapsed, "samples": seen}


def _test_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + 1_000_003)


def _loaders(cfg: TrainConfig, train_ds, test_ds, data_gen: torch.Generator):
    from torch.utils.data import DataLoader

    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, generator=data_gen, num_workers=0)
    test_loader = DataLoader(test_ds, batch_size=cfg.batch_size, shuffle=False, num_workers=0)
    return train_loader, test_loader


# Output files ----------------------------------------------------------------------------------------------------


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def write_metrics(path: Path, history: list[dict], append_only_last: bool) -> None:
    """Append the last row of ``history`` to ``path`` (header when new), or rewrite the file from ``history``."""
    if append_only_last and path.exists() and path.stat().st_size > 0:
        with open(path, "a", newline="") as f:
            csv.writer(f).writerow([_fmt(history[-1].get(c)) for c in METRIC_COLUMNS])
        return
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(METRIC_COLUMNS)
        for row in history:
            w.writerow([_fmt(row.get(c)) for c in METRIC_COLUMNS])


def plot_curves(path: Path, history: list[dict], title: str = "") -> None:
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def format_epoch(row: dict, epochs: int) -> str:
    mem = f"peak RSS {row['peak_rss_mb']:.0f} MiB"
    if row.get("peak_cuda_mb") is not None:
        mem += f", CUDA {row['peak_cuda_mb']:.0f} MiB"
    return (
        f"epoch {row['epoch']}/{epochs}: train loss {row['train_loss']:.4f} acc {100 * row['train_acc']:.2f}% | "
        f"test loss {row['test_loss']:.4f} acc {100 * row['test_acc']:.2f}% | "
        f"train {row['train_time_s']:.1f}s ({row['train_samples_per_s']:.0f} samples/s), test {row['test_time_s']:.1f}s | {mem}"
    )


# The run ---------------------------------------------------------------------------------------------------------


def _check_resume(saved: dict, cfg: TrainConfig) -> None:
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {getattr(cfg, k)!r}" for k in _TRAJECTORY_KEYS if saved.get(k) != getattr(cfg, k)]
    if saved.get("neuron") != cfg.neuron:
        diffs.append("neuron options differ")
    if diffs:
        raise ConfigError("cannot resume: the run's settings differ from the checkpoint's (" + "; ".join(diffs) + ")")


def fit(cfg: TrainConfig, resume: str | os.PathLike | bool | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """Train per ``cfg``; returns the metric history (one dict per epoch, :data:`METRIC_COLUMNS`).

    ``resume``: ``True`` continues from ``<out>/checkpoint.pt``, a path from that checkpoint; training then runs
    until ``cfg.epochs`` epochs in total.
    """
    from .distributed import ddp

    cfg.validate()
    world = ddp.world_size()
    _check_batch_split(cfg.batch_size, world)
    main = ddp.is_main()
    if not main:
        log = _quiet
    device = torch.device(cfg.device)
    if world > 1 and device.type == "cuda":
        device = ddp.device()  # this rank's GPU
    if cfg.threads is not None:
        set_threads(cfg.threads)
    out = Path(cfg.out)
    if main:
        out.mkdir(parents=True, exist_ok=True)
    ckpt = None
    if resume:
        ckpt = _load_resume_checkpoint(out / CHECKPOINT_NAME if resume is True else resume, cfg, world)

    train_ds, test_ds, info = _load_data(cfg)
    info = _info_dict(info)
    seed_everything(cfg.seed)
    model = make_model(cfg, info).to(device)
    # Names -> the plain model's parameter and buffer tensors: the synchronized BatchNorm below shares them (and
    # every update is in place), so the checkpoint keeps the plain model's keys whatever the world size.
    plain_state = model.state_dict(keep_vars=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    enc_gen = torch.Generator().manual_seed(cfg.seed + 1)
    gens = {"data": data_gen, "encode": enc_gen}
    history: list[dict] = []
    start_epoch = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        history = list(ckpt["history"])
        start_epoch = int(ckpt["epoch"])
        _set_rng_states(ckpt["rng"], gens)
        if main:
            write_metrics(out / METRICS_NAME, history, append_only_last=False)  # drop rows past the checkpoint
        if start_epoch >= cfg.epochs:
            log(f"checkpoint is at epoch {start_epoch}; nothing to do for --epochs {cfg.epochs}")
            return history
        log(f"resuming from epoch {start_epoch} ({out / CHECKPOINT_NAME if resume is True else resume})")
    core = model  # evaluated unwrapped: eval-mode BatchNorm uses the running statistics, no collectives
    if world > 1:
        core = ddp.convert_sync_batchnorm(model)
        model = ddp.wrap_model(core)
    train_loader, test_loader = _loaders(cfg, train_ds, test_ds, data_gen)
    n_params = sum(p.numel() for p in core.parameters())
    par = f", {world} data-parallel ranks ({cfg.batch_size // world} samples each)" if world > 1 else ""
    log(
        f"spikefuse train: {cfg.model} ({n_params / 1e6:.2f} M params) on {info['name']} ({len(train_ds)} train / "
        f"{len(test_ds)} test, {info['in_channels']}x{info['height']}x{info['width']}, {info['kind']}), T={cfg.T}, "
        f"batch {cfg.batch_size}{par}, Adam lr {cfg.lr}, neurons {cfg.neurons}/{cfg.neuron_backend}, device {device}, "
        f"threads {torch.get_num_threads()}{' per rank' if world > 1 else ''}, seed {cfg.seed}"
    )
    if world > 1 and 0 < len(train_ds) % cfg.batch_size < world:
        log(f"note: the last training batch ({len(train_ds) % cfg.batch_size} samples) has fewer samples than ranks "
            f"and is skipped every epoch")
    common = dict(kind=info["kind"], T=cfg.T, encoding=cfg.encoding, device=device, data_parallel=world > 1)
    config_dict = asdict(cfg)
    for epoch in range(start_epoch + 1, cfg.epochs + 1):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tr = run_epoch(model, train_loader, optimizer=optimizer, generator=enc_gen, progress=cfg.progress and main,
                       desc=f"epoch {epoch}/{cfg.epochs}", **common)
        te = run_epoch(core, test_loader, generator=_test_generator(cfg.seed), progress=cfg.progress and main,
                       desc=f"test {epoch}/{cfg.epochs}", **common)
        rss, cuda = peak_memory_mb(device)
        if world > 1:  # the largest over the ranks
            rss, cuda = _max_over_ranks(rss, cuda, device)
        row = {
            "epoch": epoch,
            "train_loss": tr["loss"],
            "train_acc": tr["acc"],
            "test_loss": te["loss"],
            "test_acc": te["acc"],
            "train_time_s": tr["time_s"],
            "test_time_s": te["time_s"],
            "epoch_time_s": tr["time_s"] + te["time_s"],
            "train_samples_per_s": tr["samples"] / tr["time_s"] if tr["time_s"] > 0 else float("nan"),
            "peak_rss_mb": rss,
            "peak_cuda_mb": cuda,
        }
        history.append(row)
        if not main:
            continue
        save_checkpoint(
            out / CHECKPOINT_NAME,
            {
                "version": CHECKPOINT_VERSION,
                "config": config_dict,
                "info": info,
                "epoch": epoch,
                "model": {k: v.detach() for k, v in plain_state.items()},
                "optimizer": optimizer.state_dict(),
                "history": history,
                "rng": _rng_states(gens),
                "world_size": world,
            },
        )
        write_metrics(out / METRICS_NAME, history, append_only_last=True)
        plot_curves(out / CURVES_NAME, history, title=f"{cfg.model} on {info['name']}, T={cfg.T}")
        log(format_epoch(row, cfg.epochs))
    return history


def _quiet(msg: str) -> None:
    pass


def _check_batch_split(batch_size: int, world: int) -> None:
    if batch_size % world:
        raise ConfigError(f"--batch-size {batch_size} (the global batch) must be divisible by the number of "
                          f"processes ({world})")


def _load_resume_checkpoint(path, cfg: TrainConfig, world: int) -> dict:
    """Load and check the checkpoint; with several ranks rank 0 reads it and broadcasts it (or its error) to the
    others, so the file only needs to exist on rank 0's machine and an error is raised on every rank."""
    if world <= 1:
        ckpt = load_checkpoint(path)
        _check_resume(ckpt["config"], cfg)
        return ckpt
    import torch.distributed as dist

    from .distributed import ddp

    box: list = [None, None]
    if ddp.is_main():
        try:
            box[1] = load_checkpoint(path)
            _check_resume(box[1]["config"], cfg)
        except ConfigError as err:
            box = [str(err), None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ConfigError(box[0])
    return box[1]


def _max_over_ranks(rss: float, cuda: float | None, device: torch.device) -> tuple[float, float | None]:
    import torch.distributed as dist

    t = torch.tensor([rss, -1.0 if cuda is None else cuda], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), (None if cuda is None else t[1].item())


def _fit_rank(args: tuple) -> list[dict] | None:
    """One rank of :func:`fit_data_parallel`: rank 0 returns the history, the others ``None``."""
    cfg, resume, log = args
    from .distributed import ddp

    history = fit(cfg, resume=resume, log=log)
    return history if ddp.is_main() else None


def fit_data_parallel(
    cfg: TrainConfig,
    nproc: int = 1,
    resume: str | os.PathLike | bool | None = None,
    log: Callable[[str], None] = print,
    timeout: float | None = None,
) -> list[dict] | None:
    """:func:`fit` data-parallel (DDP, gloo on CPU / NCCL on GPUs) over ``nproc`` local processes.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) this process joins torchrun's group and ``nproc`` is
    ignored. ``cfg.batch_size`` is the global batch (divisible by the number of processes); ``cfg.threads`` is
    per process. Returns the history on rank 0 (the calling process when spawning) and ``None`` on the other
    ranks. ``log`` must be picklable when spawning (a module-level function); only rank 0 logs. ``nproc=1``
    outside torchrun is plain :func:`fit`. ``timeout``: seconds before spawned ranks are terminated.
    """
    from .distributed import ddp

    cfg.validate()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    world = int(os.environ["WORLD_SIZE"]) if torchrun else nproc
    _check_batch_split(cfg.batch_size, world)
    if not torchrun and nproc == 1:
        return fit(cfg, resume=resume, log=log)
    if not torchrun and resume:  # report a bad checkpoint here, not as a traceback from a spawned rank
        _check_resume(load_checkpoint(Path(cfg.out) / CHECKPOINT_NAME if resume is True else resume)["config"], cfg)
    backend = "nccl" if torch.device(cfg.device).type == "cuda" else "gloo"
    return ddp.run_data_parallel(_fit_rank, nproc, (cfg, resume, log), backend=backend, timeout=timeout,
                                 threads=cfg.threads)


def evaluate_checkpoint(
    path: str | os.PathLike,
    *,
    data_dir: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    neuron_backend: str | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> dict:
    """Evaluate a checkpoint on its data set's test split (same encoding and test generator as training)."""
    ckpt = load_checkpoint(path)
    cfg = TrainConfig.from_dict(ckpt["config"])
    cfg.device = device
    cfg.data_dir = data_dir if data_dir is not None else cfg.data_dir
    if neuron_backend is not None:
        cfg.neuron_backend = neuron_backend
    if batch_size is not None:
        cfg.batch_size = batch_size
    cfg.validate()
    if threads is not None:
        set_threads(threads)
    dev = torch.device(device)
    _, test_ds, info = _load_data(cfg)
    info = _info_dict(info)
    model = make_model(cfg, info)
    model.load_state_dict(ckpt["model"])
    model.to(dev)
    from torch.utils.data import DataLoader

    loader = DataLoader(test_ds, batch_size=cfg.batch_size, shuffle=False, num_workers=0)
    res = run_epoch(model, loader, kind=info["kind"], T=cfg.T, encoding=cfg.encoding, device=dev,
                    generator=_test_generator(cfg.seed), progress=progress, desc="test")
    rss, cuda = peak_memory_mb(dev)
    return {"epoch": int(ckpt["epoch"]), "model": cfg.model, "dataset": info["name"], "test_loss": res["loss"],
            "test_acc": res["acc"], "test_time_s": res["time_s"], "samples": res["samples"], "peak_rss_mb": rss,
            "peak_cuda_mb": cuda}
