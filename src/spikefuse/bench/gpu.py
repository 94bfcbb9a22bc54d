"""``spikefuse bench gpu``: one spiking layer on a CUDA GPU, spikefuse's Triton kernels against the peers' GPU
implementations and the memory-bandwidth floor (Fig. 5 of the temporal-fusion paper on a GPU).

One layer of N neurons, fp32 (the groups ending in ``-fp16``: fp16), at each T: forward alone and forward+backward
(``y.backward(g)`` into a leaf input whose ``.grad`` is freed inside the timed run), every implementation as its
users run it, timed with CUDA events, round-robin, medians. Groups of one dynamics, each implementation's spikes
compared with the group's first:

- ``sj-lif``: SpikingJelly 2.0's ``LIFNode(step_mode='m')`` (on CUDA a pip install runs its Triton kernel: its native
  CUDA ops need a source build) against :class:`spikefuse.compat.spikingjelly.LIFNode` with the same arguments;
  ``sj-lif-fp16``: the same on a float16 input (spikefuse reads and writes float16, its membrane float32;
  SpikingJelly's membrane takes the input's dtype, which its Triton kernel does not run: its PyTorch reference);
- ``paper-lif``: Eq. (1)-(2) (decay 0.2, threshold 0.3, sigmoid surrogate 4) as ``spikefuse.lif`` runs it (both
  memory modes), an eager loop, ``torch.compile`` of that loop, snnTorch's ``Leaky`` and Norse's ``LIFBoxCell`` (the
  last two fire on ``>``); ``paper-lif-fp16``: ``spikefuse.lif`` on a float16 input;
- ``cuba``: :class:`spikefuse.nn.CubaLIF` against a loop over snnTorch's ``Synaptic``;
- ``lsnn``: spikefuse's definition of Norse's LSNN against Norse's ``LSNN`` module;
- ``alif``: :class:`spikefuse.nn.ALIF` (no peer has these dynamics).

The floor is the bytes a fused layer must move per neuron-step over the device-to-device copy bandwidth measured in
the same run: forward 12 (read x, write spikes and the membrane) with ``memory="potential"``, 8 (read x, write
spikes) with ``"recompute"``; forward+backward 24 and 20 (backward: read the upstream gradient and the membrane, or
x, write grad_x), for every state count; in float16 x, spikes and the gradients take 2 bytes, the membrane 4.
Memory: the bytes a forward leaves allocated for its backward (beyond its output) and the peak of a
forward+backward, both over what was allocated before.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import ours, peers
from .peers import ALPHA, DECAY, THRESHOLD
from .common import add_result_args, command_line, gpu_machine_info, markdown_table, result_tag, write_csv


def floor_bytes(memory: str, element: int) -> tuple[int, int]:
    """Bytes per neuron-step (forward, forward+backward) for streams of ``element`` bytes; the membrane is float32."""
    if memory == "potential":  # x, spikes, membrane; then the upstream gradient, membrane, grad_x
        return 2 * element + 4, 4 * element + 8
    return 2 * element, 5 * element  # x, spikes; then the upstream gradient, x, grad_x


@dataclass
class Case:
    name: str
    group: str
    run: Callable[[torch.Tensor], torch.Tensor]
    memory: str | None = None  # ours: the memory mode, which sets the floor; None for peers
    note: str = ""
    dtype: torch.dtype = torch.float32


def _eager_lif(x: torch.Tensor) -> torch.Tensor:
    from .neuron import eager_lif

    return eager_lif(x)


def cases(include_compile: bool) -> tuple[list[Case], list[str]]:
    """The implementations, and a line for each peer that could not be built."""
    import spikefuse
    from spikefuse.compat import spikingjelly as sf_spikingjelly
    from spikefuse.nn import ALIF, CubaLIF
    from spikefuse.surrogate import Sigmoid

    sj_args = dict(tau=1.0 / (1.0 - DECAY), decay_input=False, v_threshold=THRESHOLD, v_reset=0.0, step_mode="m")
    # one module per case: a module's last output state holds its graph (the saved potentials) until its next
    # reset, which would free it inside another case's memory measurement
    sf_sj = sf_spikingjelly.LIFNode(**sj_args, surrogate_function=Sigmoid(ALPHA))
    sf_sj_recompute = sf_spikingjelly.LIFNode(**sj_args, surrogate_function=Sigmoid(ALPHA), memory="recompute")
    sf_sj_fp16 = sf_spikingjelly.LIFNode(**sj_args, surrogate_function=Sigmoid(ALPHA))
    found = [
        Case("spikefuse compat.spikingjelly.LIFNode", "sj-lif", lambda x: sf_sj.reset() or sf_sj(x), "potential"),
        Case(
            "spikefuse compat.spikingjelly.LIFNode (recompute)",
            "sj-lif",
            lambda x: sf_sj_recompute.reset() or sf_sj_recompute(x),
            "recompute",
        ),
        Case(
            "spikefuse compat.spikingjelly.LIFNode fp16",
            "sj-lif-fp16",
            lambda x: sf_sj_fp16.reset() or sf_sj_fp16(x),
            "potential",
            dtype=torch.float16,
        ),
    ]
    for group, dtype in (("paper-lif", torch.float32), ("paper-lif-fp16", torch.float16)):
        for memory in ("potential", "recompute"):
            name = f"spikefuse.lif{' fp16' if dtype == torch.float16 else ''} ({memory})"
            found.append(
                Case(
                    name,
                    group,
                    lambda x, m=memory: spikefuse.lif(
                        x, decay=DECAY, threshold=THRESHOLD, surrogate=Sigmoid(ALPHA), memory=m
                    ),
                    memory,
                    dtype=dtype,
                )
            )
    found.append(Case("PyTorch eager (unbind loop)", "paper-lif", _eager_lif))
    if include_compile:
        found.append(Case("PyTorch torch.compile (unbind loop)", "paper-lif", torch.compile(_eager_lif, dynamic=False)))
    # snnTorch detaches the reset; its surrogate ATan(2)
    cuba = CubaLIF(0.8, 0.9, surrogate="atan", detach_reset=True, memory="recompute").cuda()
    found.append(Case("spikefuse CubaLIF", "cuba", cuba, "recompute"))
    alif = ALIF(0.9, 0.95, detach_reset=True, memory="recompute").cuda()
    found.append(Case("spikefuse ALIF", "alif", alif, "recompute"))
    missing = [] if include_compile else ["torch.compile: skipped (--no-compile)"]
    for build in (
        _spikingjelly,
        _spikingjelly_fp16,
        _snntorch_leaky,
        _snntorch_synaptic,
        _norse_lif,
        _spikefuse_lsnn,
        _norse_lsnn,
    ):
        try:
            found.append(build())
        except Exception as err:  # a missing or broken peer is reported in the results, not fatal
            missing.append(f"{build.__name__.lstrip('_')}: {type(err).__name__}: {err}")
    order = ["sj-lif", "sj-lif-fp16", "paper-lif", "paper-lif-fp16", "cuba", "lsnn", "alif"]
    return sorted(found, key=lambda c: order.index(c.group)), missing


def _spikingjelly() -> Case:
    # SpikingJelly picks its implementation per call (SJ_LIF_CUDA_IMPLEMENTATION unset, as its users run it); a pip
    # install has no native CUDA build, so a float32 input runs its Triton kernel
    return Case("SpikingJelly 2.0 LIFNode (its Triton kernel)", "sj-lif", peers.spikingjelly_lif("cuda"))


def _spikingjelly_fp16() -> Case:
    return Case(
        "SpikingJelly 2.0 LIFNode fp16 (its PyTorch reference)",
        "sj-lif-fp16",
        peers.spikingjelly_lif("cuda"),
        dtype=torch.float16,
        note="its membrane takes the input's dtype, and its Triton kernel needs a "
        "float32 membrane, so a float16 input runs its PyTorch reference; float16 membrane arithmetic flips "
        "spikes",
    )


def _snntorch_leaky() -> Case:
    return Case(
        "snnTorch Leaky loop", "paper-lif", peers.snntorch_leaky("cuda"), note="fires on >, reset always detached"
    )


def _snntorch_synaptic() -> Case:
    return Case("snnTorch Synaptic loop", "cuba", peers.snntorch_synaptic(0.8, 0.9, "cuda"))


def _norse_lif() -> Case:
    return Case(
        "Norse LIFBoxCell loop", "paper-lif", peers.norse_lif_box("cuda"), note="v + dt/tau*(x - v), fires on >"
    )


def _spikefuse_lsnn() -> Case:  # Norse's default parameters: needs Norse
    return Case("spikefuse Norse-LSNN definition", "lsnn", ours.norse_lsnn("cuda"), "recompute")


def _norse_lsnn() -> Case:
    import norse.torch as norse

    layer = norse.LSNN().cuda()
    return Case("Norse LSNN", "lsnn", lambda x: layer(x)[0])


def _inputs(group: str, dtype: torch.dtype, t_steps: int, n: int, gen: torch.Generator) -> torch.Tensor:
    scale = {"lsnn": 3.0}.get(group, 0.6)
    return (torch.rand(t_steps, n, generator=gen, device="cuda") * scale).to(dtype)


def _median_ms(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median milliseconds of each function, timed with CUDA events, run in turns (round-robin)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end))
    return {name: statistics.median(v) for name, v in samples.items()}


def _memory(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor) -> tuple[float, float]:
    """(MiB kept for backward beyond the output, MiB peak of forward+backward), over what was allocated before."""
    leaf = x.clone().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = fn(leaf)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.nbytes
    y.backward(g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return kept / 2**20, peak / 2**20


def run(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("spikefuse bench gpu needs a CUDA GPU: none is visible to PyTorch here")
    found, missing = cases(not args.no_compile)
    copy_bytes = 1 << 30
    src, dst = torch.rand(copy_bytes // 4, device="cuda"), torch.empty(copy_bytes // 4, device="cuda")
    rows = []
    for n in args.neurons:
        for t_steps in args.T:
            gen = torch.Generator(device="cuda").manual_seed(t_steps)
            dtypes = {c.group: c.dtype for c in found}
            x = {group: _inputs(group, dtype, t_steps, n, gen) for group, dtype in dtypes.items()}
            upstream = torch.randn(t_steps, n, generator=gen, device="cuda")
            upstreams = {group: upstream.to(dtype) for group, dtype in dtypes.items()}
            leaves = {group: inputs.clone().requires_grad_() for group, inputs in x.items()}
            if not args.no_compile:
                torch._dynamo.reset()  # torch.compile compiles again for each shape, as a user with one T sees it
            first = {}
            mismatch = {}
            with torch.no_grad():
                for c in found:
                    spikes = c.run(x[c.group]).float()
                    first.setdefault(c.group, spikes)
                    mismatch[c.name] = float((spikes != first[c.group]).float().mean())
            del first

            def forward(c):
                def go():
                    with torch.no_grad():
                        c.run(x[c.group])

                return go

            def forward_backward(c):
                def go():
                    c.run(leaves[c.group]).backward(upstreams[c.group])
                    leaves[c.group].grad = None

                return go

            fwd = _median_ms({c.name: forward(c) for c in found}, args.repeats)
            both = _median_ms({c.name: forward_backward(c) for c in found}, args.repeats)
            copy_ms = _median_ms({"copy": lambda: dst.copy_(src)}, args.repeats)["copy"]
            bandwidth = 2 * copy_bytes / (copy_ms * 1e-3)
            memory = {c.name: _memory(c.run, x[c.group], upstreams[c.group]) for c in found}
            for c in found:
                ours = next(o for o in found if o.group == c.group and o.memory)
                row = {
                    "N": n,
                    "T": t_steps,
                    "group": c.group,
                    "implementation": c.name,
                    "forward_ms": round(fwd[c.name], 4),
                    "forward_backward_ms": round(both[c.name], 4),
                    "speedup_of_ours": round(both[c.name] / both[ours.name], 2),
                    "spike_mismatch": mismatch[c.name],
                    "kept_for_backward_MiB": round(memory[c.name][0], 1),
                    "peak_MiB": round(memory[c.name][1], 1),
                    "copy_GBps": round(bandwidth / 1e9, 1),
                    "floor_fraction_forward": "",
                    "floor_fraction_forward_backward": "",
                    "note": c.note,
                }
                if c.memory:
                    f_bytes, fb_bytes = floor_bytes(c.memory, c.dtype.itemsize)
                    row["floor_fraction_forward"] = round(f_bytes * t_steps * n / bandwidth * 1e3 / fwd[c.name], 3)
                    row["floor_fraction_forward_backward"] = round(
                        fb_bytes * t_steps * n / bandwidth * 1e3 / both[c.name], 3
                    )
                rows.append(row)
            print(f"N={n:,} T={t_steps}: " + ", ".join(f"{c.name} {both[c.name]:.2f} ms" for c in found), flush=True)
    write_results(args, rows, missing)


def write_results(args, rows: list[dict], missing: list[str]) -> None:
    stem = Path(args.out) / f"gpu_{args.tag}"
    write_csv(stem.with_suffix(".csv"), rows)
    device = torch.cuda.get_device_name()
    table = markdown_table(
        [
            "N",
            "T",
            "implementation",
            "fwd ms",
            "fwd+bwd ms",
            "x ours (fwd+bwd)",
            "floor fraction fwd / fwd+bwd",
            "kept for bwd MiB",
            "peak MiB",
            "spikes differing",
        ],
        [
            [
                f"{r['N']:,}",
                r["T"],
                r["implementation"],
                f"{r['forward_ms']:.3f}",
                f"{r['forward_backward_ms']:.3f}",
                f"{r['speedup_of_ours']:.2f}",
                f"{r['floor_fraction_forward']} / {r['floor_fraction_forward_backward']}"
                if r["floor_fraction_forward"]
                else "",
                r["kept_for_backward_MiB"],
                r["peak_MiB"],
                f"{r['spike_mismatch']:.1e}",
            ]
            for r in rows
        ],
    )
    text = [
        f"# One spiking layer on a GPU ({device}), fp32 (groups ending in -fp16: fp16)",
        "",
        f"Machine: {gpu_machine_info()}",
        f"Command: `{command_line()}`",
        "",
        f"Medians of {args.repeats} round-robin runs after two warm-ups, timed with CUDA events. 'x ours': the "
        "implementation's forward+backward time over that of spikefuse's first implementation of the same dynamics "
        "(group). Floor: the bytes the layer must move per neuron-step (forward 12 with memory='potential', 8 with "
        "'recompute'; forward+backward 24 and 20; in fp16 8, 4, 16 and 10: the membrane stays fp32) over the "
        "device-to-device copy bandwidth of the same run ("
        + ", ".join(sorted({f"{r['copy_GBps']} GB/s" for r in rows}))
        + "). 'kept for bwd': allocated after the "
        "forward beyond the output; 'peak': of forward+backward, over what was allocated before. 'spikes "
        "differing': fraction of spikes that differ from the group's first row.",
        "",
        table,
    ]
    notes = [f"- {r['implementation']}: {r['note']}" for r in rows if r["note"]]
    if notes:
        text += ["", *dict.fromkeys(notes)]
    if missing:
        text += ["", "Not measured: " + "; ".join(missing)]
    stem.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    print(f"wrote {stem}.md/.csv")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("gpu", help="one spiking layer on a CUDA GPU vs SpikingJelly, snnTorch, Norse, torch")
    p.add_argument(
        "--neurons", type=int, nargs="+", default=[1_000_000, 16_000_000], help="layer sizes (default: %(default)s)"
    )
    p.add_argument("--T", type=int, nargs="+", default=[32], help="time steps (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per case, median (default: %(default)s)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--quick", action="store_true", help="tiny sizes and no torch.compile, to check the harness")
    add_result_args(p)
    p.set_defaults(func=_run_cli)


def _run_cli(args) -> None:
    if args.quick:
        args.neurons, args.T, args.repeats, args.no_compile = [20_000], [4], 3, True
    args.tag = result_tag(args)
    if min(args.neurons) <= 0 or min(args.T) <= 0:
        raise SystemExit("--neurons and --T must be positive")
    run(args)
