"""The ``spikefuse`` command: usage errors and data errors exit with code 2 and a clear message; train/eval run."""

import importlib.util
import re

import pytest

from spikefuse.cli import main

TINY = [
    "--T",
    "2",
    "--epochs",
    "1",
    "--batch-size",
    "16",
    "--train-subset",
    "32",
    "--test-subset",
    "16",
    "--neuron-backend",
    "reference",
    "--no-progress",
]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--T", "0"], "--T: must be >= 1, got 0"),
        (["train", "--epochs", "x"], "--epochs: expected an integer, got 'x'"),
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
    code = main(
        ["train", "--dataset", "mnist", "--data-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "run"), *TINY]
    )
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


@pytest.mark.parametrize("memory", ["fused", "lean"])
def test_train_then_eval(tmp_path, capsys, memory):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--encoding", "poisson", "--memory", memory, *TINY]) == 0
    text = capsys.readouterr().out
    assert "epoch 1/1" in text and "final test accuracy" in text and f"memory {memory}" in text
    for name in ("metrics.csv", "checkpoint.pt", "curves.png"):
        assert (out / name).exists()
    assert main(["eval", "--checkpoint", str(out / "checkpoint.pt"), "--no-progress"]) == 0
    assert "test accuracy" in capsys.readouterr().out


def test_train_resnet18_of_adaptive_neurons_lean(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--model", "resnet18", "--width", "4", "--cell", "alif", "--memory", "lean"]
    assert main([*argv, *TINY]) == 0
    assert "final test accuracy" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(out / "checkpoint.pt"), "--no-progress"]) == 0


@pytest.mark.skipif(importlib.util.find_spec("spikingjelly") is None, reason="SpikingJelly not installed")
def test_bench_train_quick(tmp_path, capsys):
    code = main(
        [
            "bench",
            "train",
            "--quick",
            "--model",
            "resnet-tiny",
            "--datasets",
            "digits",
            "--T",
            "2",
            "--train-subset",
            "16",
            "--test-subset",
            "16",
            "--neuron-backend",
            "reference",
            "--results-dir",
            str(tmp_path),
            "--runs-dir",
            str(tmp_path / "runs"),
        ]
    )
    assert code == 0
    md = (tmp_path / "bench-train-digits-quick.md").read_text()
    assert "spikefuse LIF (reference)" in md and "SpikingJelly 2.0 LIFNode" in md
    assert "Machine:" in md and "Command: `" in md
    csv_text = (tmp_path / "bench-train-digits-quick.csv").read_text()
    assert csv_text.count("\ndigits,") == 2  # one epoch per implementation


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    assert main(["train", "--out", str(out), *TINY]) == 0
    return out / "checkpoint.pt"


