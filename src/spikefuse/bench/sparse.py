"""``spikefuse bench sparse``: the spike-sparse CPU products (:mod:`spikefuse.ops.spike_layers.cpu`) against torch's
dense ones, over spike rates.

Every product is a binary spike matrix ``S [M, K]`` (each element 1 with the given rate, drawn independently) times
a weight ``W [N, K]`` in float32: the forward ``S @ W.T`` and the weight gradient ``G.T @ S`` for a random output
gradient ``G [M, N]``, each timed in four ways, all of one product and rate in turn, round after round
(``round_robin``), medians over the rounds:

- dense: torch's product of the float tensors (``F.linear(S, W)``, ``G.t().mm(S)``: what ``nn.Linear`` runs);
- sparse: from the bits of ``S`` (as a neuron kernel writes them, or as ``SpikeLinear`` keeps them for backward),
  the forward from ``W.T`` made once (as a layer stepping over time keeps it);
- the transpose ``W.t().contiguous()`` that a row-major weight would cost at every call (``SpikeLinear`` with
  ``sparse`` keeps its weight input-major, so it makes none), the rate count ``SpikeLinear(sparse="auto")`` takes from
  the bits, and the pack of ``S`` into bits (paid by every ``SpikeLinear`` that keeps its input, dense or sparse,
  unless a neuron kernel made the bits).

Before timing, the bits are checked to hold ``S`` exactly and the sparse results to equal the dense ones up to
float32 rounding. The crossover of a product is the rate where the sparse time equals the dense one, interpolated
linearly between the measured rates next to it.
"""

from __future__ import annotations

import argparse

from .common import add_result_args, command_line, machine_info, markdown_table, result_tag, round_robin, write_csv

#: name -> (rows M, inputs K, outputs N, what it is)
PRODUCTS = {
    "shd": (8000, 700, 256, "the SHD input layer, T*B = 8000 rows"),
    "recurrent": (8000, 256, 256, "a recurrent layer's 256 -> 256 over T*B = 8000 rows"),
    "step": (32, 256, 256, "one recurrent step, batch 32"),
    "nmnist": (8000, 2 * 34 * 34, 512, "an N-MNIST input layer (2x34x34 -> 512), 8000 rows"),
}
RATES = (1, 2, 5, 10, 20, 50)
QUICK = {"rows": 64, "rates": (5, 50), "repeats": 2}
COLUMNS = [
    "product",
    "rows",
    "in",
    "out",
    "rate_pct",
    "dense_fwd_ms",
    "sparse_fwd_ms",
    "fwd_ratio",
    "dense_wgrad_ms",
    "sparse_wgrad_ms",
    "wgrad_ratio",
    "fwd_wgrad_ratio",
    "auto_ratio",
    "transpose_ms",
    "count_ms",
    "pack_ms",
]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sparse",
        help="spike-sparse CPU products (forward, weight gradient) vs torch's dense ones over spike rates",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--products",
        nargs="+",
        choices=list(PRODUCTS),
        default=list(PRODUCTS),
        help="the products timed: "
        + "; ".join(f"{k}: [{m} x {i}] @ [{i} x {o}]" for k, (m, i, o, _) in PRODUCTS.items()),
    )
    p.add_argument(
        "--rates", type=float, nargs="+", default=list(RATES), help="spike rates in percent (default: %(default)s)"
    )
    p.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=None,
        help="every product with each of these row counts instead of its own (a sweep of M)",
    )
    p.add_argument("--repeats", type=int, default=15, help="timed rounds per product and rate, median (default: 15)")
    p.add_argument("--threads", type=int, default=None, help="torch/numba threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="of the spikes, weights and gradients (default: 0)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"check the harness: {QUICK['rows']} rows per product, rates {QUICK['rates']} %%, "
        f"{QUICK['repeats']} rounds",
    )
    add_result_args(p)
    return p


