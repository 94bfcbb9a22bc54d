"""The neuron engine's Triton kernels compiled for A100 (sm_80) and H100 (sm_90) without a GPU: what the interpreter
cannot check.

One subprocess (clean environment: no ``TRITON_INTERPRET``) compiles a fixed set of specializations once per test
session; every assertion reads its results. The set (see :func:`_engine_cases`): every shipped neuron and the
test-file ones, forward and backward, with the surrogates cycled and the archs alternated; float64, float16 and
bfloat16 cases; both memory modes; the all-scalar parameter variant; a backward needing no gradient but the
input's; and Triton's launch-time integer / alignment specializations: ``N % 16 != 0``, ``N >= 2**31`` (i64),
``T = N = 1`` (constexprs) and a 16-byte-unaligned tensor. ``spikefuse bench gpu-static`` compiles more.
"""

import copy
import math
import os
import types

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run in the interpreter (or on a GPU)

import pytest  # noqa: E402
import torch  # noqa: E402

from spikefuse.bench import triton_aot as A  # noqa: E402

pytest.importorskip("triton")

ELEM_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp64": 64}
VARIANTS = {  # Triton's launch-time specializations of (T, N) and the pointers
    "n-odd": (dict(T=32, N=1_000_001), True),
    "n-i64": (dict(T=32, N=2**31 + 16), True),
    "t1-n1": (dict(T=1, N=1), True),
    "unaligned": (dict(T=32, N=2**20), False),
}


def test_grid_stays_within_cuda_limits():
    """The launcher's grid is cdiv(N, engine_block(N)) programs on axis 0 (limit 2**31 - 1): even 2**37 neurons of
    up to three states (one float32 step of them is 512 GiB, beyond any GPU's memory) stay within it."""
    from spikefuse.ops.engine.triton import block_size, engine_block

    for e in range(0, 38):
        n = 2**e
        for states in (1, 2, 3):
            programs = math.ceil(n / engine_block(n, states, torch.float32))
            assert 1 <= programs <= 2**31 - 1, (n, programs)
    assert block_size(2**40) == 1024 and block_size(1) == 128
    sizes = [block_size(2**e) for e in range(30)]
    assert sizes == sorted(sizes) and set(sizes) == {128, 256, 512, 1024}


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


def _engine_models():
    from spikefuse.compat.norse import NORSE_LIF, NORSE_LSNN
    from spikefuse.neurons import (
        ALIF_MODEL,
        CUBA_LIF,
        CUBA_LIF_EULER,
        CUBA_LIF_HARD,
        CUBA_LIF_ZERO,
        LIF_MODELS,
        SPIKINGJELLY_MODELS,
    )
    from tests.neurons.test_engine import CUBA_POST_RESET, EIF

    # SpikingJelly's forms: the two with a handoff and a division (decay_input=True, tau), and the test-file neuron
    # with a handoff over two states
    jelly = [SPIKINGJELLY_MODELS[(reset, "div_input")] for reset in ("hard", "soft")]
    return [
        CUBA_LIF,
        CUBA_LIF_ZERO,
        CUBA_LIF_HARD,
        CUBA_LIF_EULER,
        ALIF_MODEL,
        NORSE_LIF,
        NORSE_LSNN,
        EIF,
        *LIF_MODELS.values(),
        *jelly,
        CUBA_POST_RESET,
    ]


