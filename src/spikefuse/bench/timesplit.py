"""``spikefuse bench timesplit``: the temporal-fusion paper's multi-device time split (Sec. 3.3, Eq. 4-5, Fig. 6)
on this machine, one rank per "device".

One LIF layer of N neurons, forward+backward (``y.backward(g)`` with a fixed random upstream gradient), over growing
T: on one rank (``T_s``, the plain fused layer over all T steps) and time-split over k ranks with
:func:`spikefuse.distributed.timesplit_lif` (each rank runs T/k steps and passes the membrane state on, pipelined
over neuron chunks; the time of a run is the slowest rank's). ``T_c`` is the median one-way transfer time of one
``[N]`` fp32 state between two ranks (half a ping-pong). The measured speedup ``T_s / T_m`` is reported beside
Eq. (5)'s prediction ``mu = k*T_s / (k(k-1)*T_c + T_s)`` and the predicted best rank count ``sqrt(T_s/T_c)``.

On a CPU a rank is a process with ``--threads`` threads (default 1: one core per "device"), the ranks talk over
gloo (shared-memory TCP), so ``T_c`` is small and the ranks compete for memory bandwidth, unlike the paper's GPUs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import functional
from ..threads import set_threads
from .common import add_result_args, machine_info, markdown_table, result_tag, write_csv

DECAY, THRESHOLD = 0.2, 0.3  # the paper's Sec. 5.1 settings (V_rest 0, sigmoid surrogate alpha 4)
_DEFAULT_T = [8, 16, 32, 64, 128]

__all__ = ["add_parser", "run", "eq5_speedup", "eq5_best_k"]


def eq5_speedup(k: int, t_single: float, t_comm: float) -> float:
    """Eq. (5): ``mu = k*T_s / (k(k-1)*T_c + T_s)``."""
    return k * t_single / (k * (k - 1) * t_comm + t_single)


def eq5_best_k(t_single: float, t_comm: float) -> float:
    """The maximiser of Eq. (5) over a continuous k: ``sqrt(T_s / T_c)``."""
    return math.sqrt(t_single / t_comm) if t_comm > 0 else math.inf


def _median_seconds(fn, repeats: int, warmup: int, group=None) -> float:
    """Median over ``repeats`` of the slowest rank's time of ``fn`` (all ranks of ``group`` start together)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if group is not False:
            dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if group is not False:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        samples.append(elapsed.item())
    return statistics.median(samples)


def _transfer_seconds(neurons: int, repeats: int) -> float:
    """Median one-way time of one [N] fp32 state from rank 0 to rank 1 (half the round trip)."""
    buf = torch.rand(neurons)
    rank = dist.get_rank()
    samples = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i >= 2:  # two warm-up round trips
            samples.append((time.perf_counter() - start) / 2)
    out = torch.tensor([statistics.median(samples) if samples else 0.0], dtype=torch.float64)
    dist.broadcast(out, 0)
    return out.item()


