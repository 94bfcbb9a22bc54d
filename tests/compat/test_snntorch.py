"""spikefuse.compat.snntorch's ``Leaky``, ``Synaptic``, ``RLeaky`` and ``RSynaptic`` against the real snnTorch 1.0,
called as snnTorch's users call them: one step per call in a Python loop, states passed back (or kept inside),
snnTorch's saved weights loaded strict. Spikes and states bit for bit (float32; float64 where snnTorch computes in
it), ``sequence`` bit for bit the loop, gradients of the input, learnable parameters and recurrent weights to
1e-5; misuse refused by message.
"""

from __future__ import annotations

import pytest
import torch

snntorch = pytest.importorskip("snntorch", reason="snnTorch is not installed (pip install snntorch)")
from snntorch import surrogate as snn_surrogate  # noqa: E402

import spikefuse.nn  # noqa: E402
from spikefuse import surrogate as sf_surrogate  # noqa: E402
from spikefuse.compat import snntorch as C  # noqa: E402

from . import BACKENDS  # noqa: E402

T, B, N = 14, 3, 8
RESETS = ["subtract", "zero", "none"]


def _close(got, want, name):
    scale = max(float(want.abs().max()), 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"grad of {name}: {m}")


def _loop(module, x, state=(), membranes=None):
    """snnTorch's loop: one call per step, the states handed back (``state``: those of the first call); each step's
    membrane appended to ``membranes`` when given."""
    spikes = []
    for t, x_t in enumerate(x.unbind(0)):
        out = module(x_t, *state) if (t == 0 and state) or not module.init_hidden and t > 0 else module(x_t)
        spikes.append(out[0])
        state = _handed_back(module, out)
        if membranes is not None:
            membranes.append(out[-1].detach())
    return torch.stack(spikes), out[1:]


def _handed_back(module, out):
    """What snnTorch's users pass to the next call: the spikes too for the recurrent neurons."""
    module = getattr(module, "_orig_mod", module)  # a compiled module: the one it wraps
    return tuple(out) if type(module).__name__.startswith("R") else tuple(out[1:])


def _pair(peer_cls, ours_cls, backend, **kw):
    torch.manual_seed(3)
    peer = peer_cls(**kw)
    ours = ours_cls(**kw, backend=backend)
    ours.load_state_dict(peer.state_dict(), strict=True)
    return peer, ours


def _learnables(module, names):
    return [getattr(module, n) if n != "recurrent" else module.recurrent.weight for n in names]


CASES = {
    "leaky": (snntorch.Leaky, C.Leaky, dict(beta=0.8, threshold=0.9), ["beta", "threshold"]),
    "synaptic": (snntorch.Synaptic, C.Synaptic, dict(alpha=0.7, beta=0.85, threshold=0.9), ["alpha", "beta"]),
    "rleaky": (snntorch.RLeaky, C.RLeaky, dict(beta=0.8, threshold=0.9, linear_features=N), ["beta", "recurrent"]),
    "rleaky_v": (
        snntorch.RLeaky,
        C.RLeaky,
        dict(beta=0.8, all_to_all=False, V=torch.linspace(-0.5, 0.5, N)),
        ["beta", "V"],
    ),
    "rsynaptic": (
        snntorch.RSynaptic,
        C.RSynaptic,
        dict(alpha=0.7, beta=0.85, linear_features=N),
        ["alpha", "recurrent"],
    ),
}


