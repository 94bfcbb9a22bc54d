"""A surrogate defined only in this file, as a user defines one (docs/custom-neuron.md): with ``params``,
``derivative`` and ``sympy_derivative`` and no line of the library changed, it runs on every engine backend (the
reference, the CPU kernels, Triton under the interpreter) for a neuron definition and for the LIF specs, with the
formula it defines; the hand-written Triton kernels, which know the built-in surrogates only, refuse it by name."""

import math
import os
import sys
from dataclasses import dataclass

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import sympy  # noqa: E402
import torch  # noqa: E402

import spikefuse  # noqa: E402
from spikefuse.neurons import CUBA_LIF, LIF_MODELS  # noqa: E402
from spikefuse.surrogate import Surrogate, resolve  # noqa: E402

BACKENDS = ["reference", "cpu", "triton"]


@dataclass(frozen=True)
class Gaussian(Surrogate):
    sigma: float = 0.5

    def params(self):
        return float(self.sigma), 0.0

    def derivative(self, u):
        return torch.exp(-0.5 * (u / self.sigma) ** 2) / (self.sigma * math.sqrt(2 * math.pi))

    @staticmethod
    def sympy_derivative(u, p1, p2):
        return sympy.exp(-((u / p1) ** 2) / 2) / (p1 * sympy.sqrt(2 * sympy.pi))