def _worker(rank: int, world: int, cfg: dict) -> list[dict] | None:
    from ..distributed import time_partition, timesplit_lif

    set_threads(cfg["threads"])
    n, backend, chunks = cfg["neurons"], cfg["backend"], cfg["chunks"]
    groups = {k: dist.new_group(list(range(k))) for k in cfg["ranks"] if k > 1}  # collective: every rank
    t_comm = _transfer_seconds(n, cfg["comm_repeats"]) if world > 1 else 0.0
    rows = []
    for t_steps in cfg["T"]:
        gen = torch.Generator().manual_seed(t_steps)
        # one rank: the whole sequence through the plain fused layer; the other ranks wait at the barrier
        t_single = None
        if rank == 0:
            x = torch.rand(t_steps, n, generator=gen) * 0.6 - 0.1
            g = torch.randn(t_steps, n, generator=gen)

            def single():
                functional.lif(
                    x.clone().requires_grad_(True), decay=DECAY, threshold=THRESHOLD, backend=backend
                ).backward(g)

            t_single = _median_seconds(single, cfg["repeats"], cfg["warmup"], group=False)
            del x, g
        dist.barrier()
        box = torch.tensor([t_single or 0.0], dtype=torch.float64)
        dist.broadcast(box, 0)
        t_single = box.item()
        for k in cfg["ranks"]:
            if k == 1:
                t_split = t_single
            else:
                t_split = None
                if rank < k:
                    start, stop = time_partition(t_steps, k)[rank]
                    xl = torch.rand(stop - start, n, generator=gen) * 0.6 - 0.1
                    gl = torch.randn(stop - start, n, generator=gen)

                    def split():
                        x_local = xl.clone().requires_grad_(True)
                        spikes = timesplit_lif(
                            x_local, decay=DECAY, threshold=THRESHOLD, backend=backend, group=groups[k], chunks=chunks
                        )
                        spikes.backward(gl)

                    t_split = _median_seconds(split, cfg["repeats"], cfg["warmup"], group=groups[k])
                    del xl, gl
                dist.barrier()
            if rank == 0:
                rows.append(
                    {
                        "T": t_steps,
                        "N": n,
                        "ranks": k,
                        "chunks": chunks if k > 1 else 1,
                        "backend": backend,
                        "threads_per_rank": cfg["threads"],
                        "t_single_ms": round(1e3 * t_single, 4),
                        "t_split_ms": round(1e3 * t_split, 4),
                        "t_comm_ms": round(1e3 * t_comm, 4),
                        "speedup_measured": round(t_single / t_split, 4),
                        "speedup_eq5": round(eq5_speedup(k, t_single, t_comm), 4),
                        "best_k_eq5": round(eq5_best_k(t_single, t_comm), 2),
                    }
                )
        if rank == 0:
            done = ", ".join(f"k={r['ranks']}: {r['t_split_ms']:.1f} ms" for r in rows if r["T"] == t_steps)
            print(f"T={t_steps}: {done} (T_c {1e3 * t_comm:.3f} ms)", flush=True)
    return rows if rank == 0 else None


def _command(args) -> str:
    """The exact command that reproduces this run (every option spelled out)."""
    parts = [
        "spikefuse bench timesplit",
        f"--neurons {args.neurons}",
        "--T " + " ".join(map(str, args.T)),
        "--ranks " + " ".join(map(str, args.ranks)),
        f"--chunks {args.chunks}",
        f"--repeats {args.repeats}",
        f"--threads {args.threads}",
        f"--backend {args.backend}",
        f"--out {args.out}",
        f"--tag {args.tag}",
    ]
    return " ".join(parts)


def config(args: argparse.Namespace) -> dict:
    """What every rank needs to know (picklable)."""
    return dict(
        neurons=args.neurons,
        T=list(args.T),
        ranks=list(args.ranks),
        chunks=args.chunks,
        backend=args.backend,
        threads=args.threads,
        repeats=args.repeats,
        warmup=1,
        comm_repeats=max(5, 5 * args.repeats),
    )


def prepare(args: argparse.Namespace) -> argparse.Namespace:
    """Apply ``--quick`` and check the options (in place; returns ``args``)."""
    if args.quick:  # tiny sizes; explicit --neurons/--T below the quick ones are kept
        args.neurons, args.repeats = min(args.neurons, 20_000), min(args.repeats, 2)
        if list(args.T) == _DEFAULT_T:
            args.T = [8, 16]
    args.tag = result_tag(args)
    if args.neurons <= 0 or min(args.T) <= 0 or min(args.ranks) < 1 or args.chunks < 1:
        raise SystemExit("--neurons, --T, --ranks and --chunks must be positive")
    if max(args.ranks) > min(args.T):
        raise SystemExit(f"--ranks up to {max(args.ranks)} needs every T >= {max(args.ranks)}")
    args.ranks = sorted(set(args.ranks) | {1})
    return args


def run(args: argparse.Namespace) -> list[dict]:
    """Run the benchmark described by ``args`` (see :func:`add_parser`) and write the result files."""
    from ..distributed.ddp import launch

    cfg = config(prepare(args))
    set_threads(args.threads)  # for the machine-info line; the work runs in the spawned ranks
    started = time.monotonic()
    results = launch(
        _worker, max(args.ranks), cfg, backend="gloo", threads=args.threads, pg_timeout=timedelta(minutes=30)
    )
    rows = results[0]
    write_results(args, rows, time.monotonic() - started)
    return rows