# reset_delay=False (the reset in the step of the spike) where it changes something: not for "none", nor
# for the one-to-one RLeaky (the all-to-all one's model), with inputs large enough for a membrane still above the
# threshold after its reset (a second reset in the next step, which snnTorch's reset signal takes back)
_NO_DELAY = [(name, reset, False) for name in ("leaky", "synaptic", "rleaky", "rsynaptic") for reset in RESETS[:2]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, reset, reset_delay", [(n, r, True) for n in CASES for r in RESETS] + _NO_DELAY)
def test_loop_and_sequence_match_snntorch(name, reset, reset_delay, backend):
    peer_cls, ours_cls, kw, learn = CASES[name]
    flags = {f"learn_{n}": True for n in learn if n not in ("recurrent", "V")}
    peer, ours = _pair(peer_cls, ours_cls, backend, reset_mechanism=reset, reset_delay=reset_delay, **kw, **flags)
    g = torch.Generator().manual_seed(5)
    x = torch.rand(T, B, N, generator=g) * (0.7 if reset_delay else 2.4)
    upstream = torch.randn(T, B, N, generator=g)
    results, membranes = [], []
    # snnTorch's RSynaptic(reset_delay=False) fails without the states passed (it divides the argument spk)
    first = (torch.zeros(B, N),) * 3 if name == "rsynaptic" and not reset_delay else ()
    for module, run in (
        (peer, lambda m, x: _loop(m, x, first, membranes)),
        (ours, lambda m, x: _loop(m, x, first)),
        (ours, lambda m, x: (lambda o: (o[0], o[1:]))(m.sequence(x, *first))),
    ):
        module.reset_mem()
        xs = x.clone().requires_grad_()
        spikes, states = run(module, xs)
        loss = (spikes * upstream).sum() + sum((s * (i + 1)).sum() for i, s in enumerate(states))
        results.append((spikes, states, torch.autograd.grad(loss, [xs, *_learnables(module, learn)])))
    (p_spk, p_states, p_grads), (o_spk, o_states, o_grads), (s_spk, s_states, s_grads) = results
    assert 0 < float(p_spk.detach().mean()) < 1, "degenerate input: all or no spikes"
    if not reset_delay and reset == "subtract" and name != "rsynaptic":  # (snnTorch's RSynaptic drops the reset)
        assert any(bool((m > kw["threshold"] if "threshold" in kw else m > 1).any()) for m in membranes[:-1]), (
            "no membrane above the threshold after its reset: the case does not test the reset signal"
        )
    assert o_spk.dtype == torch.float32
    assert torch.equal(o_spk, p_spk) and torch.equal(s_spk, o_spk)
    for a, b, c in zip(o_states, p_states, s_states):
        assert torch.equal(a, b) and torch.equal(c, a)
    for n, a, b, c in zip(["x", *learn], o_grads, p_grads, s_grads):
        _close(a, b, n)
        _close(c, a, n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_kept_between_calls_and_reset(backend):
    """Without states, each call continues from the kept ones (snnTorch's lazy zeros first); ``sequence`` continues
    them too; ``reset_mem`` zeros them; a new batch size starts from zeros."""
    peer, ours = _pair(snntorch.RLeaky, C.RLeaky, backend, beta=0.7, linear_features=N)
    x = torch.rand(T, B, N, generator=torch.Generator().manual_seed(6)) * 0.8
    want = [peer(x_t) for x_t in x]
    got = [ours(x_t) for x_t in x[:5]]
    spk_seq, mem = ours.sequence(x[5:])
    for (a, ma), (b, mb) in zip(want[:5], got):
        assert torch.equal(a, b) and torch.equal(ma, mb)
    assert torch.equal(spk_seq, torch.stack([w[0] for w in want[5:]])) and torch.equal(mem, want[-1][1])
    spk, mem = ours.reset_mem()
    assert not spk.any() and not mem.any() and spk.shape == (B, N)
    fresh = snntorch.RLeaky(beta=0.7, linear_features=N)
    fresh.load_state_dict(peer.state_dict())
    assert torch.equal(ours(x[0, :2])[1], fresh(x[0, :2])[1])  # another batch size: from zeros


@pytest.mark.parametrize("backend", BACKENDS)
def test_init_hidden_output_and_graded_spikes(backend):
    for output in (False, True):
        peer, ours = _pair(
            snntorch.Leaky, C.Leaky, backend, beta=0.5, init_hidden=True, output=output, graded_spikes_factor=0.5
        )
        x = torch.rand(T, B, N, generator=torch.Generator().manual_seed(8))
        for x_t in x:
            a, b = peer(x_t), ours(x_t)
            if output:
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            else:
                assert torch.equal(a, b)
        assert set(ours.sequence(x)[0].unique().tolist()) <= {0.0, 0.5}
        with pytest.raises(TypeError, match="with init_hidden=True Leaky keeps its states"):
            ours(x[0], torch.zeros(B, N))
    peer, ours = _pair(
        snntorch.RSynaptic, C.RSynaptic, backend, alpha=0.6, beta=0.8, linear_features=N, init_hidden=True
    )
    x = torch.rand(T, B, N, generator=torch.Generator().manual_seed(9))
    assert torch.equal(torch.stack([peer(x_t) for x_t in x]), torch.stack([ours(x_t) for x_t in x]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_to_one_options(backend):
    """A scalar V, a fixed V (learn_recurrent=False: V a buffer, recurrent.V not saved), a learnable one."""
    x = torch.rand(T, B, N, generator=torch.Generator().manual_seed(10)) * 0.8
    for kw in (dict(V=0.3), dict(V=torch.rand(N), learn_recurrent=False), dict(V=torch.rand(N), learn_beta=True)):
        peer, ours = _pair(snntorch.RLeaky, C.RLeaky, backend, beta=0.75, all_to_all=False, **kw)
        assert set(ours.state_dict()) == set(peer.state_dict())
        a, b = _loop(peer, x), _loop(ours, x)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1][0], b[1][0])


def test_float64_leaky_and_synaptic():
    """snnTorch computes a float64 input in float64 (float32 spikes): so do Leaky and Synaptic."""
    x = torch.rand(T, B, N, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    for cls_peer, cls_ours, kw in (
        (snntorch.Leaky, C.Leaky, dict(beta=0.7, reset_mechanism="zero")),
        (snntorch.Synaptic, C.Synaptic, dict(alpha=0.7, beta=0.8)),
    ):
        peer, ours = _pair(cls_peer, cls_ours, "cpu", **kw)
        (s1, st1), (s2, st2) = _loop(peer, x), _loop(ours, x)
        assert s1.dtype == s2.dtype == torch.float32 and st2[-1].dtype == torch.float64
        assert torch.equal(s1, s2) and all(torch.equal(a, b) for a, b in zip(st1, st2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_keeps_the_parameters_float32(dtype):
    """snnTorch keeps beta, alpha and threshold float32 whatever the input's dtype (``beta=0.9`` is not bfloat16's
    0.8984): Leaky, whose membrane snnTorch turns float32 in the first step, gives its spikes and membranes bit for
    bit; Synaptic computes as on the float32 input (snnTorch keeps its synaptic current in the input's dtype, rounded
    every step: that rounding is not the drop-in's)."""
    x = (torch.rand(T, B, N, generator=torch.Generator().manual_seed(13)) * 0.6).to(dtype)
    peer, ours = _pair(snntorch.Leaky, C.Leaky, "cpu", beta=0.9, threshold=0.3)
    (s1, st1), (s2, st2) = _loop(peer, x), _loop(ours, x)
    assert s1.sum() > 0 and torch.equal(s1, s2) and all(torch.equal(a, b) for a, b in zip(st1, st2))
    kw = dict(alpha=0.9, beta=0.85, threshold=0.7)
    half, wide = _loop(C.Synaptic(**kw), x), _loop(C.Synaptic(**kw), x.float())
    assert half[0].sum() > 0 and torch.equal(half[0], wide[0]) and all(map(torch.equal, half[1], wide[1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_neuron_beta_conv_layout(backend):
    """beta of shape (C, 1, 1) on [B, C, H, W] inputs: one leak per channel, as snnTorch broadcasts it."""
    beta = torch.tensor([0.3, 0.6, 0.9]).reshape(3, 1, 1)
    peer, ours = _pair(snntorch.Leaky, C.Leaky, backend, beta=beta.clone(), learn_beta=True)
    x = torch.rand(T, 2, 3, 2, 2, generator=torch.Generator().manual_seed(4)) * 0.6
    a, b = _loop(peer, x), _loop(ours, x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1][0], b[1][0])


def test_a_state_from_a_freed_graph_says_to_reset():
    """A training loop without reset_mem() between batches: the second backward reaches the first batch's freed
    graph through the kept state; snnTorch ends in PyTorch's internals there, this says what to do."""
    lif = C.RLeaky(beta=0.9, linear_features=4)
    lin = torch.nn.Linear(3, 4)
    for batch in range(2):
        x = torch.rand(5, 2, 3)
        loss = sum(lif(lin(x_t))[1].sum() for x_t in x)
        if batch == 0:
            loss.backward()
        else:
            with pytest.raises(RuntimeError, match=r"Reset the states between batches \(spikefuse.nn.reset_states"):
                loss.backward()
    spikefuse.nn.reset_states(torch.nn.Sequential(lin, lif))
    assert not lif.mem.any() and not lif.spk.any()
    sum(lif(lin(x_t))[1].sum() for x_t in torch.rand(5, 2, 3)).backward()


def test_surrogate_mapping_and_errors():
    assert C.to_surrogate(None) == sf_surrogate.ATan(2.0)
    assert C.to_surrogate(snn_surrogate.atan()) == sf_surrogate.ATan(2.0)
    assert C.to_surrogate(snn_surrogate.fast_sigmoid()) == sf_surrogate.FastSigmoid(25.0)
    assert C.to_surrogate(snn_surrogate.sigmoid(slope=7)) == sf_surrogate.Sigmoid(7.0)
    assert C.to_surrogate(sf_surrogate.Triangle(2.0)) == sf_surrogate.Triangle(2.0)
    for unsupported in (
        snn_surrogate.triangular(),
        snn_surrogate.heaviside(),
        snn_surrogate.straight_through_estimator(),
        lambda u: u,
    ):
        with pytest.raises(ValueError, match="unsupported spike_grad.*atan"):
            C.Leaky(beta=0.5, spike_grad=unsupported)
    refused = [
        (lambda: C.Leaky(beta=0.5, inhibition=True), NotImplementedError, "inhibition"),
        (lambda: C.Leaky(beta=0.5, state_quant=True), NotImplementedError, "state_quant"),
        (lambda: C.Leaky(beta=0.5, reset_mechanism="hard"), ValueError, "reset_mechanism must be one of"),
        (lambda: C.RLeaky(beta=0.5), TypeError, "needs linear_features"),
        (lambda: C.RLeaky(beta=0.5, linear_features=0), ValueError, "linear_features must be a positive int"),
        # refused at construction, as the native modules refuse them (they failed only at the first call)
        (lambda: C.RLeaky(beta=0.5, linear_features=4, backend="cuda"), ValueError, "unknown backend 'cuda'"),
        (lambda: C.Synaptic(alpha=0.5, beta=0.5, backend="gpu"), ValueError, "unknown backend 'gpu'"),
        (lambda: C.Leaky(beta=0.5, memory="bogus"), ValueError, "unknown memory mode 'bogus'"),
        (lambda: C.RLeaky(beta=0.5, all_to_all=False, linear_features=3), TypeError, "takes V, not linear_features"),
        (lambda: C.Leaky(beta=torch.rand(3, 8))(torch.rand(3, 8)), ValueError, "per-neuron beta"),
        (
            lambda: C.Leaky(beta=0.5)(torch.rand(3, 8), torch.zeros(3, 8), torch.zeros(3, 8)),
            TypeError,
            "at most 1 states",
        ),
    ]
    for make, error, message in refused:
        with pytest.raises(error, match=message):
            make()


def test_one_to_one_layer_of_no_neurons_is_empty_as_in_snntorch():
    """A recurrent layer of 0 neurons gives empty spikes and states, as snnTorch's (it ended in a reshape error)."""
    for make in (snntorch.RLeaky, C.RLeaky):
        spk, mem = make(beta=0.9, all_to_all=False, V=0.5)(torch.rand(2, 0))
        assert spk.shape == mem.shape == (2, 0)
    spikes, mem = C.RLeaky(beta=0.9, all_to_all=False, V=0.5).sequence(torch.rand(3, 2, 0))
    assert spikes.shape == (3, 2, 0) and mem.shape == (2, 0)


def test_snntorch_utils_reset_resets_the_drop_ins():
    """The tutorials' network of ``init_hidden=True`` neurons in an ``nn.Sequential``, reset between samples by
    ``snntorch.utils.reset(net)``: the drop-ins are found as snnTorch's own (they have snnTorch's classes as bases
    where it is importable), so an evaluation under ``torch.no_grad()`` gives snnTorch's outputs (the drop-ins'
    states were carried over from the previous sample, silently)."""
    import snntorch.utils

    def net(lib):
        torch.manual_seed(5)
        return torch.nn.Sequential(
            torch.nn.Linear(6, N),
            lib.Leaky(beta=0.8, init_hidden=True),
            torch.nn.Linear(N, N),
            lib.Synaptic(alpha=0.7, beta=0.85, init_hidden=True),
            torch.nn.Linear(N, 4),
            lib.RLeaky(beta=0.8, threshold=0.2, linear_features=4, init_hidden=True, output=True),
        )

    peer, ours = net(snntorch), net(C)
    assert isinstance(ours[1], snntorch.Leaky) and isinstance(ours[5], snntorch.RLeaky)
    samples = torch.rand(3, T, B, 6, generator=torch.Generator().manual_seed(6)) * 4
    with torch.no_grad():
        for x in samples:
            outs = []
            for module in (peer, ours):
                snntorch.utils.reset(module)
                outs.append([module(x_t) for x_t in x])
            for (s1, *st1), (s2, *st2) in zip(*outs):
                assert torch.equal(s1, s2) and all(map(torch.equal, st1, st2))
    assert float(torch.stack([o[0] for o in outs[1]]).mean()) > 0
    assert all(float(ours[i].mem.abs().sum()) > 0 for i in (1, 3, 5))
    snntorch.utils.reset(ours)
    assert all(float(ours[i].mem.abs().sum()) == 0 for i in (1, 3, 5))


@pytest.mark.parametrize("name", ["leaky", "synaptic", "rleaky", "rsynaptic"])
@pytest.mark.parametrize("reset_delay", [True, False])
def test_reset_mechanism_set_after_construction_runs_as_snntorch(name, reset_delay):
    """snnTorch picks its state update in the constructor: setting ``reset_mechanism`` later changes only the reset in
    the step of a spike of ``reset_delay=False`` (and ``reset_mechanism_val``); the drop-ins run what snnTorch runs,
    bit for bit, and refuse the mixtures they do not define (the drop-ins ran the new mechanism throughout)."""
    peer_cls, ours_cls, kw, _ = CASES[name]
    x = torch.rand(T, B, N, generator=torch.Generator().manual_seed(8)) * 1.5
    for made in RESETS:
        for now in RESETS:
            peer, ours = _pair(peer_cls, ours_cls, "cpu", reset_mechanism=made, reset_delay=reset_delay, **kw)
            peer.reset_mechanism = ours.reset_mechanism = now
            assert int(ours.reset_mechanism_val) == int(peer.reset_mechanism_val)
            try:
                want = _loop(peer, x)
            except TypeError:  # snnTorch 1.0's RSynaptic(reset_delay=False) fails on its own graded spikes factor
                continue
            try:
                got = _loop(ours, x)
            except NotImplementedError as err:
                assert not reset_delay and made != now and "spikefuse does not define" in str(err)
                continue
            assert torch.equal(want[0], got[0]), (made, now)
            assert all(torch.equal(a, b) for a, b in zip(want[1], got[1])), (made, now)
    with pytest.raises(ValueError, match="reset_mechanism must be one of"):
        ours.reset_mechanism = "hard"


def test_snntorch_detach_hidden_detaches_the_drop_ins():
    """Truncated BPTT as snnTorch's users write it: ``snntorch.Leaky.detach_hidden()`` detaches every Leaky's state
    in place, the drop-ins' too (their states were views, which torch cannot detach in place)."""
    ours = C.Leaky(beta=0.9, init_hidden=True)
    x = torch.rand(T, B, N, requires_grad=True)
    for x_t in x[:3]:
        ours(x_t)
    assert ours.mem.requires_grad
    snntorch.Leaky.detach_hidden()
    assert not ours.mem.requires_grad
    ours(x[3]).sum().backward()
    assert x.grad[:3].abs().sum() == 0 and x.grad[3].abs().sum() > 0


def test_every_drop_in_compiles_without_a_graph_break():
    """``torch.compile(fullgraph=True)`` of each drop-in called as snnTorch's users call it (a step with the kept
    states, with states given, ``init_hidden``, ``sequence``): no graph break (the graded spikes factor was read on
    the host), and a compiled step loop gives the eager spikes and gradients."""
    x = torch.rand(T, B, N, generator=torch.Generator().manual_seed(9)) * 1.5
    for name, (_, ours_cls, kw, _) in CASES.items():
        calls = {
            "kept": (ours_cls(**kw), (x[0],)),
            "given": (ours_cls(**kw), (x[0], *(torch.zeros(B, N) for _ in ours_cls.STATES))),
            "init_hidden": (ours_cls(**kw, init_hidden=True), (x[0],)),
        }
        for call, (module, args) in calls.items():
            module(x[0])  # a state of this shape kept, as in a loop's later steps
            assert torch._dynamo.explain(module)(*args).graph_break_count == 0, (name, call)
        module = ours_cls(**kw)
        assert torch._dynamo.explain(module.sequence)(x).graph_break_count == 0, name
        eager, traced = ours_cls(**kw), ours_cls(**kw)
        traced.load_state_dict(eager.state_dict())
        compiled = torch.compile(traced, fullgraph=True, backend="aot_eager")
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        (s1, st1), (s2, st2) = _loop(eager, xe), _loop(compiled, xc)
        assert s1.sum() > 0 and torch.equal(s1, s2) and all(map(torch.equal, st1, st2)), name
        (s1.sum() + st1[-1].sum()).backward()
        (s2.sum() + st2[-1].sum()).backward()
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", list(CASES))
def test_attributes_set_after_construction_change_the_dynamics_as_in_snntorch(name):
    """beta, alpha, threshold and the graded spikes factor set as tensors after construction: snnTorch's spikes and
    states bit for bit (a Python number is refused by torch for both, as for any buffer)."""
    peer_cls, ours_cls, kw, _ = CASES[name]
    x = torch.rand(T, B, N, generator=torch.Generator().manual_seed(10)) * 1.5
    values = {"beta": 0.55, "alpha": 0.35, "threshold": 0.6, "graded_spikes_factor": 2.0}
    for attr, value in values.items():
        peer, ours = _pair(peer_cls, ours_cls, "cpu", **kw)
        if not hasattr(peer, attr) or (attr == "graded_spikes_factor" and name.startswith("r")):
            continue
        setattr(peer, attr, torch.tensor(value))
        setattr(ours, attr, torch.tensor(value))
        (s1, st1), (s2, st2) = _loop(peer, x), _loop(ours, x)
        assert s1.sum() > 0 and torch.equal(s1, s2) and all(map(torch.equal, st1, st2)), attr


def test_use_spikefuse_neurons_swaps_an_snntorch_model_in_place():
    """One call puts spikefuse's drop-ins in place of an snnTorch model's neurons: the same state_dict keys and values,
    snnTorch's outputs; a neuron without a drop-in (SLSTM) or with a setting the drop-in refuses (inhibition) is
    kept and named with the reason."""
    import copy

    import snntorch.utils

    from spikefuse.compat import use_spikefuse_neurons

    torch.manual_seed(7)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, N),
        snntorch.Leaky(beta=0.8, learn_beta=True, init_hidden=True, reset_mechanism="zero"),
        torch.nn.Linear(N, N),
        snntorch.Synaptic(alpha=0.7, beta=0.85, init_hidden=True, reset_delay=False),
        torch.nn.Linear(N, N),
        snntorch.RLeaky(beta=0.8, linear_features=N, init_hidden=True),
        torch.nn.Linear(N, N),
        snntorch.RSynaptic(alpha=0.6, beta=0.9, all_to_all=False, V=0.4, init_hidden=True),
        torch.nn.Sequential(torch.nn.Linear(N, 4), snntorch.Leaky(beta=0.5, inhibition=True, init_hidden=True)),
        snntorch.Alpha(alpha=0.9, beta=0.8, init_hidden=True),
        snntorch.SLSTM(N, N, init_hidden=True),
    )
    net[1].reset_mechanism = "subtract"  # as made ("zero") for the state update, snnTorch's in-step reset set
    peer = copy.deepcopy(net)
    keys = list(net.state_dict())
    swapped = use_spikefuse_neurons(net)
    assert swapped.replaced == ["1", "3", "5", "7", "9"]
    assert set(swapped.kept) == {"8.1", "10"}
    assert "inhibition" in swapped.kept["8.1"] and "SLSTM has no spikefuse drop-in" in swapped.kept["10"]
    assert isinstance(net[1], C.Leaky) and isinstance(net[9], C.Alpha) and type(net[10]) is snntorch.SLSTM
    assert list(net.state_dict()) == keys
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), peer.state_dict().values()))
    x = torch.rand(T, B, 6, generator=torch.Generator().manual_seed(11)) * 2
    head = lambda m: torch.nn.Sequential(*list(m)[:8])  # noqa: E731  (the neurons replaced)
    for module in (head(peer), head(net)):
        snntorch.utils.reset(module)
    want, got = [head(peer)(x_t) for x_t in x], [head(net)(x_t) for x_t in x]
    assert torch.stack(want).sum() > 0 and all(torch.equal(a, b) for a, b in zip(want, got))


# Neurons without reset_delay: (peer, drop-in, arguments, learnables, input scale)
MORE = {
    "lapicque": (snntorch.Lapicque, C.Lapicque, dict(beta=0.8, threshold=0.9), ["threshold"], 2.5),
    "lapicque_rc": (
        snntorch.Lapicque,
        C.Lapicque,
        dict(R=2.0, C=1.5, time_step=0.5, threshold=0.9),
        ["threshold"],
        1.5,
    ),
    "alpha": (snntorch.Alpha, C.Alpha, dict(alpha=0.9, beta=0.8, threshold=0.5), ["beta", "threshold"], 1.0),
}


@pytest.mark.parametrize("reset", RESETS)
@pytest.mark.parametrize("name", list(MORE))
def test_more_neurons_match_snntorch(name, reset):
    """Each step loop with states passed back, ``init_hidden=True`` and ``sequence`` against snnTorch's step loop:
    spikes and states bit for bit, gradients of the input and learnables to 1e-5 (the fused CPU kernels, the step
    path of the loop); snnTorch's ``state_dict`` loads strict; ``drop_in_for`` makes the same neuron."""
    peer_cls, ours_cls, kw, learn, scale = MORE[name]
    flags = {f"learn_{n}": True for n in learn}
    peer, ours = _pair(peer_cls, ours_cls, "cpu", reset_mechanism=reset, **kw, **flags)
    g = torch.Generator().manual_seed(5)
    x = torch.rand(T, B, N, generator=g) * scale
    upstream = torch.randn(T, B, N, generator=g)
    results = []
    for module, run in (
        (peer, _loop),
        (ours, _loop),
        (ours, lambda m, x: (lambda o: (o[0], o[1:]))(m.sequence(x))),
        (C.drop_in_for(peer), _loop),
    ):
        module.reset_mem()
        xs = x.clone().requires_grad_()
        spikes, states = run(module, xs)
        loss = (spikes * upstream).sum() + sum((s * (i + 1)).sum() for i, s in enumerate(states))
        results.append((spikes, states, torch.autograd.grad(loss, [xs, *_learnables(module, learn)])))
    p_spk, p_states, p_grads = results[0]
    assert 0 < float(p_spk.detach().mean()) < 1, "degenerate input: all or no spikes"
    for spikes, states, grads in results[1:]:
        assert torch.equal(spikes, p_spk) and all(map(torch.equal, states, p_states))
        for n, a, b in zip(["x", *learn], grads, p_grads):
            _close(a, b, n)
    hidden = [cls(init_hidden=True, reset_mechanism=reset, **kw) for cls in (peer_cls, ours_cls)]
    hidden[1].load_state_dict(hidden[0].state_dict(), strict=True)
    assert torch.equal(*(torch.stack([m(x_t) for x_t in x]) for m in hidden))


def test_more_neurons_refuse_what_snntorch_cannot_run():
    with pytest.raises(NotImplementedError, match="snnTorch's Lapicque does not read beta"):
        C.Lapicque(beta=0.9, learn_beta=True)
    with pytest.raises(ValueError, match="Either beta or 2 of beta, R and C"):
        C.Lapicque(R=1.0)
    with pytest.raises(ValueError, match="not all three"):
        C.Lapicque(beta=0.9, R=1.0, C=2.0)
    with pytest.raises(NotImplementedError, match="snnTorch's Alpha cannot be made with it"):
        C.Alpha(alpha=0.9, beta=0.8, learn_alpha=True)
    with pytest.raises(ValueError, match="alpha must be greater than beta"):
        C.Alpha(alpha=0.8, beta=0.9)
