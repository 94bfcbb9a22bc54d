"""The ``spikefuse`` command: ``spikefuse train``, ``spikefuse eval`` and ``spikefuse bench <name>``.

Adding a subcommand: write a module with two functions and list it in :data:`COMMANDS` (top level) or
:data:`BENCH_COMMANDS` (under ``spikefuse bench``)::

    def add_parser(subparsers) -> argparse.ArgumentParser:
        p = subparsers.add_parser("neuron", help="...", description="...")
        p.add_argument(...)
        return p

    def run(args) -> int | None:   # exit code (None = 0)
        ...

(``add_parser`` may instead ``p.set_defaults(func=...)``; that function is then run instead of ``run``.)

Keep the module's top-level imports light (import torch and friends inside ``run``): every module is imported to
build the parser. Errors the user can fix are reported without
a traceback and exit code 2: :class:`spikefuse.data.DataError`, :class:`spikefuse.train.ConfigError`, and any
exception class listed in :data:`USER_ERRORS`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import signal
import sys

from .train.arguments import add_train_arguments, bounded_int

__all__ = ["main", "build_parser", "COMMANDS", "BENCH_COMMANDS"]

#: Modules (or ``"module:object"``) providing ``add_parser(subparsers)`` and ``run(args)``: top-level subcommands.
COMMANDS: tuple[str, ...] = ("spikefuse.cli:TrainCommand", "spikefuse.cli:EvalCommand")
#: Modules providing ``add_parser(subparsers)`` and ``run(args)`` for ``spikefuse bench <name>``.
BENCH_COMMANDS: tuple[str, ...] = (
    "spikefuse.bench.train",
    "spikefuse.bench.table1",
    "spikefuse.bench.neuron",
    "spikefuse.bench.engine",
    "spikefuse.bench.recurrent",
    "spikefuse.bench.sparse",
    "spikefuse.bench.dropins",
    "spikefuse.bench.compile",
    "spikefuse.bench.memory",
    "spikefuse.bench.models",
    "spikefuse.bench.layers",
    "spikefuse.bench.profile",
    "spikefuse.bench.timesplit",
    "spikefuse.bench.gpu_static",
    "spikefuse.bench.gpu",
)
#: ``"module:ClassName"`` of further exceptions that mean a user error (message, exit code 2).
USER_ERRORS: list[str] = [
    "spikefuse.data:DataError",
    "spikefuse.train:ConfigError",
    "spikefuse.ops.buffers:SettingError",
]


def _register(subparsers, module_names) -> None:
    for name in module_names:
        mod_name, _, attr = name.partition(":")
        mod = importlib.import_module(mod_name)
        if attr:
            mod = getattr(mod, attr)
        before = set(subparsers.choices)
        mod.add_parser(subparsers)
        for cmd in set(subparsers.choices) - before:
            parser = subparsers.choices[cmd]
            # a parser that set its own ``func`` default runs that; otherwise the module's ``run(args)``
            parser.set_defaults(_run=parser.get_default("func") or mod.run, _parser=parser)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (no usage block), with the nearest valid choice or option
    for a mistyped one. It takes options spelled out in full only: a run's options are kept, in its checkpoint and
    in the commands benchmark results record, and an abbreviation changes its meaning when an option sharing its
    prefix is added."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}{self._hint(message)} (see {self.prog} --help)\n")

    def _hint(self, message: str) -> str:
        typo = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if typo:
            choices = re.findall(r"'([^']*)'", typo.group(2))
            close = difflib.get_close_matches(typo.group(1), choices, n=1)
            return f"; did you mean {close[0]!r}?" if close else ""
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        options = [name for action in self._actions for name in action.option_strings]
        for token in unknown.group(1).split() if unknown else ():
            typed = token.split("=")[0]
            completions = [name for name in options if name.startswith(typed)] if typed.startswith("--") else []
            if completions:
                return f"; options are spelled out in full: did you mean {' or '.join(completions)}?"
            close = difflib.get_close_matches(typed, options, n=1, cutoff=0.8) if typed.startswith("-") else []
            if close:
                return f"; did you mean {close[0]}?"
        return ""


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(
        prog="spikefuse",
        description="Fast, memory-lean training of spiking neural networks (time-fused LIF kernels).",
    )
    parser.add_argument("--version", action="version", version=f"spikefuse {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="<command>")
    _register(sub, COMMANDS)
    bench = sub.add_parser(
        "bench",
        help="benchmarks (train, and the ones other modules add)",
        description="Benchmarks. Each writes its results under benchmarks/results/.",
    )
    bench_sub = bench.add_subparsers(title="benchmarks", metavar="<benchmark>")
    _register(bench_sub, BENCH_COMMANDS)
    bench.set_defaults(_run=lambda args: _missing(bench, "a benchmark"), _parser=bench)
    parser.set_defaults(_run=lambda args: _missing(parser, "a command"), _parser=parser)
    return parser


def _parsers(parser: argparse.ArgumentParser):
    """``parser`` and the parsers of its commands, theirs, and so on."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                yield from _parsers(command)