def _broken_checkpoints(src, folder):
    import torch

    ckpt = torch.load(src, weights_only=True)
    no_model = {k: v for k, v in ckpt.items() if k != "model"}
    torch.save(no_model, folder / "nomodel.pt")
    bad = dict(ckpt, model={k: v[..., :1] if v.ndim else v for k, v in ckpt["model"].items()})
    torch.save(bad, folder / "badweights.pt")
    (folder / "empty.pt").write_bytes(b"")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--out", "{tmp}/afile", *TINY], "is a file, not a folder"),
        (["train", "--out", "{tmp}/afile/sub", *TINY], "cannot write to --out .*Not a directory"),
        (
            ["train", "--out", "{tmp}/r", *TINY[:-3], "--neuron-backend", "triton", "--no-progress"],
            "--neuron-backend triton cannot run on --device cpu: .*TRITON_INTERPRET=1",
        ),
        (["train", "--out", "{tmp}/r", "--image-size", "1", *TINY], "digits: size must be >= 2, got 1"),
        (
            ["train", "--out", "{tmp}/r", "--dataset", "digits-events", "--encoding", "poisson", *TINY],
            "--encoding poisson encodes static images; digits-events is event data",
        ),
        (
            ["train", "--out", "{tmp}/r", "--lr", "1e308", *TINY],
            "training diverged: NaN or inf reached the spiking neurons at epoch 1",
        ),
        (["train", "--out", "{trained}", *TINY], "holds an earlier run .*--resume.*--overwrite"),
        (
            ["train", "--out", "{trained}", "--resume", "--memory", "lean", *TINY],
            "cannot resume: .*memory: checkpoint 'fused', now 'lean'",
        ),
        (
            ["train", "--out", "{tmp}/r", "--memory", "lean", "--neurons", "spikingjelly", *TINY],
            "--memory lean fuses BatchNorm with spikefuse's neurons",
        ),
        (
            ["train", "--out", "{tmp}/c", "--cell", "alif", "--neurons", "spikingjelly", *TINY],
            "--cell alif builds spikefuse's alif neurons; --neurons spikingjelly",
        ),
        (["eval", "--checkpoint", "{tmp}/nomodel.pt"], "is incomplete: it lacks 'model'"),
        (
            ["eval", "--checkpoint", "{tmp}/badweights.pt"],
            "do not fit the model 'resnet-tiny' of its config: size mismatch",
        ),
        (["eval", "--checkpoint", "{tmp}/empty.pt"], "the file is empty"),
    ],
)
def test_user_errors_exit_2_with_one_line(tmp_path, capsys, monkeypatch, trained_checkpoint, argv, message):

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the test session runs Triton interpreted; users do not
    (tmp_path / "afile").write_text("x")
    _broken_checkpoints(trained_checkpoint, tmp_path)
    argv = [a.format(tmp=tmp_path, trained=trained_checkpoint.parent) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("spikefuse: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_overwrite_and_resume_are_exclusive(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--resume", "--overwrite", *TINY]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("signum, code, word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_signal_during_training_ends_with_a_message_and_intact_files(tmp_path, signum, code, word):
    """A real `spikefuse train` process: once epoch 1's files exist, the signal stops it with one line and the
    exit code of the signal, and the checkpoint and metrics.csv describe the same finished epochs."""
    import signal
    import subprocess
    import sys
    import time

    from spikefuse.train import load_checkpoint

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "spikefuse.cli", "train", "--out", str(out), *TINY]
    argv[argv.index("--epochs") + 1] = "50"
    # Default dispositions, as a terminal gives them: an ignored SIGINT (which earlier tests of a session may leave)
    # would be inherited, and a process started with SIGINT ignored rightly ignores Ctrl-C.
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.csv").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(getattr(signal, signum))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert (
        err.strip().splitlines()[-1] == f"spikefuse: {word}{' (SIGTERM)' if code == 143 else ''}; files already "
        "written are intact"
    )
    ckpt = load_checkpoint(out / "checkpoint.pt")
    with open(out / "metrics.csv") as f:
        rows = f.read().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == [r["epoch"] for r in ckpt["history"]] and ckpt["epoch"] >= 1
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def srnn_run(tmp_path_factory):
    """A finished one-epoch run of the recurrent network with 16 neurons (not the default 256)."""
    out = tmp_path_factory.mktemp("srnn")
    assert main(["train", "--out", str(out), "--model", "srnn", "--hidden", "16", *TINY]) == 0
    return out


def _copy_of(run, tmp_path):
    import shutil

    return shutil.copytree(run, tmp_path / "run")


