"""Two checkouts of spikefuse side by side on what a per-call check touches: the LIF layer's forward alone and with
backward at `spikefuse bench neuron`'s size and at a small size (where per-call costs show), and the recurrent
layer at the SHD size. Run as `ab_hot_paths.py` runs its cases: one fresh process per checkout and round,
alternating, after an untimed round; each case's median over rounds.

    python benchmarks/ab_check_costs.py OLD_SRC NEW_SRC [--rounds 5] [--out FILE.md]

OLD_SRC / NEW_SRC: the `src` folders of the two checkouts (e.g. a `git worktree` of the older commit).
"""

from ab_hot_paths import PRELUDE, RECURRENT_LAYER, main

CASES = (
    PRELUDE
    + RECURRENT_LAYER
    + r"""


def lif(T, n):
    x, g = torch.rand(T, n, requires_grad=True), torch.rand(T, n)

    def both():
        spikefuse.lif(x, decay=0.8, threshold=0.5).backward(g)
        x.grad = None

    def forward():
        with torch.no_grad():
            spikefuse.lif(x, decay=0.8, threshold=0.5)

    return forward, both


big_forward, big_both = lif(32, 1_000_000)
small_forward, small_both = lif(8, 4096)
print(json.dumps({
    "LIF layer T=32 N=1M forward, no grad (ms)": 1e3 * median_time(big_forward, 15),
    "LIF layer T=32 N=1M forward+backward (ms)": 1e3 * median_time(big_both, 15),
    "LIF layer T=8 N=4096 forward, no grad (us)": 1e6 * median_time(small_forward, 400),
    "LIF layer T=8 N=4096 forward+backward (us)": 1e6 * median_time(small_both, 400),
    "recurrent LIF T=250 B=32 H=256 forward+backward (ms)": 1e3 * median_time(recurrent, 7),
}))
"""
)


if __name__ == "__main__":
    main(CASES, "What a per-call check touches", "ab_check_costs.py", rounds=5)
