"""The public API: validation of bad input (by message), backend selection, state continuation."""

import pytest
import torch

import spikefuse
from spikefuse.surrogate import ATan, Rectangle


def lif(x, **kw):
    kw.setdefault("decay", 0.2)
    kw.setdefault("threshold", 0.3)
    return spikefuse.lif(x, **kw)


@pytest.mark.parametrize(
    "x, kwargs, error, message",
    [
        (torch.ones(3, 4, dtype=torch.int32), {}, TypeError, "floating-point dtype"),
        (torch.ones(3, 4, dtype=torch.bool), {}, TypeError, "floating-point dtype"),
        (torch.tensor(1.0), {}, ValueError, "time dimension first"),
        (torch.ones(0, 4), {}, ValueError, "T=0"),
        ([1.0, 2.0], {}, TypeError, "torch.Tensor"),
        (torch.ones(3, 4), {"v_init": torch.zeros(5)}, ValueError, "v_init has shape"),
        (torch.ones(3, 4), {"v_init": torch.zeros(4, dtype=torch.int64)}, TypeError, "v_init must be a floating-point"),
        (torch.ones(3, 4), {"v_init": torch.zeros(4, device="meta")}, ValueError, "same device"),
        (torch.ones(3, 4), {"decay": torch.ones(4, device="meta")}, ValueError, "same device"),
        (torch.ones(3, 4), {"surrogate": "nope"}, ValueError, "unknown surrogate 'nope': use one of"),
        (torch.ones(3, 4), {"surrogate": object()}, ValueError, "unknown surrogate"),
        (torch.ones(3, 4), {"backend": "cuda"}, ValueError, "unknown backend 'cuda': use one of"),
        (torch.ones(3, 4), {"memory": "none"}, ValueError, "unknown memory mode"),
        (torch.ones(3, 4), {"decay": float("nan")}, TypeError, "finite number"),
        (torch.ones(3, 4), {"decay": torch.ones(2, 2)}, ValueError, "scalar or a 1-D per-channel"),
        (torch.ones(3, 2, 5), {"decay": torch.ones(4)}, ValueError, "has 5 channels in dim 2"),
        (torch.ones(3, 4), {"threshold": "1"}, TypeError, "threshold must be a number"),
        (torch.ones(3, 4), {"v_reset": "0"}, TypeError, "v_reset must be a number or None"),
        (torch.ones(3, 4), {"threshold": float("inf")}, ValueError, "threshold must be a finite number"),
        (torch.ones(3, 4), {"threshold": float("nan")}, ValueError, "threshold must be a finite number"),
        (torch.ones(3, 4), {"v_reset": float("-inf")}, ValueError, "v_reset must be a finite number"),
    ],
)
def test_bad_input_raises_clear_error(x, kwargs, error, message):
    with pytest.raises(error, match=message):
        lif(x, backend=kwargs.pop("backend", "reference"), **kwargs)


def test_fused_backends_refuse_wrong_device_with_advice(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors.*TRITON_INTERPRET=1"):
        lif(torch.ones(2, 3), backend="triton")
    with pytest.raises(ValueError, match="no fused backend for device type 'meta'"):
        lif(torch.ones(2, 3, device="meta"))


def test_auto_picks_cpu_for_cpu_tensors():
    assert spikefuse.ops.resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert spikefuse.ops.resolve_backend("auto", torch.device("cuda")) == "triton"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("v_reset", [0.0, 0.15, None])
def test_state_continues_the_sequence_exactly(backend, v_reset):
    """Two chunks with the state passed on equal one call: spikes, state and gradients."""
    torch.manual_seed(0)
    x = torch.rand(9, 2, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(9, 2, 6, dtype=torch.float64)
    kw = dict(decay=0.4, threshold=0.5, v_reset=v_reset, surrogate=ATan(), backend=backend, return_state=True)
    y_full, v_full = lif(x, **kw)
    ((y_full * g).sum() + v_full.sum()).backward()
    grad_full = x.grad.clone()
    x.grad = None
    y_a, v_a = lif(x[:4], **kw)
    y_b, v_b = lif(x[4:], v_init=v_a, **kw)
    assert torch.equal(torch.cat([y_a, y_b]), y_full) and torch.equal(v_b, v_full)
    ((torch.cat([y_a, y_b]) * g).sum() + v_b.sum()).backward()
    torch.testing.assert_close(x.grad, grad_full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_per_channel_learnable_decay_gets_gradients(backend):
    torch.manual_seed(0)
    decay = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, requires_grad=True)
    x = torch.rand(5, 2, 3, 4, dtype=torch.float64)
    y = lif(x, decay=decay, surrogate=Rectangle(), backend=backend)
    y.sum().backward()
    assert decay.grad.shape == (3,) and decay.grad.abs().sum() > 0


def test_half_precision_inputs_give_half_spikes_and_float_state():
    x = torch.rand(4, 10).to(torch.bfloat16)
    y, v = lif(x, backend="reference", return_state=True)
    assert y.dtype == torch.bfloat16 and v.dtype == torch.float32
