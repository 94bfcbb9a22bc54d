"""Two checkouts of spikefuse side by side on what the engine's CPU launch touches: LIF and CubaLIF layers
(forward+backward) below, at and above ``spikefuse.ops.engine.cpu.SERIAL_WORK`` (where a call runs its one block on
the calling thread instead of numba's parallel launcher), the LIF layer at `spikefuse bench neuron`'s size, and a lean
ResNet18 training step (the fused BatchNorm's kernels). Run as `ab_hot_paths.py` runs its cases: one fresh process per
checkout and round, alternating, after an untimed round; each case's median over rounds.

    python benchmarks/ab_serial_launch.py OLD_SRC NEW_SRC [--rounds 5] [--out FILE.md]
"""

from ab_hot_paths import LAYER, LEAN_RESNET_STEP, PRELUDE, main

CASES = (
    PRELUDE
    + LEAN_RESNET_STEP
    + LAYER
    + r"""


print(json.dumps({
    "LIF layer T=8 N=256 fwd+bwd (us)": 1e6 * layer(8, 256, 400),
    "LIF layer T=8 N=1024 fwd+bwd (us)": 1e6 * layer(8, 1024, 400),
    "LIF layer T=8 N=2048 fwd+bwd (us)": 1e6 * layer(8, 2048, 400),
    "LIF layer T=8 N=4096 fwd+bwd (us)": 1e6 * layer(8, 4096, 400),
    "CubaLIF layer T=16 N=512 fwd+bwd (us)": 1e6 * layer(16, 512, 400, cuba=True, surrogate="atan"),
    "CubaLIF layer T=16 N=4096 fwd+bwd (us)": 1e6 * layer(16, 4096, 300, cuba=True, surrogate="atan"),
    "LIF layer T=32 N=1M fwd+bwd (ms)": 1e3 * layer(32, 1_000_000, 15),
    "lean ResNet18 train step T=4 B=8 32x32 (ms)": 1e3 * median_time(train_step, 5),
}))
"""
)

if __name__ == "__main__":
    main(CASES, "Single-block calls on the calling thread", "ab_serial_launch.py", rounds=5)
