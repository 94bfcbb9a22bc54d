"""spikefuse.compat.spikingjelly against SpikingJelly 2.0 itself (its CPU operators, spikingjelly/_ops/*/cpu.py).

Spikes and the post-reset state ``v`` must be bit-identical (torch.equal, float32); gradients of the input, of
PLIF's ``w`` and of the initial state must agree within rtol 1e-5. Every test carries the state over two calls.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch

pytest.importorskip("spikingjelly", reason="SpikingJelly is not installed (pip install spikingjelly --no-deps loguru)")
from spikingjelly.activation_based import functional as sj_functional  # noqa: E402
from spikingjelly.activation_based import neuron as sj_neuron  # noqa: E402
from spikingjelly.activation_based import surrogate as sj_surrogate  # noqa: E402

from spikefuse import surrogate as sf_surrogate  # noqa: E402
from spikefuse.compat import spikingjelly as C  # noqa: E402

from . import BACKENDS, GRAD_TOL, away_from_threshold  # noqa: E402

T, SHAPE = 5, (3, 8)


def _pair(name: str, backend: str, **kwargs):
    return getattr(sj_neuron, name)(step_mode="m", **kwargs), getattr(C, name)(step_mode="m", backend=backend, **kwargs)


def _inputs(ours, seed: int, v0: torch.Tensor, scale: float = 1.5, shift: float = 0.4, t_steps: int = 2 * T):
    """Inputs for two calls of T steps from ``v0``, away from threshold ties over the whole sequence."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((t_steps, *SHAPE), generator=g) * scale + shift
    leak = ours._leak()
    x = away_from_threshold(x, leak.detach() if isinstance(leak, torch.Tensor) else leak, ours.neuron(), v_init=v0)
    return x


def _check_two_calls(peer, ours, x: torch.Tensor, v0: torch.Tensor):
    """Run both modules on x[:T] then x[T:] from state v0; compare spikes, v, and gradients."""
    results = []
    for module in (peer, ours):
        xs = x.clone().requires_grad_(True)
        v_init = v0.clone().requires_grad_(True)
        module.v = v_init
        s1 = module(xs[:T])
        v1 = module.v
        s2 = module(xs[T:])
        v2 = module.v
        g = torch.Generator().manual_seed(7)
        w1, w2 = torch.randn(s1.shape, generator=g), torch.randn(s2.shape, generator=g)
        loss = (s1 * w1).sum() + (s2 * w2).sum() + (v1 * 0.3).sum() + (v2 * v2).sum()
        params = [p for p in module.parameters()]
        grads = torch.autograd.grad(loss, [xs, v_init, *params])
        results.append(((s1, v1, s2, v2), grads))
    (peer_out, peer_grads), (our_out, our_grads) = results
    for name, a, b in zip(("spikes[call 1]", "v[call 1]", "spikes[call 2]", "v[call 2]"), peer_out, our_out):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs from SpikingJelly at {(a != b).nonzero()[:5].tolist()}"
    n_spikes = peer_out[0].sum() + peer_out[2].sum()
    assert 0 < n_spikes < peer_out[0].numel() + peer_out[2].numel(), "degenerate input: all or no spikes"
    assert len(peer_grads) == len(our_grads)
    for name, a, b in zip(("x", "v_init", "w"), peer_grads, our_grads):
        torch.testing.assert_close(b, a, **GRAD_TOL, msg=lambda m: f"grad of {name}: {m}")


