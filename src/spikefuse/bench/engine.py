"""``spikefuse bench engine``: the neuron engine's generated kernels against the peers' own neurons and the
bandwidth floor (their cold start: ``spikefuse bench compile``).

One layer of N neurons, fp32, forward+backward (``y.backward(g)`` into a leaf input) at each T, medians of
round-robin runs in one process: spikefuse's CubaLIF (generated CPU kernels) against a loop over snnTorch's
``Synaptic`` (same dynamics, checked to give the same spikes), and spikefuse's definition of Norse's LSNN against
Norse's ``LSNN`` module (likewise); spikefuse's ALIF (Bellec et al.), which has no peer of the same dynamics, against
the floor alone; and the paper's LIF as :func:`spikefuse.lif` runs it (its definition in
:data:`spikefuse.neurons.LIF_MODELS` on the engine) in both memory modes, checked to give the same spikes. The floor
is the bytes a recomputing fused layer must move (forward: read x, write spikes; backward: read x and the upstream
gradient, write grad_x; 20 per neuron-step) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..threads import set_threads
from . import ours, peers
from .common import (
    EVICT_BYTES,
    add_result_args,
    cache_evictor,
    command_line,
    machine_info,
    markdown_table,
    result_tag,
    round_robin,
    write_csv,
)


def _layer_cases():
    """name -> (run(x) -> spikes, the reference name whose spikes it must equal)."""
    import spikefuse
    import spikefuse.functional
    from spikefuse.neurons import ALIF_MODEL, CUBA_LIF

    alpha, beta = 0.8, 0.9
    cases = {
        "spikefuse CubaLIF (cpu)": (
            # snnTorch Synaptic's surrogate, ATan(2)
            lambda x: spikefuse.neuron(
                x, CUBA_LIF, alpha=alpha, beta=beta, surrogate="atan", detach_reset=True, memory="recompute"
            ),
            "cuba",
        ),
    }
    try:
        cases["snnTorch Synaptic (loop)"] = (peers.snntorch_synaptic(alpha, beta), "cuba")
    except ImportError:
        pass
    try:  # Norse's default parameters
        cases["spikefuse Norse-LSNN definition (cpu)"] = (ours.norse_lsnn(), "lsnn")
    except ImportError:
        pass
    cases["spikefuse ALIF (cpu)"] = (
        lambda x: spikefuse.neuron(x, ALIF_MODEL, decay=0.9, rho=0.95, detach_reset=True, memory="recompute"),
        "alif",
    )
    # The paper's LIF as spikefuse.lif runs it, in both memory modes ("potential" is the default)
    for memory in ("potential", "recompute"):
        cases[f"spikefuse.lif (engine definition, cpu, {memory})"] = (
            lambda x, memory=memory: spikefuse.functional.lif(x, decay=0.8, threshold=1.0, memory=memory),
            "lif",
        )
    try:
        import norse.torch as norse

        cases["Norse LSNN"] = (lambda x: norse.LSNN()(x)[0], "lsnn")
    except ImportError:
        pass
    return cases


def run(args) -> None:
    set_threads(args.threads)
    rows = []
    for t_steps in args.T:
        g = torch.Generator().manual_seed(t_steps)
        x = {
            "cuba": torch.rand(t_steps, args.neurons, generator=g) * 0.6,
            "lsnn": torch.rand(t_steps, args.neurons, generator=g) * 3.0,
            "alif": torch.rand(t_steps, args.neurons, generator=g) * 0.6,
            "lif": torch.rand(t_steps, args.neurons, generator=g) * 0.6,
        }
        upstream = torch.rand(t_steps, args.neurons, generator=g)
        cases = _layer_cases()
        spikes = {name: fn(x[ref]) for name, (fn, ref) in cases.items()}
        first = {}
        for name, (_, ref) in cases.items():
            first.setdefault(ref, name)
        mismatch = {
            name: float((spikes[name].float() != spikes[first[ref]].float()).float().mean())
            for name, (_, ref) in cases.items()
        }
        leaves = {name: x[ref].clone().requires_grad_() for name, (_, ref) in cases.items()}

        def step(name):
            fn = cases[name][0]
            leaf = leaves[name]

            def go():
                fn(leaf).backward(upstream)
                leaf.grad = None

            return go

        # The copy runs on its own first, each time from cold caches: timed between the cases, right after a peer's
        # long run, it measured 18.6 GB/s against 26 GB/s, and in a loop of its own it ran in the last-level cache.
        buf = torch.empty_like(upstream)
        copy = {"copy": lambda: buf.copy_(upstream)}
        copy_s = round_robin(copy, 2 * args.repeats + 1, setups={"copy": cache_evictor()})["copy"]
        copy_bw = 2 * upstream.nbytes / copy_s
        medians = round_robin({name: step(name) for name in cases}, args.repeats)
        floor_s = 20 * t_steps * args.neurons / copy_bw
        for name, (_, ref) in cases.items():
            rows.append(
                {
                    "T": t_steps,
                    "neurons": args.neurons,
                    "implementation": name,
                    "model": ref,
                    "fwd_bwd_ms": round(medians[name] * 1e3, 2),
                    "floor_20B_ms": round(floor_s * 1e3, 2),
                    "floor_fraction": round(floor_s / medians[name], 3),
                    "spike_mismatch": mismatch[name],
                    "copy_GBps": round(copy_bw / 1e9, 2),
                }
            )
    for r in rows:  # speed-up of ours over the peer of the same model
        peer = next(
            (
                q
                for q in rows
                if q["T"] == r["T"] and q["model"] == r["model"] and not q["implementation"].startswith("spikefuse")
            ),
            None,
        )
        ours = next(
            q
            for q in rows
            if q["T"] == r["T"] and q["model"] == r["model"] and q["implementation"].startswith("spikefuse")
        )
        r["ours_speedup"] = round(r["fwd_bwd_ms"] / ours["fwd_bwd_ms"], 2) if peer else ""
    out = Path(args.out)
    stem = out / f"engine_{args.tag}"
    write_csv(stem.with_suffix(".csv"), rows)
    table = markdown_table(
        [
            "T",
            "implementation",
            "fwd+bwd ms",
            "floor fraction (20 B/neuron-step)",
            "spikefuse speed-up",
            "spikes differing",
        ],
        [
            [
                r["T"],
                r["implementation"],
                r["fwd_bwd_ms"],
                r["floor_fraction"],
                r["ours_speedup"],
                f"{r['spike_mismatch']:.1e}",
            ]
            for r in rows
        ],
    )
    text = [
        f"# Neuron engine: one layer of {args.neurons:,} neurons, fp32, forward+backward",
        "",
        f"Machine: {machine_info()}",
        f"Command: `{command_line()}`",
        "",
        f"Medians of {args.repeats} round-robin runs after one warm-up. Floor: 20 bytes per neuron-step over the "
        f"copy bandwidth of the same run (the median of copies of the upstream gradient timed on their own before "
        f"the layers, each after reading {EVICT_BYTES >> 20} MiB to empty the caches). 'spikefuse speed-up': the "
        "implementation's time over spikefuse's for the same model; 'spikes differing': fraction of spikes that "
        "differ from the first implementation of the model.",
        "",
        table,
    ]
    stem.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    print(f"wrote {stem}.md/.csv")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("engine", help="the neuron engine's CubaLIF / LSNN kernels vs snnTorch and Norse")
    p.add_argument("--neurons", type=int, default=1_000_000, help="neurons of the layer (default: %(default)s)")
    p.add_argument("--T", type=int, nargs="+", default=[32], help="time steps (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case, median (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch/numba threads (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the harness")
    add_result_args(p)
    p.set_defaults(func=_run_cli)


def _run_cli(args) -> None:
    if args.quick:
        args.neurons, args.T, args.repeats = min(args.neurons, 5000), [4], 2
    args.tag = result_tag(args)
    if args.neurons <= 0 or min(args.T) <= 0:
        raise SystemExit("--neurons and --T must be positive")
    run(args)
