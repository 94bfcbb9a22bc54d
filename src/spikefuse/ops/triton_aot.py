"""Ahead-of-time compilation of the Triton kernels for NVIDIA targets, without a GPU, and what the binaries say.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` runs the whole NVIDIA pipeline (TTIR ->
TTGIR -> LLVM -> PTX -> ``ptxas`` -> cubin) on a machine without a GPU. This module

* enumerates the specializations the launchers of :mod:`spikefuse.ops.triton` launch: every
  :class:`~spikefuse.params.NeuronSpec` is turned into constexprs by the launcher's own ``_launch_args`` and
  ``_backward_flags``; the call adds the memory mode, the per-channel leak, the input dtype and the block sizes
  ``block_size`` can choose; the integer arguments ``T, N, inner, C`` are specialized by Triton's own
  ``native_specialize_impl`` (``== 1``: a constexpr; ``% 16 == 0``: ``tt.divisibility=16``; ``>= 2**31``: i64)
  and the pointers are 16-byte aligned as fresh PyTorch allocations are (an unaligned view is a separate variant);
* compiles cases with the launchers' ``COMPILE_OPTIONS`` in a subprocess with a clean environment
  (``TRITON_INTERPRET`` must not be set there, and the test-suite sets it) and collects per kernel: registers per
  thread, stack / local memory (spills) from ``cuobjdump --dump-resource-usage``, the global loads / stores inside
  the time loop of the PTX by access width (``ld.global.v4.b32`` = 128 bits), and whether every pointer offset is
  64-bit (TTIR);
* counts the DRAM bytes each kernel moves per neuron-step and per neuron (:func:`traffic`), for rooflines;
* compiles the kernels the neuron engine generates from a :class:`~spikefuse.neurons.NeuronModel`
  (:mod:`spikefuse.ops.engine.triton`; :func:`engine_case`): the model's definition travels inside the case, so a
  neuron defined anywhere (a test file, a user's script) compiles like a shipped one.

``python -m spikefuse.ops.triton_aot`` is the worker: cases as JSON on stdin, one JSON result per line on stdout.
Nothing here imports triton at module level (the test-suite runs Triton's interpreter in-process).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = [
    "ARCHS", "DTYPES", "BLOCK_SIZES", "Case", "neuron_specs", "forward_constexprs", "backward_constexprs", "launch_ints",
    "full_counts", "structural_cases", "arithmetic_cases", "compile_cases", "traffic", "toolchain", "ptx_accesses",
    "engine_case",
]  # fmt: skip

ARCHS = {"sm_80": 80, "sm_90": 90}
#: Triton's pointer type names of the input dtypes, and the compute dtype of each.
DTYPES = ("fp32", "fp16", "bf16", "fp64")
COMPUTE = {"fp32": "fp32", "fp16": "fp32", "bf16": "fp32", "fp64": "fp64"}
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8}
BLOCK_SIZES = (128, 256, 512, 1024)  # checked against spikefuse.ops.triton.BLOCK_SIZES in the worker and tests
NUM_THREADS = 128  # 32 * NUM_WARPS of the launcher

# Pointer arguments of each kernel and whether each has the input dtype (else the compute dtype).
POINTERS = {
    "fwd": {"x_ptr": True, "leak_ptr": False, "v0_ptr": False, "spikes_ptr": True, "state_ptr": False,
            "saved_ptr": False},
    "bwd": {"gs_ptr": True, "gstate_ptr": False, "x_ptr": True, "h_ptr": False, "gx_ptr": True, "leak_ptr": False,
            "v0_ptr": False, "gv_ptr": False, "gleak_ptr": False},
}  # fmt: skip
KERNELS = {"fwd": "_forward_kernel", "bwd": "_backward_kernel"}
FLOAT_ARGS = {"fwd": ("th", "vr"), "bwd": ("th", "vr", "c1", "c2")}

Case = dict  # {"id", "kernel", "xdt", "const": {...}, "ints": {"T", "N", "inner", "C"}, "aligned", "group"}


# ----------------------------------------------------------------------------------------------------------------
# Enumeration, through the launcher's own functions
# ----------------------------------------------------------------------------------------------------------------


def neuron_specs():
    """Every :class:`NeuronSpec` that differs in a kernel constexpr: dynamics x reset x charge (SpikingJelly) x
    state_post_reset x detach_reset x surrogate (the launcher normalizes what does not matter, see
    ``_launch_args``; the float parameters are runtime arguments)."""
    from .. import params as P
    from ..surrogate import ATan, FastSigmoid, Rectangle, Sigmoid, Triangle

    surrogates = (Sigmoid(), ATan(), Rectangle(), Triangle(), FastSigmoid())
    for dyn, reset, spr, detach, sg in itertools.product(
        (P.PAPER, P.SNNTORCH, P.SPIKINGJELLY), (P.HARD, P.SOFT, P.NONE), (False, True), (False, True), surrogates
    ):
        charges = (P.CHARGE_MUL, P.CHARGE_IF, P.CHARGE_DIV_INPUT, P.CHARGE_DIV, P.CHARGE_MUL_INPUT)
        for charge in charges if dyn == P.SPIKINGJELLY else (P.CHARGE_MUL,):
            yield P.NeuronSpec(reset=reset, surrogate=sg, detach_reset=detach, dynamics=dyn, charge=charge,
                               state_post_reset=spr)  # fmt: skip


def _key(d: dict) -> tuple:
    return tuple(sorted(d.items()))


def forward_constexprs(xdt: str) -> list[dict]:
    """The distinct forward constexprs the launcher produces for input dtype ``xdt`` (without BLOCK)."""
    from . import triton as K

    out = {}
    for spec in neuron_specs():
        _, common, _ = K._launch_args(tuple(spec.kernel_args()), xdt == "fp64")
        for save_h, per_channel in itertools.product((True, False), (False, True)):
            c = {**common, "SAVE_H": save_h, "PER_CHANNEL": per_channel}
            out.setdefault(_key(c), c)
    return list(out.values())


def backward_constexprs(xdt: str) -> list[dict]:
    """The distinct backward constexprs the launcher produces for input dtype ``xdt`` (without BLOCK): both memory
    modes, with and without the leak gradient, with and without ``x`` handed to backward (recompute always has it),
    with and without grad_x written over the saved h (eager autograd once the graph is freed)."""
    import torch

    from .. import params as P
    from . import triton as K
    from .common import SpecArgs

    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}[xdt]
    out = {}
    for spec in neuron_specs():
        args = tuple(spec.kernel_args())
        _, _, common = K._launch_args(args, xdt == "fp64")
        for save, need_leak, has_x, per_channel, overwrite in itertools.product(
            (P.SAVE_POTENTIAL, P.SAVE_INPUT), (True, False), (True, False), (False, True), (False, True)
        ):
            if save == P.SAVE_INPUT and not has_x:
                continue  # the launcher refuses recompute without x
            flags = K._backward_flags(SpecArgs(*args), torch_dtype, save, need_leak, has_x, overwrite)
            c = {**common, **flags, "PER_CHANNEL": per_channel}
            out.setdefault(_key(c), c)
    return list(out.values())


def launcher_blocks() -> list[int]:
    """The block sizes ``block_size(n)`` chooses for some ``n`` (the launcher's own choice function)."""
    from . import triton as K

    assert tuple(K.BLOCK_SIZES) == BLOCK_SIZES, (K.BLOCK_SIZES, BLOCK_SIZES)
    return sorted({K.block_size(2**e) for e in range(40)})


def launch_ints(T: int, N: int, per_channel: bool, inner: int = 1, channels: int = 2) -> dict:
    """The integer arguments as the launcher passes them (``inner, C = 1, 1`` without a per-channel leak)."""
    return {"T": T, "N": N, "inner": inner if per_channel else 1, "C": channels if per_channel else 1}


def full_counts() -> dict:
    """How many specializations the launchers can launch for each kernel (constexprs x dtype x block), before
    Triton's integer / alignment specializations multiply them further."""
    blocks = len(launcher_blocks())
    return {
        "fwd": sum(len(forward_constexprs(d)) for d in DTYPES) * blocks,
        "bwd": sum(len(backward_constexprs(d)) for d in DTYPES) * blocks,
    }


def _case(kernel, xdt, const, ints, group, aligned=True, tag=""):
    cid = f"{kernel}-{xdt}-B{const['BLOCK']}-{group}" + (f"-{tag}" if tag else "")
    return {"id": cid, "kernel": kernel, "xdt": xdt, "const": const, "ints": ints, "aligned": aligned, "group": group}


def _paper_lif():
    """The temporal-fusion paper's neuron (Eq. (1)): leak toward 0, hard reset, sigmoid surrogate."""
    from .. import params as P

    return P.NeuronSpec(dynamics=P.PAPER, reset=P.HARD)


def _fwd_const(spec, xdt, save_h, per_channel, block):
    from . import triton as K

    _, common, _ = K._launch_args(tuple(spec.kernel_args()), xdt == "fp64")
    return {**common, "SAVE_H": save_h, "PER_CHANNEL": per_channel, "BLOCK": block}


def _bwd_const(spec, xdt, save, need_leak, has_x, per_channel, block, overwrite=False):
    import torch

    from . import triton as K
    from .common import SpecArgs

    args = tuple(spec.kernel_args())
    _, _, common = K._launch_args(args, xdt == "fp64")
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}[xdt]
    flags = K._backward_flags(SpecArgs(*args), torch_dtype, save, need_leak, has_x, overwrite)
    return {**common, **flags, "PER_CHANNEL": per_channel, "BLOCK": block}