SURROGATES = {"sigmoid": lambda: sj_surrogate.Sigmoid(), "atan": lambda: sj_surrogate.ATan()}
# Each (form, surrogate) compiles kernels of its own: SpikingJelly's default sigmoid on every form, ATan (its mapping
# onto spikefuse's) on one form of each node, with both resets of gradient.
_RESETS = {0.0: "hard0", 0.3: "hard0.3", None: "soft"}
LIF_CASES = [
    pytest.param(surrogate, tau, detach, v_reset, decay_input, id=f"{surrogate}-{tau}-{d_id}-{r_id}-{i_id}")
    for surrogate in sorted(SURROGATES)
    for tau in (1.25, 2.0)
    for detach, d_id in ((False, "attached"), (True, "detach_reset"))
    for v_reset, r_id in _RESETS.items()
    for decay_input, i_id in ((True, "decay_input"), (False, "no_decay_input"))
    if surrogate == "sigmoid" or (tau, v_reset, decay_input) == (2.0, None, True)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("surrogate, tau, detach_reset, v_reset, decay_input", LIF_CASES)
def test_lif_node(backend, surrogate, tau, detach_reset, v_reset, decay_input):
    kwargs = dict(tau=tau, decay_input=decay_input, v_reset=v_reset, detach_reset=detach_reset)
    peer, ours = _pair("LIFNode", backend, surrogate_function=SURROGATES[surrogate](), **kwargs)
    v0 = torch.rand(SHAPE, generator=torch.Generator().manual_seed(1)) * 0.8
    seed = zlib.crc32(repr((tau, v_reset, decay_input)).encode())
    x = _inputs(ours, seed=seed, v0=v0, scale=1.5 if decay_input else 0.8)
    _check_two_calls(peer, ours, x, v0)


PLIF_CASES = [
    pytest.param(
        surrogate, detach, v_reset, decay_input, init_tau, id=f"{surrogate}-{d_id}-{r_id}-{decay_input}-{init_tau}"
    )
    for surrogate in sorted(SURROGATES)
    for detach, d_id in ((False, "attached"), (True, "detach_reset"))
    for v_reset, r_id in ((0.0, "hard0"), (-0.2, "hard-0.2"), (None, "soft"))
    for decay_input, init_tau in ((True, 2.0), (False, 1.6), (True, 3.5))
    if surrogate == "sigmoid" or (v_reset, decay_input, init_tau) == (0.0, False, 1.6)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("surrogate, detach_reset, v_reset, decay_input, init_tau", PLIF_CASES)
def test_parametric_lif_node(backend, surrogate, detach_reset, v_reset, decay_input, init_tau):
    kwargs = dict(init_tau=init_tau, decay_input=decay_input, v_reset=v_reset, detach_reset=detach_reset)
    peer, ours = _pair("ParametricLIFNode", backend, surrogate_function=SURROGATES[surrogate](), **kwargs)
    assert torch.equal(ours.w, peer.w) and ours.w.requires_grad
    v0 = torch.rand(SHAPE, generator=torch.Generator().manual_seed(2)) * 0.8
    x = _inputs(ours, seed=int(init_tau * 10), v0=v0, scale=1.5 if decay_input else 0.8)
    _check_two_calls(peer, ours, x, v0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("detach_reset", [False, True], ids=["attached", "detach_reset"])
@pytest.mark.parametrize("v_reset", [0.0, 0.3, None], ids=["hard0", "hard0.3", "soft"])
def test_if_node(backend, detach_reset, v_reset):
    peer, ours = _pair(
        "IFNode",
        backend,
        v_threshold=0.9,
        v_reset=v_reset,
        detach_reset=detach_reset,
        surrogate_function=sj_surrogate.ATan(),
    )
    v0 = torch.rand(SHAPE, generator=torch.Generator().manual_seed(3)) * 0.5
    x = _inputs(ours, seed=5, v0=v0, scale=0.6, shift=0.1)
    _check_two_calls(peer, ours, x, v0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "make",
    [
        lambda: sj_surrogate.PiecewiseQuadratic(alpha=1.5),
        lambda: sj_surrogate.Rect(alpha=0.8),
        lambda: sj_surrogate.Sigmoid(alpha=2.5),
    ],
    ids=["PiecewiseQuadratic", "Rect", "Sigmoid2.5"],
)
def test_other_surrogates(backend, make):
    peer, ours = _pair("LIFNode", backend, tau=1.5, v_reset=None, surrogate_function=make())
    v0 = torch.zeros(SHAPE)
    x = _inputs(ours, seed=11, v0=v0)
    # Rect's window edges |u| = 0.5/alpha = 0.625 are discontinuities too: keep potentials off them as well.
    neuron = ours.neuron()
    threshold = neuron.constant("threshold")
    shifted = [
        dataclasses.replace(neuron, constants=(("threshold", threshold + d), ("v_reset", neuron.constant("v_reset"))))
        for d in (0.0, 0.625, -0.625)
    ]
    for _ in range(10):
        before = x.clone()
        for sp in shifted:
            x = away_from_threshold(x, ours._leak(), sp, v_init=v0)
        if torch.equal(x, before):
            break
    _check_two_calls(peer, ours, x, v0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_step_mode_and_reset_net(backend):
    peer = sj_neuron.ParametricLIFNode(init_tau=1.8, v_reset=None, surrogate_function=sj_surrogate.ATan())
    ours = C.ParametricLIFNode(init_tau=1.8, v_reset=None, surrogate_function=sj_surrogate.ATan(), backend=backend)
    x = _inputs(ours, seed=3, v0=torch.zeros(SHAPE))
    for _ in range(2):  # the second round after reset_net starts from v = 0 again
        out = []
        for module in (peer, ours):
            xs = x.clone().requires_grad_(True)
            spikes = [module(x_t) for x_t in xs]
            v = module.v
            loss = sum((s * (i + 1)).sum() for i, s in enumerate(spikes)) + v.sum()
            out.append((torch.stack(spikes), v, torch.autograd.grad(loss, [xs, module.w])))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
        for a, b in zip(out[0][2], out[1][2]):
            torch.testing.assert_close(b, a, **GRAD_TOL)
        sj_functional.reset_net(torch.nn.Sequential(peer, ours))
        assert ours.v == 0.0 and peer.v == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_v_seq(backend):
    for step_mode in ("m", "s"):
        peer = sj_neuron.LIFNode(tau=1.5, store_v_seq=True, step_mode=step_mode)
        ours = C.LIFNode(tau=1.5, store_v_seq=True, step_mode=step_mode, backend=backend)
        x = _inputs(ours, seed=4, v0=torch.zeros(SHAPE))
        for module in (peer, ours):
            if step_mode == "m":
                module(x[:T]), module(x[T:])
            else:
                [module(x_t) for x_t in x]
        assert peer.v_seq.shape == ours.v_seq.shape
        assert torch.equal(peer.v_seq, ours.v_seq) and torch.equal(peer.v, ours.v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_and_state_restart_on_new_shape(backend):
    peer, ours = _pair("LIFNode", backend, tau=2.0, v_reset=0.1)
    x = _inputs(ours, seed=9, v0=torch.full(SHAPE, 0.1)).double()
    assert torch.equal(peer(x), ours(x)) and torch.equal(peer.v, ours.v) and ours.v.dtype == torch.float64
    y = x[:, :2]  # another batch size: SpikingJelly silently starts again from v_reset
    assert torch.equal(peer(y), ours(y)) and torch.equal(peer.v, ours.v)


def test_defaults_and_attributes_match_spikingjelly():
    for name in ("LIFNode", "ParametricLIFNode", "IFNode"):
        peer, ours = getattr(sj_neuron, name)(), getattr(C, name)()
        for attr in ("v_threshold", "v_reset", "detach_reset", "step_mode", "store_v_seq", "v"):
            assert getattr(ours, attr) == getattr(peer, attr), (name, attr)
    assert C.LIFNode().tau == sj_neuron.LIFNode().tau
    assert C.ParametricLIFNode(init_tau=3.0).w.item() == pytest.approx(-math.log(2.0))
    assert C.to_surrogate(sj_surrogate.Sigmoid()) == sf_surrogate.Sigmoid(4.0)
    assert C.to_surrogate(sj_surrogate.ATan(alpha=3.0)) == sf_surrogate.ATan(3.0)
    assert C.to_surrogate(sj_surrogate.PiecewiseQuadratic(alpha=2.0)) == sf_surrogate.Triangle(2.0)
    assert C.to_surrogate(sf_surrogate.FastSigmoid(3.0)) == sf_surrogate.FastSigmoid(3.0)


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: C.LIFNode(surrogate_function=sj_surrogate.SuperSpike()),
            "unsupported surrogate_function.*Sigmoid/ATan",
        ),
        (lambda: C.LIFNode(surrogate_function=sj_surrogate.Sigmoid(spiking=False)), "spiking=False"),
        (lambda: C.LIFNode(surrogate_function=torch.sigmoid), "unsupported surrogate_function"),
        (lambda: C.LIFNode(tau=1.0), "tau must be > 1"),
        (lambda: C.ParametricLIFNode(init_tau=0.5), "init_tau must be > 1"),
        (lambda: C.IFNode(step_mode="x"), "step_mode"),
        (lambda: C.LIFNode(backend="cuda"), "unknown backend 'cuda'"),  # at construction, as the native modules
        (lambda: C.ParametricLIFNode(memory="bogus"), "unknown memory mode 'bogus'"),
    ],
)
def test_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_compiles_without_a_graph_break():
    """``torch.compile(fullgraph=True)`` of the drop-ins, single- and multi-step: no graph break, the eager spikes."""
    x = torch.rand(6, 3, 5) * 2
    for make, inputs in (
        (lambda: C.LIFNode(), [x[0], x[1]]),
        (lambda: C.LIFNode(step_mode="m"), [x]),
        (lambda: C.ParametricLIFNode(step_mode="m"), [x]),
        (lambda: C.IFNode(step_mode="m"), [x]),
    ):
        eager, traced = make(), make()
        assert torch._dynamo.explain(make())(inputs[0]).graph_break_count == 0
        compiled = torch.compile(traced, fullgraph=True, backend="aot_eager")
        for x_in in inputs:
            want, got = eager(x_in), compiled(x_in)
            assert torch.equal(want, got)
        assert float(want.mean()) > 0


def test_use_spikefuse_neurons_swaps_a_spikingjelly_model_in_place():
    """One call puts spikefuse's drop-ins in place of a SpikingJelly model's neurons, step mode and parameters
    carried (a ParametricLIFNode's learned w): the same state_dict and SpikingJelly's spikes; a neuron without a
    drop-in is kept and named."""
    import copy

    from spikingjelly.activation_based import layer

    from spikefuse.compat import use_spikefuse_neurons

    torch.manual_seed(7)
    net = torch.nn.Sequential(
        layer.Linear(6, 10, step_mode="m"),
        sj_neuron.LIFNode(tau=3.0, decay_input=False, v_reset=None, step_mode="m"),
        layer.Linear(10, 10, step_mode="m"),
        sj_neuron.ParametricLIFNode(init_tau=2.5, detach_reset=True, step_mode="m"),
        layer.Linear(10, 10, step_mode="m"),
        sj_neuron.IFNode(v_threshold=0.8, step_mode="m"),
        sj_neuron.IzhikevichNode(step_mode="m"),
    )
    with torch.no_grad():
        net[3].w.fill_(0.3)
    peer = copy.deepcopy(net)
    swapped = use_spikefuse_neurons(net)
    assert swapped.replaced == ["1", "3", "5"] and list(swapped.kept) == ["6"]
    assert isinstance(net[3], C.ParametricLIFNode) and net[3].step_mode == "m"
    assert list(net.state_dict()) == list(peer.state_dict())
    x = torch.rand(8, 4, 6, generator=torch.Generator().manual_seed(12)) * 3
    head = lambda m: torch.nn.Sequential(*list(m)[:6])  # noqa: E731
    want, got = head(peer)(x), head(net)(x)
    assert want.sum() > 0 and torch.equal(want, got)
