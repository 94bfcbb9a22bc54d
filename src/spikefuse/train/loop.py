"""The training loop: data, model, one epoch, :func:`fit` and :func:`evaluate_checkpoint`."""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..data._common import MissingRootError
from ..models import RECURRENT_MODELS, SPARSE_MODELS, NeuronFactory, build_model, cell_neuron
from ..ops.nonfinite import NonFiniteError
from ..threads import set_threads
from .checkpoints import (
    CHECKPOINT_NAME,
    CHECKPOINT_VERSION,
    CURVES_NAME,
    LOCK_NAME,
    METRICS_NAME,
    check_out_dir,
    load_checkpoint,
    load_model_state,
    load_optimizer_state,
    load_resume_checkpoint,
    lock_out_dir,
    remove_stale_temp_files,
    rng_states,
    save_checkpoint,
    seed_everything,
    set_rng_states,
    signals_deferred,
    unlock_out_dir,
)
from .config import PRECISIONS, SPARSE_CHOICES, ConfigError, TrainConfig, check_batch_split
from .reports import format_epoch, max_over_ranks, peak_memory_mb, plot_curves, write_metrics

__all__ = [
    "fit",
    "evaluate_checkpoint",
    "run_epoch",
    "make_model",
    "make_optimizer",
    "reset_states",
    "FIRST_BATCH_NOTE",
]

#: What the progress bar shows while the first batch of a process runs.
FIRST_BATCH_NOTE = " (first batch: compiling kernels, cached for later runs)"


def reset_states(model: nn.Module) -> None:
    """Reset stateful neurons between batches (SpikingJelly memory modules; stateful spikefuse LIFs)."""
    for m in model.modules():
        if hasattr(m, "reset_state") and callable(m.reset_state):
            m.reset_state()
        elif type(m).__module__.startswith("spikingjelly") and hasattr(m, "reset") and callable(m.reset):
            m.reset()


# Data ------------------------------------------------------------------------------------------------------------


def _load_data(cfg: TrainConfig, cache: bool | None = None):
    """The training and test splits and the data set's info; ``cache`` (default ``cfg.cache_frames``): the samples
    framed at every read kept in memory as they are first read (``load_dataset(cache="memory")``), for the epochs after
    the first."""
    from .. import data

    kw = {} if cfg.image_size is None else {"size": cfg.image_size}
    if cfg.cache_frames if cache is None else cache:
        kw["cache"] = "memory"
    try:
        train_ds, info = data.load_dataset(cfg.dataset, cfg.data_dir, train=True, T=cfg.T, seed=cfg.seed, **kw)
        test_ds, _ = data.load_dataset(cfg.dataset, cfg.data_dir, train=False, T=cfg.T, seed=cfg.seed, **kw)
    except MissingRootError as err:  # the folder is the run's --data-dir here, as in every message of a run
        raise err.naming("--data-dir") from None
    cfg.check_data_kind(info.kind)
    train_ds = _subset(train_ds, cfg.train_subset, cfg.seed)
    test_ds = _subset(test_ds, cfg.test_subset, cfg.seed + 1)
    for split, verb, ds in (("training", "train", train_ds), ("test", "test", test_ds)):
        if len(ds) == 0:
            raise ConfigError(
                f"the {split} split of {cfg.dataset} is empty (no samples in "
                f"{cfg.data_dir or 'the data folder'}): nothing to {verb} on; check the files"
            )
    return train_ds, test_ds, info


def _cached(ds) -> bool:
    from ..data import CachedDataset

    return isinstance(ds, CachedDataset) or isinstance(getattr(ds, "dataset", None), CachedDataset)


def _subset(ds, n: int | None, seed: int):
    if n is None or n >= len(ds):
        return ds
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(ds), generator=g)[:n].sort().values.tolist()
    return torch.utils.data.Subset(ds, idx)