def _engine_cases():
    """Every model's forward and backward (fp32, per-channel parameters, every gradient) with the surrogates cycled
    and the archs alternated; float64 backward of the models with the most state on both archs; the all-scalar
    parameter variant; a backward that needs no parameter or initial-state gradient, with detach_reset."""
    from spikefuse.surrogate import SURROGATES

    surrogates = [cls.__name__ for cls in SURROGATES.values()]
    n = 2**20
    work = []
    models = _engine_models()
    for i, model in enumerate(models):
        for j, kernel in enumerate(A.ENGINE_KERNELS):
            case = A.engine_case(model, surrogates[(2 * i + j) % len(surrogates)], kernel, N=n)
            work.append((case, (80, 90)[(i + j) % 2]))
    for model in (m for m in models if m.name in ("alif", "norse_lsnn")):
        case = A.engine_case(model, "ATan", "engine-bwd", "fp64", N=n)
        work += [(case, 80), (case, 90)]
    cuba = models[0]
    for kernel in A.ENGINE_KERNELS:
        work.append((A.engine_case(cuba, "Sigmoid", kernel, per_channel=False, block=512, N=n), 90))
    quiet = A.engine_case(
        models[4], "Triangle", "engine-bwd", detach=True, need_params=False, grad_init=False, block=512, N=n
    )
    quiet["id"] += "-nograd"
    work.append((quiet, 80))
    # half precision read and written as it is (bfloat16's grad_x rounded to nearest by hand)
    for xdt, kernels, arch in (("fp16", A.ENGINE_KERNELS, 90), ("bf16", ["engine-bwd"], 80)):
        work += [(A.engine_case(cuba, "Sigmoid", kernel, xdt, N=n), arch) for kernel in kernels]
    # memory="potential": the forward writes every step's states, the backward reads them (float32, float16 LIF)
    lif = next(m for m in models if m.name == "lif_hard")  # the paper's LIF
    for model, xdt in ((cuba, "fp32"), (lif, "fp16")):
        work += [(A.engine_case(model, "ATan", kernel, xdt, saved=True, N=n), 90) for kernel in A.ENGINE_KERNELS]
    # Triton's launch-time specializations of T, N and the pointers' alignment
    for kernel, model in zip(A.ENGINE_KERNELS, (lif, cuba)):
        base = A.engine_case(model, "Sigmoid", kernel, N=n)
        for tag, (ints, aligned) in VARIANTS.items():
            v = copy.deepcopy(base)
            v["ints"].update({name: ints["N"] for name in v["ints"] if name.startswith(("isize_", "gsize_"))}, **ints)
            v.update(id=f"{base['id']}-{tag}", aligned=aligned, variant=tag)
            work.append((v, 80))
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
    spilled = {
        k: {f: r[f] for f in ("reg", "local", "stack", "sass_stl", "sass_ldl")}
        for k, r in results.items()
        if r["local"] or r["stack"] or r["sass_stl"] or r["sass_ldl"]
    }
    assert not spilled, spilled
    assert {c["model"]["name"] for c in cases.values()} >= {
        "cuba_lif",
        "alif",
        "norse_lsnn",
        "test_eif",
        "sj_hard_div_input",
        "test_cuba_post_reset",
    }


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
        assert r["mul_wide"] > 0 or case.get("variant") == "t1-n1", (cid, arch)
        if case.get("variant"):
            continue  # test_launch_time_specializations
        per_thread = case["const"]["BLOCK"] // A.NUM_THREADS
        width = str(min(128, per_thread * ELEM_BITS[case["xdt"]]))
        if case["xdt"] in ("fp16", "bf16"):  # the half-precision streams, and the float32 history and states
            state_width = str(min(128, per_thread * 32))
            assert width in set(r["loop"]["ld"]) and set(r["loop"]["ld"]) | set(r["loop"]["st"]) <= {
                width,
                state_width,
            }, (cid, arch, r["loop"])
        else:
            assert set(r["loop"]["ld"]) == set(r["loop"]["st"]) == {width}, (cid, arch, r["loop"])
        if case["kernel"] == "engine-bwd" and not case["const"]["SAVED"]:  # a recompute, then the reverse loop
            assert r["bar"] > 0, (cid, arch)
        if any("/" in e for _, e in case["model"]["step"]) and case["xdt"] == "fp32":
            assert r["div_rn"] > 0, (cid, arch)


def _bits(acc):
    return sum(int(w) * n for w, n in acc.items())


def _expected_loop_bits(case):
    """Bits each thread reads / writes per time step in the time loops: ``traffic`` x neurons per thread."""
    per_thread = case["const"]["BLOCK"] // A.NUM_THREADS
    tr = A.traffic(case)
    reads = sum(b for name, b in tr["streams"] if "read" in name)
    writes = sum(b for name, b in tr["streams"] if "write" in name)
    return 8 * reads * per_thread, 8 * writes * per_thread


def test_time_loops_move_exactly_the_counted_bytes(engine_compiled):
    """The time loops of every kernel load and store exactly the bytes of ``traffic`` (what the rooflines of
    ``spikefuse bench gpu-static`` count): one access per stream, neuron and step, nothing read twice."""
    cases, results = engine_compiled
    checked = 0
    for (cid, arch), r in results.items():
        case = cases[cid]
        if case.get("variant") == "t1-n1":
            continue
        assert (_bits(r["loop"]["ld"]), _bits(r["loop"]["st"])) == _expected_loop_bits(case), (cid, r["loop"])
        checked += 1
    assert checked > 40


def test_launch_time_specializations(engine_compiled):
    """N % 16 != 0 or a 16-byte-unaligned tensor: Triton cannot prove alignment, the accesses are scalar (the same
    bytes); N beyond int32 (an i64 argument) keeps 128-bit accesses; a single step and neuron (T = N = 1, both
    constexprs) has no time loop left."""
    cases, results = engine_compiled
    seen = set()
    for (cid, arch), r in results.items():
        variant = cases[cid].get("variant")
        if variant in ("n-odd", "unaligned"):
            assert set(r["loop"]["ld"]) == set(r["loop"]["st"]) == {"32"}, (cid, r["loop"])
        elif variant == "n-i64":
            assert set(r["loop"]["ld"]) == set(r["loop"]["st"]) == {"128"}, (cid, r["loop"])
        elif variant == "t1-n1":
            assert r["loop_lines"] == 0, (cid, r["loop_lines"])
        seen.add(variant)
    assert seen == {None, *VARIANTS}
