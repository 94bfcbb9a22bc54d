"""Ahead-of-time compilation of the neuron engine's Triton kernels for NVIDIA targets, without a GPU, and what the
binaries say.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` runs the whole NVIDIA pipeline (TTIR ->
TTGIR -> LLVM -> PTX -> ``ptxas`` -> cubin) on a machine without a GPU. This module

* describes a specialization of a kernel that :mod:`spikefuse.ops.engine.triton` generates from a
  :class:`~spikefuse.neurons.NeuronModel` as its launcher launches it (:func:`engine_case`): the model's definition
  travels inside the case, so a neuron defined anywhere (a test file, a user's script) compiles like a shipped one;
  the integer arguments are specialized by Triton's own ``native_specialize_impl`` (``== 1``: a constexpr;
  ``% 16 == 0``: ``tt.divisibility=16``; ``>= 2**31``: i64) and the pointers are 16-byte aligned as fresh PyTorch
  allocations are (an unaligned view is a separate variant);
* compiles cases with the launcher's ``COMPILE_OPTIONS`` in a subprocess with a clean environment
  (``TRITON_INTERPRET`` must not be set there, and the test-suite sets it) and collects per kernel: registers per
  thread, stack / local memory (spills) from ``cuobjdump --dump-resource-usage``, the global loads / stores inside
  the time loops of the PTX by access width (``ld.global.v4.b32`` = 128 bits), and whether every pointer offset is
  64-bit (TTIR);
* counts the DRAM bytes each kernel moves per neuron-step and per neuron (:func:`traffic`), for rooflines.

``python -m spikefuse.bench.triton_aot`` is the worker: cases as JSON on stdin, one JSON result per line on stdout.
Nothing here imports triton at module level (the test-suite runs Triton's interpreter in-process).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = [
    "ARCHS",
    "DTYPES",
    "COMPUTE",
    "NUM_THREADS",
    "Case",
    "ENGINE_KERNELS",
    "engine_case",
    "case_model",
    "compile_cases",
    "traffic",
    "toolchain",
    "ptx_accesses",
]

ARCHS = {"sm_80": 80, "sm_90": 90}
#: Triton's pointer type names of the input dtypes, and the compute dtype of each.
DTYPES = ("fp32", "fp16", "bf16", "fp64")
COMPUTE = {"fp32": "fp32", "fp16": "fp32", "bf16": "fp32", "fp64": "fp64"}
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8}
NUM_THREADS = 128  # 32 * NUM_WARPS of the launcher

Case = dict  # {"id", "kernel", "xdt", "const": {...}, "ints": {...}, "aligned", "group", "model", "surrogate"}

ENGINE_KERNELS = {"engine-fwd": "forward", "engine-bwd": "backward"}
#: The engine kernels' pointers of the input's dtype (the others point at the compute dtype).
ENGINE_X_POINTERS = {"x_ptr", "spikes_ptr", "gs_ptr", "gx_ptr"}


def engine_case(
    model,
    surrogate: str,
    kernel: str,
    xdt: str = "fp32",
    *,
    per_channel: bool = True,
    detach: bool = False,
    need_params: bool = True,
    grad_init: bool = True,
    saved: bool = False,
    block: int | None = None,
    T: int = 32,
    N: int = 1_000_000,
) -> Case:
    """A generated kernel of ``model`` (a :class:`~spikefuse.neurons.NeuronModel`) with the surrogate class named
    ``surrogate``, as :func:`spikefuse.ops.engine.triton.forward` / ``backward`` launch it: parameters per channel
    (2 channels) or all scalar (``SCALAR``), initial states and final-state gradients per neuron, every parameter
    and initial-state gradient needed or none; ``saved``: memory="potential" (the forward writes every step's
    states, the backward reads them), else the backward recomputes them; ``block``: neurons per program (default:
    the launcher's :func:`~spikefuse.ops.engine.triton.engine_block`)."""
    from ..registry import arguments

    if kernel not in ENGINE_KERNELS:
        raise ValueError(f"kernel must be one of {sorted(ENGINE_KERNELS)}, got {kernel!r}")
    if block is None:
        from ..ops.engine.triton import engine_block

        block = engine_block(N, len(model.states), _torch_dtype(COMPUTE[xdt]))
    const = {"SCALAR": not per_channel, "BLOCK": block, ("SAVED" if kernel == "engine-bwd" else "SAVE"): saved}
    ints = {"T": T, "N": N, "inner": 1}
    ints.update({f"size_{p}": 2 if per_channel else 1 for p in model.params})
    ints.update({f"isize_{k}": N for k in model.states})
    if kernel == "engine-bwd":
        const["DETACH"] = detach
        const.update({f"NEED_{p}": need_params for p in model.params})
        const.update({f"GRAD_INIT_{k}": grad_init for k in model.states})
        ints.update({f"gsize_{k}": N for k in model.states})
    group = (
        f"{model.name}-{surrogate}" + ("-pc" if per_channel else "-scalar") + ("-potential" if saved else "-recompute")
    )
    cid = f"{kernel}-{xdt}-B{block}-{group}"
    return {
        "id": cid,
        "kernel": kernel,
        "xdt": xdt,
        "const": const,
        "ints": ints,
        "aligned": True,
        "group": group,
        "model": arguments(model),
        "surrogate": surrogate,
    }


def _torch_dtype(xdt: str):
    """The torch dtype of one of :data:`DTYPES`."""
    import torch

    return {"fp32": torch.float32, "fp64": torch.float64, "fp16": torch.float16, "bf16": torch.bfloat16}[xdt]


def case_model(case: Case):
    """The :class:`~spikefuse.neurons.NeuronModel` a case carries."""
    from ..neurons import NeuronModel

    fields = {
        k: tuple(tuple(v) if isinstance(v, list) else v for v in value) if isinstance(value, list) else value
        for k, value in case["model"].items()
    }  # JSON turned the tuples into lists
    return NeuronModel(**fields)


def _engine_kernel(case):
    """The generated ``@triton.jit`` function of an engine case (written into the worker's kernel cache folder)."""
    from ..surrogate import SURROGATES
    from ..ops.engine import triton as E

    model = case_model(case)
    surrogate = {cls.__name__: cls for cls in SURROGATES.values()}[case["surrogate"]]
    kernels = E.kernels(model, surrogate, _torch_dtype(case["xdt"]))
    return getattr(kernels, ENGINE_KERNELS[case["kernel"]]), E.COMPILE_OPTIONS


# ----------------------------------------------------------------------------------------------------------------
# Traffic
# ----------------------------------------------------------------------------------------------------------------


def traffic(case: Case) -> dict:
    """DRAM bytes of one kernel: ``per_step`` per neuron and time step (the time loops), ``per_neuron`` once per
    neuron (initial and final states, their gradients, per-neuron parameter gradients), and the streams behind
    them. Every element is read or written once (no reuse across programs; the parameters are negligible and left
    out)."""
    model = case_model(case)
    x, c = BYTES[case["xdt"]], BYTES[COMPUTE[case["xdt"]]]
    k, states = case["const"], model.states
    per_neuron = c * len(states)  # the initial states
    if case["kernel"] == "engine-fwd":
        streams = [("read x", x), ("write spikes", x)]
        streams += [(f"write {s}", c) for s in states] if k["SAVE"] else []
        per_neuron += c * len(states)  # the final states
    else:
        streams = [] if k["SAVED"] else [("recompute: read x", x)] + [(f"recompute: write {s}", c) for s in states]
        streams += [("read grad_spikes", x)] + [(f"read {s}", c) for s in states]
        streams += [("read x", x)] if model.backward_reads_input else []
        streams.append(("write grad_x", x))
        per_neuron += c * len(states)  # the final states' gradients
        per_neuron += c * sum(bool(k[f"GRAD_INIT_{s}"]) for s in states)
        per_neuron += c * sum(bool(k[f"NEED_{p}"]) for p in model.params)  # per-neuron partials, reduced after
    return {"per_step": sum(b for _, b in streams), "per_neuron": per_neuron, "streams": streams}


# ----------------------------------------------------------------------------------------------------------------
# Compilation (the worker runs in a subprocess without TRITON_INTERPRET)
# ----------------------------------------------------------------------------------------------------------------


def toolchain() -> dict:
    """Triton's version and the NVIDIA tools inside the triton package (``None`` when absent)."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return {"triton": None, "nvidia_backend": False, "ptxas": None, "cuobjdump": None}
    root = Path(spec.origin).parent
    bin_dir = root / "backends" / "nvidia" / "bin"
    version = None
    try:
        from importlib.metadata import version as _v

        version = _v("triton")
    except Exception:  # noqa: BLE001
        pass

    def tool(name):
        p = bin_dir / name
        return str(p) if p.is_file() and os.access(p, os.X_OK) else None

    return {
        "triton": version,
        "nvidia_backend": (root / "backends" / "nvidia" / "compiler.py").is_file(),
        "ptxas": tool("ptxas"),
        "cuobjdump": tool("cuobjdump"),
    }


_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
_LABEL = re.compile(r"^(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")


def ptx_accesses(ptx: str) -> dict:
    """Global loads and stores of a PTX function, split into the time loop(s) and the rest, counted by access width
    in bits: ``{"loop": {"ld": {128: 4, ...}, "st": {...}}, "other": {...}, "loop_lines": n}``. A loop is the span
    from a label to a later branch back to it."""
    lines = ptx.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = i
    in_loop = [False] * len(lines)
    for j, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] < j:
            for i in range(labels[m.group(1)], j + 1):
                in_loop[i] = True
    out = {"loop": {"ld": {}, "st": {}}, "other": {"ld": {}, "st": {}}, "loop_lines": sum(in_loop)}
    for i, line in enumerate(lines):
        for m in _ACCESS.finditer(line):
            mods = m.group(2).split(".")[1:]
            vec = next((int(t[1:]) for t in mods if re.fullmatch(r"v\d", t)), 1)
            bits = next((int(t[1:]) for t in mods if re.fullmatch(r"[bsuf](8|16|32|64)", t)), 0)
            where = out["loop" if in_loop[i] else "other"][m.group(1)]
            where[vec * bits] = where.get(vec * bits, 0) + 1
    return out


def _resource_usage(cubin: bytes, cuobjdump: str, name: str) -> dict:
    """Registers, stack, shared and local bytes (``cuobjdump --dump-resource-usage``), and from the SASS the local
    stores / loads (``STL`` / ``LDL``: spills) and predicate-to-register moves (``P2R``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    block = text.split(f"Function {name}:", 1)[-1]
    usage = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", block)
        usage[key.lower()] = int(m.group(1)) if m else None
    for op in ("STL", "LDL", "P2R"):
        usage[f"sass_{op.lower()}"] = len(re.findall(rf"\b{op}(?:\.[\w.]+)?\s", sass))
    return usage


def _signature(case, fn):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    names = fn.arg_names
    xdt, cdt = case["xdt"], COMPUTE[case["xdt"]]
    sig, constexprs, attrs = {}, {}, {}
    divisible = [["tt.divisibility", 16]]
    # every argument not an int or a constexpr is a pointer
    pointers = {p: p in ENGINE_X_POINTERS for p in names if p not in case["ints"] and p not in case["const"]}
    for p, is_x in pointers.items():
        sig[p] = "*" + (xdt if is_x else cdt)
        if case["aligned"]:
            attrs[(names.index(p),)] = divisible
    for p, value in case["ints"].items():  # Triton's own integer specialization, as at launch
        ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if ty == "constexpr":
            sig[p] = "constexpr"
            constexprs[(names.index(p),)] = spec
        else:
            sig[p] = ty
            if spec == "D":
                attrs[(names.index(p),)] = divisible
    for k, v in case["const"].items():
        sig[k] = "constexpr"
        constexprs[(names.index(k),)] = v
    missing = set(names) - set(sig)
    assert not missing, f"{case['id']}: arguments not covered: {missing}"
    return {n: sig[n] for n in names}, constexprs, attrs


def _i64_offsets(ttir: str) -> bool:
    """Every tensor of pointers is offset by a 64-bit tensor (``tt.addptr ..., tensor<...xi64>``)."""
    adds = re.findall(r"tt\.addptr [^\n]*", ttir)
    tensor_adds = [a for a in adds if "tensor<" in a]
    return bool(tensor_adds) and all(re.search(r"tensor<\d+xi64", a.split(",")[-1]) for a in tensor_adds)


def compile_one(case: Case, arch: int, tools: dict) -> dict:
    """Compile one case for ``sm_<arch>`` and analyse it (in the worker process)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    res = {"id": case["id"], "arch": arch}
    start = time.perf_counter()
    try:
        fn, options = _engine_kernel(case)
        sig, constexprs, attrs = _signature(case, fn)
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))
    except Exception as err:  # noqa: BLE001 - reported per case; the caller fails on it
        res.update(ok=False, error=f"{type(err).__name__}: {err}"[-4000:], seconds=time.perf_counter() - start)
        return res
    ptx = compiled.asm["ptx"]
    acc = ptx_accesses(ptx)
    res.update(
        ok=True,
        seconds=round(time.perf_counter() - start, 3),
        loop=acc["loop"],
        other=acc["other"],
        loop_lines=acc["loop_lines"],
        i64_offsets=_i64_offsets(compiled.asm["ttir"]),
        mul_wide=ptx.count("mul.wide"),
        fma=ptx.count("fma.rn"),
        div_rn=ptx.count("div.rn."),
        bar=ptx.count("bar.sync"),
        shared_meta=compiled.metadata.shared,
        **_resource_usage(compiled.asm["cubin"], tools["cuobjdump"], compiled.metadata.name),
    )
    return res


def _worker(jobs: int) -> None:
    """Read ``{"cases": [...], "archs": [...]}`` from stdin; print one JSON result per compiled case."""
    assert not os.environ.get("TRITON_INTERPRET"), "the AOT worker must run without TRITON_INTERPRET"
    job = json.load(sys.stdin)
    tools = toolchain()
    work = [(c, a) for c, a in job["work"]]
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs) as pool:
            for res in pool.map(_compile_star, [(c, a, tools) for c, a in work], chunksize=1):
                print(json.dumps(res), flush=True)
    else:
        for c, a in work:
            print(json.dumps(compile_one(c, a, tools)), flush=True)


def _compile_star(args):
    return compile_one(*args)


def compile_cases(
    cases: list[Case],
    archs=(80, 90),
    *,
    work: list | None = None,
    jobs: int = 1,
    cache_dir: str | None = None,
    timeout: float | None = None,
    progress=None,
) -> dict:
    """Compile every case for every arch (or the ``(case, arch)`` pairs of ``work``) in one subprocess (``jobs``
    compiler processes inside it) with a clean environment; returns ``{(case_id, arch): result}``. ``cache_dir``
    is Triton's cache (default: Triton's own)."""
    work = [(c, a) for c in cases for a in archs] if work is None else list(work)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache_dir:
        env["TRITON_CACHE_DIR"] = str(cache_dir)
    src_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "spikefuse.bench.triton_aot", "--jobs", str(jobs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proc.stdin.write(json.dumps({"work": work}))
    proc.stdin.close()
    results = {}
    deadline = time.monotonic() + timeout if timeout else None
    for line in proc.stdout:
        res = json.loads(line)
        results[(res["id"], res["arch"])] = res
        if progress:
            progress(len(results), len(work), res)
        if deadline and time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"AOT compilation exceeded {timeout} s after {len(results)} results")
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise RuntimeError(f"AOT worker failed (exit {proc.returncode}):\n{err[-4000:]}")
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="spikefuse Triton AOT worker (JSON on stdin)")
    parser.add_argument("--jobs", type=int, default=1)
    _worker(parser.parse_args().jobs)
