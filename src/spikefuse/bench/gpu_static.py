"""``spikefuse bench gpu-static``: the Triton kernels compiled for A100 (sm_80) and H100 (sm_90) without a GPU.

Compiles the kernels the neuron engine generates (:mod:`spikefuse.ops.engine.triton`, through
:mod:`spikefuse.bench.triton_aot`) for the shipped neurons (the paper's LIF, CubaLIF, ALIF) in every dtype and memory
mode, and (standard set) every LIF definition behind the public API with the surrogates cycled, and reports per
kernel: registers per thread, local memory (spills), the width of the global loads / stores in the time loops of
the PTX, and the DRAM bytes per neuron-step. From the bytes it estimates the time of one LIF layer (the
temporal-fusion paper's Fig. 5: N = 1M neurons, T = 4..128) as bytes / bandwidth on an A100, an H100 and an RTX
4090, plus ~5 us launch overhead per kernel, and checks from the register counts whether enough loads are in flight
to reach that bandwidth. Next to it: SpikingJelly's published Triton LIF figure. Writes
``benchmarks/results/gpu_static.md`` and ``gpu_static.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Peak DRAM bandwidth, SMs and per-SM limits. The A100 figure is the brief's 1.94e12 B/s, which is the A100 80GB
#: PCIe card (1,935 GB/s); the A100 80GB SXM4 has 2,039 GB/s (5% more, times 5% less).
GPUS = {
    "A100": dict(name="A100 80GB PCIe", bw=1.94e12, sms=108, max_threads=2048, max_ctas=32, arch=80),
    "H100": dict(name="H100 SXM5 80GB", bw=3.35e12, sms=132, max_threads=2048, max_ctas=32, arch=90),
    "RTX4090": dict(name="RTX 4090", bw=1.008e12, sms=128, max_threads=1536, max_ctas=24, arch=80),  # sm_89: sm_80 regs
}
LAUNCH_US = 5.0  # per kernel launch (host + GPU front end), order of magnitude
LATENCY_NS = 600.0  # loaded DRAM latency assumed for the latency-hiding check
REGS_PER_SM = 65536
T_DEFAULT = (4, 8, 16, 32, 64, 128)
N_DEFAULT = 1_000_000
#: SpikingJelly's Triton LIF (fwd + bwd, float16, x of shape [T=32, 64, 65536]) on an RTX 4090, as quoted in the issue.
SJ = dict(T=32, N=64 * 65536, xdt="fp16", ms=3.37, gpu="RTX4090")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "gpu-static",
        help="compile the Triton kernels for sm_80/sm_90 without a GPU: registers, spills, vector width, roofline",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--set",
        dest="case_set",
        choices=("shipped", "standard", "full"),
        default="standard",
        help="shipped: the paper's LIF, CubaLIF and ALIF x dtype x memory mode; standard: also every LIF "
        "definition of the public API in fp32 with the surrogates cycled; full: those with every "
        "surrogate in every dtype (default: %(default)s)",
    )
    p.add_argument(
        "--archs", nargs="+", default=["sm_80", "sm_90"], choices=["sm_80", "sm_90"], help="GPU targets compiled for"
    )
    p.add_argument("--jobs", type=int, default=2, help="compiler processes (default: %(default)s)")
    p.add_argument("--T", nargs="+", type=int, default=list(T_DEFAULT), help="time steps of the roofline table")
    p.add_argument("--N", type=int, default=N_DEFAULT, help="neurons of the roofline table (default: %(default)s)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="Triton cache (default: a fresh temporary folder, so every kernel is really compiled)",
    )
    p.add_argument("--results-dir", default="benchmarks/results", help="(default: %(default)s)")
    p.add_argument(
        "--render",
        metavar="JSON",
        default=None,
        help="only re-render the markdown from a gpu_static.json of an earlier run (no compilation)",
    )
    return p


# ----------------------------------------------------------------------------------------------------------------
# Estimates
# ----------------------------------------------------------------------------------------------------------------


def occupancy(regs: int, gpu: dict, threads: int = 128) -> int:
    """Resident CTAs per SM for ``regs`` registers per thread (allocated per warp in units of 256)."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    warps = REGS_PER_SM // per_warp
    return max(0, min(warps // (threads // 32), gpu["max_ctas"], gpu["max_threads"] // threads))


def kernel_estimate(case: dict, res: dict, gpu: dict, T: int, N: int) -> dict:
    """Bytes, bytes / bandwidth, and the latency-hiding check of one kernel over ``T`` steps of ``N`` neurons."""
    from .triton_aot import NUM_THREADS, traffic

    tr = traffic(case)
    total = T * N * tr["per_step"] + N * tr["per_neuron"]
    bound_us = total / gpu["bw"] * 1e6
    block = case["const"]["BLOCK"]
    ctas = math.ceil(N / block)
    resident = min(occupancy(res["reg"], gpu), math.ceil(ctas / gpu["sms"]))
    # Loads in flight: each warp has one time step's loads outstanding (the next step's loads are issued after
    # this step's arithmetic); the loop's loads are the streams read per step.
    ept = block // NUM_THREADS
    load_bytes = sum(b for name, b in tr["streams"] if "read" in name)
    inflight = resident * NUM_THREADS * ept * load_bytes  # per SM
    needed = gpu["bw"] / gpu["sms"] * LATENCY_NS * 1e-9 * load_bytes / tr["per_step"]
    ratio = inflight / needed
    return dict(
        bytes=total,
        bound_us=bound_us,
        resident_ctas=resident,
        mlp_ratio=ratio,
        est_us=bound_us / min(1.0, ratio) + LAUNCH_US,
    )


SHIPPED = ("lif_hard", "cuba_lif", "alif")  # the paper's LIF (Eq. (1)-(2)), CubaLIF, ALIF


def _shipped_models() -> dict:
    from ..neurons import ALIF_MODEL, CUBA_LIF, LIF_MODELS

    return {m.name: m for m in (LIF_MODELS[("paper", "hard")], CUBA_LIF, ALIF_MODEL)}


def shipped_cases(N: int, dtypes=("fp32", "fp16", "bf16", "fp64"), T: int = 32) -> list[dict]:
    """The shipped neurons' forward and backward in every dtype and memory mode (per-channel parameters, every
    gradient), and the LIF's backward without the decay's gradient (a fixed decay, as SpikingJelly's LIF has)."""
    from . import triton_aot as A

    cases = []
    for name, model in _shipped_models().items():
        for xdt in dtypes:
            for kernel in A.ENGINE_KERNELS:
                for saved in (True, False):
                    cases.append(A.engine_case(model, "Sigmoid", kernel, xdt, saved=saved, T=T, N=N))
                    if name == "lif_hard" and kernel == "engine-bwd":
                        fixed = A.engine_case(model, "Sigmoid", kernel, xdt, saved=saved, need_params=False, T=T, N=N)
                        cases.append(dict(fixed, id=fixed["id"] + "-fixed", group=fixed["group"] + "-fixed"))
    return cases


def definition_cases(N: int, dtypes=("fp32",), every_surrogate: bool = False, T: int = 32) -> list[dict]:
    """Every LIF definition behind the public API (the paper's, snnTorch's and SpikingJelly's forms), forward and
    recomputing backward, with the surrogates cycled (or each of them), group ``all``."""
    from ..neurons import LIF_MODELS, SPIKINGJELLY_MODELS, SPIKINGJELLY_PRE_RESET_MODELS
    from . import triton_aot as A
    from ..surrogate import SURROGATES

    surrogates = [cls.__name__ for cls in SURROGATES.values()]
    models = {
        m.name: m
        for m in (*LIF_MODELS.values(), *SPIKINGJELLY_MODELS.values(), *SPIKINGJELLY_PRE_RESET_MODELS.values())
    }
    cases = []
    for i, model in enumerate(models.values()):
        for xdt in dtypes:
            for kernel in A.ENGINE_KERNELS:
                for sg in surrogates if every_surrogate else [surrogates[i % len(surrogates)]]:
                    c = A.engine_case(model, sg, kernel, xdt, T=T, N=N)
                    cases.append(dict(c, id=c["id"] + "-all", group="all"))
    return cases


def _case_for(cases, kernel, xdt, model, saved, need_params=True):
    return next(
        c
        for c in cases
        if c["kernel"] == kernel
        and c["xdt"] == xdt
        and c["group"] != "all"
        and c["model"]["name"] == model
        and c["const"][("SAVED" if kernel == "engine-bwd" else "SAVE")] == saved
        and (kernel == "engine-fwd" or all(c["const"][f"NEED_{p}"] == need_params for p in c["model"]["params"]))
    )


def layer_estimates(cases, results, gpu_key, xdt, mode, Ts, N, need_leak=True):
    """fwd / bwd / fwd+bwd of one LIF layer (the paper's neuron, scalar decay) in memory mode ``mode``."""
    gpu = GPUS[gpu_key]
    saved = mode == "potential"
    fwd = _case_for(cases, "engine-fwd", xdt, "lif_hard", saved)
    bwd = _case_for(cases, "engine-bwd", xdt, "lif_hard", saved, need_leak)
    rows = []
    for T in Ts:
        f = kernel_estimate(fwd, results[(fwd["id"], gpu["arch"])], gpu, T, N)
        b = kernel_estimate(bwd, results[(bwd["id"], gpu["arch"])], gpu, T, N)
        rows.append(
            dict(
                T=T,
                N=N,
                xdt=xdt,
                mode=mode,
                gpu=gpu_key,
                block=fwd["const"]["BLOCK"],
                fwd=f,
                bwd=b,
                total_bound_us=f["bound_us"] + b["bound_us"],
                total_est_us=f["est_us"] + b["est_us"],
            )
        )
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def _width(acc: dict) -> str:
    """``{"128": 2, "32": 1}`` -> ``2x128b 1x32b`` (widest first)."""
    if not acc:
        return "-"
    return " ".join(f"{n}x{w}b" for w, n in sorted(acc.items(), key=lambda kv: -int(kv[0])))


def _mode(case) -> str:
    return "potential" if case["const"].get("SAVED", case["const"].get("SAVE")) else "recompute"


def _toolchain_versions(tools: dict) -> dict:
    """The tools' versions and the options the kernels are compiled with (recorded in the JSON)."""
    from ..ops.engine.triton import COMPILE_OPTIONS

    out = dict(tools, compile_options=COMPILE_OPTIONS)
    if tools.get("ptxas"):
        text = subprocess.run([tools["ptxas"], "--version"], capture_output=True, text=True).stdout
        out["ptxas_version"] = text.strip().splitlines()[-1] if text.strip() else None
    return out


def build_report(
    args, cases, results, tools, seconds, command: str | None = None, machine: str | None = None
) -> tuple[str, dict]:
    """The markdown report and the JSON record; ``command`` / ``machine``: an earlier run's (default: this one's)."""
    from .triton_aot import ARCHS, traffic
    from .common import command_line, machine_info, markdown_table

    command = command or command_line()
    machine = machine or machine_info()

    archs = [ARCHS[a] for a in args.archs]
    failed = [r for r in results.values() if not r["ok"]]
    ok = [r for r in results.values() if r["ok"]]
    spilled = [
        f"`{r['id']}` sm_{r['arch']}" for r in ok if r["local"] or r["stack"] or r.get("sass_stl") or r.get("sass_ldl")
    ]
    lines = [
        "# Triton kernels compiled for A100 / H100 without a GPU (`spikefuse bench gpu-static`)",
        "",
        f"Command: `{command}`  ",
        f"Triton {tools['triton']} (ptxas: {tools.get('ptxas_version', '?')}), compiled on: {machine}  ",
        f"Compiled {len(cases)} specializations of the kernels the neuron engine generates "
        f"(`spikefuse.ops.engine.triton`) x {len(archs)} targets ({', '.join(args.archs)}) = {len(results)} "
        f"kernels in {seconds:.0f} s; **{len(failed)} failed**. Set `{args.case_set}`.",
        "",
        f"Registers per thread over all compiled kernels: {min(r['reg'] for r in ok)}..{max(r['reg'] for r in ok)}; "
        f"local memory (cuobjdump LOCAL): max {max(r['local'] for r in ok)} bytes, stack (spills) max "
        f"{max(r['stack'] for r in ok)} bytes; every pointer offset 64-bit: {all(r['i64_offsets'] for r in ok)}.",
        "",
        f"Local memory: {len(spilled)} of {len(ok)} kernels use it (a stack frame or `STL` / `LDL` spill "
        f"instructions in the SASS){': ' + ', '.join(spilled[:20]) if spilled else ''}. Compile options: "
        f"`{tools.get('compile_options', 'not recorded')}`; without a register budget (`maxnreg`) ptxas aims at an "
        "occupancy of its own choosing and spills a few registers to reach it. Per kernel: `reg`, `stack`, "
        "`sass_stl`, `sass_ldl`, `sass_p2r` in gpu_static.json.",
        "",
        "Layout: 4 warps = 128 threads per program, BLOCK / 128 neurons per thread "
        "(`spikefuse.ops.engine.triton.engine_block`: fewer for neurons of several states, so that the backward "
        "keeps its states in registers), so a time-step access of a thread is BLOCK/128 x the element size wide; "
        "with `N % 16 == 0` and 16-byte-aligned tensors (Triton specializes both at launch: "
        "`tt.divisibility = 16`) the loads / stores are vectorized up to 128 bits (`ld.global.v4.b32`).",
        "",
    ]
    if failed:
        lines += ["## Failures", ""] + [f"- `{r['id']}` sm_{r['arch']}: {r['error'][:300]}" for r in failed] + [""]

    shipped = [c for c in cases if c["group"] != "all"]
    if shipped:
        lines += [
            "## The shipped neurons, per kernel, memory mode and dtype",
            "",
            "Parameters per channel, every gradient (`-fixed`: the LIF without the decay's gradient). "
            "Loop ld / st: the global accesses inside the time loops of the PTX, as count x bits. "
            "Bytes/step: DRAM bytes per neuron and time step.",
            "",
        ]
        header = ["neuron", "kernel", "memory", "dtype", "BLOCK", "bytes/step"]
        for a in archs:
            header += [f"regs sm_{a}", f"local sm_{a}"]
        header += [f"loop ld (sm_{archs[-1]})", f"loop st (sm_{archs[-1]})"]
        rows = []
        for c in shipped:
            name = c["model"]["name"] + ("-fixed" if c["group"].endswith("-fixed") else "")
            row = [name, c["kernel"], _mode(c), c["xdt"], c["const"]["BLOCK"], traffic(c)["per_step"]]
            for a in archs:
                r = results.get((c["id"], a))
                row += [r["reg"], r["local"]] if r and r["ok"] else ["FAIL", "FAIL"]
            r = results.get((c["id"], archs[-1]))
            row += [_width(r["loop"]["ld"]), _width(r["loop"]["st"])] if r and r["ok"] else ["-", "-"]
            rows.append(row)
        lines += [markdown_table(header, rows), ""]

    arith = [c for c in cases if c["group"] == "all"]
    if arith:
        lines += ["## Every LIF definition of the public API (paper, snnTorch, SpikingJelly forms)", ""]
        header = [
            "kernel",
            "dtype",
            "arch",
            "kernels",
            "regs min / median / max",
            "max-register definition",
            "local max",
            "loop ld",
            "loop st",
        ]
        rows = []
        for kernel in ("engine-fwd", "engine-bwd"):
            for xdt in sorted({c["xdt"] for c in arith}):
                for a in archs:
                    rs = [
                        (c, results[(c["id"], a)])
                        for c in arith
                        if c["kernel"] == kernel and c["xdt"] == xdt and (c["id"], a) in results
                    ]
                    good = [(c, r) for c, r in rs if r["ok"]]
                    if not good:
                        continue
                    regs = [r["reg"] for _, r in good]
                    cmax, _ = max(good, key=lambda cr: cr[1]["reg"])
                    rows.append(
                        [
                            kernel,
                            xdt,
                            f"sm_{a}",
                            f"{len(good)}/{len(rs)}",
                            f"{min(regs)} / {statistics.median(regs):g} / {max(regs)}",
                            f"{cmax['model']['name']}, {cmax['surrogate']}",
                            max(r["local"] for _, r in good),
                            " or ".join(sorted({_width(r["loop"]["ld"]) for _, r in good})),
                            " or ".join(sorted({_width(r["loop"]["st"]) for _, r in good})),
                        ]
                    )
        lines += [
            "Per-channel decay, every gradient, the recomputing backward; N = 1M (launch-time "
            "specialization `N % 16 == 0`).",
            "",
            markdown_table(header, rows),
            "",
        ]

    # Rooflines.
    estimates = {}
    lif_dtypes = [
        d for d in ("fp32", "fp16") if any(c["model"]["name"] == "lif_hard" and c["xdt"] == d for c in shipped)
    ]
    if lif_dtypes and {80, 90} <= set(archs):
        lines += [
            f"## Roofline of one LIF layer: N = {args.N:,} neurons (the paper's Fig. 5), "
            f"T = {min(args.T)}..{max(args.T)}",
            "",
            "The paper's LIF, learnable scalar decay. Time = DRAM bytes / peak bandwidth (every tensor element read "
            "or written once, no L2 reuse). `est.` adds ~5 us launch overhead per kernel "
            "(one forward, one backward launch; the decay-gradient sum and the allocations are extra small PyTorch "
            "kernels) and divides by the in-flight check when it is below 1. In-flight check: resident warps per SM "
            f"(from the register count and the number of programs) x one time step of loads per warp, over the "
            f"bytes needed in flight to sustain the bandwidth at {LATENCY_NS:.0f} ns loaded DRAM latency (Little's "
            "law); >= 1 means the kernel can be bandwidth-bound. Bandwidths: "
            + ", ".join(f"{g['name']} {g['bw'] / 1e12:.3f} TB/s" for g in GPUS.values())
            + " (the A100 figure, 1.94e12 B/s, is the 80GB PCIe card; the SXM4 80GB has 2.039e12 B/s).",
            "",
        ]
        for xdt in lif_dtypes:
            for mode in ("potential", "recompute"):
                header = ["T", "bytes fwd+bwd"]
                for g in ("A100", "H100"):
                    header += [
                        f"{g} fwd us",
                        f"{g} bwd us",
                        f"{g} fwd+bwd bound us",
                        f"{g} fwd+bwd est. us",
                        f"{g} in-flight fwd / bwd",
                    ]
                rows = []
                est = {g: layer_estimates(cases, results, g, xdt, mode, args.T, args.N) for g in ("A100", "H100")}
                estimates[f"{xdt}-{mode}"] = est
                for i, T in enumerate(args.T):
                    a = est["A100"][i]
                    row = [T, f"{(a['fwd']['bytes'] + a['bwd']['bytes']) / 1e6:.0f} MB"]
                    for g in ("A100", "H100"):
                        e = est[g][i]
                        row += [
                            f"{e['fwd']['bound_us']:.1f}",
                            f"{e['bwd']['bound_us']:.1f}",
                            f"{e['total_bound_us']:.1f}",
                            f"**{e['total_est_us']:.1f}**",
                            f"{e['fwd']['mlp_ratio']:.1f} / {e['bwd']['mlp_ratio']:.1f}",
                        ]
                    rows.append(row)
                saved = mode == "potential"
                fcase = _case_for(cases, "engine-fwd", xdt, "lif_hard", saved)
                bcase = _case_for(cases, "engine-bwd", xdt, "lif_hard", saved)
                lines += [
                    f"### {xdt}, memory mode `{mode}` (BLOCK {est['A100'][0]['block']}): forward "
                    f"{traffic(fcase)['per_step']} B + backward {traffic(bcase)['per_step']} B per neuron-step",
                    "",
                    markdown_table(header, rows),
                    "",
                ]

    if "fp16" in lif_dtypes and 80 in archs:
        sj_rows = []
        estimates["spikingjelly"] = {}
        for mode in ("potential", "recompute"):
            for need_leak in (False, True):
                e = layer_estimates(
                    cases, results, SJ["gpu"], SJ["xdt"], mode, [SJ["T"]], SJ["N"], need_leak=need_leak
                )[0]
                estimates["spikingjelly"][f"{mode}-{'leak' if need_leak else 'noleak'}"] = e
                sj_rows.append(
                    [
                        f"spikefuse roofline, `{mode}`" + (", learnable decay" if need_leak else ""),
                        f"{(e['fwd']['bytes'] + e['bwd']['bytes']) / 1e6:.0f} MB",
                        f"{e['total_bound_us'] / 1e3:.2f}",
                        f"{e['total_est_us'] / 1e3:.2f}",
                        f"{SJ['ms'] / (e['total_est_us'] / 1e3):.2f}x",
                    ]
                )
        lines += [
            "## Next to SpikingJelly's Triton LIF",
            "",
            f"SpikingJelly's published figure (as quoted in the issue): LIF forward + backward, float16, x of shape "
            f"[32, 64, 65536] (T = 32, N = {SJ['N']:,}), **{SJ['ms']} ms on an RTX 4090**. spikefuse at the same "
            f"size on an RTX 4090 ({GPUS['RTX4090']['bw'] / 1e12:.3f} TB/s; sm_89, register counts of the sm_80 "
            "build), estimated, not measured:",
            "",
            markdown_table(
                ["implementation", "bytes", "bound ms", "est. ms", "SpikingJelly / est."],
                [["SpikingJelly Triton (published)", "-", "-", f"{SJ['ms']}", "1.00x"]] + sj_rows,
            ),
            "",
        ]
    report = {
        "command": command,
        "machine": machine,
        "toolchain": tools,
        "case_set": args.case_set,
        "archs": args.archs,
        "seconds": seconds,
        "assumptions": {"gpus": GPUS, "launch_us": LAUNCH_US, "latency_ns": LATENCY_NS, "spikingjelly": SJ},
        "cases": cases,
        "results": [dict(r, traffic=traffic(next(c for c in cases if c["id"] == r["id"]))) for r in results.values()],
        "estimates": estimates,
    }
    return "\n".join(lines), report


def _render(args) -> int:
    """Re-render gpu_static.md from an earlier run's JSON (its command, toolchain and compile time kept)."""
    saved = json.loads(Path(args.render).read_text())
    results = {(r["id"], r["arch"]): r for r in saved["results"]}
    for k in ("case_set", "archs"):
        setattr(args, k, saved[k])
    md, _ = build_report(
        args, saved["cases"], results, saved["toolchain"], saved["seconds"], saved["command"], saved["machine"]
    )
    out = Path(args.results_dir)
    (out / "gpu_static.md").write_text(md + "\n")
    print(md)
    return 0


def run(args) -> int:
    from . import triton_aot as A

    if args.render:
        return _render(args)

    tools = A.toolchain()
    if not (tools["triton"] and tools["nvidia_backend"] and tools["ptxas"] and tools["cuobjdump"]):
        print(
            f"spikefuse bench gpu-static: Triton's NVIDIA backend or its ptxas / cuobjdump is missing: {tools}",
            file=sys.stderr,
        )
        return 2
    tools = _toolchain_versions(tools)
    cases = shipped_cases(args.N)
    if args.case_set != "shipped":
        full = args.case_set == "full"
        cases += definition_cases(args.N, A.DTYPES if full else ("fp32",), every_surrogate=full)
    archs = [A.ARCHS[a] for a in args.archs]
    print(
        f"compiling {len(cases)} specializations for {', '.join(args.archs)} with {args.jobs} jobs "
        f"(Triton {tools['triton']})",
        flush=True,
    )

    def progress(done, total, res):
        if done % 50 == 0 or done == total or not res["ok"]:
            status = "ok" if res["ok"] else f"FAILED: {res['error'][:200]}"
            print(f"  {done}/{total} {res['id']} sm_{res['arch']}: {status}", flush=True)

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spikefuse-aot-") as tmp:
        results = A.compile_cases(cases, archs, jobs=args.jobs, cache_dir=args.cache_dir or tmp, progress=progress)
    seconds = time.perf_counter() - start
    md, report = build_report(args, cases, results, tools, seconds)
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_static.md").write_text(md + "\n")
    (out / "gpu_static.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(md)
    print(f"\nwrote {out / 'gpu_static.md'} and {out / 'gpu_static.json'}")
    return 1 if any(not r["ok"] for r in results.values()) else 0
