"""Modules: LIF/IF options, stateful streaming, the [T, B, ...] helpers, torch.compile."""

import pytest
import torch
from torch import nn

import spikefuse
import spikefuse.nn as snn


def test_lif_module_equals_functional():
    torch.manual_seed(0)
    x = torch.rand(6, 3, 5)
    m = snn.LIF(decay=0.3, threshold=0.4, v_reset=None, backend="reference")
    assert torch.equal(m(x), spikefuse.lif(x, decay=0.3, threshold=0.4, v_reset=None, backend="reference"))


def test_if_is_lif_without_leak():
    x = torch.rand(6, 7)
    assert torch.equal(snn.IF(threshold=0.5, backend="reference")(x), snn.LIF(1.0, 0.5, backend="reference")(x))
    with pytest.raises(ValueError, match="IF has no decay"):
        snn.IF(decay=0.5)


def test_stateful_streaming_equals_one_long_sequence():
    torch.manual_seed(0)
    x = torch.rand(10, 2, 4)
    whole = snn.LIF(0.5, 0.6, backend="reference")(x)
    m = snn.LIF(0.5, 0.6, stateful=True, backend="reference")
    chunks = [m(x[:3]), m(x[3:4]), m(x[4:])]
    assert torch.equal(torch.cat(chunks), whole)
    with pytest.raises(ValueError, match="call reset_state"):
        m(torch.rand(2, 3, 4))
    m.reset_state()
    assert torch.equal(m(x), whole)


def test_learnable_per_channel_decay_is_a_parameter():
    m = snn.LIF(0.2, 0.3, learnable_decay=True, channels=4, backend="reference")
    assert [p.shape for p in m.parameters()] == [torch.Size([4])]
    with pytest.raises(ValueError, match="learnable_decay=True"):
        snn.LIF(0.2, 0.3, channels=4)


def test_seq_to_batch_and_flatten():
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.rand(4, 5, 2, 6, 6)
    y = snn.SeqToBatch(conv)(x)
    assert y.shape == (4, 5, 3, 6, 6)
    torch.testing.assert_close(y[2, 1], conv(x[2, 1:2])[0], rtol=1e-5, atol=1e-6)
    assert snn.Flatten()(y).shape == (4, 5, 108)


def two_layer_model(backend):
    torch.manual_seed(0)
    return nn.Sequential(
        snn.SeqToBatch(nn.Linear(8, 16)),
        snn.LIF(0.2, 0.3, backend=backend, learnable_decay=True, channels=16),
        snn.SeqToBatch(nn.Linear(16, 4)),
        snn.LIF(0.5, 0.3, v_reset=None, backend=backend),
    )


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(1)
    x = torch.rand(5, 3, 8)
    eager = two_layer_model("cpu")
    compiled_model = two_layer_model("cpu")
    compiled = torch.compile(compiled_model, fullgraph=True, backend="inductor")
    y_eager, y_comp = eager(x), compiled(x)
    assert torch.equal(y_eager, y_comp)
    y_eager.sum().backward()
    y_comp.sum().backward()
    for p_e, p_c in zip(eager.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-5, atol=1e-6)


def test_torch_compile_of_models_with_different_options_in_one_process():
    """A second model compiling the same code with other float options turns them into symbolic floats in
    torch.compile (automatic dynamic); the per-call checks must take those (math.isfinite did not)."""
    x = torch.rand(5, 3, 8)
    for decay, threshold, v_reset in ((0.5, 0.4, 0.0), (0.2, 0.3, 0.1), (0.7, 0.6, None)):
        torch.manual_seed(0)
        model = nn.Sequential(snn.SeqToBatch(nn.Linear(8, 16)), snn.LIF(decay, threshold, v_reset, backend="cpu"))
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), model(x))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: snn.LIF(backend="bogus"), "unknown backend 'bogus'"),
        (lambda: snn.LIF(memory="nothing"), "unknown memory mode 'nothing'"),
        (lambda: snn.LIF(decay=float("nan")), "decay must be a finite number"),
        (lambda: snn.LIF(decay=float("nan"), learnable_decay=True), "decay must be a finite number"),
        (lambda: snn.LIF(decay=1.5), r"decay must lie in \[0, 1\]"),
        (lambda: snn.LIF(decay=-0.1, learnable_decay=True, channels=3), r"decay must lie in \[0, 1\]"),
        (lambda: snn.LIF(threshold=0.0), "threshold must be > 0"),
        (lambda: snn.LIF(threshold=0.5, v_reset=0.7), "v_reset must be below the threshold"),
        (lambda: snn.LIF(learnable_decay=True, channels=0), "channels sets the size .* a positive int"),
        (lambda: snn.IF(threshold=-1.0), "threshold must be > 0"),
        (lambda: snn.BatchNormLIF2d(0), r"num_features \(the channels\) must be a positive int, got 0"),
        (lambda: snn.BatchNormLIF2d(4, backend="gpu"), "unknown backend 'gpu'"),
        (lambda: snn.BatchNormLIF1d(4, decay=2.0), r"decay must lie in \[0, 1\]"),
    ],
)
def test_module_options_are_validated_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(decay=1.5), r"decay must lie in \[0, 1\]"),
        (dict(decay=float("inf")), "decay must be a finite number"),
        (dict(threshold=0.0), "threshold must be > 0"),
        (dict(threshold=0.5, v_reset=0.7), "v_reset must be below the threshold"),
        (dict(backend="gpu"), "unknown backend 'gpu'"),
        (dict(memory="nothing"), "unknown memory mode 'nothing'"),
    ],
)
def test_neuron_record_checks_every_field(options, message):
    """One record of a model's neuron, checked as the module it makes."""
    backend = options.pop("backend", "auto")
    with pytest.raises(ValueError, match=message):
        snn.NeuronFactory(snn.LIF, options, backend)


