"""What a parallel CPU kernel's launcher costs in compile time and per call, measured on the LIF's generated forward
(float32, scalar parameters): the lead for a shorter cold test run (most of it is numba compiling parallel kernels).

Three launchers of the same block function (``_forward_block_scalar`` of the generated module):

- ``prange``: the generated ``forward_scalar``, ``@njit(parallel=True)`` with ``prange`` over the blocks (parfor);
- ``plain``: the same loop with ``range`` and no ``parallel`` (serial: the compile-time floor of a launcher);
- ``pool``: a nogil ``range`` over a half of the blocks, the other half on a ``ThreadPoolExecutor`` thread;
- ``fnarg``: one prange launcher that takes the block function as an argument, to be shared by kernels of one
  signature: timed for a first block function and for a second one of the same signature (numba types the argument
  as that very function, so the launcher compiles again).

Compile times: a fresh process and an empty numba cache per run (the block function's compile included). Launch
times: medians of repeated forward calls after a warm-up, at T=8 N=4096 and T=32 N=1M.

    python benchmarks/numba_launch_costs.py [--runs 3] [--out benchmarks/results/numba_launch_costs.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from spikefuse.neurons import LIF_MODELS
from spikefuse.ops.engine.cpu import kernel_source
from spikefuse.surrogate import Sigmoid

RANGE_LAUNCHER = """

@njit(nogil=True, cache=True, error_model='numpy')
def forward_range_scalar(x, par_decay, par_threshold, par_v_reset, init_v, inner, spikes, one, bits, final_v, block,
                         b0, b1):
    N = x.shape[1]
    for b in range(b0, b1):
        n0 = b * block
        _forward_block_scalar(x, par_decay, par_threshold, par_v_reset, init_v, inner, spikes, one, bits, final_v, n0,
                              min(block, N - n0))
"""

COMPILE = """
import sys, time, numpy as np
sys.path.insert(0, sys.argv[1])
import numba
m = __import__(sys.argv[2])
f = np.float32
x = np.random.rand(8, 256).astype(f)
a = (x, f(0.5), f(0.5), f(0.0), np.zeros(1, f), 1, np.zeros_like(x), f(1.0), np.zeros((8, 32), np.uint8),
     np.zeros(256, f))
t = time.perf_counter()
if sys.argv[2] == "pool_mod":
    m.forward_range_scalar(*a, 64, 0, 4)
else:
    m.forward_scalar(*a, 64)
print(time.perf_counter() - t)
"""

FNARG = """
import sys, time, numpy as np
sys.path.insert(0, sys.argv[1])
from numba import njit, prange, types
m = __import__("prange_mod")
f = np.float32
A2, A1 = types.Array(types.float32, 2, "C"), types.Array(types.float32, 1, "C")
sig = types.void(A2, types.float32, types.float32, types.float32, A1, types.int64, A2, types.float32,
                 types.Array(types.uint8, 2, "C"), A1, types.int64, types.int64)


@njit(parallel=True)
def launch(fn, x, a, b, c, init, inner, spikes, one, bits, final, block):
    N = x.shape[1]
    for i in prange((N + block - 1) // block):
        n0 = i * block
        fn(x, a, b, c, init, inner, spikes, one, bits, final, n0, min(block, N - n0))


x = np.random.rand(8, 256).astype(f)
a = (x, f(0.5), f(0.5), f(0.0), np.zeros(1, f), 1, np.zeros_like(x), f(1.0), np.zeros((8, 32), np.uint8),
     np.zeros(256, f))
for _ in range(2):
    block = njit(sig, nogil=True, error_model="numpy")(m._forward_block_scalar.py_func)  # a new dispatcher
    t = time.perf_counter()
    launch(block, *a, 64)
    print(time.perf_counter() - t)
"""

LAUNCH = """
import sys, time, statistics, numpy as np
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, sys.argv[1])
import numba
numba.set_num_threads(2)
from spikefuse.ops.engine.cpu import _block
m = __import__("pool_mod")
f = np.float32
pool = ThreadPoolExecutor(1)


