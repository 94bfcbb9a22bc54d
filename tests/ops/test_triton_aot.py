"""The Triton kernels compiled for A100 (sm_80) and H100 (sm_90) without a GPU: what the interpreter cannot check.

One subprocess (clean environment: no ``TRITON_INTERPRET``) compiles a fixed set of specializations once per test
session; every assertion reads its results. The set (see :func:`_cases`):

* every kernel x dtype x memory-structure group (the constexprs that change which tensors the time loop reads and
  writes: SAVE_H, RECOMPUTE / GX_IN_H, USE_X, NEED_LEAK, PER_CHANNEL) at BLOCK 1024, for sm_80 and sm_90;
* every block size the launcher can choose x dtype (forward and backward, ``potential``), for sm_90;
* every dynamics x reset x charge combination in the backward kernel (recompute, the largest variant, which
  also runs the forward step), in the forward kernel every reset and charge value, with state_post_reset,
  detach_reset and the five surrogates cycled through, alternating sm_80 / sm_90;
* Triton's launch-time integer / alignment specializations: ``N % 16 != 0``, ``N >= 2**31`` (i64), ``T = N = 1``
  (constexprs) and a 16-byte-unaligned tensor, for sm_80.

The full set the launchers can produce (``spikefuse.ops.triton_aot.full_counts``: ~50k per target) is far beyond
the time budget; ``spikefuse bench gpu-static`` compiles every arithmetic combination in fp32.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # as in test_triton.py: kernels run in the interpreter (or on a GPU)

import copy  # noqa: E402
import math  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from spikefuse import params as P  # noqa: E402
from spikefuse.ops import triton_aot as A  # noqa: E402

pytest.importorskip("triton")

ELEM_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp64": 64}
VARIANTS = {  # Triton's launch-time specializations of (T, N) and the pointers
    "n-odd": (dict(T=32, N=1_000_001, inner=1, C=1), True),
    "n-i64": (dict(T=32, N=2**31 + 16, inner=1, C=1), True),
    "t1-n1": (dict(T=1, N=1, inner=1, C=1), True),
    "unaligned": (dict(T=32, N=2**20, inner=1, C=1), False),
}
FWD_TEST_GROUPS = ("potential-pc", "recompute")
BWD_TEST_GROUPS = ("potential-x", "potential-noleak", "potential-inplace", "recompute-pc")


def _cases():
    """``[(case, arch)]`` to compile (see the module docstring)."""
    work = []
    for c in A.structural_cases(blocks=(1024,)):
        if c["group"] in (FWD_TEST_GROUPS if c["kernel"] == "fwd" else BWD_TEST_GROUPS):
            work += [(c, 80), (c, 90)]
    for c in A.structural_cases(dtypes=("fp32", "fp16", "fp64"), blocks=(128, 256, 512), groups=("potential",)):
        work.append((c, 90))
    # Every dynamics x reset x charge, with state_post_reset, detach_reset and the surrogate cycled.
    combos = {}
    for c in A.arithmetic_cases("fp32", 1024):
        k = c["const"]
        combos.setdefault((c["kernel"], k["DYN"], k["RESET"], k["CHARGE"]), []).append(c)
    for i, (key, candidates) in enumerate(sorted(combos.items())):
        kernel, dyn, reset, charge = key
        if kernel == "fwd" and dyn == P.SPIKINGJELLY and reset != charge % 3:
            continue  # the forward step is also compiled in every backward (recompute); 5 SpikingJelly cases suffice
        want = {"SPR": i % 2 == 1, "DETACH": (i // 2) % 2 == 1, "SG": i % 5}
        best = max(candidates, key=lambda c: sum(c["const"].get(name) == v for name, v in want.items()))
        work.append((best, (80, 90)[(i // 3) % 2]))
    for c in A.structural_cases(dtypes=("fp32",), blocks=(1024,), groups=("potential",)):
        for tag, (ints, aligned) in VARIANTS.items():
            v = copy.deepcopy(c)
            v.update(id=f"{c['id']}-{tag}", ints=ints, aligned=aligned, variant=tag)
            work.append((v, 80))
    return work


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tools = A.toolchain()
    if not tools["nvidia_backend"]:
        pytest.skip(f"Triton's NVIDIA backend is not installed in the triton package: {tools}")
    if not tools["ptxas"] or not tools["cuobjdump"]:
        pytest.skip(f"ptxas / cuobjdump missing from the triton package (triton/backends/nvidia/bin): {tools}")
    work = _cases()
    cases = {c["id"]: c for c, _ in work}
    # Triton's own cache (keyed by kernel source, options, target and ptxas version): a re-run reuses the binaries
    # of an identical compilation; SPIKEFUSE_AOT_FRESH=1 compiles everything in a fresh cache.
    cache = str(tmp_path_factory.mktemp("triton-cache")) if os.environ.get("SPIKEFUSE_AOT_FRESH") else None
    results = A.compile_cases([], work=work, jobs=2, cache_dir=cache, timeout=900)
    assert len(results) == len(work)
    return cases, results


def _ok(compiled):
    cases, results = compiled
    return [(cases[cid], r) for (cid, _), r in results.items() if r["ok"]]


def test_case_set_covers_the_launchers_switches():
    """The compiled set has every kernel x dtype, block, dynamics / reset / charge / surrogate value."""
    work = _cases()
    cases = [c for c, _ in work]
    assert {(c["kernel"], c["xdt"]) for c in cases} == {(k, d) for k in ("fwd", "bwd") for d in A.DTYPES}
    assert {c["const"]["BLOCK"] for c in cases} == set(A.launcher_blocks()) == {128, 256, 512, 1024}
    bwd = [c["const"] for c in cases if c["kernel"] == "bwd"]
    for name, values in (("DYN", 3), ("RESET", 3), ("CHARGE", 5), ("SG", 5), ("SPR", 2), ("DETACH", 2),
                         ("RECOMPUTE", 2), ("GX_IN_H", 2), ("USE_X", 2), ("NEED_LEAK", 2), ("PER_CHANNEL", 2)):  # fmt: skip
        assert len({k[name] for k in bwd}) == values, name
    fwd = [c["const"] for c in cases if c["kernel"] == "fwd"]
    for name, values in (("DYN", 3), ("RESET", 3), ("CHARGE", 5), ("SPR", 2), ("SAVE_H", 2), ("PER_CHANNEL", 2)):
        assert len({k[name] for k in fwd}) == values, name
    dyn_combos = {(k["DYN"], k["RESET"], k["CHARGE"]) for k in bwd}
    assert len(dyn_combos) == 3 + 3 + 3 * 5  # paper and snnTorch: 3 resets; SpikingJelly: 3 resets x 5 charges
    assert sum(1 for _, a in work if a == 80) > 35 and sum(1 for _, a in work if a == 90) > 35


def test_every_specialization_compiles(compiled):
    cases, results = compiled
    failed = {k: r["error"] for k, r in results.items() if not r["ok"]}
    assert not failed, failed


def test_no_local_memory_no_register_spills(compiled):
    """No kernel uses local memory: no local arrays, no stack frame, no spill stores or loads (``STL`` / ``LDL``) in
    the SASS, and every kernel fits the register file (at most 255 registers per thread)."""
    spilled = {(c["id"], r["arch"]): {k: r[k] for k in ("reg", "local", "stack", "sass_stl", "sass_ldl")}
               for c, r in _ok(compiled)
               if r["local"] or r["stack"] or r["sass_stl"] or r["sass_ldl"]}  # fmt: skip
    assert not spilled, spilled
    assert all(0 < r["reg"] <= 255 for _, r in _ok(compiled))


def _expected_loop_bits(case):
    """Bits each thread reads / writes per time step in the time loop(s): ``traffic`` x neurons per thread."""
    per_thread = case["const"]["BLOCK"] // A.NUM_THREADS
    tr = A.traffic(case)
    reads = sum(b for name, b in tr["streams"] if "read" in name)
    writes = sum(b for name, b in tr["streams"] if "write" in name)
    return 8 * reads * per_thread, 8 * writes * per_thread


def _bits(acc):
    return sum(int(w) * n for w, n in acc.items())


def test_time_loop_accesses_are_vectorized(compiled):
    """With N % 16 == 0 and aligned tensors (the launcher's usual case) every time-loop access of a thread is as
    wide as its BLOCK / 128 neurons allow, up to 128 bits; the loop moves exactly the bytes of ``traffic``."""
    checked = 0
    for case, r in _ok(compiled):
        if case.get("variant") in ("n-odd", "unaligned", "t1-n1"):
            continue
        per_thread = case["const"]["BLOCK"] // A.NUM_THREADS
        dtypes = {case["xdt"], A.COMPUTE[case["xdt"]]}
        allowed = {min(128, per_thread * ELEM_BITS[d]) for d in dtypes}
        for op in ("ld", "st"):
            widths = {int(w) for w in r["loop"][op]}
            assert widths and widths <= allowed, (case["id"], r["arch"], op, r["loop"], allowed)
        assert (_bits(r["loop"]["ld"]), _bits(r["loop"]["st"])) == _expected_loop_bits(case), (case["id"], r["loop"])
        if per_thread * 16 >= 128 or (per_thread * 32 >= 128 and case["xdt"] in ("fp32", "fp64")):
            # fp32 / fp64 at BLOCK >= 512 and half at BLOCK 1024: only 128-bit accesses (ld/st.global.v4.b32 or
            # v2.b64); smaller blocks have fewer neurons per thread than a 16-byte vector holds.
            assert set(r["loop"]["ld"]) == set(r["loop"]["st"]) == {"128"}, (case["id"], r["loop"])
        checked += 1
    assert checked > 80


def test_unaligned_layouts_fall_back_to_scalar_accesses(compiled):
    """N % 16 != 0 or a 16-byte-unaligned tensor: Triton cannot prove alignment, the accesses are scalar (still
    exactly the same bytes); a single step and neuron (T = N = 1) has no loop."""
    seen = set()
    for case, r in _ok(compiled):
        variant = case.get("variant")
        if variant in ("n-odd", "unaligned"):
            assert set(r["loop"]["ld"]) == set(r["loop"]["st"]) == {"32"}, (case["id"], r["loop"])
            assert (_bits(r["loop"]["ld"]), _bits(r["loop"]["st"])) == _expected_loop_bits(case)
            seen.add(variant)
        elif variant == "n-i64":
            assert set(r["loop"]["ld"]) == set(r["loop"]["st"]) == {"128"}, (case["id"], r["loop"])
            seen.add(variant)
    assert seen == {"n-odd", "unaligned", "n-i64"}


def test_64_bit_offsets(compiled):
    """Every tensor of pointers is offset by int64 (``t * N + offs`` does not wrap above 2**31 elements), the PTX
    forms the addresses with 64-bit arithmetic, and an N beyond int32 (an i64 argument) compiles."""
    for case, r in _ok(compiled):
        assert r["i64_offsets"], case["id"]
        assert r["mul_wide"] > 0 or case.get("variant") == "t1-n1", case["id"]
    variants = {case.get("variant") for case, _ in _ok(compiled)}
    assert "n-i64" in variants


def test_grid_stays_within_cuda_limits():
    """The launcher's grid is cdiv(N, block_size(N)) programs on axis 0 (limit 2**31 - 1): even 2**40 neurons (far
    beyond any GPU's memory) need only 2**30 programs."""
    from spikefuse.ops import triton as K

    for e in range(0, 41):
        n = 2**e
        programs = math.ceil(n / K.block_size(n))
        assert 1 <= programs <= 2**31 - 1, (n, programs)
    assert K.block_size(2**40) == 1024


def test_numerics_constraints_in_the_binaries(compiled):
    """No mul+add contracted into FMA in the forward (bit-identical spikes), IEEE division where SpikingJelly's
    divide-by-tau charges divide, the barrier between recompute and the reverse loop."""
    for case, r in _ok(compiled):
        k = case["const"]
        if case["kernel"] == "fwd":
            assert r["fma"] == 0, case["id"]
            if k["DYN"] == P.SPIKINGJELLY and k["CHARGE"] in (P.CHARGE_DIV, P.CHARGE_DIV_INPUT) and not k["F64"]:
                assert r["div_rn"] > 0, case["id"]
        elif k["RECOMPUTE"]:
            assert r["bar"] > 0, case["id"]


def test_kernels_launch_on_the_current_torch_stream():
    """Triton 3.9's GPU driver takes the stream from PyTorch's current stream of the current device (the launcher
    sets the device with ``torch.cuda.device``); checked on the driver class without a GPU."""
    from triton.backends.driver import GPUDriver

    driver = types.SimpleNamespace()
    GPUDriver.__init__(driver)  # imports torch and binds the stream / device getters; needs no CUDA
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        assert driver.get_current_stream is raw
    else:  # a CPU build of PyTorch: Triton's fallback reads torch.cuda.current_stream(idx).cuda_stream
        assert {"current_stream", "cuda_stream"} <= set(driver.get_current_stream.__code__.co_names)
    assert driver.get_current_device is torch.cuda.current_device


def test_non_contiguous_inputs_are_made_contiguous():
    """The public API hands any-strided inputs to the Triton launcher contiguous (the launcher itself rejects
    non-contiguous tensors): a transposed input gives the reference's spikes and gradients (interpreter)."""
    import spikefuse

    base = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(0))
    results = {}
    for backend in ("triton", "reference"):
        x = base.clone().requires_grad_(True)
        xt = x.transpose(1, 2)[::1, :, ::2]  # [5, 3, 4], non-contiguous
        assert not xt.is_contiguous()
        s = spikefuse.lif(xt * 2.0, decay=0.5, threshold=0.5, backend=backend)
        (s * torch.arange(s.numel()).reshape(s.shape)).sum().backward()
        results[backend] = (s.detach(), x.grad)
    assert torch.equal(results["triton"][0], results["reference"][0])
    torch.testing.assert_close(results["triton"][1], results["reference"][1])


