"""``memory="potential"`` vs ``memory="recompute"`` of :func:`spikefuse.lif`: same results on every backend, and
what each saves for backward (unique storages counted through ``saved_tensors_hooks``)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import spikefuse  # noqa: E402

from tests.ops.cases import saved_storages  # noqa: E402

SHAPE = (5, 3, 4, 6)  # T, B, C, L


# Bytes of the threshold and v_reset saved for backward: the LIF's definition on the neuron engine
# (:func:`spikefuse.neurons.lif.lif_params`) takes them as float32 tensors of one element.
CONSTANTS = 8


def _run(backend, memory, x, decay, v_init):
    xx = x.clone().requires_grad_(True)
    k = decay.clone().requires_grad_(True)
    v = v_init.clone().requires_grad_(True)
    storages, (s, st) = saved_storages(
        lambda: spikefuse.lif(
            xx * 1.0, decay=k, threshold=0.5, v_init=v, return_state=True, backend=backend, memory=memory
        )
    )
    g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    ((s * g).sum() + st.sum()).backward()
    return s, st, xx.grad, k.grad, v.grad, sum(storages.values())


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_potential_and_recompute_agree(backend):
    torch.manual_seed(0)
    x = torch.rand(SHAPE) * 0.8
    decay = torch.full((SHAPE[2],), 0.4)
    v_init = torch.rand(SHAPE[1:]) * 0.3
    pot = _run(backend, "potential", x, decay, v_init)
    rec = _run(backend, "recompute", x, decay, v_init)
    ref = _run("reference", "potential", x, decay, v_init)
    for a, b, name in zip(pot[:5], rec[:5], ["spikes", "state", "grad x", "grad decay", "grad v_init"]):
        assert torch.equal(a, b), f"{backend}: {name} differs between memory modes"
    assert torch.equal(pot[0], ref[0])
    for a, b in zip(rec[1:5], ref[1:5]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if backend != "reference":  # the reference ignores the memory mode (autograd through its loop)
        x_bytes = x.nbytes
        small = SHAPE[2] * 4 + CONSTANTS
        # potential: h [T, N] + v_init [N] + leak; recompute: x [T, N] + v_init [N] + leak (v_init is x / T)
        assert rec[5] == x_bytes + v_init.nbytes + small
        assert pot[5] == x_bytes + v_init.nbytes + small


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_recompute_does_not_save_h_with_x_saved_elsewhere(backend):
    """When x is already saved by another op (as the BN input is), recompute adds nothing of size [T, N] or [N]
    (the default v_init is one value shared by every neuron), while potential adds the potentials h."""
    x = torch.rand(SHAPE, requires_grad=True)
    for memory in ("potential", "recompute"):
        y = x * 2.0
        stores, _ = saved_storages(lambda: spikefuse.lif(y, decay=0.5, threshold=0.5, backend=backend, memory=memory))
        extra = sum(v for k, v in stores.items() if k != y.untyped_storage().data_ptr())
        expected_h = x.nbytes if memory == "potential" else 0
        assert extra == expected_h + 4 + 4 + CONSTANTS, memory  # + the shared v_init and the leak, 4 B each


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_retained_graph_backward_twice_gives_the_same_gradients(backend):
    """The fused backends write grad_x over the saved h only when the graph is freed: a retained graph must still
    hold h for a second backward."""
    torch.manual_seed(0)
    x = (torch.rand(SHAPE) * 0.8).requires_grad_(True)
    g = torch.randn(SHAPE)
    spikes = spikefuse.lif(x, decay=0.4, threshold=0.5, backend=backend)
    (first,) = torch.autograd.grad(spikes, x, g, retain_graph=True)
    (second,) = torch.autograd.grad(spikes, x, g)
    assert torch.equal(first, second)
    xr = x.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(spikefuse.lif(xr, decay=0.4, threshold=0.5, backend="reference"), xr, g)
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_writes_grad_x_over_the_saved_potential(backend, dtype):
    """Without retain_graph, grad_x takes the storage of the saved h (when grad_x has h's dtype): backward
    allocates nothing of size [T, N]; the gradient is the reference's either way."""
    torch.manual_seed(0)
    x = (torch.rand(SHAPE) * 0.8).to(dtype).requires_grad_(True)
    g = torch.randn(SHAPE).to(dtype)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        spikes = spikefuse.lif(x, decay=0.4, threshold=0.5, backend=backend)
    h_storage = next(t.untyped_storage().data_ptr() for t in saved if t.shape == (SHAPE[0], x[0].numel()))
    spikes.backward(g)
    assert (x.grad.untyped_storage().data_ptr() == h_storage) == (dtype == torch.float32)
    xr = x.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(spikefuse.lif(xr, decay=0.4, threshold=0.5, backend="reference"), xr, g)
    rtol = 1e-5 if dtype == torch.float32 else 2 * 2.0**-8  # bfloat16: grad_x rounded once more, by 1 ulp
    torch.testing.assert_close(x.grad, expected, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("used", ["spikes", "state"])
def test_gradient_through_one_output_only(backend, used):
    """Gradients are not materialized: an unused output's gradient arrives as None and is taken as zero."""
    torch.manual_seed(0)
    x = torch.rand(SHAPE) * 0.8
    grads = {}
    for b in (backend, "reference"):
        xx = x.clone().requires_grad_(True)
        spikes, state = spikefuse.lif(xx, decay=0.4, threshold=0.5, v_reset=None, return_state=True, backend=b)
        out = spikes if used == "spikes" else state
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        grads[b] = xx.grad
    torch.testing.assert_close(grads[backend], grads["reference"], rtol=1e-5, atol=1e-6)
