"""The neuron record (:class:`spikefuse.neurons.NeuronSpec`): checked where it is made, one per distinct settings,
one custom-op key per kernel, its constants checked in the dtype a call computes in."""

import pytest
import torch

from spikefuse.neurons import CUBA_LIF, LIF_MODELS, NeuronSpec, neuron_spec
from spikefuse.neurons import lif as lif_module
from spikefuse.neurons import spec as spec_module
from spikefuse.neurons.lif import lif_params, paper_lif
from spikefuse.surrogate import ATan, Sigmoid

LIF = LIF_MODELS[("paper", "hard")]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"constants": (("nope", 1.0),)},
            "lif_hard has no parameter 'nope'; its parameters: decay, threshold, v_reset",
        ),
        ({"initial": (("u", 0.0),)}, "lif_hard has no state 'u'; its states: v"),
        ({"constants": (("threshold", float("nan")),)}, "threshold must be a finite number, got nan"),
        ({"constants": (("threshold", True),)}, "threshold must be a finite number, got True"),
        ({"backend": "gpu"}, "unknown backend 'gpu'"),
        ({"memory": "all"}, "unknown memory mode 'all'"),
    ],
)
def test_refused_where_it_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NeuronSpec(LIF, Sigmoid(4.0), **kwargs)


def test_wrong_types_are_named():
    with pytest.raises(TypeError, match="model must be a spikefuse.neurons.NeuronModel, got str"):
        NeuronSpec("lif", Sigmoid(4.0))
    with pytest.raises(TypeError, match="surrogate must be a spikefuse.surrogate.Surrogate, got 'atan'"):
        NeuronSpec(LIF, "atan")


def test_one_record_per_settings_and_one_op_key_per_kernel():
    a = paper_lif(0.5, 0.0, Sigmoid(4.0))
    assert paper_lif(0.5, 0.0, Sigmoid(4.0)) is a
    b = paper_lif(0.7, 0.1, Sigmoid(4.0))
    assert b is not a and b.constant("threshold") == 0.7 and b.op_key == a.op_key  # the same kernels
    assert paper_lif(0.5, 0.0, ATan(2.0)).op_key != a.op_key
    assert paper_lif(0.5, 0.0, Sigmoid(4.0), memory="recompute").op_key != a.op_key
    assert neuron_spec(CUBA_LIF, Sigmoid(4.0)).initial_states(torch.rand(3, 2)) == [torch.zeros(1), torch.zeros(1)]
    assert a.initial_states(torch.rand(3, 2, dtype=torch.float64))[0].dtype == torch.float64


def test_constants_are_checked_in_the_dtype_a_call_computes_in():
    spec = paper_lif(1e39, 0.0, Sigmoid(4.0))
    assert lif_params(spec, torch.full((1,), 0.5, dtype=torch.float64))[1].item() == 1e39
    with pytest.raises(ValueError, match="threshold 1e\\+39 is not finite in float32"):
        lif_params(spec, torch.full((1,), 0.5))
    close = paper_lif(0.3, 0.29999999999, Sigmoid(4.0))  # below in float64, the same number in float32
    with pytest.raises(ValueError, match="v_reset 0.29999999999 is not below the threshold 0.3 in float32"):
        lif_params(close, torch.full((1,), 0.5))


def test_the_records_of_settings_that_keep_changing_are_not_kept_forever(monkeypatch):
    monkeypatch.setattr(spec_module, "MAX_KEPT", 8)
    for i in range(20):
        paper_lif(0.5 + i / 100, 0.0, Sigmoid(4.0))
    assert len(spec_module._SPECS) <= 8 and len(lif_module._PAPER_LIFS) <= 8
