"""``spikefuse bench dropins``: every drop-in of :mod:`spikefuse.compat` against the peer module it replaces, per
training step (forward over T steps and backward of the summed spikes): the peer called as its users call it (one
step a call in a Python loop, or its own multi-step module), the drop-in called the same way, and the drop-in's fused
call over all T steps. The spikes of every form are checked equal to the peer's before timing; medians of
round-robin runs in one process.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from .common import add_result_args

    p = subparsers.add_parser(
        "dropins",
        help="every drop-in against its peer: step loop and fused, per training step",
        description=__doc__,
    )
    p.add_argument("--T", type=int, default=100, help="time steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--neurons", type=int, default=256, help="neurons per layer (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds, median (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch/numba threads (default: %(default)s)")
    p.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="only the peers whose name holds TEXT (e.g. 'snnTorch', 'RLeaky'); repeatable (default: every peer)",
    )
    p.add_argument("--quick", action="store_true", help="T=6, batch 2, 8 neurons, two repeats: check the harness")
    add_result_args(p)
    return p


def _loop(module, x, handed_back):
    """The peer's users' loop: one call per step, ``handed_back(out)`` the states passed to the next call."""
    import torch

    spikes, state = [], ()
    for x_t in x.unbind(0):
        out = module(x_t, *state)
        spikes.append(out[0])
        state = handed_back(out)
    return torch.stack(spikes)


def _cases(T: int, B: int, N: int) -> list[tuple[str, str, object, object, object]]:
    """``(peer, drop-in, make the peer, make the drop-in, forms)``: ``forms(module, x)`` maps each way of calling
    (``"peer loop"``-style ``"loop"``, and ``"fused"``) to a function of the input giving the spikes ``[T, ...]``."""
    import norse.torch as norse
    import snntorch
    import torch
    from spikingjelly.activation_based import neuron as sj

    from ..compat import norse as cn
    from ..compat import snntorch as cs
    from ..compat import spikingjelly as cj

    def snn_forms(handed_back):
        def forms(m):
            def loop(x):
                m.reset_mem()  # each training step from zero states, as snnTorch's tutorials reset
                return _loop(m, x, handed_back)

            def fused(x):
                m.reset_mem()
                return m.sequence(x)[0]

            return {"loop": loop, "fused": fused}

        return forms

    def norse_cell_forms(fused_cls):
        def forms(m):
            def loop(x):
                state, spikes = None, []
                for x_t in x.unbind(0):
                    z, state = m(x_t, state)
                    spikes.append(z)
                return torch.stack(spikes)

            return {"loop": loop, "fused": lambda x: fused_cls(m.p)(x)[0]} if fused_cls else {"loop": loop}

        return forms

    def sj_forms(m):
        def loop(x):
            m.reset()
            return torch.stack([m(x_t) for x_t in x.unbind(0)])

        def fused(x):
            m.reset()
            m.step_mode = "m"
            try:
                return m(x)
            finally:
                m.step_mode = "s"

        return {"loop": loop, "fused": fused}

    feed_forward = lambda out: tuple(out[1:])  # noqa: E731  (snnTorch's states after the spikes)
    recurrent = lambda out: tuple(out)  # noqa: E731  (the spikes too)
    lif, lsnn = norse.LIFParameters(v_th=torch.tensor(0.3)), norse.LSNNParameters(v_th=torch.tensor(0.3))
    return [
        (
            "snnTorch Leaky",
            "compat.snntorch.Leaky",
            lambda: snntorch.Leaky(beta=0.9, threshold=0.5),
            lambda: cs.Leaky(beta=0.9, threshold=0.5),
            snn_forms(feed_forward),
        ),
        (
            "snnTorch Synaptic",
            "compat.snntorch.Synaptic",
            lambda: snntorch.Synaptic(alpha=0.8, beta=0.9, threshold=0.5),
            lambda: cs.Synaptic(alpha=0.8, beta=0.9, threshold=0.5),
            snn_forms(feed_forward),
        ),
        (
            "snnTorch Lapicque",
            "compat.snntorch.Lapicque",
            lambda: snntorch.Lapicque(beta=0.9, threshold=0.2),
            lambda: cs.Lapicque(beta=0.9, threshold=0.2),
            snn_forms(feed_forward),
        ),
        (
            "snnTorch Alpha",
            "compat.snntorch.Alpha",
            lambda: snntorch.Alpha(alpha=0.9, beta=0.8, threshold=0.5),
            lambda: cs.Alpha(alpha=0.9, beta=0.8, threshold=0.5),
            snn_forms(feed_forward),
        ),
        (
            "snnTorch RLeaky",
            "compat.snntorch.RLeaky",
            lambda: snntorch.RLeaky(beta=0.9, threshold=0.5, linear_features=N),
            lambda: cs.RLeaky(beta=0.9, threshold=0.5, linear_features=N),
            snn_forms(recurrent),
        ),
        (
            "snnTorch RSynaptic",
            "compat.snntorch.RSynaptic",
            lambda: snntorch.RSynaptic(alpha=0.8, beta=0.9, threshold=0.5, linear_features=N),
            lambda: cs.RSynaptic(alpha=0.8, beta=0.9, threshold=0.5, linear_features=N),
            snn_forms(recurrent),
        ),
        (
            "SpikingJelly LIFNode",
            "compat.spikingjelly.LIFNode",
            lambda: sj.LIFNode(tau=2.0, v_threshold=0.4),
            lambda: cj.LIFNode(tau=2.0, v_threshold=0.4),
            sj_forms,
        ),
        (
            "SpikingJelly ParametricLIFNode",
            "compat.spikingjelly.ParametricLIFNode",
            lambda: sj.ParametricLIFNode(v_threshold=0.4),
            lambda: cj.ParametricLIFNode(v_threshold=0.4),
            sj_forms,
        ),
        ("SpikingJelly IFNode", "compat.spikingjelly.IFNode", lambda: sj.IFNode(), lambda: cj.IFNode(), sj_forms),
        (
            "Norse LIFCell",
            "compat.norse.LIFCell",
            lambda: norse.LIFCell(lif),
            lambda: cn.LIFCell(lif),
            norse_cell_forms(cn.LIF),
        ),
        (
            "Norse LSNNCell",
            "compat.norse.LSNNCell",
            lambda: norse.LSNNCell(lsnn),
            lambda: cn.LSNNCell(lsnn),
            norse_cell_forms(cn.LSNN),
        ),
    ]


def _model_rows(T: int, B: int, repeats: int, features: tuple[int, int, int]) -> list[dict]:
    """A snnTorch user's recurrent model (issue 56's script: Linear, ``RLeaky``, Linear, ``Leaky(output=True)``,
    ``init_hidden=True`` in an ``nn.Sequential``, a loss on the mean membrane, Adam) per training step: snnTorch's
    loop, the same loop with the drop-ins imported instead, and :func:`spikefuse.compat.fuse` of it. The losses of
    every form are checked equal first."""
    import snntorch
    import torch
    from snntorch import utils
    from torch import nn

    from ..compat import fuse
    from ..compat import snntorch as cs
    from .common import round_robin

    n_in, hidden, n_out = features
    g = torch.Generator().manual_seed(2)
    x = (torch.rand(T, B, n_in, generator=g) < 0.05).float()  # events of a spike-encoded dataset (SHD's density)
    y = torch.randint(0, n_out, (B,), generator=g)

    def make(library):
        torch.manual_seed(3)
        return nn.Sequential(
            nn.Linear(n_in, hidden),
            library.RLeaky(beta=0.9, linear_features=hidden, init_hidden=True),
            nn.Linear(hidden, n_out),
            library.Leaky(beta=0.9, init_hidden=True, output=True),
        )

    def training_step(net, run):
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)

        def step():
            utils.reset(net)
            loss = nn.functional.cross_entropy(run(net).mean(0), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return float(loss)

        return step

    def loop(net):
        return torch.stack([net(x_t)[1] for x_t in x.unbind(0)])

    forms = {
        "snnTorch model, loop": training_step(make(snntorch), loop),
        "same model with compat.snntorch imported, loop": training_step(make(cs), loop),
        "compat.fuse(model)": training_step(fuse(make(snntorch)), lambda net: net(x)[1]),
    }
    losses = {name: fn() for name, fn in forms.items()}
    if len(set(losses.values())) != 1:
        raise AssertionError(f"the forms' first losses differ: {losses}")
    # the first steps changed the weights alike; each form goes on from its own copy
    times = round_robin(forms, repeats)
    peer = times["snnTorch model, loop"]
    return [
        {
            "peer": "snnTorch model",
            "implementation": name,
            "ms_per_step": round(seconds * 1e3, 3),
            "vs_peer_loop": round(seconds / peer, 3),
            "spike_rate": "",
        }
        for name, seconds in times.items()
    ]


def run(args) -> int:
    from pathlib import Path

    import torch

    from ..threads import set_threads
    from .common import command_line, machine_info, markdown_table, result_tag, round_robin, write_csv

    T, B, N, repeats = (6, 2, 8, 2) if args.quick else (args.T, args.batch_size, args.neurons, args.repeats)
    set_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(T, B, N, generator=g)
    rows = []
    for peer_name, ours_name, make_peer, make_ours, forms in _cases(T, B, N):
        if args.only and not any(text in peer_name for text in args.only):
            continue
        torch.manual_seed(1)
        peer = make_peer()
        torch.manual_seed(1)
        ours = make_ours()
        ours.load_state_dict(peer.state_dict())
        xs = x
        calls = {f"{peer_name}, loop": (peer, forms(peer)["loop"])}
        calls.update({f"{ours_name}, {form}": (ours, fn) for form, fn in forms(ours).items()})
        want = None
        for name, (module, fn) in calls.items():
            spikes = fn(xs).detach()
            want = spikes if want is None else want
            if not torch.equal(spikes, want):
                raise AssertionError(f"{name}: spikes differ from the peer's ({int((spikes != want).sum())})")

        def step(fn):
            def train_step():
                xg = xs.clone().requires_grad_()
                fn(xg).sum().backward()

            return train_step

        times = round_robin({name: step(fn) for name, (_, fn) in calls.items()}, repeats)
        peer_time = times[f"{peer_name}, loop"]
        for name, seconds in times.items():
            rows.append(
                {
                    "peer": peer_name,
                    "implementation": name,
                    "ms_per_step": round(seconds * 1e3, 3),
                    "vs_peer_loop": round(seconds / peer_time, 3),
                    "spike_rate": round(float(want.float().mean()), 4),
                }
            )
    features = (12, 10, 4) if args.quick else (700, 256, 20)
    if not args.only or any(text in "snnTorch model" for text in args.only):
        rows += _model_rows(T, B, repeats, features)
    tag = result_tag(args)
    out = Path(args.out)
    write_csv(out / f"dropins_{tag}.csv", rows)
    table = markdown_table(
        ["implementation", "ms per training step", "time / peer's loop", "spike rate"],
        [[r["implementation"], r["ms_per_step"], r["vs_peer_loop"], r["spike_rate"]] for r in rows],
    )
    text = "\n".join(
        [
            f"# Drop-ins against their peers: T={T}, batch {B}, {N} neurons, forward+backward per training step",
            "",
            f"Machine: {machine_info()}",
            f"Command: `{command_line()}`",
            "",
            "Medians of round-robin runs in one process. 'loop': one step a call in the peer's users' loop; 'fused':"
            " the drop-in's call over all T steps (snnTorch's `sequence`, SpikingJelly's step_mode='m', Norse's "
            "multi-step module). Every form's spikes were checked equal to the peer loop's first. The last rows: a "
            f"snnTorch user's recurrent model (Linear {features[0]}->{features[1]}, RLeaky, Linear ->{features[2]}, "
            "Leaky(output=True), a loss on the mean membrane, Adam; input events at 5%), per training step: "
            "snnTorch's loop, the loop with the drop-ins imported, and `spikefuse.compat.fuse` of the model (the "
            "first losses checked equal).",
            "",
            table,
            "",
        ]
    )
    (out / f"dropins_{tag}.md").write_text(text)
    print(table)
    print(f"wrote {out / f'dropins_{tag}'}.md/.csv")
    return 0
