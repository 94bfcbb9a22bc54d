"""The ``spikefuse`` command: usage errors and data errors exit with code 2 and a clear message; train/eval run."""

import importlib.util

import pytest

from spikefuse.cli import main

TINY = ["--T", "2", "--epochs", "1", "--batch-size", "16", "--train-subset", "32", "--test-subset", "16",
        "--neuron-backend", "reference", "--no-progress"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--T", "0"], "--T: expected a positive integer"),
        (["train", "--epochs", "x"], "--epochs: expected a positive integer"),
        (["train", "--lr", "-0.1"], "--lr: expected a positive number"),
        (["train", "--model", "resnet19"], "--model: invalid choice"),
        (["train", "--dataset", "imagenet"], "--dataset: invalid choice"),
        (["train", "--bogus"], "unrecognized arguments: --bogus"),
        (["eval"], "the following arguments are required: --checkpoint"),
        (["frobnicate"], "invalid choice"),
        (["bench", "nonexistent"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_no_command_and_bench_without_benchmark(capsys):
    assert main([]) == 2
    assert "choose a command" in capsys.readouterr().err
    assert main(["bench"]) == 2
    assert "choose a benchmark" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_data_error_is_reported_without_traceback(tmp_path, capsys):
    code = main(["train", "--dataset", "mnist", "--data-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "run"), *TINY])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("spikefuse: error:") and "mnist" in err
    assert "Traceback" not in err


def test_config_errors_exit_2(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "none.pt")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path), "--resume", *TINY]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["train", "--device", "cuda:7", "--out", str(tmp_path), *TINY]) == 2 or _has_cuda()
    capsys.readouterr()


def _has_cuda():
    import torch

    return torch.cuda.is_available()


def test_train_then_eval(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--encoding", "poisson", *TINY]) == 0
    text = capsys.readouterr().out
    assert "epoch 1/1" in text and "final test accuracy" in text
    for name in ("metrics.csv", "checkpoint.pt", "curves.png"):
        assert (out / name).exists()
    assert main(["eval", "--checkpoint", str(out / "checkpoint.pt"), "--no-progress"]) == 0
    assert "test accuracy" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("spikingjelly") is None, reason="SpikingJelly not installed")
def test_bench_train_quick(tmp_path, capsys):
    code = main(["bench", "train", "--quick", "--model", "resnet-tiny", "--datasets", "digits", "--T", "2",
                 "--train-subset", "16", "--test-subset", "16", "--neuron-backend", "reference",
                 "--results-dir", str(tmp_path), "--runs-dir", str(tmp_path / "runs")])
    assert code == 0
    md = (tmp_path / "bench-train-digits-quick.md").read_text()
    assert "spikefuse LIF (reference)" in md and "SpikingJelly 2.0 LIFNode" in md
    assert "Machine:" in md and "Command: `" in md
    csv_text = (tmp_path / "bench-train-digits-quick.csv").read_text()
    assert csv_text.count("\ndigits,") == 2  # one epoch per implementation
