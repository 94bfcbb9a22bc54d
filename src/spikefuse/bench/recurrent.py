"""``spikefuse bench recurrent``: a recurrent spiking layer at the Spiking Heidelberg Digits' size, spikefuse against
the peers and the matrix-product floor.

The network of every case: input spikes ``[T, B, 700]`` (5% ones) through a ``Linear(700, 256)``, a recurrent layer
of 256 all-to-all neurons, and ``(spikes * g).sum()`` with a fixed random ``g``; one forward+backward per run, into
every weight's gradient. Each peer runs as its users run it, and spikefuse runs the peer's dynamics (its drop-in,
the same weights), checked to give the same spikes:

- snnTorch ``RLeaky`` in a loop over the steps, and :class:`spikefuse.compat.snntorch.RLeaky`'s ``sequence``;
  with ``--sparse``, also :func:`spikefuse.recurrent` with RLeaky's LIF and ``sparse=True`` behind a
  ``SpikeLinear(sparse=True)`` (the products that read only the spiking inputs and neurons), the same weights;
- Norse ``LSNNRecurrent`` and :class:`spikefuse.compat.norse.LSNNRecurrent`;
- SpikingJelly ``LinearRecurrentContainer`` around a ``LIFNode``, stepped in a loop, and :func:`spikefuse.recurrent`
  with SpikingJelly's LIF definition and the container's weight split into its input and recurrent halves (the
  container multiplies the concatenation ``[x; s]`` in one product, a different rounding: its spikes are compared,
  not required equal);
- the floor: the same matrix products alone, timed as one run (the input product, T recurrent products forward, T
  products carrying the gradient back through the steps, the two weight gradients as one product each).

Memory kept for backward: the bytes of the distinct tensors autograd keeps from the forward (saved-tensor hooks),
parameters excepted; the input spikes, which every case keeps for its first layer's weight gradient, included
(spikefuse's first layer is :class:`spikefuse.nn.SpikeLinear`, which keeps them as bits, where its user would use
it: in front of the snnTorch and SpikingJelly drop-ins; Norse's module holds its own input weights).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from ..nn.spike_layers import SpikeLinear
from ..threads import set_threads
from .common import (
    add_result_args,
    command_line,
    gpu_machine_info,
    machine_info,
    markdown_table,
    result_tag,
    round_robin,
    write_csv,
)

INPUTS, HIDDEN, BATCH, RATE = 700, 256, 32, 0.05


def kept_bytes(forward, params) -> int:
    """Bytes of the distinct tensors autograd keeps for backward while ``forward()`` runs, ``params`` excepted."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(kept.values())


def _input_layer(cls, gain: float, device, like: nn.Linear | None = None) -> nn.Linear:
    """The first layer, ``Linear(700, 256)`` (``cls``: ``nn.Linear`` or spikefuse's ``SpikeLinear``, which keeps its
    spike input as bits): its weights ``like``'s, or drawn and scaled by ``gain`` so that the layer fires ~5-10% of
    the time."""
    fc = cls(INPUTS, HIDDEN).to(device)
    with torch.no_grad():
        if like is None:
            fc.weight.mul_(gain)
        else:
            fc.load_state_dict(like.state_dict())
    return fc


class Case:
    """One implementation: ``forward()`` -> spikes ``[T, B, H]`` (with its graph); its parameters."""

    def __init__(self, name: str, pair: str, forward, params):
        self.name, self.pair, self.forward, self.params = name, pair, forward, list(params)

    def step(self, upstream):
        def run():
            spikes = self.forward()
            (spikes * upstream).sum().backward()
            for p in self.params:
                p.grad = None

        return run