#: The memory-structure groups: what changes which tensors a kernel reads and writes.
FWD_GROUPS = {  # name: (SAVE_H, PER_CHANNEL)
    "potential": (True, False),
    "potential-pc": (True, True),
    "recompute": (False, False),
    "recompute-pc": (False, True),
}
BWD_GROUPS = {  # name: (spec, save, need_leak, has_x, PER_CHANNEL[, overwrite]); x handed over as autograd does
    "potential": ("paper", "potential", True, False, False),
    "potential-inplace": ("paper", "potential", True, False, False, True),  # grad_x over h: graph freed
    "potential-pc": ("paper", "potential", True, False, True),
    "potential-noleak": ("paper", "potential", False, False, False),
    "potential-x": ("plif", "potential", True, True, True),  # PLIF decay-input: dh/dk reads x
    "recompute": ("paper", "recompute", True, True, False),
    "recompute-pc": ("paper", "recompute", True, True, True),
    "recompute-noleak": ("paper", "recompute", False, True, False),
    "recompute-x": ("plif", "recompute", True, True, True),
}


def _group_spec(name):
    from .. import params as P

    if name == "plif":
        return P.NeuronSpec(dynamics=P.SPIKINGJELLY, reset=P.HARD, charge=P.CHARGE_MUL_INPUT, state_post_reset=True)
    return _paper_lif()


