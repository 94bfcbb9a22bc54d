"""``spikefuse bench compile``: what a new user waits for before the first gradient.

Each case is one neuron's first forward+backward of an [8, 64] fp32 input in a fresh process with fresh kernel and
numba cache folders ("empty caches": a first run after ``pip install``), repeated in fresh processes and folders;
then once more with the folders a cold run filled ("warm caches": every later run). Import time is reported apart.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import add_result_args, command_line, machine_info, markdown_table, result_tag, write_csv

#: case -> the code that builds the neuron ``layer`` (after ``import torch, spikefuse``).
CASES = {
    "lif": "import spikefuse.nn\nlayer = spikefuse.nn.LIF().to(device)",
    "cuba_lif": "from spikefuse.neurons import CUBA_LIF\n"
    "layer = lambda x: spikefuse.neuron(x, CUBA_LIF, alpha=0.8, beta=0.9, memory='recompute')",
    "alif": "from spikefuse.neurons import ALIF_MODEL\n"
    "layer = lambda x: spikefuse.neuron(x, ALIF_MODEL, decay=0.9, rho=0.9, memory='recompute')",
}

_FIRST_CALL = """
import json, time
t0 = time.perf_counter()
import torch, spikefuse
t_import = time.perf_counter() - t0
device = torch.device({device!r})
sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
{build}
x = torch.rand(8, 64, device=device, requires_grad=True)
sync()
t0 = time.perf_counter()
y = layer(x)
sync()
t_forward = time.perf_counter() - t0
t0 = time.perf_counter()
y.sum().backward()
sync()
t_backward = time.perf_counter() - t0
print(json.dumps({{"import_s": t_import, "forward_s": t_forward, "backward_s": t_backward}}))
"""


def first_call(case: str, cache: Path, device: str = "cpu") -> dict:
    """Seconds of import, first forward and first backward of ``case`` in a fresh process using ``cache``."""
    env = dict(
        os.environ,
        SPIKEFUSE_CACHE_DIR=str(cache / "kernels"),
        NUMBA_CACHE_DIR=str(cache / "numba"),
        TRITON_CACHE_DIR=str(cache / "triton"),
    )
    code = _FIRST_CALL.format(build=CASES[case], device=device)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"bench compile: the first call of {case} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cold_start(cases, repeats: int, device: str = "cpu") -> list[dict]:
    """Per case: the median of ``repeats`` empty-cache runs, and a warm-cache run after the last of them."""
    rows = []
    for case in cases:
        colds = []
        for i in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                colds.append(first_call(case, Path(tmp), device))
                if i == repeats - 1:
                    warm = first_call(case, Path(tmp), device)
        cold = {k: statistics.median(r[k] for r in colds) for k in colds[0]}
        cold["fwd_bwd_s"] = statistics.median(r["forward_s"] + r["backward_s"] for r in colds)
        warm["fwd_bwd_s"] = warm["forward_s"] + warm["backward_s"]
        for kind, r, n in (("empty caches", cold, repeats), ("warm caches", warm, 1)):
            rows.append({"case": case, "caches": kind, "runs": n, **{k: round(v, 3) for k, v in r.items()}})
    return rows


def run(args) -> None:
    rows = cold_start(args.cases, args.repeats, args.device)
    stem = Path(args.out) / f"compile_{args.tag}"
    write_csv(stem.with_suffix(".csv"), rows)
    text = [
        "# Cold start: a neuron's first forward+backward in a fresh process",
        "",
        f"Machine: {machine_info()}",
        f"Command: `{command_line()}`",
        "",
        f"An [8, 64] fp32 input on {args.device}. 'empty caches': fresh kernel, numba and Triton cache folders, "
        "median of the runs "
        "(each in a fresh process and folders); 'warm caches': a fresh process reusing the folders of a cold run. "
        "Seconds.",
        "",
        markdown_table(
            ["case", "caches", "runs", "import", "first forward", "first backward", "first fwd+bwd"],
            [
                [r["case"], r["caches"], r["runs"], r["import_s"], r["forward_s"], r["backward_s"], r["fwd_bwd_s"]]
                for r in rows
            ],
        ),
    ]
    stem.with_suffix(".md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    print(f"wrote {stem}.md/.csv")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compile",
        help="cold start: a neuron's first forward+backward with empty and warm kernel caches, each in a fresh process",
    )
    p.add_argument(
        "--cases", nargs="+", choices=list(CASES), default=list(CASES), help="the neurons timed (default: all)"
    )
    p.add_argument("--repeats", type=int, default=3, help="empty-cache runs per case (median)")
    p.add_argument("--device", default="cpu", help="where the input lives: cpu (numba kernels) or cuda (Triton)")
    p.add_argument("--quick", action="store_true", help="the default LIF only, one run: to check the harness")
    add_result_args(p)
    p.set_defaults(func=_run_cli)


def _run_cli(args) -> None:
    if args.quick:
        args.cases, args.repeats = ["lif"], 1
    args.tag = result_tag(args)
    if args.repeats <= 0:
        raise SystemExit("--repeats must be positive")
    run(args)
