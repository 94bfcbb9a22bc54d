"""Data-parallel training helpers: start ranks (spawned locally or by ``torchrun``), wrap models in DDP.

The neurons work under ``torch.nn.parallel.DistributedDataParallel`` unchanged: they are custom ops / autograd
Functions whose learnable decay is an ordinary ``nn.Parameter`` (its gradient is averaged by DDP's hooks like any
other) and they hold no buffers (a stateful layer's state is a plain attribute, per rank). BatchNorm buffers are
broadcast from rank 0 by DDP as usual; for statistics over the global batch use
:class:`spikefuse.distributed.TimeSplitBatchNorm` with the data-parallel group (it runs on CPU/gloo, where
``torch.nn.SyncBatchNorm`` refuses CPU tensors) -- :func:`convert_sync_batchnorm` swaps it in.

Local, one machine::

    def train(args):                      # runs on every rank
        model = wrap_model(build(args))   # DDP when world_size() > 1
        ...
    run_data_parallel(train, nproc=4, args=args)

Several machines (the same command on each node, ``--node-rank`` 0..nnodes-1)::

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank $NODE_RANK --master-addr $HOST0 --master-port 29500 \\
        --no-python spikefuse train ...

:func:`run_data_parallel` sees torchrun's environment (``RANK``/``WORLD_SIZE``) and joins that process group in
each worker instead of spawning (``--nproc`` is then ignored). gloo on CPUs picks the network interface from the
host name; set ``GLOO_SOCKET_IFNAME`` (NCCL: ``NCCL_SOCKET_IFNAME``) when that resolves to the wrong one.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

__all__ = [
    "DEFAULT_PG_TIMEOUT",
    "free_port",
    "default_backend",
    "init_from_env",
    "launch",
    "run_data_parallel",
    "wrap_model",
    "convert_sync_batchnorm",
    "rank",
    "world_size",
    "local_rank",
    "is_main",
    "device",
    "shard",
    "barrier",
]

#: Process-group timeout of :func:`launch` and :func:`init_from_env`: a collective or a send/recv that waits
#: longer (a peer died or raised and left the group) fails with a gloo/NCCL timeout error instead of hanging.
DEFAULT_PG_TIMEOUT = timedelta(minutes=5)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and ask the OS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """``nccl`` when CUDA GPUs are present, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _as_timedelta(t) -> timedelta:
    return t if isinstance(t, timedelta) else timedelta(seconds=float(t))


def init_from_env(backend: str | None = None, timeout=DEFAULT_PG_TIMEOUT) -> tuple[int, int]:
    """Join the process group described by torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``); selects the GPU ``LOCAL_RANK`` for NCCL. Returns ``(rank, world_size)``."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env needs torchrun's environment; missing {', '.join(missing)}")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=_as_timedelta(timeout))
    return dist.get_rank(), dist.get_world_size()


def _end_with(parent: int) -> None:
    """End this rank when the process that launched it ends, however it ends (``kill -9`` of ``spikefuse train
    --nproc N`` included: its ranks would train on and write the run). A rank's parent is multiprocessing's fork
    server, which outlives the launcher while any rank lives, so a daemon thread watches the launcher itself."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # alive, under another user (a pid reused): keep watching
                pass

    threading.Thread(target=watch, name="spikefuse-end-with-launcher", daemon=True).start()


def _worker(local_rank, nproc, fn, args, backend, pg_timeout, threads, addr, port, results, launcher):
    _end_with(launcher)
    os.environ.update(
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nproc),
    )
    if threads:
        torch.set_num_threads(int(threads))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=local_rank, world_size=nproc, timeout=pg_timeout
    )
    # No destroy_process_group on failure: the process exits, its sockets close, and the peers' pending
    # operations fail ("connection closed") instead of waiting for the process-group timeout.
    out = fn(local_rank, nproc, *args)
    results.put(pickle.dumps((local_rank, out)))
    dist.barrier()  # keep the group alive until every rank has finished its last collective
    dist.destroy_process_group()


def _drain(queue, results: dict) -> None:
    while not queue.empty():
        r, out = pickle.loads(queue.get())
        results[r] = out


