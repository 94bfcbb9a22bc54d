"""The recurrent layer's ``sparse_grad`` (:func:`spikefuse.recurrent`) at the SHD size: 700 inputs at 5% spikes through
a ``SpikeLinear(700, 256, sparse=True)``, a recurrent layer of 256 LIF neurons (snnTorch's RLeaky LIF: decay 0.95,
threshold 1, subtract) with ``sparse=True`` and a ``Rectangle`` surrogate, batch 32, T=250; forward+backward into
every weight's gradient. ``sparse_grad`` False (today's backward), True and ``"auto"`` (its share of nonzero gradients
recorded by a call before), and the matrix-product floor of ``spikefuse bench recurrent`` (the network's products
alone, dense), in turn each round, in one process; medians, and the share of nonzero ``G`` (the gradient of every
step's input current) that the sparse backward reads.

The Active rows (``--active-widths``): Perez-Nieves & Goodman's sparse gradient, an approximation
(:class:`spikefuse.surrogate.Active`): the surrogate ``Windowed(Sigmoid(4), w)`` for the exact gradient (dense
backward) against ``Active(Sigmoid(4), w)`` (the states' gradients zero where ``|v - threshold| > w``) with
``sparse_grad`` False, True and ``"auto"``, the same window, the same floor; each with its share of nonzero ``G``.

    python benchmarks/sparse_recurrent_gradients.py --threads 1 --repeats 11
    python benchmarks/sparse_recurrent_gradients.py --threads 1 --repeats 21 --widths --active-widths 0.5 0.1 0.025
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import spikefuse
from spikefuse.bench.common import machine_info
from spikefuse.bench.recurrent import _floor_case
from spikefuse.neurons import LIF_MODELS
from spikefuse.nn import SpikeLinear
from spikefuse.ops import recurrent as recurrent_ops
from spikefuse.surrogate import Active, Rectangle, Sigmoid, Windowed
from spikefuse.threads import set_threads

T, B, INPUTS, HIDDEN, RATE = 250, 32, 700, 256, 0.05
MODEL = LIF_MODELS[("snntorch", "soft")]
PARAMS = {"decay": 0.95, "threshold": 1.0}


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--widths", type=float, nargs="*", default=[1.0, 0.2, 0.05], help="Rectangle widths")
    p.add_argument(
        "--active-widths", type=float, nargs="*", default=[], help="windows w of the Active rows (|v - threshold| <= w)"
    )
    args = p.parse_args()
    set_threads(args.threads)
    print(f"machine: {machine_info()}")
    print(f"load before: {loadavg()}")
    torch.manual_seed(0)
    x = (torch.rand(T, B, INPUTS) < RATE).float()
    fc = SpikeLinear(INPUTS, HIDDEN, sparse=True)
    with torch.no_grad():
        fc.weight.mul_(4.0)  # ~5-10% recurrent spikes, as bench recurrent's RLeaky case
    weight = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5)
    bias = torch.nn.Parameter(torch.zeros(HIDDEN))
    upstream = torch.randn(T, B, HIDDEN)
    floor = _floor_case(x, "cpu")

    def network(width, sparse_grad, surrogate=None):
        surrogate = Rectangle(width) if surrogate is None else surrogate

        def run():
            current = fc(x)
            spikes = spikefuse.recurrent(current, MODEL, weight, bias, surrogate=surrogate, sparse=True,
                                         sparse_grad=sparse_grad, memory="potential", **PARAMS)  # fmt: skip
            return spikes

        return run

    def nonzero_share(surrogate) -> float:
        current = fc(x).detach().requires_grad_()
        out = spikefuse.recurrent(current, MODEL, weight, bias, surrogate=surrogate, sparse=True, **PARAMS)
        (g,) = torch.autograd.grad((out * upstream).sum(), current)
        return float((g != 0).double().mean())

    def timed(forward, params) -> float:
        for q in params:
            q.grad = None
        start = time.perf_counter()
        out = forward()
        (out * upstream).sum().backward()
        return time.perf_counter() - start

    params = [*fc.parameters(), weight, bias]
    floor_params = list(floor.params)

    def medians(cases: dict) -> dict:
        """Median ms of every case and the floor: 2 warm-up rounds, then ``repeats`` rounds, each in turn."""
        times = {k: [] for k in (*cases, "floor")}
        for _ in range(2):  # warm-up (compiles the kernels; auto records its share)
            for name, run in cases.items():
                timed(run, params)
            timed(floor.forward, floor_params)
        for r in range(args.repeats):
            order = [*cases, "floor"]
            order = order[r % len(order) :] + order[: r % len(order)]
            for name in order:
                if name == "floor":
                    times[name].append(timed(floor.forward, floor_params))
                else:
                    times[name].append(timed(cases[name], params))
        return {k: statistics.median(v) * 1e3 for k, v in times.items()}

    if args.widths:
        rectangle_table(args, network, medians, nonzero_share, weight)
    if args.active_widths:
        active_table(args, network, medians, nonzero_share, weight)
    print(f"\nload after: {loadavg()}")


def rectangle_table(args, network, medians, nonzero_share, weight) -> None:
    print(
        "\n| Rectangle width | recurrent spike rate | nonzero G | dense backward ms | sparse_grad=True ms | auto ms | "
        "floor ms | True / dense | auto / dense | dense x floor | True x floor | auto x floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for width in args.widths:
        with torch.no_grad():
            spikes = network(width, False)()
        share = nonzero_share(Rectangle(width))
        med = medians({"dense": network(width, False), "true": network(width, True), "auto": network(width, "auto")})
        auto_way = "sparse" if recurrent_ops.use_sparse_grad(weight, T * B) else "dense"
        print(
            f"| {width} | {float(spikes.mean()):.3f} | {share:.3f} | {med['dense']:.1f} | {med['true']:.1f} | "
            f"{med['auto']:.1f} ({auto_way}) | {med['floor']:.1f} | {med['true'] / med['dense']:.2f} | "
            f"{med['auto'] / med['dense']:.2f} | {med['dense'] / med['floor']:.2f} | {med['true'] / med['floor']:.2f} | "
            f"{med['auto'] / med['floor']:.2f} |"
        )


def active_table(args, network, medians, nonzero_share, weight) -> None:
    print(
        "\n| window w | recurrent spike rate | nonzero G exact | nonzero G Active | exact dense ms | Active dense ms | "
        "Active sparse_grad=True ms | Active auto ms | floor ms | True / exact | auto / exact | exact x floor | "
        "Active dense x floor | True x floor | auto x floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w in args.active_widths:
        exact, active = Windowed(Sigmoid(4.0), w), Active(Sigmoid(4.0), w)
        with torch.no_grad():
            spikes = network(None, False, exact)()
        share_exact, share_active = nonzero_share(exact), nonzero_share(active)
        med = medians(
            {
                "exact": network(None, False, exact),
                "dense": network(None, False, active),
                "true": network(None, True, active),
                "auto": network(None, "auto", active),
            }
        )
        auto_way = "sparse" if recurrent_ops.use_sparse_grad(weight, T * B) else "dense"
        f = med["floor"]
        print(
            f"| {w} | {float(spikes.mean()):.3f} | {share_exact:.3f} | {share_active:.3f} | {med['exact']:.1f} | "
            f"{med['dense']:.1f} | {med['true']:.1f} | {med['auto']:.1f} ({auto_way}) | {f:.1f} | "
            f"{med['true'] / med['exact']:.2f} | {med['auto'] / med['exact']:.2f} | {med['exact'] / f:.2f} | "
            f"{med['dense'] / f:.2f} | {med['true'] / f:.2f} | {med['auto'] / f:.2f} |"
        )


if __name__ == "__main__":
    main()
