"""``spikefuse bench layers``: where the time of a lean network's neurons goes, site by site.

Every site of the lean form of a model (:func:`spikefuse.nn.to_lean`) where a BatchNorm feeds a neuron -- a fused
BatchNorm+LIF, a fused BatchNorm+add+LIF ending a residual block, the stem's convolution+BatchNorm+LIF -- is timed,
forward and backward with an upstream gradient, on an input of the shape it gets in the model's training step, in
the three forms that ``spikefuse bench memory`` compares whole:

- ``lean``: the site's own module as ``to_lean`` made it (the residual as the block passes it: the block's input
  spikes saved as bits, or a downsampling shortcut's float output; the stem recomputes its convolution in backward);
- ``default``: what the default form runs there: ``F.batch_norm``, the residual add, then the fused LIF
  (:func:`spikefuse.lif`, saving the potentials), after the convolution at the stem;
- ``floor``: what the convolution floor runs there: a ReLU after the residual add, no BatchNorm (after the
  convolution at the stem).

Sites of the same kind, shape and residual are timed once and counted. The lean and default forms of a site must
give the same spikes on the same input (checked). Every case runs in turn, round after round (``round_robin``), so
that a drift of the shared machine hits all alike; times are the medians over the rounds. The totals weight each
site by its count: the neurons' share of one training step in each form, the time ``bench memory``'s ratios are
made of (without the convolutions, spike packing of conv inputs, pooling and the optimizer).

Writes ``bench-layers[-quick].md`` and ``.csv`` with the machine and the exact command.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .common import (
    add_training_step_args,
    command_line,
    machine_info,
    markdown_table,
    round_robin,
    training_step_line,
    write_csv,
)

QUICK = {"T": 2, "batch_size": 2, "image_size": 8, "resnet_width": 8, "repeats": 2}
FORMS = ("lean", "default", "floor")
COLUMNS = [
    "site",
    "input_shape",
    "residual",
    "count",
    "lean_ms",
    "default_ms",
    "floor_ms",
    "lean_vs_default",
    "lean_minus_floor_ms",
]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "layers",
        help="time of every BatchNorm+neuron site of a lean network: lean vs default vs the floor's ReLU",
        description=__doc__.split("\n\n")[1],
    )
    add_training_step_args(p, QUICK)
    p.add_argument("--repeats", type=int, default=30, help="timed rounds (default: %(default)s)")
    return p


class _Site:
    """One site: its three forms as closures over the same inputs, each returning the spikes (or ReLU output)."""

    def __init__(self, name: str, shape: tuple, residual: str, forms: dict[str, Callable], leaves: list):
        self.name, self.shape, self.residual, self.forms, self.leaves = name, shape, residual, forms, leaves
        self.count = 1

    def case(self, form: str, grad) -> Callable[[], None]:
        def run():
            self.forms[form]().backward(grad)

        return run

    def clear_grads(self) -> None:
        for t in self.leaves:
            t.grad = None


def _bn_forms(bn_lif, z_of: Callable, residual) -> dict[str, Callable]:
    """The default and floor forms after a BatchNorm+LIF module ``bn_lif`` whose input is ``z_of()``."""
    import torch
    import torch.nn.functional as F

    import spikefuse

    from ..batchnorm.modules import batchnorm_call_args

    kw = bn_lif.lif_arguments(torch.empty(0))
    kw.update(v_init=None, return_state=False)
    # the BatchNorm arguments as nn.BatchNorm decides them, once; the running statistics copied, since the lean
    # module updates its own
    running_mean, running_var, weight, bias, training, momentum, eps = batchnorm_call_args(bn_lif)
    running_mean, running_var = (None if t is None else t.clone() for t in (running_mean, running_var))

    def default():
        z = z_of()
        y = F.batch_norm(z.flatten(0, 1), running_mean, running_var, weight, bias, training, momentum, eps)
        y = y.unflatten(0, z.shape[:2])
        return spikefuse.lif(y if residual is None else y + residual, **kw)

    def floor():
        z = z_of()
        return torch.relu(z if residual is None else z + residual)

    return {"default": default, "floor": floor}


def _sites(cfg: dict) -> list[_Site]:
    """The model's lean form, run once on the bench input to record each site's inputs, then one :class:`_Site` per
    distinct (kind, input shape, residual)."""
    import torch

    from ..batchnorm.modules import BatchNormLIFBase, ConvBatchNormLIF
    from .memory import make_form, step_input

    model, reset = make_form({**cfg, "form": "lean"})
    calls = []

    def record(module, args, kwargs):
        calls.append((module, args, kwargs))

    hooks = [
        m.register_forward_pre_hook(record, with_kwargs=True)
        for m in model.modules()
        if isinstance(m, (BatchNormLIFBase, ConvBatchNormLIF))
    ]
    stem_inner = {id(m.bn_lif) for m in model.modules() if isinstance(m, ConvBatchNormLIF)}
    x, _ = step_input(cfg)
    reset(model)
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    sites: dict[tuple, _Site] = {}
    for module, args, kwargs in calls:
        if id(module) in stem_inner:
            continue
        if isinstance(module, ConvBatchNormLIF):
            site = _conv_site(module, args[0])
        else:
            site = _bn_site(module, args, kwargs, gen)
        key = (site.name, site.shape, site.residual)
        if key in sites:
            sites[key].count += 1
        else:
            sites[key] = site
    return list(sites.values())


def _conv_site(module, image) -> _Site:
    image = image.clone()
    conv = module.conv

    def conv_out():
        return conv(image.flatten(0, 1)).unflatten(0, image.shape[:2])

    forms = {"lean": lambda: module(image), **_bn_forms(module.bn_lif, conv_out, None)}
    return _Site("conv+BN+LIF", tuple(image.shape), "-", forms, list(module.parameters()))


def _bn_site(module, args, kwargs, gen) -> _Site:
    import inspect

    import torch

    call = inspect.signature(module.forward).bind(*args, **kwargs)
    call.apply_defaults()
    residual, binary = call.arguments["residual"], bool(call.arguments["residual_binary"])
    shape = tuple(args[0].shape)
    # a conv output's scale after BatchNorm's init: the neurons fire at a rate like the model's
    x = (torch.randn(shape, generator=gen) * 0.5 + 0.3).requires_grad_()
    leaves = [x, *module.parameters()]
    if residual is None:
        kind, res = "-", None
    elif binary:
        kind, res = "spikes (bits)", (torch.rand(shape, generator=gen) < 0.2).float().requires_grad_()
    else:
        kind, res = "float", (torch.randn(shape, generator=gen) * 0.3).requires_grad_()
    if res is not None:
        leaves.append(res)
    name = "BN+add+LIF" if residual is not None else "BN+LIF"
    forms = {"lean": lambda: module(x, res, binary), **_bn_forms(module, lambda: x, res)}
    return _Site(name, shape, kind, forms, leaves)


def _check_same_spikes(site: _Site) -> None:
    import torch

    with torch.no_grad():
        lean, default = site.forms["lean"](), site.forms["default"]()
    if not torch.equal(lean, default):
        raise SystemExit(
            f"bench layers: the lean and default forms of the {site.name} site {site.shape} give "
            f"different spikes in {int((lean != default).sum())} elements"
        )


def run(args) -> int:
    from ..threads import threads_while
    from .memory import TIMING_MMAP_THRESHOLD, _set_malloc_thresholds

    # as bench memory times its steps: freed buffers stay on the heap for the next call instead of faulting in anew
    _set_malloc_thresholds(TIMING_MMAP_THRESHOLD)
    cfg = {
        "model": args.model,
        "T": args.T,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "resnet_width": args.resnet_width,
        "stem": args.stem,
        "seed": args.seed,
    }
    repeats = args.repeats
    if args.quick:
        cfg.update({k: v for k, v in QUICK.items() if k != "repeats"})
        repeats = QUICK["repeats"]
    if repeats < 1:
        raise SystemExit(f"bench layers: --repeats must be at least 1, got {repeats}")
    with threads_while(args.threads):
        return _run(args, cfg, repeats)


def _row(site: str, shape: str, residual: str, count: int, ms: dict[str, float], digits: int) -> dict:
    """A result row: a site's (or the total's) milliseconds per form and lean's ratio to the default and excess
    over the floor, rounded to ``digits`` decimals (the ratio to 3)."""
    return {
        "site": site,
        "input_shape": shape,
        "residual": residual,
        "count": count,
        **{f"{form}_ms": round(ms[form], digits) for form in FORMS},
        "lean_vs_default": round(ms["lean"] / ms["default"], 3),
        "lean_minus_floor_ms": round(ms["lean"] - ms["floor"], digits),
    }


def _run(args, cfg: dict, repeats: int) -> int:
    import sys
    from pathlib import Path

    import torch

    sites = _sites(cfg)
    cases, setups = {}, {}
    for i, site in enumerate(sites):
        _check_same_spikes(site)
        with torch.no_grad():
            grad = torch.randn(site.forms["lean"]().shape, generator=torch.Generator().manual_seed(cfg["seed"] + 2))
        for form in FORMS:
            cases[(i, form)] = site.case(form, grad)
            setups[(i, form)] = site.clear_grads
    print(f"bench layers: {len(sites)} distinct sites, {len(cases)} cases, {repeats} rounds", file=sys.stderr)
    medians = round_robin(cases, repeats, warmup=2, setups=setups)

    rows, table = [], []
    totals = dict.fromkeys(FORMS, 0.0)
    for i, site in enumerate(sites):
        ms = {form: medians[(i, form)] * 1e3 for form in FORMS}
        for form in FORMS:
            totals[form] += site.count * ms[form]
        rows.append(_row(site.name, "x".join(map(str, site.shape)), site.residual, site.count, ms, digits=4))
        table.append([rows[-1][c] for c in COLUMNS])
    rows.append(_row("all sites, x count", "", "", sum(s.count for s in sites), totals, digits=3))
    table.append([f"**{rows[-1][c]}**" if rows[-1][c] != "" else "" for c in COLUMNS])

    tag = "-quick" if args.quick else ""
    out = Path(args.results_dir)
    write_csv(out / f"bench-layers{tag}.csv", rows)
    text = (
        "\n\n".join(
            [
                "# bench layers",
                f"Machine: {machine_info()}",
                f"Command: `{command_line()}`",
                f"{training_step_line(cfg)}; each site forward + backward with an upstream gradient, medians of {repeats} "
                "rounds (every case in turn each round); input shapes [T, B, C, ...] (the stem's: its image).",
                markdown_table(COLUMNS, table),
                "- lean: the site's module of `spikefuse.nn.to_lean` (fused BatchNorm+LIF; +add with the block's shortcut, "
                "as bits when it is the block's input spikes; the stem's convolution recomputed in backward); default: "
                "`F.batch_norm`, the add, `spikefuse.lif` (saving the potentials); floor: ReLU after the add, no "
                "BatchNorm. Lean and default gave the same spikes on every site (checked).",
            ]
        )
        + "\n"
    )
    (out / f"bench-layers{tag}.md").write_text(text)
    print(markdown_table(COLUMNS, table))
    print(f"wrote {out / f'bench-layers{tag}.md'} and {out / f'bench-layers{tag}.csv'}")
    return 0