def _measure(rows: int, k_in: int, n_out: int, rate: float, repeats: int, seed: int) -> dict[str, float]:
    """Median milliseconds of each way of one product at spike rate ``rate`` (a fraction), after the checks."""
    import torch
    import torch.nn.functional as F

    from ..ops.spike_layers import cpu as sparse_cpu
    from ..ops.bitpack import pack, unpack

    g = torch.Generator().manual_seed(seed)
    spikes = (torch.rand(rows, k_in, generator=g) < rate).float()
    weight = torch.randn(n_out, k_in, generator=g) / k_in**0.5
    weight_t = weight.t().contiguous()
    grad = torch.randn(rows, n_out, generator=g)
    bits, _ = pack(spikes, reuse=False)
    if not torch.equal(unpack(bits, spikes.shape), spikes):
        raise SystemExit(f"bench sparse: the bits of the [{rows} x {k_in}] spikes do not hold them")
    checks = {
        "forward": (sparse_cpu.linear(bits, rows, weight_t), F.linear(spikes, weight)),
        "weight gradient": (sparse_cpu.weight_grad(grad, bits, k_in), grad.t().mm(spikes)),
    }
    for what, (sparse, dense) in checks.items():
        if not torch.allclose(sparse, dense, rtol=1e-5, atol=1e-5 * float(dense.abs().max().clamp(min=1))):
            raise SystemExit(
                f"bench sparse: the sparse {what} of [{rows} x {k_in}] @ [{k_in} x {n_out}] at {rate:.0%} differs "
                f"from the dense one by {float((sparse - dense).abs().max()):.3g}"
            )
    cases = {
        "dense_fwd": lambda: F.linear(spikes, weight),
        "sparse_fwd": lambda: sparse_cpu.linear(bits, rows, weight_t),
        "dense_wgrad": lambda: grad.t().mm(spikes),
        "sparse_wgrad": lambda: sparse_cpu.weight_grad(grad, bits, k_in),
        "transpose": lambda: weight.t().contiguous(),
        "count": lambda: sparse_cpu.spike_count(bits, spikes.numel()),
        "pack": lambda: pack(spikes, reuse=False),
    }
    return {name: sec * 1e3 for name, sec in round_robin(cases, repeats, warmup=2).items()}


def _auto_ms(ms: dict[str, float], rows: int, rate: float) -> float:
    """The forward and weight gradient of ``SpikeLinear(sparse="auto")`` from the times measured: below
    ``spike_layers.cpu.CROSSOVER_ROWS`` rows the dense products; else the rate count, then each product in the way its
    crossover constant picks at ``rate`` (the layer keeps its weight input-major, so neither product copies it)."""
    from ..ops.spike_layers import cpu as sparse_cpu

    if rows < sparse_cpu.CROSSOVER_ROWS:
        return ms["dense_fwd"] + ms["dense_wgrad"]
    fwd = ms["sparse_fwd"] if rate < sparse_cpu.CROSSOVER_FORWARD else ms["dense_fwd"]
    wgrad = ms["sparse_wgrad"] if rate < sparse_cpu.CROSSOVER_WEIGHT_GRAD else ms["dense_wgrad"]
    return ms["count"] + fwd + wgrad


def _row(name: str, rows: int, k_in: int, n_out: int, rate: float, ms: dict[str, float]) -> dict:
    """A result row (:data:`COLUMNS`) from the medians ``ms`` of one product and rate."""
    dense = ms["dense_fwd"] + ms["dense_wgrad"]
    return {
        "product": name,
        "rows": rows,
        "in": k_in,
        "out": n_out,
        "rate_pct": rate,
        "dense_fwd_ms": round(ms["dense_fwd"], 4),
        "sparse_fwd_ms": round(ms["sparse_fwd"], 4),
        "fwd_ratio": round(ms["sparse_fwd"] / ms["dense_fwd"], 3),
        "dense_wgrad_ms": round(ms["dense_wgrad"], 4),
        "sparse_wgrad_ms": round(ms["sparse_wgrad"], 4),
        "wgrad_ratio": round(ms["sparse_wgrad"] / ms["dense_wgrad"], 3),
        "fwd_wgrad_ratio": round((ms["sparse_fwd"] + ms["sparse_wgrad"]) / dense, 3),
        "auto_ratio": round(_auto_ms(ms, rows, rate / 100) / dense, 3),
        "transpose_ms": round(ms["transpose"], 4),
        "count_ms": round(ms["count"], 4),
        "pack_ms": round(ms["pack"], 4),
    }


def crossover(rates: list[float], ratios: list[float]) -> float | str:
    """The rate where ``ratio`` (sparse / dense time) crosses 1, interpolated linearly between the two measured rates
    around the first crossing, or why there is none among the rates measured."""
    points = sorted(zip(rates, ratios))
    if points[0][1] >= 1:
        return "none: sparse is slower at every rate measured"
    for (r0, q0), (r1, q1) in zip(points, points[1:]):
        if q0 < 1 <= q1:
            return r0 + (1 - q0) * (r1 - r0) / (q1 - q0)
    return "above the rates measured"