def structural_cases(dtypes=DTYPES, blocks=None, T=32, N=1_000_000, groups=None) -> list[Case]:
    """Every kernel x dtype x block x memory-structure group, for the paper's LIF (PLIF for the ``x`` groups)."""
    from .. import params as P

    blocks = blocks or launcher_blocks()
    cases = []
    for xdt, block in itertools.product(dtypes, blocks):
        for g, (save_h, pc) in FWD_GROUPS.items():
            if groups and g not in groups:
                continue
            const = _fwd_const(_paper_lif(), xdt, save_h, pc, block)
            cases.append(_case("fwd", xdt, const, launch_ints(T, N, pc), g))
        for g, (spec, save, need_leak, has_x, pc, *overwrite) in BWD_GROUPS.items():
            if groups and g not in groups:
                continue
            const = _bwd_const(_group_spec(spec), xdt, P.MEMORY_MODES[save], need_leak, has_x, pc, block, *overwrite)
            cases.append(_case("bwd", xdt, const, launch_ints(T, N, pc), g))
    return cases


def arithmetic_cases(xdt="fp32", block=1024, T=32, N=1_000_000, full=False) -> list[Case]:
    """The code that changes with the neuron's dynamics, reset, charge, state_post_reset, detach and surrogate
    switches, for one dtype and block: every constexpr set the launcher produces (``full``), or each arithmetic
    combination once in the kernel's largest memory variant (forward: saving ``h``, per-channel leak; backward:
    recompute with the leak gradient, ``x`` and a per-channel leak), which has the most live registers."""
    cases = []
    for kernel, consts in (("fwd", forward_constexprs(xdt)), ("bwd", backward_constexprs(xdt))):
        for i, c in enumerate(consts):
            if not full and not (c["PER_CHANNEL"] and (c["SAVE_H"] if kernel == "fwd" else
                                                       (c["RECOMPUTE"] and c["NEED_LEAK"]))):
                continue
            const = {**c, "BLOCK": block}
            cases.append(_case(kernel, xdt, const, launch_ints(T, N, c["PER_CHANNEL"]), "all", tag=f"a{i}"))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# The neuron engine's generated kernels
# ----------------------------------------------------------------------------------------------------------------

ENGINE_KERNELS = {"engine-fwd": "forward", "engine-bwd": "backward"}
#: The engine kernels' pointers of the input's dtype (the others point at the compute dtype).
ENGINE_X_POINTERS = {"x_ptr", "spikes_ptr", "gs_ptr", "gx_ptr"}