def test_resolve_keeps_a_surrogate_of_the_users():
    g = Gaussian(0.3)
    assert resolve(g) is g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_formula_on_a_grid(backend, dtype):
    """T=1, no reset, zero initial state: grad_x = surrogate'(x - threshold), the definition's formula."""
    u = torch.linspace(-2, 2, 401, dtype=torch.float64)
    x = (u + 0.5).to(dtype).reshape(1, -1).requires_grad_()
    spikes = spikefuse.neuron(
        x, LIF_MODELS[("paper", "none")], surrogate=Gaussian(0.4), decay=0.9, threshold=0.5, backend=backend
    )
    spikes.backward(torch.ones_like(spikes))
    expected = Gaussian(0.4).derivative(x.detach()[0] - 0.5)
    torch.testing.assert_close(x.grad[0], expected, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-30)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_neuron_and_lif_spec_match_the_reference(backend):
    """CubaLIF (two states) and the paper's LIF spec, float32: spikes and states bit for bit, gradients to 1e-5."""
    g = torch.Generator().manual_seed(4)
    x = torch.rand(7, 3, 5, generator=g) * 0.7
    upstream = torch.rand(x.shape, generator=g)
    runs = {
        "cuba": lambda x, b: spikefuse.neuron(
            x, CUBA_LIF, surrogate=Gaussian(0.4), alpha=0.8, beta=0.9, backend=b, return_state=True
        ),
        "lif": lambda x, b: spikefuse.lif(
            x, decay=0.8, threshold=0.5, surrogate=Gaussian(0.4), backend=b, return_state=True
        ),
    }
    for name, run in runs.items():
        out = {}
        for b in ("reference", backend):
            xr = x.clone().requires_grad_()
            spikes, state = run(xr, b)
            spikes.backward(upstream)
            out[b] = (spikes.detach(), state, xr.grad)
        (ref_s, ref_state, ref_g), (s, state, grad) = out["reference"], out[backend]
        assert 0 < float(ref_s.mean()) < 1, name
        assert torch.equal(s, ref_s), name
        for a, b in zip(
            state if isinstance(state, tuple) else (state,), ref_state if isinstance(ref_state, tuple) else (ref_state,)
        ):
            assert torch.equal(a.detach(), b.detach()), name
        torch.testing.assert_close(grad, ref_g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_batchnorm_lif_with_a_users_surrogate(backend):
    """The fused BatchNorm + LIF with a surrogate of the user's on every backend (the reference's LIF gets the
    object itself), half precision on Triton: the same spikes and input gradient."""
    x = torch.randn(4, 2, 3, 5, generator=torch.Generator().manual_seed(0))
    dtype = torch.float16 if backend == "triton" else torch.float32
    out = {}
    for b in ("reference", backend):
        leaf = x.to(dtype).requires_grad_()
        spikes = spikefuse.batchnorm_lif(
            leaf,
            None,
            None,
            torch.ones(3),
            torch.zeros(3),
            True,
            decay=0.8,
            threshold=0.5,
            surrogate=Gaussian(),
            backend=b,
        )
        spikes.float().sum().backward()
        out[b] = spikes.detach(), leaf.grad
    assert 0 < float(out["reference"][0].float().mean()) < 1
    assert torch.equal(out[backend][0], out["reference"][0])
    got, want = out[backend][1].float(), out["reference"][1].float()
    tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps  # half: the float32 gradients, rounded
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_a_surrogate_whose_source_is_not_kept(monkeypatch):
    """Defined by ``exec`` (as ``python -c`` or a docs runner does), where ``inspect.getsource`` fails: the kernels'
    cache key is the formula itself."""
    import types

    module = types.ModuleType("user_surrogates")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(
        "from dataclasses import dataclass\n"
        "import sympy, torch\n"
        "from spikefuse.surrogate import Surrogate\n"
        "@dataclass(frozen=True)\n"
        "class Bump(Surrogate):\n"
        "    width: float = 0.7\n"
        "    def params(self):\n"
        "        return float(self.width), 0.0\n"
        "    def derivative(self, u):\n"
        "        return 1 / (1 + (u / self.width) ** 2)\n"
        "    @staticmethod\n"
        "    def sympy_derivative(u, p1, p2):\n"
        "        return 1 / (1 + (u / p1) ** 2)\n",
        module.__dict__,
    )
    x = torch.linspace(-1, 2, 31).reshape(1, -1).requires_grad_()
    spikefuse.neuron(
        x, LIF_MODELS[("paper", "none")], surrogate=module.Bump(), decay=0.9, threshold=0.5, backend="cpu"
    ).sum().backward()
    torch.testing.assert_close(x.grad[0], module.Bump().derivative(x.detach()[0] - 0.5))


# ------------------------------------------------------------------------------------------------- windowed
WINDOWED = [
    spikefuse.surrogate.Windowed(spikefuse.surrogate.Sigmoid(4.0), 0.5),
    spikefuse.surrogate.Windowed("triangle", 0.3),
    spikefuse.surrogate.Windowed(Gaussian(0.4), 0.25),  # a user's formula, wrapped
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("surrogate", WINDOWED, ids=lambda s: type(s).__name__)
def test_windowed_formula_on_a_grid(surrogate, backend, dtype):
    """Every backend's derivative is the definition's: zero exactly where ``|u| > width`` (the grid holds both edges),
    the wrapped surrogate's inside."""
    u = torch.cat([torch.linspace(-2, 2, 401, dtype=torch.float64), torch.tensor([-surrogate.width, surrogate.width])])
    x = (u + 0.5).to(dtype).reshape(1, -1).requires_grad_()
    spikes = spikefuse.neuron(
        x, LIF_MODELS[("paper", "none")], surrogate=surrogate, decay=0.9, threshold=0.5, backend=backend
    )
    spikes.backward(torch.ones_like(spikes))
    expected = surrogate.derivative(x.detach()[0] - 0.5)
    assert torch.equal(x.grad[0] != 0, expected != 0)
    assert 0.05 < float((expected != 0).double().mean()) < 0.5
    torch.testing.assert_close(x.grad[0], expected, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-30)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_windowed_neuron_over_time_matches_the_reference(backend):
    """T=7 with the leak and the reset: gradients to 1e-5 of the reference, zero at the same places (the leak carries
    the gradient back from a later step near the threshold; a neuron far above it spikes, and its reset cuts that)."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(7, 3, 40, generator=g) * 2
    upstream = torch.rand(x.shape, generator=g)
    grads = {}
    for b in ("reference", backend):
        xr = x.clone().requires_grad_()
        surrogate = spikefuse.surrogate.Windowed("sigmoid", 0.1)
        spikefuse.lif(xr, decay=0.2, threshold=0.3, surrogate=surrogate, backend=b).backward(upstream)
        grads[b] = xr.grad
    assert torch.equal(grads[backend] != 0, grads["reference"] != 0)
    assert float((grads["reference"] == 0).double().mean()) > 0.05
    torch.testing.assert_close(grads[backend], grads["reference"], rtol=1e-5, atol=1e-6)


def test_windowed_is_one_surrogate_per_wrapped_type():
    import pickle

    from spikefuse.surrogate import ATan, Sigmoid, Windowed

    w = Windowed(Sigmoid(4.0), 0.5)
    assert repr(w) == "Windowed(surrogate=Sigmoid(alpha=4.0), width=0.5)"
    assert w.params() == (4.0, 0.5)
    assert type(w).__name__ == "WindowedSigmoid" and type(w) is type(Windowed("sigmoid", 0.1))
    assert type(Windowed(ATan(), 0.5)) is not type(w) and isinstance(w, Windowed)
    assert pickle.loads(pickle.dumps(w)) == w
    assert resolve(w) is w


def test_windowed_refuses_what_it_cannot_be_by_message():
    from spikefuse.surrogate import Rectangle, Windowed

    with pytest.raises(ValueError, match=r"Windowed: width must be a positive finite number, got -1"):
        Windowed("sigmoid", -1)
    with pytest.raises(ValueError, match=r"Windowed: width must be a positive finite number, got inf"):
        Windowed("sigmoid", math.inf)
    with pytest.raises(ValueError, match=r"has two parameters.*Rectangle is zero outside \|u\| < width/2 already"):
        Windowed(Rectangle(), 0.2)
    with pytest.raises(ValueError, match=r"unknown surrogate 'nope'"):
        Windowed("nope", 0.2)