def args(T, N):
    x = np.random.rand(T, N).astype(f)
    return (x, f(0.5), f(0.5), f(0.0), np.zeros(1, f), 1, np.zeros_like(x), f(1.0), np.zeros((T, N // 8), np.uint8),
            np.zeros(N, f))


def prange(a, block):
    m.forward_scalar(*a, block)


def threads(a, block):
    nb = (a[0].shape[1] + block - 1) // block
    half = (nb + 1) // 2
    done = pool.submit(m.forward_range_scalar, *a, block, half, nb)
    m.forward_range_scalar(*a, block, 0, half)
    done.result()


for T, N, repeats in ((8, 4096, 2000), (32, 1_000_000, 20)):
    a, block = args(T, N), _block(N, 2)
    for name, fn in (("prange", prange), ("pool", threads)):
        fn(a, block)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn(a, block)
            times.append(time.perf_counter() - t)
        print(f"{T} {N} {name} {1e6 * statistics.median(times):.1f}")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/numba_launch_costs.md")
    args = p.parse_args()
    source = kernel_source(LIF_MODELS[("paper", "hard")], Sigmoid, torch.float32)
    folder = Path(tempfile.mkdtemp())
    (folder / "prange_mod.py").write_text(source)
    plain = source.replace(
        "@njit(parallel=True, cache=True, error_model='numpy')", "@njit(cache=True, error_model='numpy')"
    )
    (folder / "plain_mod.py").write_text(plain.replace("prange(", "range("))
    pooled = source.replace(
        "@njit(cache=True, error_model='numpy')\ndef _forward_block_scalar(",
        "@njit(nogil=True, cache=True, error_model='numpy')\ndef _forward_block_scalar(",
    )
    (folder / "pool_mod.py").write_text(pooled + RANGE_LAUNCHER)
    compile_s = {name: [] for name in ("prange", "plain", "pool")}
    for _ in range(args.runs):
        for name in compile_s:
            env = dict(os.environ, NUMBA_CACHE_DIR=tempfile.mkdtemp())
            out = subprocess.run([sys.executable, "-c", COMPILE, str(folder), f"{name}_mod"], env=env, check=True,
                                 capture_output=True, text=True)  # fmt: skip
            compile_s[name].append(float(out.stdout.split()[-1]))
    env = dict(os.environ, NUMBA_CACHE_DIR=tempfile.mkdtemp())
    fnarg = subprocess.run(
        [sys.executable, "-c", FNARG, str(folder)], env=env, check=True, capture_output=True, text=True
    )
    first, second = (float(v) for v in fnarg.stdout.split()[-2:])
    launch = subprocess.run([sys.executable, "-c", LAUNCH, str(folder)], check=True, capture_output=True, text=True)
    rows = [line.split() for line in launch.stdout.strip().splitlines()]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    text = [
        f"# Launch costs of a parallel CPU kernel ({cpu}, {os.cpu_count()} cores, Python {platform.python_version()})",
        "",
        f"Command: `python benchmarks/numba_launch_costs.py --runs {args.runs}`",
        "",
        "The LIF's generated forward (float32, scalar parameters), its block function launched three ways; compile: a",
        "fresh process with an empty numba cache per run (the block function's compile included).",
        "",
        "| launcher | compile s (each run) |",
        "|---|---|",
        *[f"| {name} | {' / '.join(f'{t:.2f}' for t in times)} |" for name, times in compile_s.items()],
        "",
        f"fnarg: the launcher's compile for a first block function {first:.2f} s, for a second one of the same",
        f"signature {second:.2f} s (the block functions compiled beforehand, not counted).",
        "",
        "| T | N | launcher | forward us (median) |",
        "|---|---|---|---|",
        *[f"| {t} | {n} | {name} | {us} |" for t, n, name, us in rows],
    ]
    Path(args.out).write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
