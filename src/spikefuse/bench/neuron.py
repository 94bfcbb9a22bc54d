"""``spikefuse bench neuron``: the temporal-fusion paper's Fig. 5 on this machine.

One LIF layer of N neurons over growing T, forward alone and forward+backward (``y.backward(g)`` into a leaf
input whose ``.grad`` each implementation frees at the end of its own step, with a fixed random upstream gradient,
so neither a loss nor an input copy is timed), every implementation run as its users run it and configured to the
paper's dynamics (decay 0.2, threshold 0.3, V_rest 0, sigmoid surrogate alpha 4), in one process, round-robin,
medians. Each implementation's spikes are compared with spikefuse's reference and the mismatch is reported.

Apart from the layer, our two kernels are timed alone (:func:`kernel_cases`), writing into reused buffers (no page
faults), against the floor: the bytes each must move (12 per neuron-step: forward reads x, writes spikes and h;
backward reads the upstream gradient and h, writes grad_x) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import functional
from ..ops import buffers
from ..ops.engine import NeuronInputs
from ..ops.engine import cpu as engine_cpu
from ..surrogate import Sigmoid
from ..neurons.lif import lif_params, paper_lif
from ..threads import set_threads
from . import peers
from .peers import ALPHA, DECAY, THRESHOLD
from .common import (
    EVICT_BYTES,
    add_result_args,
    cache_evictor,
    command_line,
    machine_info,
    markdown_table,
    result_tag,
    round_robin,
    timed,
    write_csv,
)


class _SigmoidSpike(torch.autograd.Function):
    """The spike function as a PyTorch user writes it: Heaviside forward, sigmoid surrogate backward."""

    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return (u >= 0).to(u.dtype)

    @staticmethod
    def backward(ctx, grad):
        (u,) = ctx.saved_tensors
        s = torch.sigmoid(ALPHA * u)
        return grad * ALPHA * s * (1 - s)


def eager_lif(x: torch.Tensor) -> torch.Tensor:
    """Eq. (1)-(2) as a serial loop; ``unbind`` rather than ``x[t]``, which makes backward quadratic in T."""
    v = torch.zeros_like(x[0])
    y = torch.zeros_like(x[0])
    out = []
    for x_t in x.unbind(0):
        v = DECAY * v * (1 - y) + x_t
        y = _SigmoidSpike.apply(v - THRESHOLD)
        out.append(y)
    return torch.stack(out)


OURS = "spikefuse cpu (fused)"


@dataclass
class Implementation:
    name: str
    run: Callable[[torch.Tensor], torch.Tensor]
    note: str = ""


def _spikefuse(backend: str) -> Callable:
    return lambda x: functional.lif(x, decay=DECAY, threshold=THRESHOLD, backend=backend)


def _spikefuse_per_step(x: torch.Tensor) -> torch.Tensor:
    """Our fused kernel called once per time step: the paper's "Serial (CUDA)" baseline."""
    state, out = None, []
    for x_t in x.unbind(0):
        y, state = functional.lif(
            x_t.unsqueeze(0), decay=DECAY, threshold=THRESHOLD, v_init=state, return_state=True, backend="cpu"
        )
        out.append(y)
    return torch.cat(out)


def _spikingjelly() -> Implementation:
    return Implementation(
        "SpikingJelly 2.0 LIFNode(step_mode='m')", peers.spikingjelly_lif(), "leaks as v - v/tau: 1-ulp differences"
    )


def _snntorch() -> Implementation:
    return Implementation(
        "snnTorch Leaky loop", peers.snntorch_leaky(), "fires on >, reset always detached (other gradients)"
    )


def _norse() -> Implementation:
    return Implementation(
        "Norse LIFBoxCell loop", peers.norse_lif_box(), "v + dt/tau*(x - v) and fires on >: rounding differs"
    )


