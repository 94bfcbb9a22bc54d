"""Two checkouts of spikefuse side by side on what the packing's binary check and the recurrent layer's custom op
touch: packing a large spike tensor, spike layers fed spikes that no neuron kernel packed (so they pack them
themselves, checking), the recurrent layer at the SHD size, and a lean ResNet18 training step. Run as
`ab_hot_paths.py` runs its cases: one fresh process per checkout and round, alternating, after an untimed round;
each case's median over rounds.

    python benchmarks/ab_pack_check.py OLD_SRC NEW_SRC [--rounds 5] [--out FILE.md]

OLD_SRC / NEW_SRC: the `src` folders of the two checkouts (e.g. a `git worktree` of the older commit).
"""

from ab_hot_paths import LEAN_RESNET_STEP, PRELUDE, RECURRENT_LAYER, main

CASES = (
    PRELUDE
    + LEAN_RESNET_STEP
    + RECURRENT_LAYER
    + r"""
from spikefuse.nn import SpikeConv2d, SpikeLinear
from spikefuse.ops import bitpack

big = (torch.rand(32, 64, 128, 16, 16) < 0.2).float()  # 268 MB
small = (torch.rand(8, 32, 4096) < 0.2).float()


def layer_step(layer, x):
    def step():
        layer(x).square().sum().backward()
        layer.zero_grad()

    return step


linear = layer_step(SpikeLinear(256, 256), (torch.rand(100, 32, 256) < 0.1).float())
conv = layer_step(SpikeConv2d(16, 32, 3, padding=1), (torch.rand(8, 16, 16, 32, 32) < 0.2).float())


print(json.dumps({
    "pack 268 MB float32 spikes (ms)": 1e3 * median_time(lambda: bitpack.pack(big, reuse=False), 21),
    "pack 4 MB float32 spikes (us)": 1e6 * median_time(lambda: bitpack.pack(small, reuse=False), 301),
    "SpikeLinear 256->256 T=100 B=32 fwd+bwd (ms)": 1e3 * median_time(linear, 31),
    "SpikeConv2d 16->32 3x3 T=8 B=16 32x32 fwd+bwd (ms)": 1e3 * median_time(conv, 11),
    "recurrent LIF T=250 B=32 H=256 fwd+bwd (ms)": 1e3 * median_time(recurrent, 7),
    "lean ResNet18 train step T=4 B=8 32x32 (ms)": 1e3 * median_time(train_step, 5),
}))
"""
)


if __name__ == "__main__":
    main(CASES, "The packing's binary check and the recurrent custom op", "ab_pack_check.py", rounds=5)
