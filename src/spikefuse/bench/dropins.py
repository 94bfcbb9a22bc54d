"""``spikefuse bench dropins``: every drop-in of :mod:`spikefuse.compat` against the peer module it replaces, per
training step (forward over T steps and backward of the summed spikes): the peer called as its users call it (one
step a call in a Python loop, or its own multi-step module), the drop-in called the same way, and the drop-in's fused
call over all T steps. The spikes of every form are checked equal to the peer's before timing; medians of
round-robin runs in one process. snnTorch's ``StateLeaky`` and ``LinearLeaky`` take the whole sequence in one call,
peer and drop-in alike; ``sparse=True`` and ``recursive=True`` forms may differ from the peer's spikes where a membrane
lies within rounding of the threshold, and the number that differ is reported.
"""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple


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
        "--conv-channels",
        type=int,
        default=8,
        help="channels of the recurrent convolutions' steps [B, C, H, H] (default: %(default)s)",
    )
    p.add_argument("--conv-side", type=int, default=16, help="their H (default: %(default)s)")
    p.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="only the peers whose name holds TEXT (e.g. 'snnTorch', 'RLeaky'); repeatable (default: every peer)",
    )
    p.add_argument(
        "--quick", action="store_true", help="T=6, batch 2, 8 neurons, 2x4x4 images, two repeats: check the harness"
    )
    add_result_args(p)
    return p


class Case(NamedTuple):
    """A drop-in against its peer. ``peer_forms(module)`` / ``our_forms(module)`` map each way of calling the module
    to a function of the input giving its output ``[T, ...]`` (the peer's first form is the baseline);
    ``make_input(generator)`` draws the input; forms in ``ties`` may differ from the peer's spikes where a membrane
    lies within rounding of the threshold (their count is reported), every other form must give the peer's output
    bit for bit; ``spikes=False``: the output is a membrane (Norse's leaky integrators)."""

    peer: str
    ours: str
    make_peer: Callable[[], object]
    make_ours: Callable[[], object]
    peer_forms: Callable[[object], dict]
    our_forms: Callable[[object], dict]
    make_input: Callable[[object], object]
    ties: tuple[str, ...] = ()
    spikes: bool = True


def _loop(module, x, handed_back):
    """The peer's users' loop: one call per step, ``handed_back(out)`` the states passed to the next call."""
    import torch

    spikes, state = [], ()
    for x_t in x.unbind(0):
        out = module(x_t, *state)
        spikes.append(out[0])
        state = handed_back(out)
    return torch.stack(spikes)