def implementations(include_peers: bool, include_compile: bool) -> tuple[list[Implementation], list[str]]:
    impls = [Implementation("PyTorch eager (unbind loop)", eager_lif)]
    if include_compile:
        impls.append(Implementation("PyTorch torch.compile (unbind loop)", torch.compile(eager_lif, dynamic=False)))
    impls += [
        Implementation("spikefuse reference", _spikefuse("reference")),
        Implementation("spikefuse cpu kernel per step", _spikefuse_per_step),
        Implementation(OURS, _spikefuse("cpu")),
    ]
    missing = [] if include_compile else ["torch.compile: skipped (--no-compile; it compiles ~10 s per T)"]
    if include_peers:
        for module, build in (("spikingjelly", _spikingjelly), ("snntorch", _snntorch), ("norse", _norse)):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{module}: not installed (pip install -e .[bench])")
                continue
            try:
                impls.append(build())
            except Exception as err:  # a broken peer install is reported, not fatal
                missing.append(f"{module}: {type(err).__name__}: {err}")
    return impls, missing


def kernel_cases(x: torch.Tensor, g: torch.Tensor) -> tuple[dict[str, Callable[[], object]], dict[str, Callable]]:
    """``(cases, setups)`` for :func:`round_robin`: the copy that sets the floor and our kernels alone (those the LIF
    layer runs: the engine's, from the paper's LIF definition), each writing into buffers reused from call to call
    (:mod:`spikefuse.ops.buffers`), with the caches emptied (untimed) before every run.

    ``backward`` runs as the layer runs it when the graph is freed: grad_x written over the saved h (restored from a
    copy before each run, untimed). ``backward_separate_grad_x`` writes into a buffer of its own, as when the graph
    is kept; its stores must first read their cache lines (16 instead of 12 bytes of traffic per neuron-step).
    """
    t_steps, n = x.shape
    lif = paper_lif(THRESHOLD, 0.0, Sigmoid(ALPHA), False)
    params = lif_params(lif, torch.full((1,), DECAY))
    # As the layer calls them by default: the initial state and the unused final state's gradient shared by all neurons.
    v_init, zero_state, need = [torch.zeros(1)], [torch.zeros(1)], [False] * len(params)
    _, _, (h,) = engine_cpu.forward(lif, NeuronInputs(x, params, v_init), save=True)
    h_work = torch.empty_like(h)
    # The floor copies between the same kinds of memory our kernels use: from a torch tensor (like x) into a buffer
    # advised as huge pages (like the outputs from spikefuse.ops.buffers).
    src, dst = torch.rand(t_steps, n), buffers.fresh((t_steps, n), torch.float32)
    empty_caches = cache_evictor()

    def restore_h():
        h_work.copy_(h)
        empty_caches()

    def backward(saved, overwrite):
        # x is not read with the states saved (the layer does not keep it): g stands in, as in the layer's backward
        return engine_cpu.backward(
            lif, NeuronInputs(g, params, v_init), g, zero_state, need, saved=[saved], overwrite_saved=overwrite
        )

    cases = {
        "copy": lambda: dst.copy_(src),
        "forward": lambda: engine_cpu.forward(lif, NeuronInputs(x, params, v_init), save=True),
        "backward": lambda: backward(h_work, True),
        "backward_separate_grad_x": lambda: backward(h, False),
    }
    setups = {name: empty_caches for name in cases} | {"backward": restore_h}
    return cases, setups


