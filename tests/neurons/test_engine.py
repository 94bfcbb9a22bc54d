"""The neuron engine's conformance suite: every shipped model (and one defined only in this file) on every engine
backend (the generated numba kernels, and the generated Triton kernels through Triton's interpreter) against the
reference loop evaluated from the same definition.

Spikes and final states bit-identical in float32 and float64 (states to a few ulps where the step calls exp or log,
which each backend's math library rounds in its own way); gradients of the input, the initial states and every
parameter (scalar and per channel) within 1e-5 relative; gradcheck in float64 where the derivative is exact;
hypothesis over shapes (T=1, N=1, odd sizes, trailing dims); a run split in two calls through the returned state
equals one call.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (conftest may have chosen the GPU)

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spikefuse
import spikefuse.nn
from spikefuse.neurons import (
    ALIF_MODEL,
    CUBA_LIF,
    CUBA_LIF_HARD,
    CUBA_LIF_ZERO,
    LIF_MODELS,
    SPIKINGJELLY_MODELS,
    SYNAPTIC_NO_DELAY_MODELS,
    NeuronModel,
)
from spikefuse.neurons.spec import neuron_spec
from spikefuse.ops.engine import NeuronInputs, cpu, reference, triton
from spikefuse.surrogate import ATan, FastSigmoid, Rectangle, Sigmoid, Triangle

# Defined here, not in the package: an exponential integrate-and-fire neuron (Fourcaud-Trocme et al. 2003),
# forward Euler with step dt, reset to v_reset after a spike. Nothing in spikefuse knows it.
EIF = NeuronModel(
    name="test_eif",
    states=("v",),
    params=("dt", "v_rest", "delta", "v_t", "v_reset", "threshold"),
    step=(("v", "v - s*(v - v_reset)"), ("v", "v + dt*((v_rest - v) + delta*exp((v - v_t)/delta) + x)")),
    fire="v - threshold",
    defaults=(("dt", 0.5), ("v_rest", 0.0), ("delta", 0.5), ("v_t", 0.6), ("v_reset", 0.0), ("threshold", 1.2)),
)

# Also only here: a current-based LIF that hands on its states after the reset (a handoff over two states, one of
# which the reset leaves alone), as Norse's LIF does.
CUBA_POST_RESET = NeuronModel(
    name="test_cuba_post_reset",
    states=("i", "v"),
    params=("alpha", "beta", "threshold", "v_reset"),
    step=(("v", "where(s, v_reset, v)"), ("i", "alpha*i + x"), ("v", "beta*v + i")),
    fire="v - threshold",
    handoff=(("v", "where(s, v_reset, v)"),),
)

MODELS = {
    "cuba_lif": (CUBA_LIF, {"alpha": 0.8, "beta": 0.7, "threshold": 1.0}),
    "cuba_lif_zero": (CUBA_LIF_ZERO, {"alpha": 0.6, "beta": 0.9, "threshold": 0.8}),
    "cuba_lif_hard": (CUBA_LIF_HARD, {"alpha": 0.7, "beta": 0.8, "threshold": 0.9}),
    "alif": (ALIF_MODEL, {"decay": 0.8, "rho": 0.9, "b0": 0.6, "beta": 0.4}),
    "eif": (EIF, {}),
    "lif_hard": (LIF_MODELS[("paper", "hard")], {"decay": 0.8, "threshold": 0.7, "v_reset": -0.1}),  # where(s, a, b)
    # handoffs: the states handed on are post-reset, the first step sees no spike
    "sj_hard_mul_input": (
        SPIKINGJELLY_MODELS[("hard", "mul_input")],
        {"decay": 0.6, "threshold": 0.7, "v_reset": -0.1},
    ),
    "cuba_post_reset": (CUBA_POST_RESET, {"alpha": 0.7, "beta": 0.8, "threshold": 0.6, "v_reset": 0.1}),
    # heaviside (in the step and its derivatives), a constant in the handoff, three states
    "synaptic_zero_no_delay": (SYNAPTIC_NO_DELAY_MODELS["zero"], {"alpha": 0.7, "beta": 0.8, "threshold": 0.6}),
}
BACKENDS = {"cpu": cpu, "triton": triton}


def _inputs(model, params, shape, dtype, seed, per_channel=None):
    """Input, parameter tensors ([1], or [C] for the names in ``per_channel``) and initial states ([N])."""
    g = torch.Generator().manual_seed(seed)
    t_steps, n = shape[0], int(torch.tensor(shape[1:]).prod())
    x = (torch.rand(shape, generator=g, dtype=dtype) * 1.2 - 0.1).reshape(t_steps, n)
    values = {**dict(model.defaults), **params}
    channels = shape[2] if len(shape) >= 3 else 1
    inner = n // (shape[1] * channels) if per_channel else 1
    tensors = []
    for p in model.params:
        if per_channel and p in per_channel:
            scale = torch.linspace(0.9, 1.0, channels, dtype=dtype)
            tensors.append(values[p] * scale)
        else:
            tensors.append(torch.full((1,), values[p], dtype=dtype))
    init = [torch.rand(n, generator=g, dtype=dtype) * 0.5 for _ in model.states]
    return x, tensors, inner, init


def _close(a, b, what, atol=0.0):
    scale = max(float(b.abs().max()), 1e-6) if b.numel() else 1.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= 1e-5 * scale + atol, f"{what}: max abs diff {err:.3g}, scale {scale:.3g}"


def _check(
    model,
    params,
    shape,
    dtype,
    backend,
    surrogate,
    detach,
    per_channel=None,
    seed=0,
    save=False,
    need=True,
    overwrite=False,
):
    x, tensors, inner, init = _inputs(model, params, shape, dtype, seed, per_channel)
    ops = BACKENDS[backend]
    neuron, inputs = neuron_spec(model, surrogate, detach), NeuronInputs(x, tensors, init, inner)
    spikes, final, saved = ops.forward(neuron, inputs, save=save)
    ref_spikes, ref_final, ref_saved = reference.forward(neuron, inputs, save=save)
    assert torch.equal(spikes, ref_spikes), "spikes differ"
    transcendental = any(f"{name}(" in e for _, e in model.step for name in ("exp", "log"))
    for k, a, b in zip(model.states, final, ref_final):
        if transcendental:  # each backend's exp/log may round the last bit differently
            torch.testing.assert_close(a, b, rtol=4 * torch.finfo(dtype).eps, atol=0, msg=f"final state {k}")
        else:
            assert torch.equal(a, b), f"final state {k} differs"
    assert len(saved) == len(ref_saved) == (len(model.states) if save else 0)
    for k, a, b in zip(model.states, saved, ref_saved):  # every step's states, for backward to read
        assert a.shape == x.shape and (torch.equal(a, b) or transcendental), f"saved state {k} differs"
    g = torch.Generator().manual_seed(seed + 1)
    grad_spikes = torch.rand(x.shape, generator=g, dtype=dtype)
    grad_final = [torch.rand(x.shape[1], generator=g, dtype=dtype) for _ in model.states]
    need = [need] * len(model.params)
    got = ops.backward(neuron, inputs, grad_spikes, grad_final, need, saved=saved, overwrite_saved=overwrite)
    if overwrite:
        assert got[0] is saved[0], "grad_x goes over the saved first state"
    want = reference.backward(neuron, inputs, grad_spikes, grad_final, need)
    _close(got[0], want[0], "grad x")
    for k, a, b in zip(model.states, got[1], want[1]):
        _close(a, b, f"grad initial {k}")
    for p, a, b in zip(model.params, got[2], want[2]):
        assert (a is None) == (b is None) and (a is None or a.shape == b.shape), p
        if a is not None:  # a sum over neurons and steps, which may cancel far below its terms: eps absolute too
            _close(a, b, f"grad {p}", atol=torch.finfo(dtype).eps)
    return spikes


# float64 and the per-channel / grad_x-over-the-states kernels for two models: each case compiles kernels of its own
_POTENTIAL_CASES = [(name, torch.float32) for name in MODELS] + [("cuba_lif", torch.float64)]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name, dtype", _POTENTIAL_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_memory_potential(name, dtype, backend):
    """memory="potential": the forward saves every step's states (equal to the reference's), the backward reads them
    instead of recomputing: the same gradients, with and without parameter gradients, grad_x apart or (CPU) over the
    saved states."""
    model, params = MODELS[name]
    _check(model, params, (9, 3, 70), dtype, backend, Sigmoid(4.0), False, save=True)
    if name in ("cuba_lif", "lif_hard", "cuba_post_reset"):
        _check(
            model,
            params,
            (5, 2, 3, 4, 5),
            dtype,
            backend,
            ATan(2.0),
            True,
            per_channel=model.params[:1],
            save=True,
            need=False,
            overwrite=backend == "cpu",
        )


def test_memory_potential_keeps_the_saved_states_for_a_retained_graph():
    """grad_x goes over the saved states only once autograd frees them: a retained graph's second backward is the
    first's, and both are memory="recompute"'s."""
    x = torch.rand(6, 2, 5, requires_grad=True)
    g = torch.rand(6, 2, 5)
    y = spikefuse.neuron(x, CUBA_LIF, alpha=0.8, beta=0.7, memory="potential", backend="cpu")
    first = torch.autograd.grad(y, x, g, retain_graph=True)[0]
    second = torch.autograd.grad(y, x, g)[0]
    y_recompute = spikefuse.neuron(x, CUBA_LIF, alpha=0.8, beta=0.7, memory="recompute", backend="cpu")
    assert torch.equal(first, second)
    torch.testing.assert_close(first, torch.autograd.grad(y_recompute, x, g)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("model", [CUBA_LIF, CUBA_LIF_ZERO], ids=lambda m: m.name)
def test_memory_potential_keeps_the_input_only_where_a_derivative_reads_it(model, backend):
    """With the states saved, the input stays alive for backward only if a derivative of the step reads it
    (cuba_lif_zero's reset ``where(s, 0, ...)`` holds x; cuba_lif's derivatives do not)."""
    x = torch.rand(4, 3, 5, requires_grad=True)
    y = x * 2.0  # saved by nothing else
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        spikes = spikefuse.neuron(y, model, alpha=0.8, beta=0.7, memory="potential", backend=backend)
    kept = any(t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in saved)
    assert kept == model.backward_reads_input == (model is CUBA_LIF_ZERO)
    spikes.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    spikefuse.neuron(x * 2.0, model, alpha=0.8, beta=0.7, backend="reference").sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-6)


def test_unknown_memory_mode():
    with pytest.raises(ValueError, match=r"unknown memory mode 'saved': use one of \['potential', 'recompute'\]"):
        spikefuse.neuron(torch.rand(3, 4), CUBA_LIF, alpha=0.5, beta=0.5, memory="saved")


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("detach", [False, True], ids=["reset-grad", "detach-reset"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_matches_the_reference(name, detach, dtype, backend):
    model, params = MODELS[name]
    spikes = _check(model, params, (9, 3, 70), dtype, backend, Sigmoid(4.0), detach)
    assert 0 < float(spikes.mean()) < 1, "the case must spike and not spike"


@pytest.mark.parametrize(
    "surrogate",
    [Sigmoid(3.0), ATan(2.0), Rectangle(0.8, 1.2), Triangle(1.5), FastSigmoid(10.0)],
    ids=lambda s: type(s).__name__,
)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_surrogate(surrogate, backend):
    model, params = MODELS["cuba_lif"]
    _check(model, params, (6, 2, 40), torch.float32, backend, surrogate, False)


@pytest.mark.parametrize("memory", ["recompute", "potential"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("name", ["cuba_lif", "lif_hard", "cuba_post_reset"])
def test_half_precision_runs_in_float32(name, backend, dtype, memory):
    """A float16 / bfloat16 input runs as its float32 value: spikes in the input's dtype, float32 states, and the
    input's gradient the float32 run's rounded to the input's dtype (to nearest, ties to even), bit for bit. The
    Triton kernels read and write the half-precision tensors themselves and keep every state's history in float32
    (one state, two, and a handoff)."""
    model, params = MODELS[name]
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(6, 2, 40, generator=g) * 1.2).to(dtype)
    upstream = torch.rand(x.shape, generator=g).to(dtype)
    runs = {}
    for d in (dtype, torch.float32):
        xx = x.to(d, copy=True).requires_grad_()
        spikes, states = spikefuse.neuron(xx, model, return_state=True, backend=backend, memory=memory, **params)
        torch.autograd.backward([spikes, states[-1]], [upstream.to(d), torch.ones_like(states[-1])])
        runs[d] = spikes, states, xx.grad
    (spikes, states, grad), (spikes32, states32, grad32) = runs[dtype], runs[torch.float32]
    assert 0 < float(spikes32.detach().mean()) < 1, "the case must spike and not spike"
    assert spikes.dtype == dtype and torch.equal(spikes, spikes32.to(dtype))
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(states, states32))
    assert grad.dtype == dtype and torch.equal(grad, grad32.to(dtype))


def test_triton_backend_checks_its_tensors():
    """The Triton backend indexes raw pointers: what it cannot read is refused with a message, never misread."""
    model, _ = MODELS["cuba_lif"]
    x = torch.rand(3, 8)
    params = [torch.full((1,), 0.5) for _ in model.params]
    init = [torch.zeros(1) for _ in model.states]
    neuron = neuron_spec(model, Sigmoid(4.0))
    assert triton.READS_HALF and not cpu.READS_HALF and not reference.READS_HALF
    with pytest.raises(TypeError, match="take float32, float64, float16 or bfloat16, got torch.int32"):
        triton.forward(neuron, NeuronInputs(x.int(), params, init))
    with pytest.raises(
        ValueError, match="every parameter and initial-state tensor must be contiguous, of dtype torch.float32"
    ):  # a half input's parameters are float32
        triton.forward(neuron, NeuronInputs(x.half(), [p.half() for p in params], init))
    with pytest.raises(ValueError, match="must be contiguous and of one dtype, got torch.float16 and torch.float32"):
        triton.backward(neuron, NeuronInputs(x.half(), params, init), x, [torch.zeros(1)] * 2, [False] * 3)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", ["cuba_lif", "alif"])
def test_per_channel_parameters(name, backend):
    model, params = MODELS[name]
    per_channel = model.params[:2]
    _check(model, params, (5, 2, 3, 4, 5), torch.float64, backend, ATan(2.0), False, per_channel=per_channel)


@pytest.mark.parametrize("backend", list(BACKENDS))
@settings(max_examples=15, deadline=None)
@given(t_steps=st.integers(1, 6), dims=st.lists(st.integers(1, 7), min_size=1, max_size=3), seed=st.integers(0, 99))
def test_shapes(backend, t_steps, dims, seed):
    model, params = MODELS["cuba_lif"]
    _check(model, params, (t_steps, *dims), torch.float32, backend, Sigmoid(4.0), False, seed=seed)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_many_blocks(backend):
    """More neurons than one parallel task / program holds, the last block partial."""
    model, params = MODELS["alif"]
    _check(model, params, (3, 2 * cpu.BLOCK + 37), torch.float32, backend, Sigmoid(4.0), False)
    if backend == "cpu":  # a block cut to fit the recomputing backward's scratch, and the potential mode's full one
        _check(model, params, (40, 3 * cpu.MIN_BLOCK + 5), torch.float32, backend, Sigmoid(4.0), False)
        _check(model, params, (3, 2 * cpu.BLOCK + 37), torch.float32, backend, Sigmoid(4.0), False, save=True)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(MODELS))
def test_without_parameter_gradients(name, backend):
    """No parameter needs a gradient: the CPU backward keeps the history of only the states its reverse pass reads
    (CubaLIF's current is carried through the recompute in one row), over several blocks, the last partial."""
    model, params = MODELS[name]
    _check(model, params, (9, 2, 3, 5), torch.float32, backend, Sigmoid(4.0), False, need=False)
    if name in ("cuba_lif", "alif", "cuba_post_reset"):  # float64 compiles kernels of its own: a model of each kind
        _check(model, params, (2, 3, 5), torch.float64, backend, Sigmoid(4.0), True, need=False)
    if backend == "cpu":
        _check(model, params, (9, 2 * cpu.MIN_BLOCK + 37), torch.float32, backend, Sigmoid(4.0), False, need=False)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("name", list(MODELS))
def test_gradcheck_fp64(name, backend):
    """The final states with a detached reset are smooth in the input and parameters (inputs kept away from the
    threshold): gradcheck against finite differences."""
    model, params = MODELS[name]
    g = torch.Generator().manual_seed(2)
    x = torch.rand(4, 3, generator=g, dtype=torch.float64) * 0.6
    values = {**dict(model.defaults), **params}
    tensors = [torch.tensor(values[p], dtype=torch.float64, requires_grad=True) for p in model.params]

    def final_states(x, *tensors):
        _, final = spikefuse.neuron(
            x,
            model,
            surrogate="sigmoid",
            detach_reset=True,
            return_state=True,
            backend=backend,
            **dict(zip(model.params, tensors)),
        )
        return final

    assert torch.autograd.gradcheck(final_states, (x.requires_grad_(), *tensors), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(MODELS))
def test_continuation_through_the_state(name, backend):
    model, params = MODELS[name]
    params = {**params, "backend": backend, "surrogate": "sigmoid"}  # the kernels of the tests above
    x = torch.rand(10, 2, 6) * 1.2
    whole, whole_state = spikefuse.neuron(x, model, return_state=True, **params)
    first, state = spikefuse.neuron(x[:4], model, return_state=True, **params)
    second, last = spikefuse.neuron(x[4:], model, state=state, return_state=True, **params)
    assert torch.equal(torch.cat([first, second]), whole)
    for a, b in zip(last, whole_state):
        assert torch.equal(a, b)
    as_dict = spikefuse.neuron(x[4:], model, state=dict(zip(model.states, state)), **params)
    assert torch.equal(as_dict, second)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_user_model_through_the_public_api_and_module(backend):
    """The test-file neuron on the public entry points: functional and nn module, learnable per-channel parameter."""
    layer = spikefuse.nn.EngineNeuron(EIF, learnable=("delta",), channels=3, surrogate="atan", backend=backend)
    x = (torch.rand(6, 2, 3, 4) * 1.5).requires_grad_()
    out = layer(x)
    assert out.shape == x.shape and set(out.unique().tolist()) <= {0.0, 1.0}
    out.sum().backward()
    assert layer.delta.grad.shape == (3,) and x.grad is not None
    reference_out = spikefuse.neuron(x.detach(), EIF, surrogate="atan", backend="reference", delta=layer.delta.detach())
    assert torch.equal(out.detach(), reference_out)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_final_state_without_a_gradient_path(backend):
    """ALIF with detach_reset from the default (shared) initial states: its final adaptation depends on no input, so
    the reference's backward has no gradient to take through it (it raised), and the fused kernels agree with it."""
    x = torch.rand(5, 2, 7) * 0.8
    grads = {}
    for run in ("reference", backend):
        leaf = x.clone().requires_grad_()
        spikes, (v, a) = spikefuse.neuron(
            leaf, ALIF_MODEL, decay=0.9, rho=0.95, detach_reset=True, backend=run, return_state=True
        )
        (spikes * torch.linspace(0.5, 1.5, 7) + v + a).sum().backward()
        grads[run] = leaf.grad
    _close(grads[backend], grads["reference"], "grad x")


def test_triton_block_keeps_eight_words_of_state_per_thread():
    """The generated Triton kernels' block: the LIF launcher's choice, capped at 8 state words per thread."""
    from spikefuse.ops.engine.triton import block_size

    n = 2**24
    assert block_size(n) == 1024
    expected = {
        (1, torch.float32): 1024,
        (2, torch.float32): 512,
        (3, torch.float32): 256,
        (2, torch.float64): 256,
        (3, torch.float64): 128,
    }
    for (states, dtype), block in expected.items():
        assert triton.engine_block(n, states, dtype) == block, (states, dtype)
    assert triton.engine_block(1000, 1, torch.float32) == 128


def test_kernel_cache_folder_falls_back_when_it_cannot_be_written(tmp_path, monkeypatch):
    """A kernel cache folder that cannot be made (a read-only home; here a path under a file): a folder in the
    temporary directory, with a warning; an error that says what to set where neither can be written."""
    import tempfile

    from spikefuse.ops.engine import emit

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPIKEFUSE_CACHE_DIR", str(blocker / "kernels"))
    monkeypatch.setattr(emit, "_CACHE_DIRS", {})
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    with pytest.warns(
        UserWarning, match=r"cannot write the kernel cache folder .*a-file/kernels.*cached in .*spikefuse-kernels"
    ):
        folder = emit.cache_dir()
    assert folder.parent == tmp_path and folder.is_dir()
    monkeypatch.setattr(emit, "_CACHE_DIRS", {})
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(blocker))
    with pytest.raises(RuntimeError, match="cannot write a folder for its generated kernels.*set SPIKEFUSE_CACHE_DIR"):
        emit.cache_dir()


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="owners and modes are POSIX's")
def test_kernel_cache_fallback_is_private_and_refuses_a_planted_folder(tmp_path, monkeypatch):
    """The fallback in the shared temporary directory is made with mode 0700; one found there that another user
    could have filled (writable by others, another owner, a link) is refused before any module is imported from it."""
    import stat
    import tempfile

    from spikefuse.ops.engine import emit

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPIKEFUSE_CACHE_DIR", str(blocker / "kernels"))
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(shared))
    fallback = shared / f"spikefuse-kernels-{os.getuid()}"

    monkeypatch.setattr(emit, "_CACHE_DIRS", {})
    with pytest.warns(UserWarning, match="cached in"):
        assert emit.cache_dir() == fallback
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700

    def link(folder):
        folder.rmdir()
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")

    plants = {"writable by others": lambda f: f.chmod(0o777), "a link": link}
    if os.getuid() == 0:
        plants["another user's"] = lambda f: os.chown(f, 12345, -1)
    for what, plant in plants.items():
        monkeypatch.setattr(emit, "_CACHE_DIRS", {})
        plant(fallback)
        with pytest.raises(RuntimeError, match=r"not this user's alone .*refused, since spikefuse imports") as err:
            emit.cache_dir()
        assert str(fallback) in str(err.value), what
        fallback.unlink() if fallback.is_symlink() else fallback.rmdir()
        fallback.mkdir(mode=0o700)