def _to_time_major(
    x: torch.Tensor, kind: str, T: int, encoding: str, generator: torch.Generator | None
) -> torch.Tensor:
    """A batch from the loader -> ``[T, B, C, H, W]`` (sequences: ``[T, B, F]``, their intensities drawn as spikes
    with ``encoding="poisson"``)."""
    if kind in ("event", "sequence"):
        if x.ndim != (5 if kind == "event" else 3):
            form = "[B, T, C, H, W]" if kind == "event" else "[B, T, F]"
            raise ConfigError(f"{kind} batches must be {form}, got {tuple(x.shape)}")
        x = x.transpose(0, 1)
        if kind == "sequence" and encoding == "poisson":
            from ..data.sequences import bernoulli_steps

            return bernoulli_steps(x, generator)
        return x.contiguous()
    from ..data import encode

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
    if cfg.model in RECURRENT_MODELS:  # the features of a step: a sequence's, or an event frame's flattened
        # Framed events are counts per bin, not spikes: the first layer keeps its input as it is (a spike layer
        # would keep bits and refuse them), in the lean form too; Bernoulli-coded inputs are spikes.
        kw: dict = {"hidden": cfg.hidden, "layers": cfg.layers, "cell": cfg.cell, "sparse": SPARSE_CHOICES[cfg.sparse]}
        kw["spike_inputs"] = cfg.encoding == "poisson"
        in_features = info["in_channels"] * info["height"] * info["width"]
        return build_model(
            cfg.model, in_features, info["num_classes"], neuron_backend=cfg.neuron_backend, memory=cfg.memory, **kw
        )
    kw = {"image_size": (info["height"], info["width"])}
    if cfg.model.startswith(("resnet", "sew_resnet")):
        kw["stem"] = _resolved_stem(cfg, info)
        if cfg.width is not None:
            kw["width"] = cfg.width
    if cfg.model.startswith("sew_resnet"):
        kw["cnf"] = cfg.cnf
    if cfg.model == "mlp":
        kw["hidden"] = cfg.hidden
        kw["sparse_grad"] = cfg.sparse_grad
    if cfg.model in SPARSE_MODELS:
        kw["sparse"] = SPARSE_CHOICES[cfg.sparse]
    neuron = cell_neuron(cfg.cell) if cfg.neuron is None else NeuronFactory.from_dict(cfg.neuron)
    model = build_model(
        cfg.model,
        info["in_channels"],
        info["num_classes"],
        neuron=neuron,
        neuron_backend=cfg.neuron_backend,
        memory=cfg.memory,
        **kw,
    )
    if cfg.neurons == "spikingjelly":
        from ..compat.spikingjelly import use_spikingjelly_neurons

        try:
            use_spikingjelly_neurons(model)
        except (ImportError, ValueError) as err:
            raise ConfigError(f"--neurons spikingjelly: {err}") from None
    return model


# Epochs ----------------------------------------------------------------------------------------------------------


