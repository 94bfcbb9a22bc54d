import pytest
import torch

from spikefuse.data import encode


def test_poisson_rate_matches_intensity_and_shape():
    levels = torch.tensor([0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
    images = levels.view(1, 1, 1, -1).expand(2, 3, 4, -1).contiguous()  # [B=2, C=3, H=4, W=6]
    T = 2000
    g = torch.Generator().manual_seed(0)
    spikes = encode(images, T, "poisson", generator=g)
    assert spikes.shape == (T, 2, 3, 4, 6)
    assert spikes.dtype == torch.float32
    assert set(spikes.unique().tolist()) <= {0.0, 1.0}
    rate = spikes.mean(dim=(0, 1, 2, 3))  # per intensity level; 24000 draws each
    assert torch.allclose(rate, levels, atol=0.01)
    assert rate[0] == 0.0 and rate[-1] == 1.0  # intensity 0 never spikes, 1 always


def test_poisson_deterministic_with_generator():
    images = torch.rand(3, 1, 5, 5, generator=torch.Generator().manual_seed(1))
    a = encode(images, 8, generator=torch.Generator().manual_seed(7))
    b = encode(images, 8, generator=torch.Generator().manual_seed(7))
    c = encode(images, 8, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_poisson_steps_are_independent():
    images = torch.full((1, 1, 64, 64), 0.5)
    s = encode(images, 2, generator=torch.Generator().manual_seed(3))
    both = (s[0] * s[1]).mean().item()  # P(spike at both steps) = 0.25 if independent
    assert abs(both - 0.25) < 0.03


def test_direct_repeats_image():
    images = torch.rand(2, 3, 4, 4, dtype=torch.float64)
    d = encode(images, 5, "direct")
    assert d.shape == (5, 2, 3, 4, 4) and d.dtype == torch.float64
    for t in range(5):
        assert torch.equal(d[t], images)


def test_encode_rejects_bad_arguments():
    with pytest.raises(ValueError, match="B, C, H, W"):
        encode(torch.rand(3, 4, 4), 4)
    with pytest.raises(ValueError, match="T must be"):
        encode(torch.rand(1, 1, 4, 4), 0)
    with pytest.raises(ValueError, match="unknown encoding"):
        encode(torch.rand(1, 1, 4, 4), 4, "rank")