def _snntorch_cases(x, device, sparse: bool = False) -> list[Case]:
    import snntorch

    import spikefuse
    from ..compat import snntorch as compat
    from ..neurons import LIF_MODELS
    from ..surrogate import ATan

    torch.manual_seed(1)
    fc, peer = _input_layer(nn.Linear, 4.0, device), snntorch.RLeaky(beta=0.95, linear_features=HIDDEN).to(device)
    ours = compat.RLeaky(beta=0.95, linear_features=HIDDEN, memory="recompute").to(device)
    ours.load_state_dict(peer.state_dict())
    ours_fc = _input_layer(SpikeLinear, 4.0, device, fc)

    def peer_loop():
        spk, mem = peer.reset_mem()
        out = []
        for x_t in x.unbind(0):
            spk, mem = peer(fc(x_t), spk, mem)
            out.append(spk)
        return torch.stack(out)

    def ours_sequence():
        ours.reset_mem()
        return ours.sequence(ours_fc(x))[0]

    sparse_fc = _input_layer(functools.partial(SpikeLinear, sparse=True), 4.0, device, fc)

    def ours_sparse():  # RLeaky's LIF (beta 0.95, threshold 1, subtract), snnTorch's ATan surrogate
        current = sparse_fc(x)
        weight, bias = ours.recurrent.weight, ours.recurrent.bias
        model = LIF_MODELS[("snntorch", "soft")]
        kw = dict(surrogate=ATan(2.0), decay=0.95, threshold=1.0, memory="recompute", sparse=True)
        return spikefuse.recurrent(current, model, weight, bias, **kw)

    return [
        Case("snnTorch RLeaky, loop", "snntorch", peer_loop, [*fc.parameters(), *peer.parameters()]),
        Case(
            "spikefuse compat RLeaky.sequence", "snntorch", ours_sequence, [*ours_fc.parameters(), *ours.parameters()]
        ),
    ] + (
        [
            Case(
                "spikefuse.recurrent(sparse=True), RLeaky's LIF",
                "snntorch",
                ours_sparse,
                [*sparse_fc.parameters(), *ours.recurrent.parameters()],
            )
        ]
        if sparse
        else []
    )


def _norse_cases(x, device) -> list[Case]:
    import norse.torch as norse

    from ..compat import norse as compat

    modules = []
    for make in (norse.LSNNRecurrent, functools.partial(compat.LSNNRecurrent, memory="recompute")):
        torch.manual_seed(2)
        modules.append(make(INPUTS, HIDDEN).to(device))
        with torch.no_grad():
            modules[-1].input_weights.mul_(64.0)  # Norse's LSNN needs a stronger drive to fire ~5% of the time
    peer, ours = modules
    return [
        Case("Norse LSNNRecurrent", "norse", lambda: peer(x)[0], peer.parameters()),
        Case("spikefuse compat LSNNRecurrent", "norse", lambda: ours(x)[0], ours.parameters()),
    ]


def _spikingjelly_cases(x, device) -> list[Case]:
    from spikingjelly.activation_based import functional, layer, neuron

    import spikefuse
    from ..neurons import SPIKINGJELLY_MODELS
    from ..surrogate import Sigmoid

    torch.manual_seed(3)
    fc = _input_layer(nn.Linear, 5.0, device)
    net = layer.LinearRecurrentContainer(neuron.LIFNode(tau=2.0, step_mode="s"), HIDDEN, HIDDEN).to(device)
    with torch.no_grad():
        net.rc.weight.mul_(5.0)
    ours_fc = _input_layer(SpikeLinear, 5.0, device, fc)

    def peer_loop():
        functional.reset_net(net)
        return torch.stack([net(fc(x_t)) for x_t in x.unbind(0)])

    def ours():
        w = net.rc.weight
        current = nn.functional.linear(ours_fc(x), w[:, :HIDDEN])
        return spikefuse.recurrent(
            current,
            SPIKINGJELLY_MODELS[("hard", "div_input")],
            w[:, HIDDEN:],
            net.rc.bias,
            surrogate=Sigmoid(4.0),
            decay=2.0,
            threshold=1.0,
            v_reset=0.0,
            memory="recompute",
        )

    return [
        Case(
            "SpikingJelly LinearRecurrentContainer(LIFNode), loop",
            "spikingjelly",
            peer_loop,
            [*fc.parameters(), *net.parameters()],
        ),
        Case(
            "spikefuse.recurrent, SpikingJelly's LIF", "spikingjelly", ours, [*ours_fc.parameters(), *net.parameters()]
        ),
    ]


