"""Malformed and hostile checkpoints: `spikefuse eval` and `spikefuse train --resume` refuse each with one line that
names the file and what is wrong (exit code 2), before anything of it is used: no traceback from deep inside the
loop (a config of wrong types ended in AttributeError, ValueError and TypeError tracebacks)."""

import math

import pytest
import torch

from spikefuse.cli import main
from spikefuse.train import TrainConfig

from ..test_cli import TINY


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A valid checkpoint's contents (a run of one epoch), to spoil one part at a time."""
    out = tmp_path_factory.mktemp("valid")
    assert main(["train", "--out", str(out), *TINY]) == 0
    return torch.load(out / "checkpoint.pt", weights_only=True)


def _with(ckpt, **fields):
    return {**ckpt, **fields}


def _config(ckpt, **settings):
    return _with(ckpt, config={**ckpt["config"], **settings})


def _rng(ckpt, **states):
    return _with(ckpt, rng={**ckpt["rng"], **states})


def _first_row(ckpt, **values):
    return _with(ckpt, history=[{**ckpt["history"][0], **values}])


def _weights(ckpt, spoil):
    return _with(ckpt, model={k: spoil(v) if v.is_floating_point() and v.ndim else v for k, v in ckpt["model"].items()})


def _saved(make):
    def write(ckpt, path):
        torch.save(make(ckpt), path)

    return write


def _bytes(make):
    def write(ckpt, path):
        torch.save(ckpt, path)
        path.write_bytes(make(path.read_bytes()))

    return write


