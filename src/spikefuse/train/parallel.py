"""Data-parallel training: :func:`fit` over several local processes (DDP) or under ``torchrun``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from .checkpoints import CHECKPOINT_NAME, check_out_dir, load_resume_checkpoint
from .config import ConfigError, TrainConfig, check_batch_split, out_of_bounds
from .loop import fit

__all__ = ["fit_data_parallel"]


def _fit_rank(args: tuple) -> list[dict] | None:
    """One rank of :func:`fit_data_parallel`: rank 0 returns the history, the others ``None``."""
    cfg, resume, log, overwrite = args
    from ..distributed import ddp

    history = fit(cfg, resume=resume, log=log, overwrite=overwrite)
    return history if ddp.is_main() else None


def fit_data_parallel(
    cfg: TrainConfig,
    nproc: int = 1,
    resume: str | os.PathLike | bool | None = None,
    log: Callable[[str], None] = print,
    timeout: float | None = None,
    overwrite: bool = False,
) -> list[dict] | None:
    """:func:`fit` data-parallel (DDP, gloo on CPU / NCCL on GPUs) over ``nproc`` local processes.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) this process joins torchrun's group and ``nproc`` is
    ignored. ``cfg.batch_size`` is the global batch (divisible by the number of processes); ``cfg.threads`` is
    per process. Returns the history on rank 0 (the calling process when spawning) and ``None`` on the other
    ranks. ``log`` must be picklable when spawning (a module-level function); only rank 0 logs. ``nproc=1``
    outside torchrun is plain :func:`fit`. ``timeout``: seconds before spawned ranks are terminated.
    """
    from ..distributed import ddp

    cfg.validate()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    problem = out_of_bounds("nproc", nproc)
    if problem:
        raise ConfigError(f"--nproc {problem}")
    world = int(os.environ["WORLD_SIZE"]) if torchrun else nproc
    check_batch_split(cfg.batch_size, world)
    if not torchrun and nproc == 1:
        return fit(cfg, resume=resume, log=log, overwrite=overwrite)
    if not torchrun:  # report a bad folder or checkpoint here, not as a traceback from a spawned rank
        check_out_dir(Path(cfg.out), resume, overwrite)
        if resume:
            load_resume_checkpoint(Path(cfg.out) / CHECKPOINT_NAME if resume is True else resume, cfg)
    backend = "nccl" if torch.device(cfg.device).type == "cuda" else "gloo"
    return ddp.run_data_parallel(
        _fit_rank, nproc, (cfg, resume, log, overwrite), backend=backend, timeout=timeout, threads=cfg.threads
    )