# The devices this library trains on where torch has a fused Adam step.
_FUSED_ADAM_DEVICES = ("cpu", "cuda")


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Adam:
    """Adam over ``model``'s parameters, its step one fused kernel where torch has one for every parameter's device
    (the CPU's included): torch's default steps one parameter at a time on the CPU, 1.1 ms for the N-MNIST MLP's
    1.5 M parameters on two cores against the fused kernel's 0.3 ms (``benchmarks/results/fused_adam.md``); the same
    update, to rounding."""
    params = list(model.parameters())
    fused = all(p.device.type in _FUSED_ADAM_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.Adam(params, lr=lr, fused=fused or None)


def _check_finite(value: float, what: str, where: str) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"training diverged: the {what} is {value} {where}; lower --lr (Adam's learning rate)")


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
    first_run: bool = False,
    autocast: torch.dtype | None = None,
) -> dict:
    """One pass over ``loader``: trains when ``optimizer`` is given, else evaluates (no grad, eval-mode BN).

    Returns ``{"loss", "acc", "time_s", "samples"}``; the loss is cross-entropy of the time-averaged output.
    Training stops with :class:`ConfigError` at the first batch whose loss is NaN or inf (in a single process;
    with several ranks, which may meet it at different batches, at the end of the epoch, on every rank).

    ``data_parallel`` (in a process group of several ranks, every rank iterating the same batches): each rank
    runs its shard of every batch and the returned metrics are all-reduced over the ranks. In training the loss
    backpropagated is the shard's summed loss times ``world_size / global batch``, so DDP's gradient average is
    the joint batch's mean gradient even when the shards are uneven; a batch smaller than the world is skipped
    in training and run whole on rank 0 in evaluation.

    ``autocast``: run the forward and the loss under ``torch.autocast`` in this dtype (None: as the model is).

    ``first_run``: the first batches this process runs, whose kernels compile on first use (numba, Triton; cached
    on disk for later runs): the progress bar says so while the first batch runs, and its rate and ETA count from
    the second batch on.
    """
    from ..distributed import ddp

    world = ddp.world_size() if data_parallel else 1
    rank = ddp.rank() if world > 1 else 0
    training = optimizer is not None
    model.train(training)
    total_loss, correct, seen = 0.0, 0, 0
    bar = None
    if progress:
        from tqdm import tqdm

        def new_bar(note: str = "", initial: int = 0):
            # disable=None: no bar where stderr is no terminal (a log file, a pipe): one line per epoch there
            return tqdm(
                total=len(loader.dataset),
                desc=desc + note,
                initial=initial,
                unit="sample",
                leave=False,
                dynamic_ncols=True,
                disable=None,
            )

        bar = new_bar(FIRST_BATCH_NOTE if first_run else "")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.set_grad_enabled(training):
        for batch, (x, y) in enumerate(loader, 1):
            x = _to_time_major(x, kind, T, encoding, generator)  # the global batch (same encoding on every rank)
            if world > 1:
                n_global = y.shape[0]
                if bar is not None and not (first_run and batch == 1):
                    bar.update(n_global)
                if n_global < world:  # some shard would be empty
                    if training or rank != 0:
                        continue
                else:
                    x, y = ddp.shard(x, dim=1), ddp.shard(y)
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            try:
                with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                    out = model(x).mean(0).float()
            except NonFiniteError as err:  # the weights went NaN or inf in an earlier step, or the data holds them
                what = "training diverged" if training else "evaluation stopped"
                raise ConfigError(
                    f"{what}: NaN or inf reached the spiking neurons at {desc}, batch {batch} ({err.where}); "
                    + ("lower --lr (Adam's learning rate)" if training else "check the data")
                ) from None
            n = y.shape[0]
            if world > 1:
                loss_sum = F.cross_entropy(out, y, reduction="sum")
                loss = loss_sum * (world / n_global)  # DDP divides by world: sum over the global batch / n_global
                batch_loss = loss_sum.item()
            else:
                loss = F.cross_entropy(out, y)
                batch_loss = loss.item() * n
                if training:
                    _check_finite(batch_loss, "training loss", f"at {desc}, batch {batch}")
            if training:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            reset_states(model)
            total_loss += batch_loss
            correct += int((out.argmax(1) == y).sum())
            seen += n
            if bar is not None:
                if first_run and batch == 1:  # a fresh bar: the rate and ETA leave the compilation out
                    done = bar.n + (n if world == 1 else n_global)
                    bar.close()
                    bar = new_bar(initial=done)
                elif world == 1:
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
    loss = total_loss / max(seen, 1)
    if training:
        _check_finite(loss, "training loss", f"at {desc}")
    return {"loss": loss, "acc": correct / max(seen, 1), "time_s": elapsed, "samples": seen}


def _test_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + 1_000_003)


def _loaders(cfg: TrainConfig, train_ds, test_ds, data_gen: torch.Generator, kind: str):
    """The training loader (shuffled by ``data_gen``) and the test loader. A cached data set's batches are built
    whole by :func:`spikefuse.data.cache.batch_loader` (same batches, order and draws), event and sequence ones
    time-major in memory, as :func:`_to_time_major` turns them, so that it copies nothing."""
    from torch.utils.data import DataLoader

    from ..data.cache import batch_loader

    stack_dim = 1 if kind in ("event", "sequence") else 0

    def loader(ds, shuffle: bool, generator: torch.Generator | None):
        if _cached(ds):
            return batch_loader(ds, cfg.batch_size, shuffle=shuffle, generator=generator, stack_dim=stack_dim)
        return DataLoader(ds, batch_size=cfg.batch_size, shuffle=shuffle, generator=generator, num_workers=0)

    return loader(train_ds, True, data_gen), loader(test_ds, False, None)


# The run ---------------------------------------------------------------------------------------------------------


