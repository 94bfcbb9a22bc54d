"""``spikefuse bench table1``'s settings: the CPU scale by default, the paper's network on a timed subset with
``--device cuda``, each data set's own settings beneath what the command line sets."""

import argparse

from spikefuse.bench import table1


def _args(*argv):
    parser = argparse.ArgumentParser()
    table1.add_parser(parser.add_subparsers()).set_defaults()
    args = parser.parse_args(["table1", *argv])
    return args, table1.resolve_defaults(args)


def test_cpu_defaults_are_the_cpu_scale():
    args, gpu = _args()
    assert not gpu and (args.width, args.T, args.train_subset) == (16, 4, None)
    ns = table1._namespace(args, {"epochs": 1, "batch_size": 100}, {"train_subset": None, "test_subset": None}, None)
    assert (ns.width, ns.T, ns.epochs, ns.batch_size, ns.device, ns.precision) == (16, 4, 1, 100, "cpu", "fp32")


def test_gpu_runs_the_papers_network_on_a_subset():
    args, gpu = _args("--device", "cuda", "--precision", "bf16", "--epochs", "2")
    assert gpu and (args.width, args.T) == (64, 32)
    ns = table1._namespace(args, {"epochs": 5, "batch_size": 32}, {}, None)
    assert (ns.width, ns.T, ns.train_subset, ns.test_subset) == (64, 32, 3000, 1000)
    assert (ns.epochs, ns.batch_size, ns.device, ns.precision, ns.compile) == (2, 32, "cuda", "bf16", False)
    args, _ = _args("--device", "cuda", "--train-subset", "500", "--T", "8")
    ns = table1._namespace(args, {"epochs": 1}, {}, None)
    assert (ns.train_subset, ns.test_subset, ns.T) == (500, 1000, 8)
