"""The training loop: output files, exact resumption, evaluation of a checkpoint, resume errors."""

import csv
import importlib.util
import math

import pytest
import torch

from spikefuse.train import (
    FIRST_BATCH_NOTE,
    METRIC_COLUMNS,
    ConfigError,
    TrainConfig,
    evaluate_checkpoint,
    fit,
    load_checkpoint,
    run_epoch,
)
from spikefuse.models import NeuronFactory


BACKENDS = ["reference", "cpu"]


def tiny_config(out, **kw) -> TrainConfig:
    base = dict(
        model="resnet-tiny",
        dataset="digits",
        T=2,
        epochs=1,
        batch_size=16,
        threads=2,
        seed=3,
        out=str(out),
        train_subset=48,
        test_subset=32,
        neuron_backend="reference",
        progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def quiet(msg):
    pass


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_epoch_writes_metrics_checkpoint_and_curves(tmp_path, backend):
    hist = fit(tiny_config(tmp_path, neuron_backend=backend), log=quiet)
    assert len(hist) == 1
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == METRIC_COLUMNS
    assert len(rows) == 2
    row = dict(zip(rows[0], rows[1]))
    assert row["epoch"] == "1"
    assert 0.0 <= float(row["test_acc"]) <= 1.0 and float(row["train_loss"]) > 0
    assert float(row["train_samples_per_s"]) > 0 and float(row["peak_rss_mb"]) > 10
    assert row["peak_cuda_mb"] == ""  # CPU run
    assert row["memory"] == "fused"
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["epoch"] == 1 and ckpt["config"]["model"] == "resnet-tiny"
    assert set(ckpt["rng"]) >= {"torch", "numpy", "python", "generators"}
    assert set(ckpt["rng"]["generators"]) == {"data", "encode"}
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not leftovers  # the atomic writes left no temp files


@pytest.mark.parametrize("memory", ["fused", "lean"])
def test_resume_continues_exactly(tmp_path, memory):
    # Poisson encoding and shuffling exercise both generators and the global RNGs.
    cfg = dict(encoding="poisson", train_subset=40, test_subset=24, memory=memory)
    full = fit(tiny_config(tmp_path / "full", epochs=2, **cfg), log=quiet)
    fit(tiny_config(tmp_path / "split", epochs=1, **cfg), log=quiet)
    # As a checkpoint of the multi-tensor Adam step (before the fused one) says: the step's implementation is the
    # resumed run's, and the same update
    path = tmp_path / "split" / "checkpoint.pt"
    ckpt = load_checkpoint(path)
    assert [g["fused"] for g in ckpt["optimizer"]["param_groups"]] == [True]
    ckpt["optimizer"]["param_groups"][0]["fused"] = None
    torch.save(ckpt, path)
    # Disturb the global RNGs in between: the resumed run must not depend on them.
    torch.manual_seed(12345)
    torch.rand(100)
    resumed = fit(tiny_config(tmp_path / "split", epochs=2, **cfg), resume=True, log=quiet)

    a = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    assert a["epoch"] == b["epoch"] == 2
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        for k in sa:
            assert torch.equal(sa[k], sb[k])
    keys = ("epoch", "train_loss", "train_acc", "test_loss", "test_acc")
    assert [{k: r[k] for k in keys} for r in full] == [{k: r[k] for k in keys} for r in resumed]
    with open(tmp_path / "split" / "metrics.csv", newline="") as f:
        assert [(r["epoch"], r["memory"]) for r in csv.DictReader(f)] == [("1", memory), ("2", memory)]
    assert b["config"]["memory"] == memory
    assert [g["fused"] for g in b["optimizer"]["param_groups"]] == [True]


def test_lean_training_follows_the_fused_trajectory(tmp_path):
    """Same seed, same initial weights, same batches: the lean form's losses are the fused form's up to rounding
    (its gradients agree to ~1e-6; Adam carries the differences along)."""
    fused = fit(tiny_config(tmp_path / "fused", epochs=2), log=quiet)
    lean = fit(tiny_config(tmp_path / "lean", epochs=2, memory="lean"), log=quiet)
    for a, b in zip(fused, lean):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert b["test_loss"] == pytest.approx(a["test_loss"], rel=1e-4)
    a, b = load_checkpoint(tmp_path / "fused" / "checkpoint.pt"), load_checkpoint(tmp_path / "lean" / "checkpoint.pt")
    assert a["model"].keys() != b["model"].keys()  # the lean form's own modules (fused BatchNorm+LIF)


def test_bfloat16_precision_trains_the_lean_form_as_the_fused_one(tmp_path, monkeypatch):
    """--precision bf16: the forward under CPU autocast (the fused neurons read bfloat16), the same trajectory for
    the lean form as for the fused one; the setting is part of a run's trajectory (a resume with another is
    refused)."""
    seen = []
    real = torch.nn.Conv2d.forward
    monkeypatch.setattr(torch.nn.Conv2d, "forward", lambda self, x: seen.append(real(self, x).dtype) or real(self, x))
    cfg = dict(epochs=2, precision="bf16", neuron_backend="cpu")
    fused = fit(tiny_config(tmp_path / "fused", **cfg), log=quiet)
    lean = fit(tiny_config(tmp_path / "lean", memory="lean", **cfg), log=quiet)
    assert set(seen) == {torch.bfloat16}
    for a, b in zip(fused, lean):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert b["test_loss"] == pytest.approx(a["test_loss"], rel=1e-4)
    plain = fit(tiny_config(tmp_path / "fp32", epochs=2, neuron_backend="cpu"), log=quiet)
    assert plain[-1]["train_loss"] != fused[-1]["train_loss"]  # bfloat16 rounding moved the trajectory
    with pytest.raises(ConfigError, match="precision: checkpoint 'bf16', now 'fp32'"):
        fit(tiny_config(tmp_path / "fused", epochs=3, neuron_backend="cpu"), resume=True, log=quiet)


def test_compiled_model_trains_as_the_eager_one(tmp_path, monkeypatch):
    """--compile: torch.compile traces the model through the fused neurons' custom ops; the same losses as eager
    mode (inductor's code generation swapped for aot_eager's, which runs the traced graph: a test of the tracing,
    not of the C++ compiler)."""
    compiled = []
    real = torch.compile

    def compile_spy(model, **kw):
        compiled.append(model)
        return real(model, backend="aot_eager", **kw)

    monkeypatch.setattr(torch, "compile", compile_spy)
    torch._dynamo.reset()
    eager = fit(tiny_config(tmp_path / "eager", neuron_backend="cpu"), log=quiet)
    traced = fit(tiny_config(tmp_path / "compiled", neuron_backend="cpu", compile=True), log=quiet)
    assert len(compiled) == 2  # the training and the evaluation model
    assert traced[0]["train_loss"] == pytest.approx(eager[0]["train_loss"], rel=1e-6)
    assert traced[0]["test_loss"] == pytest.approx(eager[0]["test_loss"], rel=1e-6)
    ckpt = load_checkpoint(tmp_path / "compiled" / "checkpoint.pt")
    assert not any(k.startswith("_orig_mod") for k in ckpt["model"])  # the plain model's keys


def test_evaluate_checkpoint_reproduces_the_test_metrics(tmp_path):
    hist = fit(tiny_config(tmp_path, encoding="poisson"), log=quiet)
    r = evaluate_checkpoint(tmp_path / "checkpoint.pt", threads=2)
    assert r["epoch"] == 1 and r["samples"] == 32
    assert r["test_acc"] == hist[-1]["test_acc"]
    assert r["test_loss"] == pytest.approx(hist[-1]["test_loss"], rel=1e-6)


def test_resume_errors(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint"):
        fit(tiny_config(tmp_path / "none"), resume=True, log=quiet)
    fit(tiny_config(tmp_path), log=quiet)
    with pytest.raises(ConfigError, match="settings differ.*T: checkpoint 2, now 3"):
        fit(tiny_config(tmp_path, T=3, epochs=2), resume=True, log=quiet)
    with pytest.raises(ConfigError, match="settings differ.*memory: checkpoint 'fused', now 'lean'"):
        fit(tiny_config(tmp_path, epochs=2, memory="lean"), resume=True, log=quiet)
    # already at the requested epoch count: nothing to do, history unchanged
    assert len(fit(tiny_config(tmp_path, epochs=1), resume=True, log=quiet)) == 1


def test_checkpoint_from_before_the_memory_setting_resumes_as_fused(tmp_path):
    fit(tiny_config(tmp_path), log=quiet)
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    del ckpt["config"]["memory"]
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    assert len(fit(tiny_config(tmp_path, epochs=2), resume=True, log=quiet)) == 2
    with pytest.raises(ConfigError, match="memory: checkpoint 'fused', now 'lean'"):
        fit(tiny_config(tmp_path, epochs=3, memory="lean"), resume=True, log=quiet)


def test_config_validation(tmp_path):
    for bad, message in (
        (dict(T=0), "--T must be"),
        (dict(epochs=0), "--epochs"),
        (dict(lr=-1.0), "--lr"),
        (dict(model="nope"), "unknown model"),
        (dict(encoding="rate"), "--encoding"),
        (dict(neuron_backend="gpu"), "unknown neuron backend"),
        (dict(neurons="norse"), "--neurons"),
        (dict(memory="tiny"), "--memory must be one of fused, lean, got 'tiny'"),
        (dict(memory="lean", neurons="spikingjelly"), "--memory lean fuses BatchNorm"),
        (dict(precision="fp16"), "--precision must be one of fp32, bf16, got 'fp16'"),
    ):
        with pytest.raises(ConfigError, match=message):
            tiny_config(tmp_path, **bad).validate()


@pytest.mark.skipif(importlib.util.find_spec("spikingjelly") is None, reason="SpikingJelly not installed")
def test_spikingjelly_neurons_match_spikefuse():
    import copy

    from spikefuse.models import build_model, neuron_layers
    from spikefuse.compat.spikingjelly import use_spikingjelly_neurons
    from spikefuse.train import reset_states

    torch.manual_seed(0)
    ours = build_model("resnet-tiny", 1, 10, width=4, stem="cifar", neuron_backend="reference")
    sj = copy.deepcopy(ours)
    assert use_spikingjelly_neurons(sj) == len(neuron_layers(ours)) and not neuron_layers(sj)
    x = torch.rand(4, 3, 1, 8, 8)
    a, b = ours(x), sj(x)
    reset_states(sj)
    # SpikingJelly leaks as v - v/tau, not decay*v: 1-ulp differences in the potentials, identical spikes here
    assert ((a - b).norm() / a.norm()).item() < 1e-5
    assert torch.equal(sj(x), b)  # the reset between batches clears SpikingJelly's stored potentials


@pytest.mark.parametrize("memory", ["fused", "lean"])
def test_data_parallel_two_processes_match_one_process(tmp_path, capfd, memory):
    """`spikefuse train --nproc 2` (DDP over 2 gloo ranks, half of every global batch each, synchronized BN) ends
    at the weights of one process on the same global batches. Not bit-identical: the reductions run in another
    order, and Adam divides each gradient by its own running RMS (+ eps 1e-8), which turns the last-ulp
    differences of near-zero gradients into weight differences of up to a few % of one step of lr 1e-3 (seen: 6e-6
    here, 5e-5 with an uneven last batch) in a few elements: all within atol 1e-4, nearly all within rtol 1e-4."""
    from spikefuse.cli import main

    args = [
        "train",
        "--model",
        "resnet-tiny",
        "--T",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--threads",
        "1",
        "--seed",
        "3",
        "--train-subset",
        "48",
        "--test-subset",
        "32",
        "--neuron-backend",
        "reference",
        "--no-progress",
        "--memory",
        memory,
        "--out",
        str(tmp_path / "ddp"),
        "--nproc",
        "2",
    ]
    assert main(args) == 0
    # The ranks' own prints are not asserted: forkserver ranks inherit the stdout of the process that started the
    # forkserver (an earlier test's capture when the whole suite runs), so capfd cannot see them reliably.
    assert "final test accuracy" in capfd.readouterr().out
    one = fit(tiny_config(tmp_path / "one", threads=1, memory=memory), log=quiet)
    with open(tmp_path / "ddp" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1"]
    a, b = load_checkpoint(tmp_path / "ddp" / "checkpoint.pt"), load_checkpoint(tmp_path / "one" / "checkpoint.pt")
    assert a["history"][0]["train_loss"] == pytest.approx(one[0]["train_loss"], rel=1e-5)
    assert a["history"][0]["test_loss"] == pytest.approx(one[0]["test_loss"], rel=1e-5)
    assert a["history"][0]["train_acc"] == one[0]["train_acc"] and a["history"][0]["test_acc"] == one[0]["test_acc"]
    assert a["model"].keys() == b["model"].keys()  # the plain model's names: loads without DDP
    off = total = 0
    for k, want in b["model"].items():
        if want.is_floating_point():
            torch.testing.assert_close(a["model"][k], want, rtol=1e-4, atol=1e-4, msg=k)
            off += int((~torch.isclose(a["model"][k], want, rtol=1e-4, atol=1e-7)).sum())
            total += want.numel()
        else:
            assert torch.equal(a["model"][k], want), k  # num_batches_tracked
    assert off <= total // 1000, (off, total)
    # the global batch must split evenly over the processes
    assert main(args[:-1] + ["3"]) == 2
    assert "divisible by the number of processes (3)" in capfd.readouterr().err


def test_progress_bar_names_the_first_batch_compilation_then_leaves_it_out(capsys, monkeypatch):
    """The first batch of a process compiles kernels (tens of seconds with an empty cache): the bar says so instead
    of an ETA extrapolated from it, and a fresh bar (whose rate counts from the second batch) replaces it. Off a
    terminal (a log file, a pipe) there is no bar at all."""
    import sys

    from torch.utils.data import DataLoader, TensorDataset

    from spikefuse.models import build_model

    model = build_model("resnet-tiny", 1, 10, width=4, stem="cifar", neuron_backend="reference")
    data = TensorDataset(torch.rand(12, 1, 8, 8), torch.randint(0, 10, (12,)))
    run_epoch(
        model,
        DataLoader(data, batch_size=4),
        kind="image",
        T=2,
        encoding="direct",
        device=torch.device("cpu"),
        optimizer=torch.optim.Adam(model.parameters()),
        progress=True,
        desc="epoch 1/1",
        first_run=True,
    )
    assert capsys.readouterr().err == ""  # captured: no terminal, no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    for first_run in (True, False):
        run_epoch(
            model,
            DataLoader(data, batch_size=4),
            kind="image",
            T=2,
            encoding="direct",
            device=torch.device("cpu"),
            optimizer=torch.optim.Adam(model.parameters()),
            progress=True,
            desc="epoch 1/1",
            first_run=first_run,
        )
        err = capsys.readouterr().err
        assert (("epoch 1/1" + FIRST_BATCH_NOTE) in err) == first_run
        if first_run:
            assert "epoch 1/1:  33%" in err  # the fresh bar after the first batch, at 4 of 12 samples


@pytest.mark.parametrize("encoding", ["direct", "poisson"])
def test_recurrent_network_on_sequences_resumes_exactly(tmp_path, encoding):
    """srnn on sequential MNIST (row by row, from small idx files), its grey values or (poisson) spikes drawn from
    them: trains, resumes bit for bit, evaluates."""
    from tests.data.test_mnist import write_mnist

    write_mnist(tmp_path / "mnist", n_train=40, n_test=12)
    cfg = dict(
        model="srnn",
        dataset="smnist",
        data_dir=str(tmp_path / "mnist"),
        T=28,
        hidden=16,
        neuron_backend="cpu",
        train_subset=None,
        test_subset=None,
        encoding=encoding,
    )
    full = fit(tiny_config(tmp_path / "full", epochs=2, **cfg), log=quiet)
    fit(tiny_config(tmp_path / "split", epochs=1, **cfg), log=quiet)
    resumed = fit(tiny_config(tmp_path / "split", epochs=2, **cfg), resume=True, log=quiet)
    assert [r["train_loss"] for r in full] == [r["train_loss"] for r in resumed]
    a, b = (load_checkpoint(tmp_path / run / "checkpoint.pt") for run in ("full", "split"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["config"]["hidden"] == 16 and a["config"]["cell"] == "lif"
    assert evaluate_checkpoint(tmp_path / "full" / "checkpoint.pt", threads=2)["samples"] == 12


@pytest.mark.parametrize("memory", ["fused", "lean"])
def test_compiled_recurrent_network_trains_as_the_eager_one(tmp_path, monkeypatch, memory):
    """--model srnn --compile: the recurrent layers are custom ops, traced on the first batch (dynamo traced into
    numba's compiler there and stopped with an AssertionError); the losses of eager mode (aot_eager, as above)."""
    from tests.data.test_mnist import write_mnist

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend="aot_eager", **kw))
    torch._dynamo.reset()
    write_mnist(tmp_path / "mnist", n_train=24, n_test=8)
    cfg = dict(model="srnn", dataset="smnist", data_dir=str(tmp_path / "mnist"), T=28, hidden=12, memory=memory)
    cfg.update(neuron_backend="cpu", train_subset=None, test_subset=None)
    eager = fit(tiny_config(tmp_path / "eager", **cfg), log=quiet)
    traced = fit(tiny_config(tmp_path / "compiled", compile=True, **cfg), log=quiet)
    assert traced[0]["train_loss"] == pytest.approx(eager[0]["train_loss"], rel=1e-6)
    assert traced[0]["test_loss"] == pytest.approx(eager[0]["test_loss"], rel=1e-6)


def test_poisson_draws_sequences_of_intensities_as_spikes(tmp_path):
    """--encoding poisson on smnist/psmnist: each batch ``[B, T, F]`` becomes time-major spikes drawn from its grey
    values (:func:`spikefuse.data.sequences.bernoulli_steps`), the first layer told its input is spikes; refused for
    SHD/SSC, whose frames are spike counts, and for event data, with what to do."""
    from spikefuse.data.sequences import bernoulli_steps
    from spikefuse.train.loop import _to_time_major, make_model

    batch = torch.rand(5, 28, 28, generator=torch.Generator().manual_seed(1))
    spikes = _to_time_major(batch, "sequence", 28, "poisson", torch.Generator().manual_seed(2))
    want = bernoulli_steps(batch.transpose(0, 1), torch.Generator().manual_seed(2))
    assert spikes.shape == (28, 5, 28) and torch.equal(spikes, want) and 0 < float(spikes.mean()) < 1
    assert torch.equal(_to_time_major(batch, "sequence", 28, "direct", None), batch.transpose(0, 1))
    for dataset in ("smnist", "psmnist"):
        TrainConfig(model="srnn", dataset=dataset, encoding="poisson").check_data_kind("sequence")
    info = {"name": "smnist", "in_channels": 28, "num_classes": 10, "height": 1, "width": 1, "kind": "sequence"}
    for encoding, first in (("poisson", "SpikeLinear"), ("direct", "Linear")):
        cfg = TrainConfig(model="srnn", dataset="smnist", encoding=encoding, memory="lean", hidden=8)
        assert type(make_model(cfg, info).layers[0]).__name__ == first
    with pytest.raises(
        ConfigError,
        match=r"--encoding poisson encodes static images; shd is a sequence of spike counts already: leave "
        r"--encoding out \(it draws the intensities of the sequences smnist and psmnist as spikes too\)",
    ):
        TrainConfig(model="srnn", dataset="shd", encoding="poisson").check_data_kind("sequence")
    with pytest.raises(ConfigError, match=r"digits-events is event data \(already spikes per frame\)"):
        TrainConfig(model="srnn", dataset="digits-events", encoding="poisson").check_data_kind("event")


def test_sequences_need_a_recurrent_network(tmp_path):
    from tests.data.test_mnist import write_mnist

    write_mnist(tmp_path / "mnist", n_train=8, n_test=4)
    with pytest.raises(ConfigError, match="smnist is a sequence .* train it with a recurrent network"):
        fit(
            tiny_config(
                tmp_path / "run",
                dataset="smnist",
                T=28,
                data_dir=str(tmp_path / "mnist"),
                train_subset=None,
                test_subset=None,
            ),
            log=quiet,
        )
    with pytest.raises(ConfigError, match="--hidden sets the neurons of a layer of --model srnn or mlp, not"):
        fit(tiny_config(tmp_path / "run2", hidden=64), log=quiet)
    with pytest.raises(ConfigError, match="--layers sets a recurrent network"):
        fit(tiny_config(tmp_path / "run3", layers=2), log=quiet)


def test_an_empty_split_is_an_error(tmp_path):
    """An MNIST folder whose test files hold no image: refused before training, not reported as 0% accuracy."""
    from tests.data.test_mnist import write_mnist

    write_mnist(tmp_path / "mnist", n_train=8, n_test=0)
    with pytest.raises(ConfigError, match="the test split of mnist is empty .*nothing to test on"):
        fit(
            tiny_config(
                tmp_path / "run", dataset="mnist", data_dir=str(tmp_path / "mnist"), train_subset=None, test_subset=None
            ),
            log=quiet,
        )
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_lean_recurrent_network_on_event_counts_has_the_fused_gradients():
    """``--model srnn --memory lean`` on framed events: the frames are counts (up to 4 per bin in N-MNIST), so the
    first layer keeps them as they are; the lean form's gradients are the fused form's (its first layer kept bits,
    and its weight gradient counted every 2, 3 and 4 as 1)."""
    from spikefuse.train.loop import make_model

    info = {"name": "nmnist", "in_channels": 2, "num_classes": 10, "height": 6, "width": 5, "kind": "event"}
    g = torch.Generator().manual_seed(0)
    frames = torch.poisson(torch.full((7, 3, 2, 6, 5), 0.6), generator=g)  # [T, B, C, H, W] counts
    assert frames.max() >= 3
    grads = {}
    for memory in ("fused", "lean"):
        torch.manual_seed(1)
        model = make_model(TrainConfig(model="srnn", hidden=24, memory=memory, neuron_backend="cpu"), info)
        model(frames).square().mean().backward()
        grads[memory] = {name: p.grad for name, p in model.named_parameters()}
    assert grads["lean"].keys() == grads["fused"].keys()
    for name, grad in grads["fused"].items():
        torch.testing.assert_close(grads["lean"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("model", ["mlp", "srnn"])
def test_sparse_reaches_the_linear_layers(model):
    """--sparse sets ``sparse`` of every linear layer of the model (the input layer reading event counts
    included; the MLP's readout stays torch's) and of srnn's recurrent layer; false keeps torch's layers, and the
    recurrent layer dense."""
    from spikefuse.nn import SpikeLinear
    from spikefuse.nn.recurrent import Recurrent
    from spikefuse.train.loop import make_model

    info = {"name": "digits-events", "in_channels": 2, "num_classes": 10, "height": 8, "width": 8, "kind": "event"}
    for sparse, expected in (("true", True), ("auto", "auto"), ("false", None)):
        built = make_model(TrainConfig(model=model, dataset="digits-events", sparse=sparse, hidden=32), info)
        layers = [m for n, m in built.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("recurrent")]
        assert len(layers) == (3 if model == "mlp" else 2)
        recurrent = [m for m in built.modules() if isinstance(m, Recurrent)]
        assert len(recurrent) == (0 if model == "mlp" else 1)
        assert all(m.sparse == (expected or False) for m in recurrent)
        if expected is None:
            assert not any(isinstance(m, SpikeLinear) for m in layers)
        else:
            if model == "mlp":  # its readout's product is too small for the sparse kernels: torch's layer
                assert type(layers.pop()) is torch.nn.Linear
            assert all(isinstance(m, SpikeLinear) and m.sparse == expected for m in layers)


@pytest.mark.parametrize("model", ["mlp", "srnn"])
def test_a_sparse_run_gives_the_dense_runs_losses_to_rounding(tmp_path, model):
    histories = {}
    for sparse in ("false", "true"):
        cfg = tiny_config(tmp_path / sparse, model=model, dataset="digits-events", T=4, hidden=32, sparse=sparse)
        histories[sparse] = fit(cfg, log=quiet)
    for dense, sparse in zip(histories["false"], histories["true"]):
        for key in ("train_loss", "test_loss", "train_acc", "test_acc"):
            assert sparse[key] == pytest.approx(dense[key], rel=1e-4, abs=1e-5), key


def test_sparse_grad_reaches_the_mlp():
    """--sparse-grad W windows the mlp's neurons' surrogate and sets the layers before them; refused for other
    models and for a width that is not positive, from the command line too."""
    import argparse

    from spikefuse.surrogate import Windowed
    from spikefuse.train.arguments import add_train_arguments
    from spikefuse.train.loop import make_model

    info = {"name": "digits-events", "in_channels": 2, "num_classes": 10, "height": 8, "width": 8, "kind": "event"}
    built = make_model(TrainConfig(model="mlp", dataset="digits-events", sparse_grad=0.2, hidden=32), info)
    assert built.layers[1].surrogate == Windowed("sigmoid", 0.2) and built.layers[2].sparse_grad == "auto"
    with pytest.raises(
        ConfigError, match=r"--sparse-grad sets the neurons and layers of --model mlp, not --model srnn"
    ):
        TrainConfig(model="srnn", sparse_grad=0.2).check_settings()
    with pytest.raises(ConfigError, match=r"--sparse-grad must be a positive width, got -1.0"):
        TrainConfig(model="mlp", sparse_grad=-1.0).check_settings()
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert parser.parse_args(["--sparse-grad", "0.25"]).sparse_grad == 0.25
    assert parser.parse_args([]).sparse_grad is None


def test_sparse_settings_that_cannot_run_are_refused():
    with pytest.raises(ConfigError, match=r"--sparse sets the linear layers of --model mlp or srnn, not --model"):
        TrainConfig(sparse="auto").check_settings()
    with pytest.raises(ConfigError, match=r"--sparse must be one of false, true, auto, got 'yes'"):
        TrainConfig(model="mlp", sparse="yes").check_settings()
    with pytest.raises(ConfigError, match=r"--sparse true runs float32 CPU kernels.*--precision bf16"):
        TrainConfig(model="mlp", sparse="true", precision="bf16").check_settings()
    for sparse in ("true", "auto"):
        with pytest.raises(ConfigError, match=r"--sparse runs CPU kernels; on --device meta leave it out"):
            TrainConfig(model="mlp", sparse=sparse, device="meta").validate()
    TrainConfig(model="mlp", sparse="auto", precision="bf16").check_settings()


def test_cell_builds_every_model_of_those_neurons(tmp_path):
    """--cell cubalif / alif: every neuron of a feed-forward model the cell's engine neuron, in the lean form fused
    with its BatchNorm (and the stem's convolution); a checkpoint's cell rebuilds the same model."""
    from spikefuse.nn import ALIF, ConvBatchNormNeuron, CubaLIF
    from spikefuse.train.loop import make_model

    info = {"in_channels": 1, "num_classes": 10, "height": 8, "width": 8}
    for cell, kind in (("cubalif", CubaLIF), ("alif", ALIF)):
        for model in ("resnet18", "sew_resnet_tiny", "liang-small", "mlp", "spikformer_tiny"):
            cfg = tiny_config(tmp_path, model=model, cell=cell, memory="lean")
            net = make_model(cfg, info)
            kinds = {type(m) for m in net.modules() if isinstance(m, (CubaLIF, ALIF))}
            assert kinds == {kind}, (cell, model)
        assert isinstance(make_model(tiny_config(tmp_path, cell=cell, memory="lean"), info).bn1, ConvBatchNormNeuron)
    history = fit(tiny_config(tmp_path / "run", model="resnet18", width=4, cell="alif", memory="lean"), log=quiet)
    assert len(history) == 1 and math.isfinite(history[0]["train_loss"])
    saved = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert saved["config"]["cell"] == "alif"
    assert evaluate_checkpoint(tmp_path / "run" / "checkpoint.pt", threads=2)["samples"] == 32


def test_cell_refuses_what_it_cannot_build(tmp_path):
    with pytest.raises(ConfigError, match="--cell alif builds spikefuse's alif neurons; --neurons spikingjelly"):
        fit(tiny_config(tmp_path / "a", cell="alif", neurons="spikingjelly"), log=quiet)
    with pytest.raises(ConfigError, match="the config's neuron and --cell cubalif both say what the neurons are"):
        fit(tiny_config(tmp_path / "b", cell="cubalif", neuron=NeuronFactory().to_dict()), log=quiet)
    with pytest.raises(ConfigError, match="--cell must be one of lif, cubalif, alif, got 'gru'"):
        fit(tiny_config(tmp_path / "c", cell="gru"), log=quiet)


def test_cached_frames_train_as_the_framing_at_every_read(tmp_path, monkeypatch):
    """--cache-frames (the default): the N-MNIST samples framed once, the first epoch filling the cache (train and
    test splits), the later epochs reading no file; the run the same, loss for loss and weight for weight, as one
    that frames every sample at every read. A resume and an evaluation take it as it was given."""
    pytest.importorskip("tonic")
    from spikefuse.data import CachedDataset
    from spikefuse.data.cache import CachedBatches
    from spikefuse.data.neuromorphic import TonicFramesDataset
    from spikefuse.train import loop
    from tests.data.test_neuromorphic import write_nmnist

    write_nmnist(tmp_path / "nmnist", per_class=4, n_events=300)
    cfg = dict(
        model="mlp",
        dataset="nmnist",
        data_dir=str(tmp_path / "nmnist"),
        T=3,
        hidden=16,
        epochs=3,
        batch_size=5,
        train_subset=None,
        test_subset=None,
        neuron_backend="cpu",
    )
    reads = {"n": 0}
    events = TonicFramesDataset.events

    def counted(self, index):
        reads["n"] += 1
        return events(self, index)

    monkeypatch.setattr(TonicFramesDataset, "events", counted)
    logs = []
    cached = fit(tiny_config(tmp_path / "cached", **cfg), log=logs.append)
    assert reads["n"] == 12 + 12  # every training and test recording once, in the first epoch
    assert "framed samples cached in memory" in logs[0]
    plain = fit(tiny_config(tmp_path / "plain", cache_frames=False, **cfg), log=logs.append)
    assert reads["n"] == 24 + 3 * 24 and "cached" not in logs[-4]
    keys = ("train_loss", "train_acc", "test_loss", "test_acc")
    assert [[r[k] for k in keys] for r in cached] == [[r[k] for k in keys] for r in plain]
    a, b = (load_checkpoint(tmp_path / run / "checkpoint.pt") for run in ("cached", "plain"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["config"]["cache_frames"] is True and b["config"]["cache_frames"] is False
    train_ds, test_ds, _ = loop._load_data(tiny_config(tmp_path, **cfg))
    assert isinstance(train_ds, CachedDataset) and isinstance(test_ds, CachedDataset)
    subset = loop._load_data(tiny_config(tmp_path, **{**cfg, "train_subset": 6}))[0]
    for ds in (train_ds, test_ds, subset):  # the batches built whole, time-major (what the cached run above trained on)
        loader = loop._loaders(tiny_config(tmp_path, **cfg), ds, ds, torch.Generator(), "event")[0]
        assert isinstance(loader.dataset, CachedBatches) and next(iter(loader))[0].transpose(0, 1).is_contiguous()
    assert not isinstance(loop._load_data(tiny_config(tmp_path, cache_frames=False, **cfg))[0], CachedDataset)
    resumed = fit(tiny_config(tmp_path / "cached", cache_frames=False, **{**cfg, "epochs": 4}), resume=True, log=quiet)
    assert len(resumed) == 4  # a cache changes no sample: a run resumes with or without it
    before = reads["n"]
    assert evaluate_checkpoint(tmp_path / "cached", threads=2)["samples"] == 12
    assert reads["n"] == before + 12  # one pass: read once, nothing cached


def test_cache_frames_refuses_what_is_not_a_bool(tmp_path):
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match=r"cache_frames must be True \(--cache-frames\) or False"):
            fit(tiny_config(tmp_path / "a", cache_frames=bad), log=quiet)


def test_cache_frames_flag_reaches_the_config():
    import argparse

    from spikefuse.cli import config_from_args
    from spikefuse.train.arguments import add_train_arguments

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    assert config_from_args(p.parse_args([])).cache_frames is True
    assert config_from_args(p.parse_args(["--cache-frames"])).cache_frames is True
    assert config_from_args(p.parse_args(["--no-cache-frames"])).cache_frames is False