def launch(
    fn: Callable,
    nproc: int,
    *args,
    backend: str | None = None,
    timeout: float | None = None,
    pg_timeout=DEFAULT_PG_TIMEOUT,
    threads: int | None = None,
    master_addr: str = "127.0.0.1",
    start_method: str | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``nproc`` spawned processes that form a process group.

    Each process joins the group (``backend``: gloo on CPU, NCCL with one GPU per rank; a free local port) with
    ``pg_timeout`` as the process-group timeout, so a collective stuck on a dead or failed peer raises instead of
    hanging. ``fn`` and ``args`` must be picklable (a module-level function); its return value is pickled back.
    ``threads`` sets ``torch.set_num_threads`` per process (default: the cores divided among the ranks).

    Returns the list of return values by rank. When a rank raises, the others are terminated and a
    ``torch.multiprocessing.ProcessRaisedException`` carrying the rank's traceback is raised; when ``timeout``
    seconds pass first, every rank is terminated and :class:`TimeoutError` is raised.

    ``start_method``: ``"forkserver"`` (default on Linux: one server process imports torch once and forks every
    rank from it, for this and every later launch, so a rank starts in a fraction of a second instead of paying
    torch's import) or ``"spawn"`` (a fresh interpreter per rank).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    backend = backend or default_backend()
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // nproc)
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method == "forkserver":
        # Takes effect when this process starts its fork server (the first forkserver launch); later ones reuse it.
        mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", "spikefuse"])
    port = free_port(master_addr)
    queue = mp.get_context(start_method).SimpleQueue()
    context = mp.start_processes(
        _worker,
        args=(nproc, fn, args, backend, _as_timedelta(pg_timeout), threads, master_addr, port, queue, os.getpid()),
        nprocs=nproc,
        join=False,
        start_method=start_method,
    )
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    results: dict[int, Any] = {}
    try:
        while True:
            _drain(queue, results)
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            if context.join(timeout=wait):  # raises ProcessRaisedException/ProcessExitedException on failure
                break
            if deadline is not None and time.monotonic() >= deadline:
                alive = [i for i, p in enumerate(context.processes) if p.is_alive()]
                raise TimeoutError(
                    f"launch({getattr(fn, '__name__', fn)!r}, nproc={nproc}): ranks {alive} still running after "
                    f"{timeout} s; terminated them"
                )
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
        for p in context.processes:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    _drain(queue, results)
    return [results.get(r) for r in range(nproc)]


def _call_train(rank_, world, train_fn, args):
    return train_fn(args)


def run_data_parallel(
    train_fn: Callable,
    nproc: int,
    args: Any = None,
    *,
    backend: str | None = None,
    timeout: float | None = None,
    pg_timeout=DEFAULT_PG_TIMEOUT,
    threads: int | None = None,
):
    """Run ``train_fn(args)`` data-parallel on ``nproc`` local processes and return rank 0's result.

    - Started by ``torchrun`` (``RANK``/``WORLD_SIZE`` set): joins that group in this process and runs
      ``train_fn(args)`` here (``nproc`` is ignored: torchrun's ``--nproc-per-node`` and ``--nnodes`` decide).
    - ``nproc == 1``: runs ``train_fn(args)`` in this process without a process group.
    - Otherwise spawns ``nproc`` ranks with :func:`launch`.

    Inside ``train_fn`` use :func:`wrap_model`, :func:`shard` (or a ``DistributedSampler``), :func:`is_main` (to
    log and save once) and :func:`device`. ``train_fn`` must be a module-level function and ``args`` picklable.
    The per-rank batch is the global batch divided by the world size (DDP averages the gradients).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        init_from_env(backend, pg_timeout)
        try:
            return train_fn(args)
        finally:
            dist.destroy_process_group()
    if nproc <= 1:
        return train_fn(args)
    return launch(
        _call_train, nproc, train_fn, args, backend=backend, timeout=timeout, pg_timeout=pg_timeout, threads=threads
    )[0]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group=None) -> int:
    """This process's rank in ``group`` (default: the world); 0 without a process group."""
    return dist.get_rank(group) if _initialized() else 0


def world_size(group=None) -> int:
    """Size of ``group`` (default: the world); 1 without a process group."""
    return dist.get_world_size(group) if _initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0)) if _initialized() else 0


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if _initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def barrier() -> None:
    if _initialized():
        dist.barrier()


def shard(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """This rank's contiguous share of ``x`` along ``dim`` (the global batch split like ``tensor_split`` over the
    ranks of ``group``, default the world). The batch of ``[T, B, ...]`` tensors is ``dim=1``."""
    return torch.tensor_split(x, world_size(group), dim=dim)[rank(group)]


def convert_sync_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """Swap every ``SeqToBatch(nn.BatchNormNd)``/``nn.BatchNormNd`` for a BatchNorm synchronized over ``group``
    (default: the world) that runs on CPU/gloo as well as on GPUs."""
    from .timesplit import convert_batchnorm

    return convert_batchnorm(module, group)


def wrap_model(model: nn.Module, group=None, **ddp_kwargs) -> nn.Module:
    """``DistributedDataParallel(model, process_group=group)`` on this rank's device when ``group`` (default: the
    world) has more than one rank, else ``model`` unchanged. A subgroup gives data parallelism along one axis of
    a grid, e.g. data x time with time-split layers over the other axis."""
    if world_size(group) <= 1:
        return model
    if group is not None:
        ddp_kwargs.setdefault("process_group", group)
    dev = device()
    model = model.to(dev)
    if dev.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [dev.index])
    return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