# (how the file is made from a valid checkpoint's contents, what the message says)
HOSTILE = {
    "a list": (_saved(lambda c: [1, 2]), "is not a spikefuse checkpoint"),
    "version 2": (_saved(lambda c: _with(c, version=2)), "is not a spikefuse checkpoint \\(version 1\\)"),
    "a missing field": (
        _saved(lambda c: {k: v for k, v in c.items() if k != "rng"}),
        "is incomplete: it lacks 'rng'",
    ),
    "truncated": (_bytes(lambda b: b[: len(b) // 2]), "the file is truncated or corrupt"),
    "not a zip": (_bytes(lambda b: b"a text file, not a checkpoint\n"), "not a file that torch.save wrote"),
    "an object": (
        _saved(lambda c: _with(c, config=TrainConfig())),
        "holds a spikefuse.train.config.TrainConfig, which checkpoints never hold",
    ),
    "config a string": (_saved(lambda c: _with(c, config="resnet-tiny")), "its config is a str, not a dict"),
    "config key unknown": (
        _saved(lambda c: _config(c, bogus=1)),
        "its config holds settings this spikefuse does not know: 'bogus'",
    ),
    "T a string": (_saved(lambda c: _config(c, T="2")), "its config's T must be an int, got '2'"),
    "T a bool": (_saved(lambda c: _config(c, T=True)), "its config's T must be an int, got True"),
    "lr a string": (_saved(lambda c: _config(c, lr="fast")), "its config's lr must be a float, got 'fast'"),
    "width a float": (_saved(lambda c: _config(c, width=1.5)), "its config's width must be an int or None, got 1.5"),
    "compile a string": (_saved(lambda c: _config(c, compile="no")), "its config's compile must be a bool, got 'no'"),
    "neuron a list": (_saved(lambda c: _config(c, neuron=[1])), "its config's neuron must be a dict or None"),
    "T zero": (_saved(lambda c: _config(c, T=0)), "its config cannot run: --T must be >= 1, got 0"),
    "T huge": (_saved(lambda c: _config(c, T=10**9)), "its config cannot run: --T must be at most 10000 time steps"),
    "model unknown": (_saved(lambda c: _config(c, model="resnet999")), "its config cannot run: unknown model"),
    "neuron surrogate unknown": (
        _saved(lambda c: _config(c, neuron={"decay": 0.2, "surrogate": {"name": "dataclass"}})),
        "its config cannot run: bad neuron options: unknown surrogate 'dataclass'",
    ),
    "neuron options bad": (
        _saved(lambda c: _config(c, neuron={"decay": "x", "surrogate": {"name": "Sigmoid", "alpha": 4.0}})),
        "its config cannot run: bad neuron options: decay must be a finite number",
    ),
    "info a list": (_saved(lambda c: _with(c, info=[1])), "its info is a list, not a dict"),
    "epoch a string": (_saved(lambda c: _with(c, epoch="1")), "its epoch must be an int >= 1, got '1'"),
    "epoch negative": (_saved(lambda c: _with(c, epoch=-1)), "its epoch must be an int >= 1, got -1"),
    "model a tensor": (_saved(lambda c: _with(c, model=torch.zeros(3))), "its model is a Tensor, not a dict"),
    "model holds a number": (
        _saved(lambda c: _with(c, model={**c["model"], next(iter(c["model"])): 1.0})),
        "its model's '.+' is a float, not a tensor",
    ),
    "model key a number": (
        _saved(lambda c: _with(c, model={**c["model"], 0: torch.zeros(1)})),
        "its model holds the key 0, not a parameter's name",
    ),
    "weights of wrong shapes": (
        _saved(lambda c: _weights(c, lambda v: v[..., :1])),
        "the weights in .* do not fit the model 'resnet-tiny' of its config: size mismatch",
    ),
    "weights NaN": (_saved(lambda c: _weights(c, lambda v: v * math.nan)), "its model's weights hold NaN or inf"),
    "optimizer a list": (_saved(lambda c: _with(c, optimizer=[])), "its optimizer is a list, not a dict"),
    "optimizer without param_groups": (
        _saved(lambda c: _with(c, optimizer={"state": {}})),
        "its optimizer lacks 'param_groups'",
    ),
    "history a dict": (_saved(lambda c: _with(c, history={})), "its history is a dict, not a list"),
    "history row a number": (_saved(lambda c: _with(c, history=[1])), "its history's row 1 is an int, not a dict"),
    "history row lacks test_acc": (
        _saved(lambda c: _with(c, history=[{k: v for k, v in c["history"][0].items() if k != "test_acc"}])),
        "its history's row 1 lacks 'test_acc'",
    ),
    "history value a string": (
        _saved(lambda c: _first_row(c, test_acc="high")),
        "its history's row 1 holds test_acc 'high', not a number",
    ),
    "history of other epochs": (
        _saved(lambda c: _first_row(c, epoch=5)),
        "its history holds epochs \\[5\\], not 1 to its epoch 1",
    ),
    "rng a string": (_saved(lambda c: _with(c, rng="seeded")), "its rng is a str, not a dict"),
    "rng torch state short": (
        _saved(lambda c: _rng(c, torch=c["rng"]["torch"][:10])),
        "its RNG states do not load: torch: ",
    ),
    "rng numpy key short": (
        _saved(lambda c: _rng(c, numpy={**c["rng"]["numpy"], "key": c["rng"]["numpy"]["key"][:3]})),
        "its RNG states do not load: numpy: ",
    ),
    "rng python state bad": (
        _saved(lambda c: _rng(c, python=(3, (1, 2), None))),
        "its RNG states do not load: python: ",
    ),
    "rng generator missing": (_saved(lambda c: _rng(c, generators={})), "its RNG states do not load: generators: "),
}

# Parts only a resume uses: eval reads the weights alone.
HOSTILE_TO_RESUME = {
    "optimizer state of wrong shapes": (
        _saved(
            lambda c: _with(
                c,
                optimizer={
                    **c["optimizer"],
                    "state": {
                        i: {k: v[..., :1] if v.ndim else v for k, v in s.items()}
                        for i, s in c["optimizer"]["state"].items()
                    },
                },
            )
        ),
        "the optimizer state in .* does not fit the model's parameters: .*exp_avg",
    ),
    "optimizer learning rate a string": (
        _saved(
            lambda c: _with(
                c, optimizer={**c["optimizer"], "param_groups": [{**c["optimizer"]["param_groups"][0], "lr": "fast"}]}
            )
        ),
        "the optimizer state in .* does not fit the model's parameters: its param group's lr is 'fast'",
    ),
    "optimizer of another model": (
        _saved(lambda c: _with(c, optimizer={**c["optimizer"], "state": {}, "param_groups": []})),
        "the optimizer state in .* does not fit the model's parameters: ",
    ),
}


def _refused(argv, capsys, path, message):
    import re

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("spikefuse: error: ") and err.count("\n") == 1, err
    assert str(path) in err and re.search(message, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", list(HOSTILE))
def test_eval_refuses_a_hostile_checkpoint_in_one_line(tmp_path, capsys, checkpoint, case):
    write, message = HOSTILE[case]
    path = tmp_path / "checkpoint.pt"
    write(checkpoint, path)
    _refused(["eval", "--checkpoint", str(path), "--no-progress"], capsys, path, message)


@pytest.mark.parametrize("case", list(HOSTILE) + list(HOSTILE_TO_RESUME))
def test_resume_refuses_a_hostile_checkpoint_in_one_line(tmp_path, capsys, checkpoint, case):
    write, message = {**HOSTILE, **HOSTILE_TO_RESUME}[case]
    path = tmp_path / "checkpoint.pt"
    write(checkpoint, path)
    out = tmp_path / "resumed"
    _refused(
        ["train", "--resume", str(path), "--out", str(out), "--epochs", "2", "--no-progress"], capsys, path, message
    )
    assert not out.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a checkpoint holds CUDA RNG states where CUDA is")
def test_eval_refuses_a_bad_cuda_rng_state_in_one_line(tmp_path, capsys, checkpoint):
    path = tmp_path / "checkpoint.pt"
    torch.save(_rng(checkpoint, cuda=[state[:10] for state in checkpoint["rng"]["cuda"]]), path)
    _refused(["eval", "--checkpoint", str(path), "--no-progress"], capsys, path, "its RNG states do not load: cuda: ")
