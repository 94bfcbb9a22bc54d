"""The fused Triton backend against the reference, run on the CPU through Triton's interpreter.

Every specialization the launchers can produce is executed here: each ``dynamics x reset x charge x detach x
surrogate`` spec with a scalar and a per-channel learnable leak in both memory modes (backward), every forward
specialization, the no-leak-gradient and with/without-``x`` variants, the float16 / bfloat16 (scratch buffer for
recompute) and float64 paths, and every block size the launcher can choose. The interpreter is slow, so the
tensors are tiny.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (conftest may have chosen the GPU)

import subprocess  # noqa: E402
import sys  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import spikefuse  # noqa: E402
from spikefuse import params as P  # noqa: E402
from spikefuse.ops import reference  # noqa: E402
from spikefuse.surrogate import ATan, FastSigmoid, Rectangle, Sigmoid, Triangle  # noqa: E402

from . import cases  # noqa: E402

triton_ops = pytest.importorskip("spikefuse.ops.triton")

SHAPE = (4, 2, 3, 5)  # T=4, N=30 neurons in 3 channels of inner 5
MEMORY = {"potential": P.SAVE_POTENTIAL, "recompute": P.SAVE_INPUT}


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _dyn_id(combo) -> str:
    dyn, reset, charge, _ = combo
    name = f"{cases.DYNAMICS_NAMES[dyn]}-{cases.RESET_NAMES[reset]}"
    return name + (f"-{cases.CHARGE_NAMES[charge]}" if dyn == P.SPIKINGJELLY else "")


DYN_COMBOS = [pytest.param(c, id=_dyn_id(c)) for c in cases.dynamics_combos()]


def _spec_for(combo, i: int, detach: bool = False) -> P.NeuronSpec:
    """A spec for a dynamics combo, cycling through the test surrogates."""
    dyn, reset, charge, spr = combo
    return cases.make_spec(dyn, reset, charge, spr, cases.SURROGATES[i % len(cases.SURROGATES)], detach, variant=i)


def _x_for_backward(x2, spec, save):
    """What the autograd wrapper hands to backward: x only for recompute or the PLIF decay-input charge."""
    return x2 if save == P.SAVE_INPUT or spec.charge == P.CHARGE_MUL_INPUT else None


def _reference_grads(gs, gst, x2, leak, inner, v0, args, need_leak):
    gx, gv, gl = reference.backward(gs, gst, x2, leak, inner, v0, None, args, P.SAVE_INPUT, need_leak)
    if need_leak and gl is None:  # the leak is unused (IF charge): autograd reports no gradient
        gl = torch.zeros_like(leak)
    return gx, gv, gl


def _assert_grads_close(got, want, rtol=1e-5):
    for name, g, w in zip(("grad_x", "grad_v_init", "grad_leak"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        # Relative to each element, plus an absolute floor at float32 rounding of the tensor's scale (elements
        # that are sums of cancelling terms have no meaningful relative error).
        scale = max(float(w.abs().max()), 1.0)
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * 0.1 * scale, msg=lambda m: f"{name}: {m}")


def _check_case(spec, shape, *, per_channel, save, dtype=torch.float32, need_leak=True, block=None, seed=0,
                x_override=None, grad_rtol=1e-5):  # fmt: skip
    """Forward and backward of the Triton backend against the reference on fresh inputs."""
    x, leak, v = cases.make_inputs(shape, spec, dtype, seed=seed, per_channel=per_channel)
    x2, leak, inner, v0 = cases.kernel_inputs(x, leak, v)
    args = spec.kernel_args()

    spikes, state, saved = triton_ops.forward(x2, leak, inner, v0, args, save, block=block)
    with torch.no_grad():
        want_spikes, want_state, want_h = reference.run(x2, leak, inner, v0, args)
    assert spikes.dtype == x2.dtype and state.dtype == v0.dtype
    assert torch.equal(spikes, want_spikes), "spikes differ from the reference"
    assert torch.equal(state, want_state), "state differs from the reference"
    if save == P.SAVE_POTENTIAL:
        assert torch.equal(saved, want_h), "saved potentials differ from the reference"
    else:
        assert saved is None

    gen = torch.Generator().manual_seed(seed + 1)
    gs = torch.randn(x2.shape, generator=gen).to(x2.dtype)
    gst = torch.randn(v0.shape, generator=gen, dtype=torch.float64).to(v0.dtype)
    xb = _x_for_backward(x2, spec, save) if x_override is None else x_override(x2)
    got = triton_ops.backward(gs, gst, xb, leak, inner, v0, saved, args, save, need_leak, block=block)
    want = _reference_grads(gs, gst, x2, leak, inner, v0, args, need_leak)
    _assert_grads_close(got, want, grad_rtol)
    return got, want


# ---------------------------------------------------------------------------------------------------------------
# The full sweep: every spec x scalar / per-channel learnable leak x memory mode.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "perchannel"])
@pytest.mark.parametrize("spec", cases.spec_params())
def test_matches_reference(spec, per_channel, memory):
    """Spikes, states (and saved potentials) bit-identical in float32; gradients of x, v_init and leak close."""
    _check_case(spec, SHAPE, per_channel=per_channel, save=MEMORY[memory], seed=_seed(spec, per_channel, memory))


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("combo", DYN_COMBOS)
def test_no_leak_gradient(combo, memory):
    """A fixed leak: the kernels specialized without the leak-gradient accumulation."""
    spec = _spec_for(combo, 3)
    got, _ = _check_case(spec, SHAPE, per_channel=True, save=MEMORY[memory], need_leak=False, seed=_seed(combo, 7))
    assert got[2] is None


@pytest.mark.parametrize("charge", [P.CHARGE_DIV_INPUT, P.CHARGE_MUL_INPUT], ids=["divin", "mulin"])
@pytest.mark.parametrize("with_x", [False, True], ids=["without-x", "with-x"])
def test_decay_input_leak_gradient_with_and_without_x(charge, with_x):
    """dh/dk of the decay-input charges uses x when backward gets it and recovers it from h[t] - u otherwise."""
    spec = cases.make_spec(P.SPIKINGJELLY, P.HARD, charge, True, ATan(2.5), False, variant=1)
    _check_case(
        spec, SHAPE, per_channel=True, save=P.SAVE_POTENTIAL, seed=_seed(charge, with_x),
        x_override=(lambda x2: x2) if with_x else (lambda x2: None),
    )  # fmt: skip


@pytest.mark.parametrize("surrogate", cases.SURROGATES, ids=lambda sg: type(sg).__name__)
def test_surrogate_derivative_on_a_grid(surrogate):
    """The kernel's surrogate'(u) against Surrogate.derivative: with T=1, no reset, k=1, v_init=0 and threshold 0,
    h = u exactly and grad_x = 1 * surrogate'(u) + 0."""
    u = torch.linspace(-3, 3, 601)
    p1, _ = surrogate.params()
    u = u[((u.abs() - p1).abs() > 1e-4) | (surrogate.code != Rectangle.code)]  # not on the Rectangle's edges
    spec = P.NeuronSpec(threshold=0.0, reset=P.NONE, surrogate=surrogate)
    n = u.numel()
    grad_x, _, _ = triton_ops.backward(
        torch.ones(1, n), torch.zeros(n), u[None].contiguous(), torch.ones(1), 1, torch.zeros(n), None,
        spec.kernel_args(), P.SAVE_INPUT, False,
    )  # fmt: skip
    torch.testing.assert_close(grad_x[0], surrogate.derivative(u), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Dtypes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("combo", DYN_COMBOS)
def test_half_inputs(combo, dtype, memory):
    """Half inputs are upcast per step like the reference: identical spikes (in the input dtype) and fp32 state.

    Recompute mode keeps h in a float32 scratch buffer here (grad_x is half).
    """
    spec = _spec_for(combo, 1, detach=combo[1] == P.SOFT)
    half_ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    x, leak, v = cases.make_inputs(SHAPE, spec, dtype, seed=_seed(combo, dtype, memory), per_channel=True)
    x2, leak, inner, v0 = cases.kernel_inputs(x, leak, v)
    args = spec.kernel_args()
    save = MEMORY[memory]
    spikes, state, saved = triton_ops.forward(x2, leak, inner, v0, args, save)
    want_spikes, want_state, _ = reference.forward(x2, leak, inner, v0, args, save)
    assert spikes.dtype == dtype and state.dtype == torch.float32
    assert torch.equal(spikes, want_spikes)
    assert torch.equal(state, want_state)
    gen = torch.Generator().manual_seed(5)
    gs = torch.randn(x2.shape, generator=gen).to(dtype)
    gst = torch.randn(v0.shape, generator=gen)
    got = triton_ops.backward(gs, gst, _x_for_backward(x2, spec, save), leak, inner, v0, saved, args, save, True)
    want = _reference_grads(gs, gst, x2, leak, inner, v0, args, True)
    assert got[0].dtype == dtype
    # grad_x is rounded to the half dtype from float32 values that may differ in the last float32 bits.
    scale = max(float(want[0].abs().max()), 1.0)
    torch.testing.assert_close(got[0], want[0], rtol=half_ulp, atol=half_ulp * 0.1 * scale)
    _assert_grads_close((None,) + got[1:], (None,) + want[1:])


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("combo", DYN_COMBOS)
def test_float64(combo, memory):
    """Float64 is computed in float64, with constants that are not float32-representable passed exactly."""
    dyn, reset, charge, spr = combo
    base = _spec_for(combo, 2)
    spec = P.NeuronSpec(
        threshold=0.3, v_reset=0.1 if reset == P.HARD and dyn != P.SNNTORCH else 0.0, reset=reset,
        surrogate=base.surrogate, detach_reset=False, dynamics=dyn, charge=charge, state_post_reset=spr,
    )  # fmt: skip
    _check_case(spec, SHAPE, per_channel=True, save=MEMORY[memory], dtype=torch.float64, seed=_seed(combo, 64),
                grad_rtol=1e-10)  # fmt: skip


def test_float32_constants_round_like_pytorch():
    """Thresholds / resets that are not float32-representable round exactly as PyTorch rounds the scalar."""
    for i, combo in enumerate(cases.dynamics_combos()):
        dyn, reset, charge, spr = combo
        spec = P.NeuronSpec(
            threshold=0.3, v_reset=0.1 if dyn != P.SNNTORCH and reset == P.HARD else 0.0, reset=reset, surrogate=Sigmoid(3.3),
            dynamics=dyn, charge=charge, state_post_reset=spr,
        )  # fmt: skip
        _check_case(spec, (3, 40), per_channel=False, save=P.SAVE_POTENTIAL, seed=i)


def test_unsupported_dtype_raises():
    spec = P.NeuronSpec()
    x2 = torch.ones(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="float32, float16, bfloat16 and float64"):
        triton_ops.forward(x2, torch.ones(1), 1, torch.zeros(3), spec.kernel_args(), P.SAVE_POTENTIAL)


def test_non_contiguous_input_is_rejected():
    spec = P.NeuronSpec()
    x2 = torch.ones(3, 2).t()
    with pytest.raises(ValueError, match="must be contiguous"):
        triton_ops.forward(x2, torch.ones(1), 1, torch.zeros(3), spec.kernel_args(), P.SAVE_POTENTIAL)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block=100), r"block must be one of"),
        (dict(leak=torch.ones(4)), r"6 neurons do not tile a per-channel leak of 4 entries x inner 1"),
        (dict(v_init=torch.zeros(6, dtype=torch.float64)), r"v_init has dtype torch.float64, expected torch.float32"),
    ],
)
def test_launcher_checks_raise_errors_not_asserts(kwargs, message):
    """The launchers index raw pointers: a bad layout raises (also under ``python -O``), never reads out of bounds."""
    args = dict(leak=torch.ones(1), v_init=torch.zeros(6))
    args.update(kwargs)
    block = args.pop("block", None)
    with pytest.raises((ValueError, TypeError), match=message):
        triton_ops.forward(torch.rand(2, 6), args["leak"], 1, args["v_init"], P.NeuronSpec().kernel_args(),
                           P.SAVE_POTENTIAL, block=block)