# ---------------------------------------------------------------------------------------------------------------
# The neuron engine's generated kernels (spikefuse.ops.engine.triton), for every shipped neuron and the test-file one
# ---------------------------------------------------------------------------------------------------------------


def _engine_models():
    from spikefuse.compat.norse import NORSE_LIF, NORSE_LSNN
    from spikefuse.neurons import (ALIF_MODEL, CUBA_LIF, CUBA_LIF_EULER, CUBA_LIF_HARD, CUBA_LIF_ZERO, LIF_MODELS,
                                   SPIKINGJELLY_MODELS)  # fmt: skip
    from tests.neurons.test_engine import CUBA_POST_RESET, EIF

    # SpikingJelly's forms: the two with a handoff and a division (decay_input=True, tau), and the test-file neuron
    # with a handoff over two states
    jelly = [SPIKINGJELLY_MODELS[(reset, "div_input")] for reset in ("hard", "soft")]
    return [CUBA_LIF, CUBA_LIF_ZERO, CUBA_LIF_HARD, CUBA_LIF_EULER, ALIF_MODEL, NORSE_LIF, NORSE_LSNN, EIF,
            *LIF_MODELS.values(), *jelly, CUBA_POST_RESET]


def _engine_cases():
    """Every model's forward and backward (fp32, per-channel parameters, every gradient) with the surrogates cycled
    and the archs alternated; float64 backward of the models with the most state on both archs; the all-scalar
    parameter variant; a backward that needs no parameter or initial-state gradient, with detach_reset."""
    from spikefuse.ops.engine.triton import engine_block
    from spikefuse.surrogate import SURROGATES

    surrogates = [cls.__name__ for cls in SURROGATES.values()]
    n = 2**20
    work = []
    models = _engine_models()
    for i, model in enumerate(models):
        block = engine_block(n, len(model.states), torch.float32)
        for j, kernel in enumerate(A.ENGINE_KERNELS):
            case = A.engine_case(model, surrogates[(2 * i + j) % len(surrogates)], kernel, block=block, N=n)
            work.append((case, (80, 90)[(i + j) % 2]))
    for model in (m for m in models if m.name in ("alif", "norse_lsnn")):
        block = engine_block(n, len(model.states), torch.float64)
        case = A.engine_case(model, "ATan", "engine-bwd", "fp64", block=block, N=n)
        work += [(case, 80), (case, 90)]
    cuba = models[0]
    for kernel in A.ENGINE_KERNELS:
        work.append((A.engine_case(cuba, "Sigmoid", kernel, per_channel=False, block=512, N=n), 90))
    quiet = A.engine_case(models[4], "Triangle", "engine-bwd", detach=True, need_params=False, grad_init=False,
                          block=512, N=n)  # fmt: skip
    quiet["id"] += "-nograd"
    work.append((quiet, 80))
    # half precision read and written as it is (bfloat16's grad_x rounded to nearest by hand)
    block = engine_block(n, len(cuba.states), torch.float32)
    for xdt, kernels, arch in (("fp16", A.ENGINE_KERNELS, 90), ("bf16", ["engine-bwd"], 80)):
        work += [(A.engine_case(cuba, "Sigmoid", kernel, xdt, block=block, N=n), arch) for kernel in kernels]
    return work