def _floor_case(x, device) -> Case:
    """The matrix products of the network alone: what no implementation can skip."""
    fc = nn.Linear(INPUTS, HIDDEN).to(device)
    w = nn.Parameter(torch.randn(HIDDEN, HIDDEN, device=device) / HIDDEN**0.5)
    b = nn.Parameter(torch.zeros(HIDDEN, device=device))
    spikes = (torch.rand(x.shape[0], x.shape[1], HIDDEN, device=device) < RATE).float()

    class Products(torch.autograd.Function):
        @staticmethod
        def forward(ctx, current, w, b):
            out = torch.empty_like(current)
            for t in range(current.shape[0]):
                torch.addmm(b, spikes[t - 1] if t else spikes[-1], w.t(), out=out[t])
            ctx.save_for_backward(w)
            return out + current

        @staticmethod
        def backward(ctx, g):
            (w,) = ctx.saved_tensors
            carry = torch.empty_like(g[0])
            for t in range(g.shape[0] - 1, -1, -1):
                torch.mm(g[t], w, out=carry)
            previous = torch.cat([spikes[-1:], spikes[:-1]]).reshape(-1, HIDDEN)
            return g, g.reshape(-1, HIDDEN).t() @ previous, g.sum((0, 1))

    return Case(
        "floor: the matrix products alone", "floor", lambda: Products.apply(fc(x), w, b), [*fc.parameters(), w, b]
    )


def cases(x, device, peers=("snntorch", "norse", "spikingjelly"), sparse: bool = False) -> list[Case]:
    out = []
    builders = {
        "snntorch": functools.partial(_snntorch_cases, sparse=sparse),
        "norse": _norse_cases,
        "spikingjelly": _spikingjelly_cases,
    }
    for peer in peers:
        try:
            out += builders[peer](x, device)
        except ImportError as err:
            print(f"skipping {peer}: {err}")
    return out + [_floor_case(x, device)]


def run(args) -> None:
    set_threads(args.threads)
    device = args.device
    rows = []
    for t_steps in args.T:
        g = torch.Generator().manual_seed(t_steps)
        x = (torch.rand(t_steps, BATCH, INPUTS, generator=g) < RATE).float().to(device)
        upstream = torch.randn(t_steps, BATCH, HIDDEN, generator=g).to(device)
        all_cases = cases(x, device, args.peers, args.sparse)
        spikes = {}
        for case in all_cases:
            with torch.no_grad():
                spikes[case.name] = case.forward().float()
        kept = {case.name: kept_bytes(case.forward, case.params) for case in all_cases}
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        steps = {case.name: case.step(upstream) for case in all_cases}
        timed = {name: (lambda fn=fn: (fn(), sync())) for name, fn in steps.items()}
        medians = round_robin(timed, args.repeats)
        floor = medians["floor: the matrix products alone"]
        for case in all_cases:
            # (the sparse row's partner: the peer, the first of its pair)
            partner = next((c for c in all_cases if c.pair == case.pair and c is not case), None)
            differ = float((spikes[case.name] != spikes[partner.name]).float().mean()) if partner else 0.0
            peer = next((c for c in all_cases if c.pair == case.pair and not c.name.startswith("spikefuse")), None)
            rows.append(
                {
                    "T": t_steps,
                    "implementation": case.name,
                    "fwd_bwd_ms": round(medians[case.name] * 1e3, 1),
                    "vs_floor": round(medians[case.name] / floor, 2),
                    "speedup_of_spikefuse": round(medians[peer.name] / medians[case.name], 2)
                    if case.name.startswith("spikefuse") and peer is not None
                    else "",
                    "kept_MB": round(kept[case.name] / 2**20, 1),
                    "kept_vs_peer": round(kept[case.name] / kept[peer.name], 3)
                    if case.name.startswith("spikefuse") and peer is not None
                    else "",
                    "spike_rate": round(float(spikes[case.name].mean()), 4) if case.pair != "floor" else "",
                    "spikes_differing": differ,
                }
            )
    out = Path(args.out)
    stem = out / f"recurrent_{args.tag}"
    write_csv(stem.with_suffix(".csv"), rows)
    table = markdown_table(
        [
            "T",
            "implementation",
            "fwd+bwd ms",
            "x floor",
            "spikefuse speed-up",
            "kept for backward MB",
            "kept vs peer",
            "spike rate",
            "spikes differing from its pair",
        ],
        [
            [
                r["T"],
                r["implementation"],
                r["fwd_bwd_ms"],
                r["vs_floor"],
                r["speedup_of_spikefuse"],
                r["kept_MB"],
                r["kept_vs_peer"],
                r["spike_rate"],
                f"{r['spikes_differing']:.1e}",
            ]
            for r in rows
        ],
    )
    machine = machine_info() if device == "cpu" else gpu_machine_info()
    text = [
        f"# Recurrent layer at the SHD size: {INPUTS} inputs ({RATE:.0%} spikes) -> {HIDDEN} recurrent, batch {BATCH}, "
        f"forward+backward ({device})",
        "",
        f"Machine: {machine}",
        f"Command: `{command_line()}`",
        "",
        f"Medians of {args.repeats} round-robin runs after one warm-up, in one process. 'x floor': the time over the "
        "floor's, the network's matrix products alone (input product, a recurrent product per step forward and one "
        "backward, each weight gradient as one product). 'spikefuse speed-up': the peer's time over spikefuse's "
        "for the same dynamics and weights; 'kept vs peer' likewise for the bytes autograd keeps for backward "
        "(parameters excepted, the input spikes included). 'spikes differing': the fraction of spikes that differ "
        "from the other implementation of the pair (SpikingJelly's container multiplies [x; s] in one product, a "
        "different rounding, so its pair may differ; the others must not; the sparse row sums its currents in "
        "another order than the peer's dense product, so it may differ at threshold ties).",
        "",
        table,
    ]
    stem.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    print(f"wrote {stem}.md/.csv")