def write_results(args, rows: list[dict], seconds: float) -> None:
    out = Path(args.out)
    stem = out / f"timesplit_{args.tag}"
    write_csv(stem.with_suffix(".csv"), rows)
    table = markdown_table(
        ["T", "ranks k", "T_s (ms)", "T_m (ms)", "T_c (ms)", "speedup measured", "Eq. 5 mu", "Eq. 5 best k"],
        [
            [
                r["T"],
                r["ranks"],
                f"{r['t_single_ms']:.2f}",
                f"{r['t_split_ms']:.2f}",
                f"{r['t_comm_ms']:.4f}",
                f"{r['speedup_measured']:.2f}",
                f"{r['speedup_eq5']:.2f}",
                f"{r['best_k_eq5']:.1f}",
            ]
            for r in rows
        ],
    )
    text = [
        f"# Time split of one LIF layer over ranks, N = {args.neurons:,}, fp32 (Sec. 3.3 / Fig. 6 of the "
        "temporal-fusion paper, on this CPU)",
        "",
        f"Machine: {machine_info()}; {args.threads} thread(s) per rank, gloo",
        f"Command: `{_command(args)}`",
        "",
        f"Forward+backward (`y.backward(g)`), backend `{args.backend}`, medians of {args.repeats} runs after one "
        f"warm-up; a time-split run takes as long as its slowest rank. Neuron chunks of the pipeline: {args.chunks}. "
        f"T_c: median one-way send/recv of one [N] fp32 state between two ranks. Wall time {seconds:.0f} s.",
        "",
        table,
        "",
        "Eq. (5) counts one transfer per rank boundary; forward+backward makes two (the state forward, its gradient "
        "backward), and the chunked pipeline hides part of both.",
    ]
    stem.with_suffix(".md").write_text("\n".join(text) + "\n")
    plot(stem.with_suffix(".png"), rows, args.neurons)
    print(f"wrote {stem}.md/.csv/.png")


def plot(path: Path, rows: list[dict], neurons: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for k in sorted({r["ranks"] for r in rows}):
        sel = [r for r in rows if r["ranks"] == k]
        ts = [r["T"] for r in sel]
        left.plot(ts, [r["t_split_ms"] for r in sel], marker="o", label=f"{k} rank{'s' if k > 1 else ''}")
        if k > 1:
            line = right.plot(ts, [r["speedup_measured"] for r in sel], marker="o", label=f"k={k} measured")[0]
            right.plot(ts, [r["speedup_eq5"] for r in sel], ls="--", color=line.get_color(), label=f"k={k} Eq. (5)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("time steps T")
    left.set_ylabel("forward + backward (ms)")
    left.set_title(f"One LIF layer, {neurons:,} neurons")
    right.set_xscale("log", base=2)
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xlabel("time steps T")
    right.set_ylabel("speedup over one rank")
    right.set_title("Measured vs Eq. (5)")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("timesplit", help="one LIF layer time-split over ranks vs Eq. (5) (the paper's Fig. 6)")
    p.add_argument("--neurons", type=int, default=1_000_000, help="neurons of the layer (default: %(default)s)")
    p.add_argument("--T", type=int, nargs="+", default=list(_DEFAULT_T), help="time steps (default: %(default)s)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts k to time (1 is always timed)")
    p.add_argument("--chunks", type=int, default=4, help="neuron chunks of the pipeline")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case, median (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch/numba threads per rank (one core = one device)")
    p.add_argument("--backend", default="auto", help="neuron backend: auto, cpu, reference")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the harness")
    add_result_args(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> None:
    """``python -m spikefuse.bench.timesplit ...`` without the CLI."""
    parser = argparse.ArgumentParser(prog="spikefuse bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["timesplit", *(argv if argv is not None else __import__("sys").argv[1:])])
    args.func(args)


if __name__ == "__main__":
    main()