def _cases(T: int, B: int, N: int, conv: tuple[int, int]) -> list[Case]:
    """Every drop-in of :mod:`spikefuse.compat` against its installed peer; ``conv``: the channels and the side of
    the recurrent convolutions' steps ``[B, C, H, H]``."""
    import norse.torch as norse
    import snntorch
    import torch
    from spikingjelly.activation_based import neuron as sj

    from ..compat import norse as cn
    from ..compat import snntorch as cs
    from ..compat import spikingjelly as cj

    def snn_forms(handed_back, sparse=False):
        def loop_forms(m):
            def loop(x):
                m.reset_mem()  # each training step from zero states, as snnTorch's tutorials reset
                return _loop(m, x, handed_back)

            return {"loop": loop}

        def forms(m):
            def fused(x):
                m.reset_mem()
                return m.sequence(x)[0]

            def fused_sparse(x):
                m.sparse = True
                try:
                    return fused(x)
                finally:
                    m.sparse = False

            return {**loop_forms(m), "fused": fused, **({"fused, sparse=True": fused_sparse} if sparse else {})}

        return loop_forms, forms

    def whole_sequence_forms(m):  # snnTorch's StateLeaky / LinearLeaky: one call takes the sequence
        return {"sequence": lambda x: m(x)[0]}

    def recursive_forms(m):
        def recursive(x):
            m.recursive = True
            try:
                return m(x)[0]
            finally:
                m.recursive = False

        return {**whole_sequence_forms(m), "sequence, recursive=True": recursive}

    def norse_loop(m):
        def loop(x):
            state, out = None, []
            for x_t in x.unbind(0):
                z, state = m(x_t, state)
                out.append(z)
            return torch.stack(out)

        return {"loop": loop}

    def norse_forms(multi_step):
        """Our cell's loop, and the multi-step module ``multi_step(cell)`` (made once, sharing the cell's
        parameters) over all T steps."""

        def forms(m):
            made = []

            def fused(x):
                made[:] = made or [multi_step(m)]
                return made[0](x)[0]

            return {**norse_loop(m), "fused": fused}

        return forms

    def sj_loop(m):
        def loop(x):
            m.reset()
            return torch.stack([m(x_t) for x_t in x.unbind(0)])

        return {"loop": loop}

    def sj_forms(m):
        def fused(x):
            m.reset()
            m.step_mode = "m"
            try:
                return m(x)
            finally:
                m.step_mode = "s"

        return {**sj_loop(m), "fused": fused}

    def uniform(*shape, low=0.0):
        return lambda g: torch.rand(*shape, generator=g) + low

    feed_forward = lambda out: tuple(out[1:])  # noqa: E731  (snnTorch's states after the spikes)
    recurrent = lambda out: tuple(out)  # noqa: E731  (the spikes too)
    ff_loop, ff = snn_forms(feed_forward)
    rec_loop, rec = snn_forms(recurrent, sparse=True)
    conv_loop, conv_rec = snn_forms(recurrent)
    lif, lsnn = norse.LIFParameters(v_th=torch.tensor(0.3)), norse.LSNNParameters(v_th=torch.tensor(0.3))
    steps = uniform(T, B, N)
    channels, side = conv
    images = uniform(T, B, channels, side, side)

    def snn(name, kw, loop_forms, forms, x=steps, ties=(), label=""):
        return Case(
            f"snnTorch {name}{label}",
            f"compat.snntorch.{name}{label}",
            lambda: getattr(snntorch, name)(**kw),
            lambda: getattr(cs, name)(**kw),
            loop_forms,
            forms,
            x,
            ties,
        )

    def norse_case(name, make, multi_step, x=steps, spikes=True):
        return Case(
            f"Norse {name}",
            f"compat.norse.{name}",
            lambda: make(norse),
            lambda: make(cn),
            norse_loop,
            norse_forms(multi_step),
            x,
            spikes=spikes,
        )

    def sj_case(name, kw):
        make = lambda lib: lambda: getattr(lib, name)(**kw)  # noqa: E731
        return Case(f"SpikingJelly {name}", f"compat.spikingjelly.{name}", make(sj), make(cj), sj_loop, sj_forms, steps)

    def recurrent_of(cls):  # the multi-step module of a recurrent cell, on the cell's weights
        return lambda m: cls(
            m.input_size, m.hidden_size, m.p, input_weights=m.input_weights, recurrent_weights=m.recurrent_weights
        )

    conv_kw = dict(conv2d_channels=channels, kernel_size=3)
    return [
        snn("Leaky", dict(beta=0.9, threshold=0.5), ff_loop, ff),
        snn("Synaptic", dict(alpha=0.8, beta=0.9, threshold=0.5), ff_loop, ff),
        snn("Lapicque", dict(beta=0.9, threshold=0.2), ff_loop, ff),
        snn("Alpha", dict(alpha=0.9, beta=0.8, threshold=0.5), ff_loop, ff),
        snn("RLeaky", dict(beta=0.9, threshold=0.5, linear_features=N), rec_loop, rec, ties=("fused, sparse=True",)),
        snn(
            "RSynaptic",
            dict(alpha=0.8, beta=0.9, threshold=0.5, linear_features=N),
            rec_loop,
            rec,
            ties=("fused, sparse=True",),
        ),
        snn("RLeaky", dict(beta=0.9, threshold=0.5, **conv_kw), conv_loop, conv_rec, images, label=" conv2d"),
        snn(
            "RSynaptic",
            dict(alpha=0.8, beta=0.9, threshold=0.5, **conv_kw),
            conv_loop,
            conv_rec,
            images,
            label=" conv2d",
        ),
        snn(
            "StateLeaky",
            dict(beta=0.9, channels=N, threshold=2.0),
            whole_sequence_forms,
            recursive_forms,
            uniform(T, B, N, low=-0.3),
            ties=("sequence, recursive=True",),
        ),
        snn(
            "LinearLeaky",
            dict(beta=0.9, in_features=N, out_features=N, threshold=0.5),
            whole_sequence_forms,
            recursive_forms,
            ties=("sequence, recursive=True",),
        ),
        sj_case("LIFNode", dict(tau=2.0, v_threshold=0.4)),
        sj_case("ParametricLIFNode", dict(v_threshold=0.4)),
        sj_case("IFNode", {}),
        norse_case("LIFCell", lambda lib: lib.LIFCell(lif), lambda m: cn.LIF(m.p)),
        norse_case("LSNNCell", lambda lib: lib.LSNNCell(lsnn), lambda m: cn.LSNN(m.p)),
        norse_case("LIFRecurrentCell", lambda lib: lib.LIFRecurrentCell(N, N, lif), recurrent_of(cn.LIFRecurrent)),
        norse_case("LSNNRecurrentCell", lambda lib: lib.LSNNRecurrentCell(N, N, lsnn), recurrent_of(cn.LSNNRecurrent)),
        norse_case("LICell", lambda lib: lib.LICell(), lambda m: cn.LI(m.p), spikes=False),
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
            return float(loss.detach())

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


def _case_rows(case: Case, x, repeats: int) -> list[dict]:
    """``case``'s forms, their outputs checked against the peer's first form, timed per training step."""
    import torch

    from .common import round_robin

    torch.manual_seed(1)
    peer = case.make_peer()
    torch.manual_seed(1)
    ours = case.make_ours()
    ours.load_state_dict(peer.state_dict())
    calls = {f"{case.peer}, {form}": fn for form, fn in case.peer_forms(peer).items()}
    calls.update({f"{case.ours}, {form}": fn for form, fn in case.our_forms(ours).items()})
    baseline = next(iter(calls))
    want, differing = None, {}
    for name, fn in calls.items():
        out = fn(x).detach()
        want = out if want is None else want
        differing[name] = int((out != want).sum())
        if differing[name] and not name.endswith(tuple(f", {form}" for form in case.ties)):
            raise AssertionError(f"{name}: output differs from the peer's ({differing[name]} elements)")

    def step(fn):
        def train_step():
            xg = x.clone().requires_grad_()
            fn(xg).sum().backward()

        return train_step

    times = round_robin({name: step(fn) for name, fn in calls.items()}, repeats)
    return [
        {
            "peer": case.peer,
            "implementation": name,
            "ms_per_step": round(seconds * 1e3, 3),
            "vs_peer_loop": round(seconds / times[baseline], 3),
            "spike_rate": round(float(want.float().mean()), 4) if case.spikes else "",
            "spikes_differing": differing[name] if case.spikes else "",
        }
        for name, seconds in times.items()
    ]


def run(args) -> int:
    import os
    from pathlib import Path

    import torch

    from ..threads import set_threads
    from .common import command_line, machine_info, markdown_table, result_tag, write_csv

    T, B, N, repeats = (6, 2, 8, 2) if args.quick else (args.T, args.batch_size, args.neurons, args.repeats)
    conv = (2, 4) if args.quick else (args.conv_channels, args.conv_side)
    set_threads(args.threads)
    load_before = os.getloadavg()[0]
    rows = []
    for case in _cases(T, B, N, conv):
        if args.only and not any(text in case.peer for text in args.only):
            continue
        rows += _case_rows(case, case.make_input(torch.Generator().manual_seed(0)), repeats)
    features = (12, 10, 4) if args.quick else (700, 256, 20)
    if not args.only or any(text in "snnTorch model" for text in args.only):
        rows += _model_rows(T, B, repeats, features)
    load = (load_before, os.getloadavg()[0])
    tag = result_tag(args)
    out = Path(args.out)
    write_csv(out / f"dropins_{tag}.csv", rows)
    table = markdown_table(
        ["implementation", "ms per training step", "time / peer's", "spike rate", "spikes differing"],
        [
            [r["implementation"], r["ms_per_step"], r["vs_peer_loop"], r["spike_rate"], r.get("spikes_differing", "")]
            for r in rows
        ],
    )
    text = "\n".join(
        [
            f"# Drop-ins against their peers: T={T}, batch {B}, {N} neurons, forward+backward per training step",
            "",
            f"Machine: {machine_info()}",
            f"Command: `{command_line()}`",
            f"Load average (1 min) at the start and the end: {load[0]:.1f}, {load[1]:.1f} on {os.cpu_count()} cores"
            + (
                ": other processes shared the machine, so the times are noisy (the ratios of rows timed in turn "
                "less so)"
                if max(load) > (os.cpu_count() or 1) - args.threads + 0.5
                else ""
            ),
            "",
            "Medians of round-robin runs in one process. For each drop-in: the installed peer as its users call it "
            "('loop': one step a call in a Python loop; 'sequence': snnTorch's StateLeaky and LinearLeaky, which "
            "take the whole sequence), then the drop-in called the same way and its fused call over all T steps "
            "(snnTorch's `sequence`, SpikingJelly's step_mode='m', Norse's multi-step module of the cell: `LIF`, "
            "`LSNN`, `LIFRecurrent`, `LSNNRecurrent`, `LI`); 'time / peer's' against the peer's first row. Every "
            "form's output (Norse's LI: the membrane) was checked equal to the peer's first, bit for bit, except "
            "the forms of ours that may differ where a membrane lies within rounding of the threshold "
            "(`sparse=True`, `recursive=True`): 'spikes differing' counts theirs (a recurrent layer carries a "
            f"flipped spike on). Inputs uniform in [0, 1) of [T, B, {N}] (the recurrent convolutions: [T, B, "
            f"{conv[0]}, {conv[1]}, {conv[1]}], kernel 3; StateLeaky: shifted by -0.3). The last rows: a "
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