SMNIST_HIDDEN, SMNIST_BATCH = 256, 256


def smnist_epoch(args) -> None:
    """One training epoch of pixel-by-pixel sequential MNIST (T=784, one pixel a step, 60,000 samples) for the same
    network in snnTorch and in spikefuse, extrapolated from ``args.smnist_batches`` timed batches each (after one
    untimed): ``Linear(1, 256)``, a recurrent LIF layer of 256 (snnTorch's ``RLeaky``; spikefuse's drop-in
    ``sequence``), ``Linear(256, 10)`` averaged over the steps, cross-entropy, Adam. The two take the same weights
    and batches, and their spikes are checked equal on the first batch."""
    import time

    import snntorch

    from ..compat import snntorch as compat
    from ..data import load_dataset

    set_threads(args.threads)
    images, _ = load_dataset("smnist", args.data_dir, train=True, T=784)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randperm(len(images), generator=g)[:SMNIST_BATCH] for _ in range(args.smnist_batches + 1)]

    def network(cls, **extra):
        torch.manual_seed(4)
        fc1, fc2 = nn.Linear(1, SMNIST_HIDDEN), nn.Linear(SMNIST_HIDDEN, 10)
        lif = cls(beta=0.95, linear_features=SMNIST_HIDDEN, **extra)
        torch.manual_seed(5)
        lif.recurrent.reset_parameters()
        return fc1, lif, fc2

    peer, ours = network(snntorch.RLeaky), network(compat.RLeaky, memory="recompute")
    ours[1].load_state_dict(peer[1].state_dict())

    def peer_forward(x):
        fc1, lif, fc2 = peer
        spk, mem = lif.reset_mem()
        out = []
        for x_t in x.unbind(0):
            spk, mem = lif(fc1(x_t), spk, mem)
            out.append(spk)
        spikes = torch.stack(out)
        return spikes, fc2(spikes).mean(0)

    def ours_forward(x):
        fc1, lif, fc2 = ours
        lif.reset_mem()
        spikes = lif.sequence(fc1(x))[0]
        return spikes, fc2(spikes).mean(0)

    rows = []
    first = {}
    for name, modules, forward in (
        ("snnTorch RLeaky, loop", peer, peer_forward),
        ("spikefuse compat RLeaky.sequence", ours, ours_forward),
    ):
        optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=1e-3)
        times = []
        for i, idx in enumerate(batches):
            x = images.data[idx].transpose(0, 1).contiguous()  # [784, B, 1]
            y = images.targets[idx]
            start = time.perf_counter()
            spikes, logits = forward(x)
            loss = nn.functional.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if i == 0:
                first[name] = spikes.detach()
            else:
                times.append(time.perf_counter() - start)
        per_batch = sorted(times)[len(times) // 2]
        rows.append(
            {
                "implementation": name,
                "batch_s": round(per_batch, 3),
                "epoch_min": round(per_batch * len(images) / SMNIST_BATCH / 60, 1),
                "spike_rate": round(float(first[name].mean()), 4),
            }
        )
    peer_row, ours_row = rows
    differ = float((first["snnTorch RLeaky, loop"] != first["spikefuse compat RLeaky.sequence"]).float().mean())
    for r in rows:
        r["spikes_differing"] = differ
        r["speedup_of_spikefuse"] = round(peer_row["batch_s"] / ours_row["batch_s"], 2) if r is ours_row else ""
    out = Path(args.out)
    stem = out / f"recurrent-smnist_{args.tag}"
    write_csv(stem.with_suffix(".csv"), rows)
    table = markdown_table(
        [
            "implementation",
            "s per batch",
            "epoch (min, extrapolated)",
            "spikefuse speed-up",
            "spike rate",
            "spikes differing",
        ],
        [
            [
                r["implementation"],
                r["batch_s"],
                r["epoch_min"],
                r["speedup_of_spikefuse"],
                r["spike_rate"],
                f"{r['spikes_differing']:.1e}",
            ]
            for r in rows
        ],
    )
    text = [
        "# Pixel-by-pixel sequential MNIST (T=784): one training epoch, snnTorch vs spikefuse",
        "",
        f"Machine: {machine_info()}",
        f"Command: `{command_line()}`",
        "",
        f"Linear(1, {SMNIST_HIDDEN}) -> recurrent LIF ({SMNIST_HIDDEN}, all to all, beta 0.95) -> Linear("
        f"{SMNIST_HIDDEN}, 10) averaged over the 784 steps, cross-entropy, Adam; batch {SMNIST_BATCH} of the "
        f"real MNIST training images. Median of {args.smnist_batches} timed training steps each (after one "
        f"untimed), the epoch ({len(images):,} samples) extrapolated from it. Same weights and batches; "
        "'spikes differing' on the first batch.",
        "",
        table,
    ]
    stem.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    print(f"wrote {stem}.md/.csv")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "recurrent",
        help="a recurrent layer at the SHD size vs snnTorch, Norse, SpikingJelly and the matrix-product floor",
    )
    p.add_argument("--T", type=int, nargs="+", default=[250, 1000], help="sequence lengths (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, median (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch/numba threads (default: %(default)s)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: %(default)s)")
    p.add_argument(
        "--peers",
        nargs="*",
        default=["snntorch", "norse", "spikingjelly"],
        choices=["snntorch", "norse", "spikingjelly"],
        help="the peer libraries timed beside spikefuse (default: all three)",
    )
    p.add_argument(
        "--sparse",
        action="store_true",
        help="add spikefuse's sparse products (SpikeLinear(sparse=True), spikefuse.recurrent(sparse=True)) beside "
        "snnTorch's pair, CPU only",
    )
    p.add_argument(
        "--smnist-batches",
        type=int,
        default=0,
        help="instead: time this many training batches of pixel-by-pixel sequential MNIST (snnTorch and "
        "spikefuse) and extrapolate an epoch; needs --data-dir with the MNIST files",
    )
    p.add_argument("--data-dir", default=None, help="the MNIST files, for --smnist-batches (default: $SPIKEFUSE_DATA)")
    p.add_argument("--quick", action="store_true", help="T=20, two repeats: check the harness")
    add_result_args(p)
    p.set_defaults(func=_run_cli)


def _run_cli(args) -> None:
    if args.quick:
        args.T, args.repeats = [20], 2
    if min(args.T) <= 0 or args.repeats <= 0:
        raise SystemExit("--T and --repeats must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    if args.sparse and args.device != "cpu":
        raise SystemExit("--sparse: the sparse products run on the CPU")
    args.tag = result_tag(args) + ("" if args.device == "cpu" else f"_{args.device}")
    if args.smnist_batches > 0:
        smnist_epoch(args)
    else:
        run(args)