def run(args) -> int:
    import sys
    from pathlib import Path

    from ..ops.spike_layers import cpu as sparse_cpu
    from ..threads import threads_while
    from .memory import TIMING_MMAP_THRESHOLD, _set_malloc_thresholds

    rates, repeats = sorted(args.rates), args.repeats
    if args.quick:
        rates, repeats = list(QUICK["rates"]), QUICK["repeats"]
    if repeats < 1:
        raise SystemExit(f"bench sparse: --repeats must be at least 1, got {repeats}")
    if not all(0 <= r <= 100 for r in rates):
        raise SystemExit(f"bench sparse: --rates are percentages from 0 to 100, got {rates}")
    # as the other benchmarks time: freed outputs stay on the heap for the next call instead of faulting in anew
    _set_malloc_thresholds(TIMING_MMAP_THRESHOLD)
    rows_out, table, crossings = [], [], []
    with threads_while(args.threads):
        info = machine_info()
        for name in args.products:
            own_rows, k_in, n_out, _ = PRODUCTS[name]
            for rows in args.rows or [own_rows]:
                if args.quick:
                    rows = min(rows, QUICK["rows"])
                fwd_ratios, wgrad_ratios = [], []
                for rate in rates:
                    print(f"bench sparse: {name}, {rows} rows, at {rate:g}%", file=sys.stderr)
                    ms = _measure(rows, k_in, n_out, rate / 100, repeats, args.seed)
                    row = _row(name, rows, k_in, n_out, rate, ms)
                    fwd_ratios.append(row["fwd_ratio"])
                    wgrad_ratios.append(row["wgrad_ratio"])
                    rows_out.append(row)
                    table.append(list(row.values()))
                crossings.append((name, rows, crossover(rates, fwd_ratios), crossover(rates, wgrad_ratios)))

    def pct(rate):
        return rate if isinstance(rate, str) else f"{rate:.1f}%"

    out = Path(args.out)
    stem = out / f"sparse_{result_tag(args)}"
    write_csv(stem.with_suffix(".csv"), rows_out)
    text = "\n\n".join(
        [
            "# Spike-sparse CPU products vs dense",
            f"Machine: {info}",
            f"Command: `{command_line()}`",
            "float32; milliseconds, medians of "
            f"{repeats} rounds (all ways of one product and rate in turn each round); ratios: sparse / dense time. "
            + "; ".join(f"{k}: [{m} x {i}] @ [{i} x {o}], {what}" for k, (m, i, o, what) in PRODUCTS.items()),
            markdown_table(COLUMNS, table),
            "Crossover of `SpikeLinear(sparse=True)` (sparse time = dense time, interpolated between the measured "
            "rates):\n\n"
            + "\n".join(
                f"- {name}, {rows} rows: forward {pct(f)}, weight gradient {pct(w)}" for name, rows, f, w in crossings
            ),
            "- dense: `F.linear(S, W)` and `G.t().mm(S)` on the float spikes; sparse: `spike_layers.cpu.linear` "
            "(W.T made once) and `spike_layers.cpu.weight_grad` from the bits of S; auto: what "
            "`SpikeLinear(sparse='auto')` runs, from these times, against dense forward + weight gradient: the dense "
            f"products below `spike_layers.cpu.CROSSOVER_ROWS` = {sparse_cpu.CROSSOVER_ROWS} rows, else count + each "
            f"product sparse below its crossover (`CROSSOVER_FORWARD` = {sparse_cpu.CROSSOVER_FORWARD:.0%}, "
            f"`CROSSOVER_WEIGHT_GRAD` = {sparse_cpu.CROSSOVER_WEIGHT_GRAD:.0%}); transpose: `W.t().contiguous()`, "
            "what a row-major weight would cost at every call (`SpikeLinear(sparse=...)` keeps it input-major); "
            "count: the rate "
            "`SpikeLinear(sparse='auto')` reads from the bits; pack: the bits from the float spikes (paid by any "
            "`SpikeLinear` keeping its input, unless a neuron kernel made them). The sparse results equal the dense "
            "ones to float32 rounding (checked).",
        ]
    )
    stem.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"wrote {stem}.md and {stem}.csv")
    return 0