def test_neuron_record_makes_and_round_trips():
    from spikefuse.surrogate import Active, ATan, Windowed

    opts = snn.NeuronFactory(
        snn.LIF, dict(decay=0.4, threshold=0.6, v_reset=None, surrogate=ATan(), memory="recompute")
    )
    layer = opts.make()
    assert (layer.decay, layer.threshold, layer.v_reset, layer.memory) == (0.4, 0.6, None, "recompute")
    assert layer.surrogate == ATan() and snn.NeuronFactory.from_dict(opts.to_dict()) == opts
    cuba = snn.NeuronFactory(snn.CubaLIF, {"alpha": 0.5, "beta": 0.8}, "reference")
    assert snn.NeuronFactory.from_dict(cuba.to_dict()) == cuba
    # a config written before the one record: a LIF's arguments
    old = {"decay": 0.4, "threshold": 0.6, "v_reset": None, "surrogate": {"name": "ATan", "alpha": 2.0}}
    assert snn.NeuronFactory.from_dict({**old, "backend": "cpu"}) == snn.NeuronFactory(
        snn.LIF, {**old, "surrogate": ATan(2.0)}, "cpu"
    )
    with pytest.raises(ValueError, match="unknown neuron module 'Linear'"):
        snn.NeuronFactory.from_dict({"module": "Linear", "arguments": {}})
    with pytest.raises(ValueError, match="unknown surrogate 'os.system'"):
        snn.NeuronFactory.from_dict({"module": "LIF", "arguments": {"surrogate": {"name": "os.system"}}})
    with pytest.raises(ValueError, match="cannot be written to a config: only LIF, IF, CubaLIF, ALIF"):
        snn.NeuronFactory(snn.EngineNeuron, {"model": snn.LIF().model, "decay": 0.5}).to_dict()
    for wrapped in (Windowed(ATan(), 0.1), Active(ATan(), 0.2)):
        record = snn.NeuronFactory(snn.LIF, {"surrogate": wrapped})  # (Active: the srnn cell's settings)
        assert snn.NeuronFactory.from_dict(record.to_dict()) == record
    with pytest.raises(ValueError, match="CubaLIF's alpha=tensor.*cannot be written to a config: give it as a number"):
        snn.NeuronFactory(snn.CubaLIF, {"alpha": torch.tensor([0.5, 0.6]), "beta": 0.5}).to_dict()


def test_learnable_decay_out_of_range_is_rejected_at_forward_time():
    """An optimizer can push a learnable decay to NaN or out of [0, 1]; the next forward says so."""
    m = snn.LIF(decay=0.5, threshold=0.3, learnable_decay=True, channels=3)
    x = torch.rand(4, 2, 3)
    with torch.no_grad():
        m.decay[1] = float("nan")
    with pytest.raises(ValueError, match=r"decay holds NaN or inf \(channel 1: nan\).*lower the learning rate"):
        m(x)
    with torch.no_grad():
        m.decay.copy_(torch.tensor([0.5, 0.5, 1.25]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\], got channel 2: 1.25.*clamp_\(0, 1\)"):
        m(x)


@pytest.mark.parametrize("v_reset", [-0.1, None])
def test_lif_is_the_engine_neurons_preset(v_reset):
    """nn.LIF is an EngineNeuron of the paper's LIF model: the general module with that model and the same numbers
    gives its spikes, gradients and kept state (the membrane starting at v_reset); the soft reset's ``v_reset``
    reads None and is not shown."""
    from spikefuse.neurons import LIF_MODELS

    lif = snn.LIF(0.6, 0.5, v_reset=v_reset, learnable_decay=True, channels=3, stateful=True)
    model = LIF_MODELS[("paper", "soft" if v_reset is None else "hard")]
    general = snn.EngineNeuron(
        model, decay=0.6, threshold=0.5, v_reset=v_reset or 0.0, learnable=("decay",), channels=3, stateful=True
    )
    assert isinstance(lif, snn.EngineNeuron) and lif.model is model and lif.v_reset == v_reset
    assert ("v_reset" in repr(lif)) == (v_reset is not None)
    x = torch.rand(5, 2, 3, generator=torch.Generator().manual_seed(2)) * 0.9
    for _ in range(2):  # the second call continues from the kept state
        a, b = lif(x), general(x)
        assert torch.equal(a, b) and a.sum() > 0
    assert torch.equal(lif.state, general.state[0])
    (a * torch.arange(a.numel()).view_as(a)).sum().backward()
    (b * torch.arange(b.numel()).view_as(b)).sum().backward()
    torch.testing.assert_close(lif.decay.grad, general.decay.grad, rtol=1e-5, atol=1e-6)


def test_batchnorm_lif_takes_the_lif_arguments_but_memory():
    bn = snn.BatchNormLIF2d(4, decay=0.5, threshold=0.4, v_reset=None, learnable_decay=True, channels=4)
    assert (bn.decay.shape, bn.threshold, bn.v_reset) == ((4,), 0.4, None)
    with pytest.raises(TypeError, match="BatchNormLIF2d keeps only its input for backward .* it takes no memory"):
        snn.BatchNormLIF2d(4, memory="recompute")
    with pytest.raises(TypeError, match="unexpected keyword argument 'tau'"):
        snn.BatchNormLIF2d(4, tau=2.0)