@pytest.mark.parametrize(
    "typed, meant", [(["--hid", "32"], "--hidden"), (["--epoch", "2"], "--epochs"), (["--dev", "meta"], "--device")]
)
def test_abbreviated_options_are_refused_naming_the_full_one(tmp_path, capsys, srnn_run, typed, meant):
    """argparse took unambiguous prefixes, which a resume, deciding from the tokens typed, then ignored: --hid 32
    resumed with 16 neurons, --epoch 2 trained nothing, --dev meta trained on the CPU."""
    import torch

    out = _copy_of(srnn_run, tmp_path)
    assert main(["train", "--out", str(out), "--resume", *typed, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"spikefuse train: error: unrecognized arguments: {' '.join(typed)}; options are spelled out in full: "
        f"did you mean {meant}? (see spikefuse train --help)\n"
    )
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1


def test_a_resume_takes_every_spelling_of_a_typed_setting(tmp_path, capsys, srnn_run):
    import torch

    out = _copy_of(srnn_run, tmp_path)
    assert main(["train", "--out", str(out), "--resume", "--hidden=32", "--no-progress"]) == 2
    assert "cannot resume: the run's settings differ from the checkpoint's (hidden: checkpoint 16, now 32)" in (
        capsys.readouterr().err
    )
    assert main(["train", "--out", str(out), "--resume", "--epochs=2", "--no-progress"]) == 0
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["config"]["hidden"] == 16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--T", "1000000000"], "argument --T: must be at most 10000 time steps"),
        (["train", "--batch-size", "1000000000"], "argument --batch-size: must be at most 65536 samples"),
        (["train", "--epochs", "1000000000"], "argument --epochs: must be at most 100000 epochs"),
        (["train", "--model", "srnn", "--hidden", "1000000000"], "argument --hidden: must be at most 16384 neurons"),
        (["train", "--model", "srnn", "--layers", "1000000000"], "argument --layers: must be at most 64 layers"),
        (["train", "--width", "1000000000"], "argument --width: must be at most 1024 channels"),
        (["train", "--image-size", "1000000000"], "argument --image-size: must be at most 1024 pixels"),
        (["train", "--threads", "1000000000"], "argument --threads: must be at most"),
        (["train", "--nproc", "1000000000"], "argument --nproc: must be at most"),
        (["train", "--seed", str(2**64)], "argument --seed: must be at most 9223372036854775807"),
        (
            ["eval", "--checkpoint", "c.pt", "--batch-size", "1000000000"],
            "argument --batch-size: must be at most 65536",
        ),
        (["eval", "--checkpoint", "c.pt", "--threads", "1000000000"], "argument --threads: must be at most"),
    ],
)
def test_sizes_that_only_exhaust_the_machine_are_refused_at_parse_time(tmp_path, capsys, argv, message):
    """One line saying the bound and why, before anything is allocated or started (--T 1e9 ended in an allocator
    traceback)."""
    assert main([*argv, *(["--out", str(tmp_path / "run")] if argv[0] == "train" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spikefuse {argv[0]}: error: ") and err.count("\n") == 1, err
    assert re.search(re.escape(message) + r".* \(.+\), got \d+ \(see ", err), err  # the bound, why, the value
    assert not (tmp_path / "run").exists()


def test_a_missing_data_folder_names_the_option_that_sets_it(tmp_path, capsys, monkeypatch):
    """The command line's --data-dir (train, bench train and any other command), the Python API's root=: each route
    names its own way to give the folder (the command line said root=...)."""
    from spikefuse.data import DataError, load_dataset

    monkeypatch.delenv("SPIKEFUSE_DATA", raising=False)
    assert main(["train", "--dataset", "shd", "--model", "srnn", "--out", str(tmp_path / "run"), *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spikefuse: error: data set 'shd' needs a root folder (pass --data-dir or set "), err
    assert "root=" not in err
    assert main(["bench", "train", "--dataset", "shd", "--results-dir", str(tmp_path), *TINY[:2]]) == 2
    assert "(pass --data-dir or set SPIKEFUSE_DATA)" in capsys.readouterr().err
    assert main(["bench", "recurrent", "--smnist-batches", "1", "--out", str(tmp_path)]) == 2
    assert "(pass --data-dir or set SPIKEFUSE_DATA)" in capsys.readouterr().err
    with pytest.raises(
        DataError, match=r"data set 'shd' needs a root folder \(pass root=\.\.\. or set SPIKEFUSE_DATA\)"
    ):
        load_dataset("shd", None, train=True, T=4)


def test_every_option_has_a_help_line():
    """``--help`` says what each option of every command and benchmark does (bench recurrent listed --T, --repeats,
    --peers and --out without a word)."""
    import argparse

    from spikefuse.cli import _parsers, build_parser

    missing = [
        f"{parser.prog} {action.option_strings[-1]}"
        for parser in _parsers(build_parser())
        for action in parser._actions
        if action.option_strings and not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert not missing, missing