# ---------------------------------------------------------------------------------------------------------------
# Block sizes, shapes
# ---------------------------------------------------------------------------------------------------------------


def test_block_size_choice():
    assert all(triton_ops.block_size(n) in triton_ops.BLOCK_SIZES for n in (1, 127, 128, 10**5, 10**6, 10**9))
    assert triton_ops.block_size(1) == 128 and triton_ops.block_size(10**9) == 1024
    sizes = [triton_ops.block_size(2**e) for e in range(30)]
    assert sizes == sorted(sizes) and set(sizes) == set(triton_ops.BLOCK_SIZES)


@pytest.mark.parametrize("block", [128, 256, 512, 1024])
@pytest.mark.parametrize("memory", list(MEMORY))
def test_block_sizes(block, memory):
    """Every block size the launcher can pick, over several programs with a partial last block."""
    n = 2 * block + 37
    for i, combo in enumerate([(P.PAPER, P.HARD, P.CHARGE_MUL, False), (P.SPIKINGJELLY, P.SOFT, P.CHARGE_DIV, True)]):
        spec = _spec_for(combo, i + block)
        _check_case(spec, (3, n // 7, 7), per_channel=True, save=MEMORY[memory], block=block, seed=_seed(block, i))
        _check_case(spec, (2, n), per_channel=False, save=MEMORY[memory], block=block, seed=_seed(block, i, 1))


ODD_SHAPES = [(1, 1), (1, 7), (5, 1), (3, 1, 1, 1), (2, 3, 1, 5, 2), (6, 2, 4, 1), (1, 300), (3, 5, 7)]


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_odd_shapes(shape, memory):
    """T=1, N=1, unit and trailing dims; a per-channel leak wherever the rank allows more than one channel."""
    combos = [(P.SNNTORCH, P.SOFT, P.CHARGE_MUL, False), (P.SPIKINGJELLY, P.HARD, P.CHARGE_MUL_INPUT, True)]
    for i, combo in enumerate(combos):
        spec = _spec_for(combo, i + len(shape))
        _check_case(spec, shape, per_channel=len(shape) >= 2, save=MEMORY[memory], seed=_seed(shape, i))


# ---------------------------------------------------------------------------------------------------------------
# Through the public API and the custom op
# ---------------------------------------------------------------------------------------------------------------


API_SPECS = [
    pytest.param(P.NeuronSpec(threshold=0.8, v_reset=-0.1, surrogate=Triangle(1.5)), id="paper"),
    pytest.param(
        P.NeuronSpec(threshold=1.0, reset=P.SOFT, dynamics=P.SNNTORCH, surrogate=FastSigmoid(10.0), detach_reset=True),
        id="snntorch",
    ),
    pytest.param(
        P.NeuronSpec(
            dynamics=P.SPIKINGJELLY, charge=P.CHARGE_DIV_INPUT, state_post_reset=True, surrogate=Rectangle(0.8, 1.25)
        ),
        id="sj-divin",
    ),
]


def _run_api(spec, memory, x, leak, v, *, chained):
    """spiking_neuron with each backend (two chained calls, or one); compares outputs and input gradients.

    Chained, the second call's v_init is the first call's state, and leak / v_init are learnable.
    """
    results = {}
    for backend in ("triton", "reference"):
        xr = x.clone().requires_grad_(True)
        kr = leak.clone().requires_grad_(chained)
        vr = v.clone().requires_grad_(chained)
        w = torch.linspace(-1, 1, x[:3].numel()).reshape(x[:3].shape)
        if chained:
            s1, st1 = spikefuse.spiking_neuron(xr[:3], kr, spec, v_init=vr, backend=backend, memory=memory)
            s2, st2 = spikefuse.spiking_neuron(xr[3:], kr, spec, v_init=st1, backend=backend, memory=memory)
            outputs = (s1, s2, st2)
            loss = (s1 * w).sum() + (s2 * w.flip(0)).sum() + (st2 * st2).sum()
        else:
            s1, st1 = spikefuse.spiking_neuron(xr, kr, spec, v_init=vr, backend=backend, memory=memory)
            outputs = (s1, st1)
            loss = (s1[:3] * w).sum() + (s1[3:] * w.flip(0)).sum() + (st1 * st1).sum()
        loss.backward()
        results[backend] = (outputs, (xr.grad, vr.grad, kr.grad))
    (got_out, got_grads), (want_out, want_grads) = results["triton"], results["reference"]
    for g, w in zip(got_out, want_out):
        assert torch.equal(g.detach(), w.detach())
    _assert_grads_close(got_grads, want_grads)


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("spec", API_SPECS)
def test_api_custom_op_autograd(spec, memory):
    """spiking_neuron(backend='triton') through the custom op equals backend='reference' (values, x-gradient)."""
    x, leak, v = cases.make_inputs((6, 2, 3, 4), spec, seed=_seed(spec, memory), per_channel=True)
    _run_api(spec, memory, x, leak, v, chained=False)


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("spec", API_SPECS[:1])
def test_api_learnable_leak_v_init_and_continuation(spec, memory):
    x, leak, v = cases.make_inputs((6, 2, 3, 4), spec, seed=3, per_channel=True)
    _run_api(spec, memory, x, leak, v, chained=True)


def test_importing_spikefuse_does_not_import_triton():
    code = "import sys, spikefuse, spikefuse.functional, spikefuse.ops; assert 'triton' not in sys.modules, 'triton'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# The kernels compiled for sm_80 / sm_90 without a GPU (registers, spills, vector widths, FMA, div.rn, barriers):
# tests/ops/test_triton_aot.py.