def _options_given(argv: list[str]) -> set[str]:
    """The destinations of the options ``argv`` gives, as the parser reads them (``--hidden=32`` too): ``argv``
    parsed again with every default suppressed, so that only what it gives lands in the namespace."""
    parser = build_parser()
    for p in _parsers(parser):
        for action in p._actions:
            action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _missing(parser: argparse.ArgumentParser, what: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: choose {what}", file=sys.stderr)
    return 2


def _user_error_types() -> tuple[type, ...]:
    types = []
    for spec in USER_ERRORS:
        mod_name, cls_name = spec.split(":")
        mod = sys.modules.get(mod_name)  # only modules the command loaded can have raised it
        cls = getattr(mod, cls_name, None) if mod is not None else None
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spikefuse`` console script; returns the exit code (2 for usage and data errors)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # reported by the command's parser, which knows the options it meant
            args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.argv = argv  # for the options the user gave (see _resumed_config)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, message already printed)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        code = args._run(args)
    except KeyboardInterrupt as err:
        terminated = isinstance(err, _Terminated)
        print(
            f"spikefuse: {'terminated (SIGTERM)' if terminated else 'interrupted'}; files already written are intact",
            file=sys.stderr,
        )
        return 143 if terminated else 130
    except Exception as err:
        if isinstance(err, _user_error_types()):
            naming = getattr(err, "naming", None)  # a missing data folder: every command takes it as --data-dir
            print(f"spikefuse: error: {naming('--data-dir') if naming else err}", file=sys.stderr)
            return 2
        raise
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    return code if isinstance(code, int) else 0  # run() may return its results; only an int is an exit code


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every cleanup (temp files of an atomic write) runs on the way out."""


def _raise_terminated(signum, frame):
    raise _Terminated()


# train / eval ----------------------------------------------------------------------------------------------------


def config_from_args(args, **overrides):
    from .train import TrainConfig

    cfg = TrainConfig(
        model=args.model,
        dataset=args.dataset,
        data_dir=args.data_dir,
        T=args.T,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        device=args.device,
        threads=args.threads,
        seed=args.seed,
        encoding=args.encoding,
        neuron_backend=args.neuron_backend,
        stem=args.stem,
        image_size=args.image_size,
        train_subset=args.train_subset,
        test_subset=args.test_subset,
        width=args.width,
        progress=not args.no_progress,
        neurons=getattr(args, "neurons", "spikefuse"),
        out=getattr(args, "out", "runs/spikefuse"),
        memory=args.memory,
        precision=args.precision,
        sparse=args.sparse,
        sparse_grad=args.sparse_grad,
        compile=args.compile,
        cache_frames=args.cache_frames,
        hidden=args.hidden,
        layers=args.layers,
        cell=args.cell,
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


class TrainCommand:
    @staticmethod
    def add_parser(subparsers) -> argparse.ArgumentParser:
        p = subparsers.add_parser(
            "train",
            help="train a spiking network",
            description="Train a spiking network with Adam and cross-entropy on the time-averaged output. Writes "
            "<out>/metrics.csv, <out>/checkpoint.pt (every epoch) and <out>/curves.png. The defaults train a small "
            "Spiking-ResNet on the embedded 8x8 digits in about a minute on 2 CPU threads.",
        )
        add_train_arguments(p)
        p.add_argument("--out", default="runs/spikefuse", help="output folder (default: %(default)s)")
        start = p.add_mutually_exclusive_group()
        start.add_argument(
            "--resume",
            nargs="?",
            const=True,
            default=None,
            metavar="CHECKPOINT",
            help="continue from <out>/checkpoint.pt (or the given checkpoint) up to --epochs in total",
        )
        start.add_argument(
            "--overwrite",
            action="store_true",
            help="start a fresh run in an --out that holds an earlier one, replacing its files (by "
            "default such an --out is refused)",
        )
        p.add_argument(
            "--neurons",
            choices=("spikefuse", "spikingjelly"),
            default="spikefuse",
            help="neuron implementation: spikefuse LIF, or SpikingJelly 2.0 LIFNode with the same dynamics",
        )
        p.add_argument(
            "--nproc",
            type=bounded_int("nproc"),
            default=1,
            help="data-parallel training (DDP; gloo on CPU, NCCL on GPUs) over this many local processes; "
            "--batch-size is the global batch, split evenly over them, and --threads is per process. "
            "Under torchrun (--nproc-per-node/--nnodes decide) leave it out: it is ignored, and torchrun would take it "
            "for an abbreviation of its own --nproc-per-node (default: %(default)s)",
        )
        return p

    @staticmethod
    def run(args) -> int:
        from .train import fit_data_parallel

        history = fit_data_parallel(
            _resumed_config(args), nproc=args.nproc, resume=args.resume, overwrite=args.overwrite
        )
        if history:  # None on the ranks other than 0 under torchrun
            last = history[-1]
            epochs = f"{last['epoch']} epoch{'s' if last['epoch'] != 1 else ''}"
            print(
                f"final test accuracy {100 * last['test_acc']:.2f}% after {epochs}; "
                f"files in {args.out}: metrics.csv, checkpoint.pt, curves.png"
            )
        return 0


def _resumed_config(args):
    """The run's settings: those given on the command line; when resuming, every other one from the checkpoint (a
    resume continues that run: its settings need not be typed again)."""
    cfg = config_from_args(args)
    if not args.resume:
        return cfg
    from pathlib import Path

    from .train import load_checkpoint
    from .train.checkpoints import CHECKPOINT_NAME

    path = Path(args.out) / CHECKPOINT_NAME if args.resume is True else Path(args.resume)
    if not path.exists():  # fit says what is missing, with the way out
        return cfg
    saved = load_checkpoint(path)["config"]
    given = _options_given(args.argv)
    for name, value in saved.items():
        if hasattr(cfg, name) and name not in given | {"out", "progress"}:
            setattr(cfg, name, value)
    return cfg


class EvalCommand:
    @staticmethod
    def add_parser(subparsers) -> argparse.ArgumentParser:
        p = subparsers.add_parser(
            "eval",
            help="evaluate a checkpoint on the test split",
            description="Evaluate a checkpoint written by `spikefuse train` on its data set's test split.",
        )
        p.add_argument("--checkpoint", required=True, help="path to checkpoint.pt, or the run folder holding it")
        p.add_argument("--data-dir", default=None, help="data folder (default: the one the run used)")
        p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
        p.add_argument(
            "--threads", type=bounded_int("threads"), default=2, help="torch CPU threads (default: %(default)s)"
        )
        p.add_argument("--batch-size", type=bounded_int("batch_size"), default=None, help="(default: the run's)")
        p.add_argument(
            "--neuron-backend",
            choices=("auto", "cpu", "triton", "reference"),
            default=None,
            help="(default: the run's)",
        )
        p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
        return p

    @staticmethod
    def run(args) -> int:
        from .train import evaluate_checkpoint

        r = evaluate_checkpoint(
            args.checkpoint,
            data_dir=args.data_dir,
            device=args.device,
            threads=args.threads,
            neuron_backend=args.neuron_backend,
            batch_size=args.batch_size,
            progress=not args.no_progress,
        )
        print(
            f"{r['model']} on {r['dataset']} (epoch {r['epoch']}): test loss {r['test_loss']:.4f}, "
            f"test accuracy {100 * r['test_acc']:.2f}% on {r['samples']} samples in {r['test_time_s']:.1f}s"
        )
        return 0


if __name__ == "__main__":
    sys.exit(main())