@pytest.fixture(scope="module")
def engine_compiled(tmp_path_factory):
    tools = A.toolchain()
    if not tools["nvidia_backend"] or not tools["ptxas"] or not tools["cuobjdump"]:
        pytest.skip(f"Triton's NVIDIA backend or its tools are missing from the triton package: {tools}")
    work = _engine_cases()
    results = A.compile_cases([], work=work, jobs=2, timeout=900)
    assert len(results) == len(work)
    return {c["id"]: c for c, _ in work}, results


def test_engine_kernels_compile_without_spills(engine_compiled):
    """Every generated kernel compiles for its target with no local memory (no spill stores / loads, no stack)."""
    cases, results = engine_compiled
    failed = {k: r["error"] for k, r in results.items() if not r["ok"]}
    assert not failed, failed
    spilled = {k: {f: r[f] for f in ("reg", "local", "stack", "sass_stl", "sass_ldl")} for k, r in results.items()
               if r["local"] or r["stack"] or r["sass_stl"] or r["sass_ldl"]}  # fmt: skip
    assert not spilled, spilled
    assert {c["model"]["name"] for c in cases.values()} >= {"cuba_lif", "alif", "norse_lsnn", "test_eif",
                                                            "sj_hard_div_input", "test_cuba_post_reset"}


