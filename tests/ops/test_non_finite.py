"""A NaN or an inf reaching the neurons is refused, never silent: the fused kernels flag it as they read the input
(no pass of their own over it) and the call raises an error that says where; the reference checks it too. On a GPU,
where reading the flag would cost a host sync per call, the Triton kernels make the spikes of such a neuron NaN
instead (checked here under Triton's interpreter): the loss then is NaN, which a training loop's check sees.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (conftest may have chosen the GPU)

import pytest
import torch

import spikefuse
import spikefuse.nn
from spikefuse.neurons import CUBA_LIF, LIF_MODELS
from spikefuse.ops.engine import triton as engine_triton
from spikefuse.ops.recurrent import autograd as recurrent_autograd

BACKENDS = ["reference", "cpu", "triton"]
# Triton's interpreter computes inf - inf with numpy, which warns
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
LEAKY = LIF_MODELS[("snntorch", "soft")]


def _input(value, t=2, n=5, shape=(6, 2, 4)):
    x = torch.rand(shape) * 0.8
    x.view(shape[0], -1)[t, n] = value
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_input_is_refused_with_where(value, backend):
    x = _input(value)
    with pytest.raises(ValueError, match=r"the input holds NaN or inf \(first at step 2, neuron 5 of 8\).*nan_to_num"):
        spikefuse.neuron(x, LEAKY, decay=0.9, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_entry_refuses_it(backend):
    """The LIF layer, the potential memory mode (the forward that saves the states), a model of two states and a
    non-finite initial state."""
    x = _input(float("nan"), t=0, n=0)
    message = r"holds NaN or inf \(first at step 0, neuron 0"
    with pytest.raises(ValueError, match=message):
        spikefuse.lif(x, decay=0.9, threshold=1.0, backend=backend)
    with pytest.raises(ValueError, match=message):
        spikefuse.neuron(x, CUBA_LIF, alpha=0.8, beta=0.7, memory="potential", backend=backend)
    state = (torch.zeros(2, 4), torch.full((2, 4), float("nan")))
    with pytest.raises(ValueError, match=r"an initial state \(v_init, or a state passed back\) holds NaN or inf"):
        spikefuse.neuron(torch.rand(6, 2, 4), CUBA_LIF, alpha=0.8, beta=0.7, state=state, backend=backend)
    spikefuse.neuron(torch.rand(6, 2, 4), CUBA_LIF, alpha=0.8, beta=0.7, backend=backend)  # finite: runs


def test_the_fused_batchnorm_refuses_it():
    x = torch.rand(4, 2, 3, 5, 5)
    x[1, 0, 2, 3, 3] = float("nan")
    bn = spikefuse.nn.BatchNormLIF2d(3, decay=0.9, backend="cpu")
    with pytest.raises(ValueError, match=r"the input holds NaN or inf \(first at step 1, neuron 68 of 150\)"):
        bn(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_recurrent_layer_refuses_it(backend):
    x = _input(float("inf"), t=3, n=6, shape=(5, 2, 4))
    weight = torch.rand(4, 4) * 0.3
    with pytest.raises(ValueError, match=r"the input holds NaN or inf \(first at step 3, neuron 6 of 8\)"):
        spikefuse.recurrent(x, LEAKY, weight, decay=0.9, backend=backend)
    weight[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"the recurrent current \(the recurrent weight, its bias or the initial"):
        spikefuse.recurrent(torch.rand(5, 2, 4), LEAKY, weight, decay=0.9, backend=backend)


def test_on_a_gpu_the_triton_kernels_make_such_spikes_nan(monkeypatch):
    """What the Triton kernels do where nobody reads their flags (a GPU): a neuron's spikes are NaN from the step it
    read a NaN or an inf, the other neurons' as without it; likewise in the recurrent layer, whose NaN spikes then
    reach every neuron through the recurrent weight."""
    monkeypatch.setattr(engine_triton, "refuse_flagged", lambda *args, **kw: None)
    monkeypatch.setattr(recurrent_autograd, "refuse_flagged", lambda *args, **kw: None)
    x = _input(float("inf"), t=2, n=5)
    spikes = spikefuse.neuron(x, LEAKY, decay=0.9, backend="triton").reshape(6, -1)
    clean = spikefuse.neuron(x.nan_to_num(posinf=0.0), LEAKY, decay=0.9, backend="triton").reshape(6, -1)
    assert spikes[2:, 5].isnan().all() and not spikes[:2, 5].isnan().any()
    others = torch.arange(8) != 5
    assert torch.equal(spikes[:, others], clean[:, others]) and torch.equal(spikes[:2], clean[:2])
    x = _input(float("nan"), t=1, n=3, shape=(4, 2, 4))
    spikes = spikefuse.recurrent(x, LEAKY, torch.rand(4, 4), decay=0.9, backend="triton").reshape(4, -1)
    assert not spikes[:1].isnan().any() and spikes[1, 3].isnan() and spikes[2, :4].isnan().all()
