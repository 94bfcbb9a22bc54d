"""Two checkouts of spikefuse side by side on the calls whose arguments the neuron record (``NeuronSpec``, issue 59)
changed: the functional LIF and CubaLIF at a small size (where per-call costs show) and at `spikefuse bench
neuron`'s, an ``nn.LIF`` module, snnTorch's ``Leaky`` and ``RLeaky`` drop-ins called step by step (the one-step
kernels; each call now looks its record up), the recurrent layer at the SHD size, the fused BatchNorm+LIF and
conv+BatchNorm+LIF at a small size (the BatchNorm op's records), and a lean ResNet18 training step (the fused
BatchNorm). Every call names its surrogate, so both checkouts run the same kernels whatever their defaults. Run as `ab_hot_paths.py` runs its cases: one fresh process per checkout and round, alternating, after an
untimed round; each case's median over rounds.

    python benchmarks/ab_neuron_spec.py OLD_SRC NEW_SRC [--rounds 5] [--out FILE.md]
"""

from ab_hot_paths import LAYER, LEAN_RESNET_STEP, PRELUDE, main

CASES = (
    PRELUDE
    + LEAN_RESNET_STEP
    + LAYER
    + r"""
import spikefuse.nn
from spikefuse.compat import snntorch as sf_snntorch
from spikefuse.neurons import LIF_MODELS
from spikefuse.surrogate import ATan, Sigmoid


def module(T, n, repeats):
    lif = spikefuse.nn.LIF(decay=0.8, threshold=0.5, surrogate=Sigmoid(4.0))
    x = torch.rand(T, n, requires_grad=True)

    def step():
        lif(x).sum().backward()
        x.grad = None

    return median_time(step, repeats)


def step_loop(recurrent, repeats, T=100, B=32, n=256):
    neuron = sf_snntorch.RLeaky(beta=0.9, linear_features=n) if recurrent else sf_snntorch.Leaky(beta=0.9)
    x = torch.rand(T, B, n, requires_grad=True)

    def run():
        if recurrent:
            spk, mem = neuron.init_rleaky()
        else:
            mem = neuron.init_leaky()
        out = []
        for t in range(T):
            if recurrent:
                spk, mem = neuron(x[t], spk, mem)
            else:
                spk, mem = neuron(x[t], mem)
            out.append(spk)
        torch.stack(out).sum().backward()
        x.grad = None

    return median_time(run, repeats)


def recurrent_layer(repeats, T=250, B=32, H=256):
    x = (torch.rand(T, B, H) * 0.6).requires_grad_()
    w = (torch.randn(H, H) * 0.05).requires_grad_()

    def run():
        model = LIF_MODELS[("snntorch", "soft")]
        spikefuse.recurrent(x, model, w, decay=0.9, threshold=1.0, surrogate=ATan(2.0)).sum().backward()
        x.grad = w.grad = None

    return median_time(run, repeats)


# a fused BatchNorm+LIF (conv: conv+BatchNorm+LIF) in training, forward+backward, at a small size
def batchnorm(repeats, conv=False, T=4, B=8, C=16, H=8):
    from spikefuse.bn_functional import batchnorm_lif, conv_batchnorm_lif

    x = torch.rand(T, B, C, H, H, requires_grad=True)
    w, b = torch.ones(C, requires_grad=True), torch.zeros(C, requires_grad=True)
    rm, rv, k = torch.zeros(C), torch.ones(C), torch.randn(C, C, 3, 3, requires_grad=True)
    options = dict(training=True, decay=0.5, threshold=0.5, surrogate=Sigmoid(4.0), backend="cpu")

    def run():
        if conv:
            conv_batchnorm_lif(x, k, None, 1, 1, 1, 1, rm, rv, w, b, **options).sum().backward()
        else:
            batchnorm_lif(x, rm, rv, w, b, **options).sum().backward()
        x.grad = w.grad = b.grad = k.grad = None

    return median_time(run, repeats)


print(json.dumps({
    "batchnorm_lif T=4 B=8 C=16 8x8 train fwd+bwd (us)": 1e6 * batchnorm(60),
    "conv_batchnorm_lif T=4 B=8 C=16 8x8 train fwd+bwd (us)": 1e6 * batchnorm(30, conv=True),
    "spikefuse.lif T=8 N=4096 fwd+bwd (us)": 1e6 * layer(8, 4096, 400, surrogate=Sigmoid(4.0)),
    "spikefuse.neuron CubaLIF T=16 N=512 fwd+bwd (us)": 1e6 * layer(16, 512, 400, cuba=True, surrogate=ATan(2.0)),
    "nn.LIF T=8 N=4096 fwd+bwd (us)": 1e6 * module(8, 4096, 400),
    "compat.snntorch.Leaky step loop T=100 B=32 N=256 (ms)": 1e3 * step_loop(False, 15),
    "compat.snntorch.RLeaky step loop T=100 B=32 N=256 (ms)": 1e3 * step_loop(True, 10),
    "spikefuse.recurrent T=250 B=32 H=256 fwd+bwd (ms)": 1e3 * recurrent_layer(7),
    "spikefuse.lif T=32 N=1M fwd+bwd (ms)": 1e3 * layer(32, 1_000_000, 15, surrogate=Sigmoid(4.0)),
    "lean ResNet18 train step T=4 B=8 32x32 (ms)": 1e3 * median_time(train_step, 5),
}))
"""
)

if __name__ == "__main__":
    main(CASES, "The neuron record (NeuronSpec) against the loose arguments before", "ab_neuron_spec.py", rounds=5)