def test_engine_kernels_numerics_and_memory_access(engine_compiled):
    """No FMA contraction in any generated kernel (the step is bit-exact, the recompute in backward too); IEEE
    division where a model's step divides (the test-file EIF, SpikingJelly's decay_input LIF); the barrier between
    recompute and the reverse loop;
    64-bit offsets; with aligned tensors and N % 16 == 0, time-loop accesses as wide as a thread's neurons allow
    (up to 128 bits)."""
    cases, results = engine_compiled
    for (cid, arch), r in results.items():
        case = cases[cid]
        assert r["fma"] == 0, (cid, arch)
        assert r["i64_offsets"], (cid, arch)
        per_thread = case["const"]["BLOCK"] // A.NUM_THREADS
        width = str(min(128, per_thread * ELEM_BITS[case["xdt"]]))
        if case["xdt"] in ("fp16", "bf16"):  # the half-precision streams, and the float32 history and states
            state_width = str(min(128, per_thread * 32))
            assert width in set(r["loop"]["ld"]) and set(r["loop"]["ld"]) | set(r["loop"]["st"]) <= {
                width, state_width}, (cid, arch, r["loop"])
        else:
            assert set(r["loop"]["ld"]) == set(r["loop"]["st"]) == {width}, (cid, arch, r["loop"])
        if case["kernel"] == "engine-bwd":
            assert r["bar"] > 0, (cid, arch)
        if any("/" in e for _, e in case["model"]["step"]) and case["xdt"] == "fp32":
            assert r["div_rn"] > 0, (cid, arch)