def _decided_on_main(fn: Callable[[], object], world: int):
    """``fn()`` on rank 0 (the only rank that owns the output folder), its result or its :class:`ConfigError`
    broadcast so every rank returns or raises alike (a lone failing rank would leave the others waiting)."""
    if world <= 1:
        return fn()
    import torch.distributed as dist

    from ..distributed import ddp

    box: list = [None, None]
    if ddp.is_main():
        try:
            box[1] = fn()
        except ConfigError as err:
            box = [str(err), None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ConfigError(box[0])
    return box[1]


def _prepare_out(out: Path, resume, overwrite: bool) -> bool:
    """Check ``out`` and take its lock (:func:`lock_out_dir`); whether this made the folder."""
    made = not out.exists()
    try:
        check_out_dir(out, resume, overwrite)
        lock_out_dir(out)
    except ConfigError:
        _remove_if_unused(out, made)
        raise
    remove_stale_temp_files(out)
    return made


def _remove_if_unused(out: Path, made: bool) -> None:
    """Remove the folder a run made and wrote nothing into (a failed start), its lock included."""
    if not made or not out.is_dir() or any(p.name != LOCK_NAME for p in out.iterdir()):
        return
    with contextlib.suppress(OSError):
        (out / LOCK_NAME).unlink(missing_ok=True)
        out.rmdir()


def fit(
    cfg: TrainConfig,
    resume: str | os.PathLike | bool | None = None,
    log: Callable[[str], None] = print,
    overwrite: bool = False,
) -> list[dict]:
    """Train per ``cfg``; returns the metric history (one dict per epoch, :data:`METRIC_COLUMNS`).

    ``resume``: ``True`` continues from ``<out>/checkpoint.pt``, a path from that checkpoint; training then runs
    until ``cfg.epochs`` epochs in total. A fresh run into an ``out`` that holds an earlier run raises
    :class:`ConfigError` unless ``overwrite`` (then its files are replaced at the end of the first epoch).
    """
    from ..distributed import ddp

    cfg.validate()
    world = ddp.world_size()
    check_batch_split(cfg.batch_size, world)
    main = ddp.is_main()
    if not main:
        log = _quiet
    device = torch.device(cfg.device)
    if world > 1 and device.type == "cuda":
        device = ddp.device()  # this rank's GPU
    if cfg.threads is not None:
        set_threads(cfg.threads)
    out = Path(cfg.out)
    made = _decided_on_main(lambda: _prepare_out(out, resume, overwrite), world)
    try:
        return _train(cfg, resume, log, out, world, main, device)
    except BaseException:
        if main:
            _remove_if_unused(out, made)
        raise
    finally:
        if main:
            unlock_out_dir(out)


def _train(cfg: TrainConfig, resume, log, out: Path, world: int, main: bool, device: torch.device) -> list[dict]:
    """:func:`fit` once ``out`` is ready and held."""
    from ..distributed import ddp

    ckpt = None
    if resume:
        path = out / CHECKPOINT_NAME if resume is True else resume
        ckpt = _decided_on_main(lambda: load_resume_checkpoint(path, cfg), world)

    train_ds, test_ds, info = _load_data(cfg)
    info = _info_dict(info)
    seed_everything(cfg.seed)
    model = make_model(cfg, info).to(device)
    # Names -> the plain model's parameter and buffer tensors: the synchronized BatchNorm below shares them (and
    # every update is in place), so the checkpoint keeps the plain model's keys whatever the world size.
    plain_state = model.state_dict(keep_vars=True)
    optimizer = make_optimizer(model, cfg.lr)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    enc_gen = torch.Generator().manual_seed(cfg.seed + 1)
    gens = {"data": data_gen, "encode": enc_gen}
    history: list[dict] = []
    start_epoch = 0
    if ckpt is not None:
        load_model_state(model, ckpt, path)
        load_optimizer_state(optimizer, ckpt, path)
        history = list(ckpt["history"])
        start_epoch = int(ckpt["epoch"])
        set_rng_states(ckpt["rng"], gens)
        if main:
            write_metrics(out / METRICS_NAME, history)  # the checkpoint's epochs, whatever was written after it
        if start_epoch >= cfg.epochs:
            log(f"checkpoint is at epoch {start_epoch}; nothing to do for --epochs {cfg.epochs}")
            return history
        log(f"resuming from epoch {start_epoch} ({path})")
    core = model  # evaluated unwrapped: eval-mode BatchNorm uses the running statistics, no collectives
    if world > 1:
        core = ddp.convert_sync_batchnorm(model)
        model = ddp.wrap_model(core)
    train_loader, test_loader = _loaders(cfg, train_ds, test_ds, data_gen, info["kind"])
    n_params = sum(p.numel() for p in core.parameters())
    par = f", {world} data-parallel ranks ({cfg.batch_size // world} samples each)" if world > 1 else ""
    log(
        f"spikefuse train: {cfg.model} ({n_params / 1e6:.2f} M params) on {info['name']} ({len(train_ds)} train / "
        f"{len(test_ds)} test, {info['in_channels']}x{info['height']}x{info['width']}, {info['kind']}"
        f"{', framed samples cached in memory' if _cached(train_ds) else ''}), T={cfg.T}, "
        f"batch {cfg.batch_size}{par}, Adam lr {cfg.lr}, neurons {cfg.neurons}/{cfg.neuron_backend}, memory "
        f"{cfg.memory}, precision {cfg.precision}{', compiled' if cfg.compile else ''}, device {device}, "
        f"threads {torch.get_num_threads()}{' per rank' if world > 1 else ''}, seed {cfg.seed}"
    )
    if world > 1 and 0 < len(train_ds) % cfg.batch_size < world:
        log(
            f"note: the last training batch ({len(train_ds) % cfg.batch_size} samples) has fewer samples than ranks "
            f"and is skipped every epoch"
        )
    if cfg.compile:  # the plain modules stay those the checkpoint, the optimizer and the checks above hold
        model, core = torch.compile(model), torch.compile(core)
    common = dict(
        kind=info["kind"],
        T=cfg.T,
        encoding=cfg.encoding,
        device=device,
        data_parallel=world > 1,
        autocast=PRECISIONS[cfg.precision],
    )
    config_dict = asdict(cfg)
    for epoch in range(start_epoch + 1, cfg.epochs + 1):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            tr = run_epoch(
                model,
                train_loader,
                optimizer=optimizer,
                generator=enc_gen,
                progress=cfg.progress and main,
                desc=f"epoch {epoch}/{cfg.epochs}",
                first_run=epoch == start_epoch + 1,
                **common,
            )
            if not all(bool(torch.isfinite(p).all()) for p in core.parameters()):
                raise ConfigError(
                    f"training diverged: the weights hold NaN or inf after epoch {epoch}; lower --lr "
                    "(Adam's learning rate)"
                )
            te = run_epoch(
                core,
                test_loader,
                generator=_test_generator(cfg.seed),
                progress=cfg.progress and main,
                desc=f"test {epoch}/{cfg.epochs}",
                **common,
            )
        except ConfigError as err:
            kept = f"epoch {epoch - 1} in {out / CHECKPOINT_NAME}" if epoch > 1 else "none was written"
            raise ConfigError(f"{err}. The last good checkpoint is kept ({kept})") from None
        rss, cuda = peak_memory_mb(device)
        if world > 1:  # the largest over the ranks
            rss, cuda = max_over_ranks(rss, cuda, device)
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
            "memory": cfg.memory,
        }
        history.append(row)
        if not main:
            continue
        state = {
            "version": CHECKPOINT_VERSION,
            "config": config_dict,
            "info": info,
            "epoch": epoch,
            "model": {k: v.detach() for k, v in plain_state.items()},
            "optimizer": optimizer.state_dict(),
            "history": history,
            "rng": rng_states(gens),
            "world_size": world,
        }
        with signals_deferred():  # the checkpoint and metrics.csv are written as a pair
            save_checkpoint(out / CHECKPOINT_NAME, state)
            write_metrics(out / METRICS_NAME, history)
            plot_curves(out / CURVES_NAME, history, title=f"{cfg.model} on {info['name']}, T={cfg.T}")
        log(format_epoch(row, cfg.epochs))
    return history


