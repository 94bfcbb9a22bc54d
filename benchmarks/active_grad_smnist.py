"""Accuracy of Perez-Nieves & Goodman's sparse gradient (:class:`spikefuse.surrogate.Active`, an approximation)
against the exact gradient, on sequential MNIST (28 rows of 28 grey values, ``spikefuse.models.srnn``: 28 -> 256
recurrent LIF -> 10), a seeded subset, a few epochs of Adam, the same seed for every form: the exact gradient with
the model's Sigmoid(4) surrogate, the exact gradient of the windowed surrogate ``Windowed(Sigmoid(4), w)``, and
``Active(Sigmoid(4), w)`` with ``sparse_grad=True``. ``spikefuse train`` cannot take a surrogate object from its
command line, hence this script; the loop is the training loop's (the readout averaged over T, cross-entropy).

    python benchmarks/active_grad_smnist.py --data-dir ../shared/data/mnist --epochs 3 --window 0.25
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from spikefuse.bench.common import machine_info
from spikefuse.data import load_dataset
from spikefuse.models.srnn import SRNN
from spikefuse.nn import LIF
from spikefuse.nn.neurons import NeuronFactory
from spikefuse.surrogate import Active, Sigmoid, Windowed
from spikefuse.threads import set_threads


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def subset(root, train: bool, n: int, seed: int):
    data, _ = load_dataset("smnist", root, train=train, T=28)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(data), generator=g)[:n]
    x = data.data[idx].float()
    if data.data.dtype == torch.uint8:
        x = x / 255.0
    return x.transpose(0, 1).contiguous(), data.targets[idx]  # [T, N, 28]


def nonzero_g(model, x) -> float:
    """The share of nonzero entries of the gradient of the recurrent layer's input current (``G``)."""
    layer = next(m for m in model.modules() if type(m).__name__ == "RecurrentLIF")
    seen = {}

    def hook(_, args):
        args[0].register_hook(lambda g: seen.setdefault("g", g))

    handle = layer.register_forward_pre_hook(hook)
    try:
        model.zero_grad()
        model(x).mean(0).sum().backward()
    finally:
        handle.remove()
        model.zero_grad()
    return float((seen["g"] != 0).double().mean())


def train(form: str, surrogate, sparse_grad, args, data) -> dict:
    (x_train, y_train), (x_test, y_test) = data
    torch.manual_seed(args.seed)
    neuron = NeuronFactory(LIF, dict(decay=0.9, threshold=0.5, v_reset=None, surrogate=surrogate))
    model = SRNN(28, 10, hidden=256, neuron=neuron, neuron_backend="cpu", sparse_grad=sparse_grad)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    rates, accs = [], []
    n = x_train.shape[1]
    for _ in range(args.epochs):
        model.train()
        order = torch.randperm(n, generator=g)
        start = time.perf_counter()
        for i in range(0, n - args.batch_size + 1, args.batch_size):
            idx = order[i : i + args.batch_size]
            out = model(x_train[:, idx]).mean(0)
            loss = F.cross_entropy(out, y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        rates.append(n // args.batch_size * args.batch_size / (time.perf_counter() - start))
        model.eval()
        with torch.no_grad():
            correct = sum(
                int((model(x_test[:, i : i + 500]).mean(0).argmax(1) == y_test[i : i + 500]).sum())
                for i in range(0, x_test.shape[1], 500)
            )
        accs.append(100.0 * correct / x_test.shape[1])
    share = nonzero_g(model, x_train[:, : args.batch_size])
    return {"form": form, "rates": rates, "accs": accs, "share": share}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-subset", type=int, default=10000)
    p.add_argument("--test-subset", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--window", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    set_threads(args.threads)
    print(f"machine: {machine_info()}")
    print(f"load before: {loadavg()}")
    data = subset(args.data_dir, True, args.train_subset, args.seed), subset(args.data_dir, False, args.test_subset, 1)
    w = args.window
    forms = [
        ("exact, Sigmoid(4)", Sigmoid(4.0), False),
        (f"exact, Windowed(Sigmoid(4), {w})", Windowed(Sigmoid(4.0), w), False),
        (f"Active(Sigmoid(4), {w}), sparse_grad=True", Active(Sigmoid(4.0), w), True),
    ]
    print(
        "\n| gradient | train samples/s by epoch | test accuracy % by epoch | nonzero G after training |\n|---|---|---|---|"
    )
    for form, surrogate, sparse_grad in forms:
        r = train(form, surrogate, sparse_grad, args, data)
        print(
            f"| {r['form']} | {' / '.join(f'{v:.0f}' for v in r['rates'])} | "
            f"{' / '.join(f'{v:.2f}' for v in r['accs'])} | {r['share']:.3f} |",
            flush=True,
        )
    print(f"\nload after: {loadavg()}")


if __name__ == "__main__":
    main()