def engine_case(model, surrogate: str, kernel: str, xdt: str = "fp32", *, per_channel: bool = True,
                detach: bool = False, need_params: bool = True, grad_init: bool = True, block: int = 1024,
                T: int = 32, N: int = 1_000_000) -> Case:  # fmt: skip
    """A generated kernel of ``model`` (a :class:`~spikefuse.neurons.NeuronModel`) with the surrogate class named
    ``surrogate``, as :func:`spikefuse.ops.engine.triton.forward` / ``backward`` launch it: parameters per channel
    (2 channels) or all scalar (``SCALAR``), initial states and final-state gradients per neuron, every parameter
    and initial-state gradient needed or none."""
    from ..registry import arguments

    if kernel not in ENGINE_KERNELS:
        raise ValueError(f"kernel must be one of {sorted(ENGINE_KERNELS)}, got {kernel!r}")
    const = {"SCALAR": not per_channel, "BLOCK": block, ("SAVED" if kernel == "engine-bwd" else "SAVE"): False}
    ints = {"T": T, "N": N, "inner": 1}
    ints.update({f"size_{p}": 2 if per_channel else 1 for p in model.params})
    ints.update({f"isize_{k}": N for k in model.states})
    if kernel == "engine-bwd":
        const["DETACH"] = detach
        const.update({f"NEED_{p}": need_params for p in model.params})
        const.update({f"GRAD_INIT_{k}": grad_init for k in model.states})
        ints.update({f"gsize_{k}": N for k in model.states})
    group = f"{model.name}-{surrogate}" + ("-pc" if per_channel else "-scalar")
    case = _case(kernel, xdt, const, ints, group)
    case.update(model=arguments(model), surrogate=surrogate)
    return case


def _engine_kernel(case):
    """The generated ``@triton.jit`` function of an engine case (written into the worker's kernel cache folder)."""
    import torch

    from ..neurons import NeuronModel
    from ..surrogate import SURROGATES
    from .engine import triton as E

    fields = {k: tuple(tuple(v) if isinstance(v, list) else v for v in value) if isinstance(value, list) else value
              for k, value in case["model"].items()}  # fmt: skip (JSON turned the tuples into lists)
    model = NeuronModel(**fields)
    surrogate = {cls.__name__: cls for cls in SURROGATES.values()}[case["surrogate"]]
    dtype = {"fp32": torch.float32, "fp64": torch.float64, "fp16": torch.float16, "bf16": torch.bfloat16}[case["xdt"]]
    return getattr(E.kernels(model, surrogate, dtype), ENGINE_KERNELS[case["kernel"]]), E.COMPILE_OPTIONS


# ----------------------------------------------------------------------------------------------------------------
# Traffic
# ----------------------------------------------------------------------------------------------------------------


def traffic(case: Case) -> dict:
    """DRAM bytes of one kernel: ``per_step`` per neuron and time step (the time loop), ``per_neuron`` once per
    neuron (initial state, final state, per-neuron gradients), and the streams behind them. Every element is read
    or written once (no reuse across programs; the leak is negligible and left out)."""
    x = BYTES[case["xdt"]]
    c = BYTES[COMPUTE[case["xdt"]]]
    k = case["const"]
    streams = []
    if case["kernel"] == "fwd":
        streams += [("read x", x), ("write spikes", x)]
        if k["SAVE_H"]:
            streams.append(("write h", c))
        per_neuron = c + c  # read v_init, write state
    else:
        if k["RECOMPUTE"]:
            streams += [("recompute: read x", x), ("recompute: write h", c)]
        streams += [("read grad_spikes", x), ("read h", c)]
        if k["USE_X"]:
            streams.append(("read x", x))
        streams.append(("write grad_x", c if k["GX_IN_H"] else x))
        per_neuron = c + c + c + (c if k["NEED_LEAK"] else 0)  # grad_state, v_init, grad_v_init, leak partials
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
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
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
    if case["kernel"] in ENGINE_KERNELS:  # every argument not an int or a constexpr is a pointer
        pointers = {p: p in ENGINE_X_POINTERS for p in names if p not in case["ints"] and p not in case["const"]}
    else:
        pointers = POINTERS[case["kernel"]]
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
    for c in FLOAT_ARGS.get(case["kernel"], ()):
        for part in ("hi", "mid", "lo"):
            sig[f"{c}_{part}"] = "fp32"
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

    from . import triton as K

    res = {"id": case["id"], "arch": arch}
    start = time.perf_counter()
    try:
        if case["kernel"] in ENGINE_KERNELS:
            fn, options = _engine_kernel(case)
        else:
            fn, options = getattr(K, KERNELS[case["kernel"]]), K.COMPILE_OPTIONS
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


def compile_cases(cases: list[Case], archs=(80, 90), *, work: list | None = None, jobs: int = 1,
                  cache_dir: str | None = None, timeout: float | None = None, progress=None) -> dict:  # fmt: skip
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
        [sys.executable, "-m", "spikefuse.ops.triton_aot", "--jobs", str(jobs)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
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