def _quiet(msg: str) -> None:
    pass


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
    """Evaluate a checkpoint (or a run folder's ``checkpoint.pt``) on its data set's test split (same encoding and test
    generator as training)."""
    if Path(path).is_dir():
        path = Path(path) / CHECKPOINT_NAME
    ckpt = load_checkpoint(path)
    cfg = TrainConfig.from_dict(ckpt["config"])
    cfg.device = device
    cfg.threads = threads  # this evaluation's (checked against this machine), not the run's
    cfg.data_dir = data_dir if data_dir is not None else cfg.data_dir
    if neuron_backend is not None:
        cfg.neuron_backend = neuron_backend
    if batch_size is not None:
        cfg.batch_size = batch_size
    cfg.validate()
    if cfg.threads is not None:
        set_threads(cfg.threads)
    dev = torch.device(device)
    _, test_ds, info = _load_data(cfg, cache=False)  # one pass: a cache would be filled and never read
    info = _info_dict(info)
    model = make_model(cfg, info)
    load_model_state(model, ckpt, path)
    model.to(dev)
    from torch.utils.data import DataLoader

    loader = DataLoader(test_ds, batch_size=cfg.batch_size, shuffle=False, num_workers=0)
    res = run_epoch(
        model,
        loader,
        kind=info["kind"],
        T=cfg.T,
        encoding=cfg.encoding,
        device=dev,
        generator=_test_generator(cfg.seed),
        progress=progress,
        desc="test",
        autocast=PRECISIONS[cfg.precision],
    )
    rss, cuda = peak_memory_mb(dev)
    return {
        "epoch": int(ckpt["epoch"]),
        "model": cfg.model,
        "dataset": info["name"],
        "test_loss": res["loss"],
        "test_acc": res["acc"],
        "test_time_s": res["time_s"],
        "samples": res["samples"],
        "peak_rss_mb": rss,
        "peak_cuda_mb": cuda,
    }