def run(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    torch.manual_seed(0)
    impls, missing = implementations(not args.no_peers, not args.no_compile)
    rows, compile_seconds = [], {}
    for t_steps in args.T:
        x = torch.rand(t_steps, args.neurons) * 0.6 - 0.1
        g = torch.randn(t_steps, args.neurons)
        leaf = x.clone().requires_grad_(True)
        reference = functional.lif(x, decay=DECAY, threshold=THRESHOLD, backend="reference")
        for compiled in (i for i in impls if "torch.compile" in i.name):
            # A fresh compilation per T, as a user with one T sees it (and dynamo's recompile limit stays unreached).
            torch._dynamo.reset()
            compiled.run = torch.compile(eager_lif, dynamic=False)
            compile_seconds[t_steps] = timed(lambda: compiled.run(x.clone().requires_grad_(True)).backward(g))
        mismatch = {impl.name: (impl.run(x) != reference).float().mean().item() for impl in impls}

        def forward(impl):
            return lambda: impl.run(x)

        def forward_backward(impl):
            def step():
                impl.run(leaf).backward(g)
                # Each implementation frees its own gradient inside its own timing, as a training loop's
                # zero_grad does: freed at the start of the next step instead, a fresh 128 MB gradient's munmap
                # landed in the time of whichever implementation ran next (~10 ms at T=32).
                leaf.grad = None

            return step

        fwd = round_robin({i.name: forward(i) for i in impls}, args.repeats)
        both = round_robin({i.name: forward_backward(i) for i in impls}, args.repeats)
        cases, setups = kernel_cases(x, g)
        kernels = round_robin(cases, args.repeats, setups=setups)
        bandwidth = 8 * t_steps * args.neurons / kernels["copy"]  # dst.copy_(src): reads 4 B, writes 4 B
        del cases, setups  # their ~1 GB of buffers (at T=128) are not held through the next T's runs
        floor = 12 * t_steps * args.neurons / bandwidth  # 12 B per neuron-step, forward and backward alike
        for impl in impls:
            row = {
                "T": t_steps,
                "N": args.neurons,
                "implementation": impl.name,
                "forward_ms": round(1e3 * fwd[impl.name], 3),
                "forward_backward_ms": round(1e3 * both[impl.name], 3),
                "spike_mismatch": mismatch[impl.name],
                "copy_GBps": round(bandwidth / 1e9, 2),
                "floor_12B_ms": round(1e3 * floor, 3),
                "kernel_forward_ms": "",
                "kernel_backward_ms": "",
                "kernel_backward_separate_grad_x_ms": "",
                "note": impl.note,
            }
            if impl.name == OURS:
                row["kernel_forward_ms"] = round(1e3 * kernels["forward"], 3)
                row["kernel_backward_ms"] = round(1e3 * kernels["backward"], 3)
                row["kernel_backward_separate_grad_x_ms"] = round(1e3 * kernels["backward_separate_grad_x"], 3)
            rows.append(row)
        print(f"T={t_steps}: " + ", ".join(f"{i.name} {1e3 * both[i.name]:.1f} ms" for i in impls), flush=True)
    write_results(args, rows, compile_seconds, missing)


def write_results(args, rows, compile_seconds, missing) -> None:
    out = Path(args.out)
    stem = out / f"neuron_{args.tag}"
    write_csv(stem.with_suffix(".csv"), rows)
    by_t: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_t.setdefault(row["T"], {})[row["implementation"]] = row
    names = list(dict.fromkeys(row["implementation"] for row in rows))
    ours = OURS
    table = markdown_table(
        ["implementation"] + [f"T={t} fwd / fwd+bwd ms (x ours)" for t in by_t],
        [
            [name]
            + [
                f"{r[name]['forward_ms']:.1f} / {r[name]['forward_backward_ms']:.1f} "
                f"({r[name]['forward_backward_ms'] / r[ours]['forward_backward_ms']:.1f}x)"
                for r in by_t.values()
            ]
            for name in names
        ],
    )
    mismatch = markdown_table(
        ["implementation"] + [f"T={t}" for t in by_t],
        [[name] + [f"{r[name]['spike_mismatch']:.2e}" for r in by_t.values()] for name in names],
    )

    def vs_floor(r, column):
        return f"{r[column]:.1f} ({r['floor_12B_ms'] / r[column]:.2f})"

    kernel_table = markdown_table(
        [
            "T",
            "floor ms (12 B / copy bandwidth)",
            "forward kernel ms (floor / kernel)",
            "backward kernel ms (floor / kernel)",
            "backward, separate grad_x ms (floor / kernel)",
            "layer fwd+bwd ms (2 x floor / layer)",
        ],
        [
            [
                t,
                f"{r[ours]['floor_12B_ms']:.1f}",
                vs_floor(r[ours], "kernel_forward_ms"),
                vs_floor(r[ours], "kernel_backward_ms"),
                vs_floor(r[ours], "kernel_backward_separate_grad_x_ms"),
                f"{r[ours]['forward_backward_ms']:.1f} "
                f"({2 * r[ours]['floor_12B_ms'] / r[ours]['forward_backward_ms']:.2f})",
            ]
            for t, r in by_t.items()
        ],
    )
    text = [
        f"# One LIF layer, N = {args.neurons:,}, fp32 (Fig. 5 of the temporal-fusion paper, on this CPU)",
        "",
        f"Machine: {machine_info()}",
        f"Command: `{command_line()}`",
        "",
        f"Medians of {args.repeats} round-robin runs after one warm-up; forward+backward is `y.backward(g)` into a "
        "leaf input whose `.grad` is freed at the end of each run, in that run's time (no input copy timed).",
        "",
        table,
        "",
        "torch.compile time of the first call (compiles again for every T; inductor's on-disk cache from earlier "
        "runs on the same machine shortens it): "
        + (", ".join(f"T={t}: {s:.1f} s" for t, s in compile_seconds.items()) or "not measured"),
        "",
        "Fraction of spikes that differ from spikefuse's reference (Eq. 1-2 exactly):",
        "",
        mismatch,
        "",
        "Floor: 12 bytes per neuron-step over the copy bandwidth measured in the same run: "
        + ", ".join(f"T={t}: {r[ours]['floor_12B_ms']:.1f} ms ({r[ours]['copy_GBps']} GB/s)" for t, r in by_t.items()),
        "",
        "Our kernels alone, writing into buffers of their own reused from call to call, each run (and the copy) "
        f"after reading {EVICT_BYTES >> 20} MiB to empty the caches, as a fraction of the floor (1.0 = at the copy "
        "bandwidth). The backward writes grad_x over the saved h, as the layer does when the graph is freed (h "
        "restored before each run, untimed); 'separate grad_x' is the backward when the graph is kept, whose stores "
        "first read their cache lines (16 instead of 12 bytes of traffic per neuron-step):",
        "",
        kernel_table,
    ]
    if missing:
        text += ["", "Not measured: " + "; ".join(missing)]
    stem.with_suffix(".md").write_text("\n".join(text) + "\n")
    plot(stem.with_suffix(".png"), by_t, names, args.neurons)
    print(f"wrote {stem}.md/.csv/.png")


def plot(path: Path, by_t, names, neurons: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ts = list(by_t)
    for name in names:
        ax.plot(ts, [by_t[t][name]["forward_backward_ms"] for t in ts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("time steps T")
    ax.set_ylabel("forward + backward (ms)")
    ax.set_title(f"One LIF layer, {neurons:,} neurons, fp32, CPU")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("neuron", help="one LIF layer vs the peers over T (the paper's Fig. 5)")
    p.add_argument("--neurons", type=int, default=1_000_000, help="neurons of the layer (default: %(default)s)")
    p.add_argument(
        "--T", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128], help="time steps (default: %(default)s)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case, median (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch/numba threads (default: %(default)s)")
    p.add_argument("--no-peers", action="store_true", help="skip SpikingJelly, snnTorch and Norse")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--quick", action="store_true", help="tiny sizes and no torch.compile, to check the harness")
    add_result_args(p)
    p.set_defaults(func=_run_cli)


def _run_cli(args) -> None:
    if args.quick:
        args.neurons, args.T, args.repeats, args.no_compile = min(args.neurons, 20_000), [4, 8], 2, True
    args.tag = result_tag(args)
    if args.neurons <= 0 or min(args.T) <= 0:
        raise SystemExit("--neurons and --T must be positive")
    run(args)
