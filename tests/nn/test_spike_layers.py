"""SpikeLinear / SpikeConv{1,2,3}d: bit-identical to the torch layers, input saved as bits, debug-mode check."""

import pytest
import torch
from torch import nn

from spikefuse.nn import SeqToBatch
from spikefuse.nn import spike_layers as sl
from spikefuse.nn.spike_layers import (
    SpikeConv1d,
    SpikeConv2d,
    SpikeConv3d,
    SpikeLinear,
    SpikeMaxPool1d,
    SpikeMaxPool2d,
    SpikeMaxPool3d,
)
from spikefuse.ops.spike_layers.autograd import input_major


pytestmark = pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel lengths")


def spikes(shape, seed=0, p=0.3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < p).to(dtype)


def pair(ref: nn.Module, mine: nn.Module, dtype=torch.float32):
    ref = ref.to(dtype)
    mine = mine.to(dtype)
    mine.load_state_dict(ref.state_dict())
    if isinstance(ref, nn.Linear) and input_major(mine.weight) and not input_major(ref.weight):
        # a sparse SpikeLinear keeps its weight input-major, and torch's products round by the layout: the same for both
        ref.weight = nn.Parameter(ref.weight.detach().t().contiguous().t())
    return ref, mine


def run_both(ref, mine, x, input_grad=True):
    """Forward + backward of the torch layer (on [T*B, ...] via SeqToBatch) and the spike layer, same grad_y."""
    xa = x.clone().requires_grad_(input_grad)
    xb = x.clone().requires_grad_(input_grad)
    ya = (ref if isinstance(ref, nn.Linear) else SeqToBatch(ref))(xa)
    yb = mine(xb)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(1)).to(ya.dtype)
    ya.backward(g)
    yb.backward(g)
    return (ya, xa.grad, ref.weight.grad, None if ref.bias is None else ref.bias.grad), (
        yb,
        xb.grad,
        mine.weight.grad,
        None if mine.bias is None else mine.bias.grad,
    )


def assert_identical(a, b):
    for name, u, v in zip(("output", "grad_input", "grad_weight", "grad_bias"), a, b):
        assert (u is None) == (v is None), name
        if u is not None:
            assert u.shape == v.shape, name
            assert torch.equal(u, v), f"{name} differs: max abs diff {(u - v).abs().max().item()}"


CONV2D_CASES = [
    dict(kernel_size=3),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(3, 2), stride=(1, 2), padding=(2, 0), bias=False),
    dict(kernel_size=3, padding=2, dilation=2),
    dict(kernel_size=3, padding="same", dilation=(1, 2)),
    dict(kernel_size=4, padding="same"),  # asymmetric 'same': torch pads the remainder on the right
    dict(kernel_size=1, padding="valid"),
    dict(kernel_size=3, padding=1, groups=2),
    dict(kernel_size=3, padding=1, groups=4, bias=False),  # depthwise-like (out = 2 * in / groups)
    dict(kernel_size=3, padding=2, padding_mode="reflect"),
    dict(kernel_size=2, padding="same", padding_mode="replicate"),
    dict(kernel_size=3, padding=1, stride=2, padding_mode="circular"),
]


@pytest.mark.parametrize("kw", CONV2D_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("T", [1, 3])
def test_conv2d_equals_torch(kw, T):
    torch.manual_seed(0)
    ref, mine = pair(nn.Conv2d(4, 8, **kw), SpikeConv2d(4, 8, **kw))
    x = spikes((T, 2, 4, 9, 7), seed=T)
    a, b = run_both(ref, mine, x)
    assert b[0].shape == (T, 2, *a[0].shape[2:])
    assert_identical(a, b)


@pytest.mark.parametrize("input_grad", [False, True])
@pytest.mark.parametrize("weight_grad", [False, True])
def test_conv2d_partial_requires_grad(input_grad, weight_grad):
    ref, mine = pair(nn.Conv2d(3, 5, 3, padding=1), SpikeConv2d(3, 5, 3, padding=1))
    for m in (ref, mine):
        m.weight.requires_grad_(weight_grad)
    if not (input_grad or weight_grad):
        x = spikes((2, 2, 3, 6, 6))
        assert torch.equal(SeqToBatch(ref)(x), mine(x))
        return
    a, b = run_both(ref, mine, spikes((2, 2, 3, 6, 6)), input_grad=input_grad)
    assert_identical(a, b)


def test_conv2d_channels_last_input():
    ref, mine = pair(nn.Conv2d(4, 6, 3, padding=1), SpikeConv2d(4, 6, 3, padding=1))
    x = spikes((6, 4, 5, 7)).contiguous(memory_format=torch.channels_last).unflatten(0, (3, 2))
    assert x.flatten(0, 1).is_contiguous(memory_format=torch.channels_last)
    a, b = run_both(ref, mine, x)
    assert_identical(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_conv2d_other_dtypes(dtype):
    ref, mine = pair(nn.Conv2d(3, 4, 3, padding=1), SpikeConv2d(3, 4, 3, padding=1), dtype)
    a, b = run_both(ref, mine, spikes((2, 2, 3, 5, 5), dtype=dtype))
    assert_identical(a, b)


def test_conv1d_and_conv3d_equal_torch():
    ref, mine = pair(nn.Conv1d(3, 5, 3, stride=2, padding=1), SpikeConv1d(3, 5, 3, stride=2, padding=1))
    assert_identical(*run_both(ref, mine, spikes((3, 2, 3, 11))))
    ref, mine = pair(nn.Conv3d(2, 3, 2, padding="same"), SpikeConv3d(2, 3, 2, padding="same"))
    assert_identical(*run_both(ref, mine, spikes((2, 2, 2, 3, 4, 5))))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 3, 13), (4, 5, 13), (3, 2, 5, 13)])
def test_linear_equals_torch(bias, shape):
    torch.manual_seed(0)
    ref, mine = pair(nn.Linear(13, 7, bias=bias), SpikeLinear(13, 7, bias=bias))
    a, b = run_both(ref, mine, spikes(shape))
    if len(shape) == 3:
        assert_identical(a, b)
    else:  # torch's own path for >3-d input (matmul, then add) may round the sums differently
        for u, v in zip(a, b):
            if u is not None:
                torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_linear_other_dtypes(dtype):
    ref, mine = pair(nn.Linear(10, 4), SpikeLinear(10, 4), dtype)
    assert_identical(*run_both(ref, mine, spikes((3, 2, 10), dtype=dtype)))


def test_linear_weight_frozen_or_input_constant():
    ref, mine = pair(nn.Linear(9, 4), SpikeLinear(9, 4))
    assert_identical(*run_both(ref, mine, spikes((2, 3, 9)), input_grad=False))
    for m in (ref, mine):
        m.weight.requires_grad_(False)
        m.bias.grad = None
    assert_identical(*run_both(ref, mine, spikes((2, 3, 9))))


# --------------------------------------------------------------------------------------- saved-tensor memory
def saved_bytes(module, x, exclude=()):
    """Bytes of the distinct storages autograd saves during the forward of ``module(x)``, minus ``exclude``'s."""
    storages = {}
    skip = {p.untyped_storage().data_ptr() for p in exclude}

    def pack_hook(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        module(x)
    return sum(storages.values())


@pytest.mark.parametrize("dtype,ratio", [(torch.float32, 32), (torch.bfloat16, 16)])
def test_saved_input_is_bits(dtype, ratio):
    ref, mine = pair(nn.Conv2d(8, 16, 3, padding=1), SpikeConv2d(8, 16, 3, padding=1), dtype)
    x = spikes((4, 2, 8, 16, 16), dtype=dtype).requires_grad_()  # as the output of a neuron layer
    params = list(ref.parameters()) + list(mine.parameters())
    ref_bytes = saved_bytes(SeqToBatch(ref), x, params)
    mine_bytes = saved_bytes(mine, x, params)
    assert ref_bytes == x.numel() * x.element_size()
    assert mine_bytes == x.numel() // 8
    assert ref_bytes == ratio * mine_bytes

    ref, mine = pair(nn.Linear(24, 10), SpikeLinear(24, 10), dtype)
    x = spikes((5, 3, 24), dtype=dtype).requires_grad_()
    params = list(ref.parameters()) + list(mine.parameters())
    assert saved_bytes(ref, x, params) == ratio * saved_bytes(mine, x, params)


def test_nothing_of_the_input_saved_without_weight_grad():
    for mine, x in ((SpikeConv2d(3, 4, 3), spikes((2, 2, 3, 8, 8))), (SpikeLinear(8, 4), spikes((2, 2, 8)))):
        mine.weight.requires_grad_(False)
        assert saved_bytes(mine, x.requires_grad_(), list(mine.parameters())) == 0
        mine.weight.requires_grad_(True)
        assert saved_bytes(mine, x.detach(), list(mine.parameters())) == x.numel() // 8  # first layer
        with torch.no_grad():
            assert saved_bytes(mine, x, list(mine.parameters())) == 0


# ------------------------------------------------------------------------------------------------ contract
@pytest.fixture
def debug_on():
    previous = sl.set_debug(True)
    yield
    sl.set_debug(previous)


def test_debug_mode_rejects_non_binary_input(debug_on):
    assert sl.debug_enabled()
    conv = SpikeConv2d(2, 3, 3, padding=1)
    x = spikes((2, 2, 2, 5, 5))
    conv(x)  # binary: fine
    x[1, 0, 1, 2, 3] = 0.5
    x[1, 1, 0, 0, 0] = 2.0
    message = r"SpikeConv2d\(2, 3, kernel_size=\(3, 3\).*binary.*0\.5 at index \(1, 0, 1, 2, 3\)"
    with pytest.raises(ValueError, match=message):
        conv(x)
    lin = SpikeLinear(4, 2)
    x = torch.tensor([[[0.0, 1.0, float("nan"), 1.0]]])
    with pytest.raises(ValueError, match=r"SpikeLinear\(in_features=4, out_features=2.*nan at index \(0, 0, 2\)"):
        lin(x)


def test_without_debug_mode_a_kept_input_is_checked_on_the_cpu():
    """Without debug mode, a CPU spike layer that keeps its input as bits refuses one that is not binary (the
    packing kernel tells as it reads it), naming the layer and the first other value: its weight gradient would
    count 0.5 or 2 as 1. A layer that keeps nothing (no weight gradient wanted) gives torch's output."""
    previous = sl.set_debug(False)
    try:
        lin = SpikeLinear(4, 2)
        x = torch.tensor([[[0.0, 1.0, 0.5, 1.0]]], requires_grad=True)
        with pytest.raises(ValueError, match=r"SpikeLinear\(in_features=4.*binary.*0\.5 at index \(0, 0, 2\)"):
            lin(x)
        with torch.no_grad():
            assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))
        conv = SpikeConv2d(2, 3, 3, padding=1)
        counts = spikes((2, 2, 2, 5, 5))
        counts[1, 1, 0, 4, 4] = 2.0
        with pytest.raises(ValueError, match=r"SpikeConv2d.*binary.*2\.0 at index \(1, 1, 0, 4, 4\)"):
            conv(counts)
        with pytest.raises(ValueError, match=r"SpikeMaxPool2d.*binary.*2\.0 at index \(3, 0, 4, 4\)"):
            SpikeMaxPool2d(2)(counts.flatten(0, 1))
    finally:
        sl.set_debug(previous)


def test_debug_env_variable(monkeypatch):
    for value, expected in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("SPIKEFUSE_DEBUG", value)
        assert sl._env_flag("SPIKEFUSE_DEBUG") is expected


def test_wrong_number_of_dims():
    with pytest.raises(ValueError, match=r"SpikeConv2d expects multi-step input \[T, B, C, H, W\]"):
        SpikeConv2d(2, 3, 3)(torch.zeros(2, 2, 5, 5))
    with pytest.raises(ValueError, match=r"SpikeLinear expects multi-step input"):
        SpikeLinear(4, 2)(torch.zeros(3, 4))


def test_state_dict_compatible_with_torch_layers():
    ref = nn.Conv2d(3, 6, 3, stride=2, padding=1, groups=3)
    mine = SpikeConv2d(3, 6, 3, stride=2, padding=1, groups=3)
    assert isinstance(mine, nn.Conv2d)
    assert mine.state_dict().keys() == ref.state_dict().keys()
    mine.load_state_dict(ref.state_dict(), strict=True)
    assert torch.equal(mine.weight, ref.weight) and torch.equal(mine.bias, ref.bias)
    nn.Conv2d(3, 6, 3, stride=2, padding=1, groups=3).load_state_dict(mine.state_dict(), strict=True)
    lin = SpikeLinear(5, 3, bias=False)
    assert isinstance(lin, nn.Linear) and list(lin.state_dict()) == ["weight"]
    lin.load_state_dict(nn.Linear(5, 3, bias=False).state_dict())
    # inside a model: a Sequential of torch layers loads into the same Sequential of spike layers
    seq = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    spk = nn.Sequential(SpikeConv2d(2, 4, 3), nn.Flatten(), SpikeLinear(4, 2))
    spk.load_state_dict(seq.state_dict(), strict=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: (SpikeConv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)),
        lambda: (SpikeLinear(6, 5), nn.Linear(6, 5)),
    ],
)
def test_autocast_casts_like_the_torch_layer(make):
    """Under CPU autocast (bf16) the torch layer computes in bf16; the spike layer did so in float32 before."""
    torch.manual_seed(0)
    spike_layer, torch_layer = make()
    torch_layer.load_state_dict(spike_layer.state_dict())
    shape = (2, 3, 3, 6, 6) if isinstance(spike_layer, SpikeConv2d) else (2, 3, 6)
    x = (torch.rand(shape) > 0.5).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = spike_layer(x)
        y_ref = SeqToBatch(torch_layer)(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert torch.equal(y, y_ref)
    y.float().sum().backward()
    y_ref.float().sum().backward()
    assert spike_layer.weight.grad.dtype == torch.float32
    assert torch.equal(spike_layer.weight.grad, torch_layer.weight.grad)


# ------------------------------------------------------------------------------------------------ max-pooling
POOL_CASES = [
    (SpikeMaxPool2d, nn.MaxPool2d, dict(kernel_size=3, stride=2, padding=1), (4, 3, 9, 9)),  # the ResNet stem's
    (SpikeMaxPool2d, nn.MaxPool2d, dict(kernel_size=2), (4, 3, 8, 8)),
    (
        SpikeMaxPool2d,
        nn.MaxPool2d,
        dict(kernel_size=(3, 2), stride=(2, 1), dilation=(1, 2), ceil_mode=True),
        (3, 2, 11, 7),
    ),
    (SpikeMaxPool1d, nn.MaxPool1d, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), (4, 3, 10)),
    (SpikeMaxPool3d, nn.MaxPool3d, dict(kernel_size=2, stride=(1, 2, 2), padding=1), (2, 3, 4, 6, 5)),
]


@pytest.mark.parametrize("mine_cls,ref_cls,kw,shape", POOL_CASES, ids=lambda v: getattr(v, "__name__", None))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.95])  # sparse and dense: windows with ties everywhere
def test_max_pool_equals_torch(mine_cls, ref_cls, kw, shape, dtype, p):
    x = spikes(shape, seed=3, p=p, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref_cls(**kw)(xa), mine_cls(**kw)(xb)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad), "the gradient went to another maximum of a window"


@pytest.mark.parametrize("mine_cls,ref_cls,kw,shape", POOL_CASES, ids=lambda v: getattr(v, "__name__", None))
def test_max_pool_of_a_neurons_spikes_pools_their_bits(mine_cls, ref_cls, kw, shape, monkeypatch):
    """Input whose bits a neuron kernel made (remembered as spikes): the pooling reads those bits, not the values,
    gives torch's output and gradient, and hands its output's bits (where each plane fills whole bytes) to the next
    layer; the values are not read."""
    from spikefuse.ops import bitpack
    from spikefuse.ops.maxpool import cpu as maxpool_cpu

    x = spikes(shape, seed=7, p=0.4)
    bitpack.remember(x, bitpack.pack_torch(x), spikes=True)
    monkeypatch.setattr(maxpool_cpu, "forward", lambda *a: pytest.fail("pooled the values"))
    xa, xb = x.clone().requires_grad_(), x.requires_grad_()
    ya, yb = ref_cls(**kw)(xa), mine_cls(**kw)(xb)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(8))
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    if yb[0, 0].numel() % 8 == 0:
        assert torch.equal(bitpack.spike_bits(yb), bitpack.pack_torch(ya))
    else:
        assert bitpack.spike_bits(yb) is None


def test_max_pool_channels_last_and_multi_step():
    x = spikes((6, 4, 10, 10), seed=5).contiguous(memory_format=torch.channels_last)
    ref, mine = SeqToBatch(nn.MaxPool2d(3, 2, 1)), SeqToBatch(SpikeMaxPool2d(3, 2, 1))
    xa, xb = x.unflatten(0, (3, 2)).requires_grad_(), x.unflatten(0, (3, 2)).requires_grad_()  # [T, B, C, H, W]
    ya, yb = ref(xa), mine(xb)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(6))
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)


def test_max_pool_saves_bits_not_indices():
    x = spikes((4, 8, 16, 16)).requires_grad_()
    ref_bytes = saved_bytes(nn.MaxPool2d(3, 2, 1), x, [])
    mine_bytes = saved_bytes(SpikeMaxPool2d(3, 2, 1), x, [])
    assert ref_bytes == x.numel() * 4 + (x.numel() // 4) * 8  # the input and the int64 index of each output
    assert mine_bytes == x.numel() // 8


def test_max_pool_contract(debug_on):
    with pytest.raises(ValueError, match="SpikeMaxPool2d does not return indices"):
        SpikeMaxPool2d(2, return_indices=True)
    x = spikes((2, 2, 4, 4))
    x[1, 0, 2, 3] = 0.25
    with pytest.raises(ValueError, match=r"SpikeMaxPool2d\(kernel_size=2.*binary.*0\.25 at index \(1, 0, 2, 3\)"):
        SpikeMaxPool2d(2)(x)


def test_max_pool_bad_arguments_get_torchs_error():
    x = spikes((2, 2, 4, 4))
    with pytest.raises(RuntimeError, match="pad should be at most half of effective kernel size"):
        SpikeMaxPool2d(2, padding=2)(x)
    with pytest.raises(RuntimeError, match="Output size is too small"):
        SpikeMaxPool2d(5)(x)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: SpikeLinear(4, 3), (2, 3, 4)),
        (lambda: SpikeConv2d(2, 3, 3, padding=1), (2, 3, 2, 5, 5)),
        (lambda: SpikeMaxPool2d(2), (6, 2, 4, 4)),
    ],
)
def test_double_backward_is_refused_by_message(make, shape):
    """create_graph=True: nn.Linear gives second-order terms; these layers' backward is kernels on bits, so they
    refuse instead of silently giving none."""
    layer = make()
    x = (torch.rand(shape) < 0.5).float().requires_grad_()
    with pytest.raises(
        RuntimeError, match=r"double backward \(create_graph=True.*keeps its input as bits; use torch.nn"
    ):
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)
    torch.autograd.grad(layer(x).sum(), x)  # first order as before


@pytest.mark.parametrize("edit", ["data", "numpy", "detach"])
def test_stale_bits_after_an_edit_around_torch(edit):
    """Spikes whose bits a neuron kernel made, edited in place: through torch (detach() shares the version counter)
    the bits are dropped and the pooling reads the values; through .data or numpy torch counts nothing, so the
    layer would read the old bits (as autograd's saved tensors miss such edits): its debug mode re-packs the input
    and refuses them by message."""
    from spikefuse.ops import bitpack

    x = spikes((2, 3, 8, 8), seed=9, p=0.3)
    bitpack.remember(x, bitpack.pack_torch(x), spikes=True)
    flipped = 1 - x[0, 0, 0, 0]
    {"data": lambda: x.data[0, 0, 0].fill_(flipped), "numpy": lambda: x.numpy()[0, 0, 0].fill(flipped.item())}.get(
        edit, lambda: x.detach()[0, 0, 0].fill_(flipped)
    )()
    pool = SpikeMaxPool2d(2)
    if edit == "detach":
        assert bitpack.spike_bits(x) is None and torch.equal(pool(x), nn.MaxPool2d(2)(x))
        return
    assert bitpack.stale(x)
    previous = sl.set_debug(True)
    try:
        with pytest.raises(ValueError, match=r"changed in place where torch does not count it \(through \.data or a "):
            pool(x)
    finally:
        sl.set_debug(previous)


# ------------------------------------------------------------------------------------------ sparse SpikeLinear
def run_sparse(sparse, x, in_features, out_features, bias=True, dtype=torch.float32, seed=0):
    """nn.Linear and SpikeLinear(sparse=...) with the same weights, forward + backward with the same grad_y."""
    torch.manual_seed(seed)
    ref, mine = pair(
        nn.Linear(in_features, out_features, bias=bias),
        SpikeLinear(in_features, out_features, bias=bias, sparse=sparse),
        dtype,
    )
    return (ref, mine, *run_both(ref, mine, x))


@pytest.mark.parametrize("sparse", [True, "auto"])
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (1, 3, 13), (4, 1, 13), (3, 2, 70), (2, 5, 3, 9)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("bias", [True, False])
def test_sparse_linear_is_the_dense_product_to_rounding(sparse, shape, bias):
    """T=1, B=1, K=1, extra dims: the output and weight gradient equal torch's to rounding and (sparse=True) their
    same-order references bit for bit; the input and bias gradients are torch's own ops (the dense G @ W, G.sum(0))."""
    from spikefuse.ops.spike_layers import reference

    x = spikes(shape, seed=sum(shape), p=0.2)
    ref, mine, a, b = run_sparse(sparse, x, shape[-1], 7, bias)
    x2, g2 = x.reshape(-1, shape[-1]), torch.randn(a[0].shape, generator=torch.Generator().manual_seed(1))
    if sparse is True:  # auto may take either path at this rate
        assert torch.equal(b[0].reshape(-1, 7), reference.linear_reference(x2, mine.weight, mine.bias))
        assert torch.equal(mine.weight.grad, reference.weight_grad_reference(g2.reshape(-1, 7), x2))
    for name, u, v in zip(("output", "grad_input", "grad_weight", "grad_bias"), a, b):
        if u is not None:
            torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-5, msg=name)


def test_sparse_linear_empty_and_all_active_rows():
    x = spikes((3, 2, 40), seed=5, p=0.1)
    x[0, 0] = 0
    x[1, 1] = 1
    x[2] = 0
    ref, mine, a, b = run_sparse(True, x, 40, 6)
    assert torch.equal(b[0][2], mine.bias.detach().expand(2, 6))
    for u, v in zip(a, b):
        torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-5)


def test_sparse_linear_gradcheck_float64():
    """gradcheck of the sparse kernels themselves (they run float64) in the weight and bias; the input stays
    binary, as the layer requires (a perturbed input is no longer spikes)."""
    from spikefuse.ops.spike_layers.autograd import _SpikeLinearFn

    x = spikes((2, 3, 11), seed=6, p=0.3, dtype=torch.float64)
    layer = SpikeLinear(11, 4, sparse=True).double()

    def f(weight, bias):
        return _SpikeLinearFn.apply(x, weight, bias, sl.bitpack.pack(x.reshape(-1, 11))[0], True, True)

    w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (w, b))


def test_sparse_auto_picks_by_the_spike_rate(monkeypatch):
    """``auto``: sparse below the crossover rates, torch's product (bit-identical to nn.Linear) above; the forward
    and the weight gradient each by its own crossover; below the crossover rows the dense path without a count."""
    from spikefuse.ops.spike_layers import cpu as sparse_cpu

    calls = []
    for name in ("linear", "weight_grad"):
        monkeypatch.setattr(
            sparse_cpu, name, lambda *a, f=getattr(sparse_cpu, name), name=name: calls.append(name) or f(*a)
        )
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_ROWS", 12)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_WORK", 0)
    x = spikes((4, 3, 50), seed=7, p=0.2)
    for forward, weight_grad, expected in (
        (0.3, 0.3, ["linear", "weight_grad"]),
        (0.1, 0.3, ["weight_grad"]),
        (0.1, 0.1, []),
    ):
        monkeypatch.setattr(sparse_cpu, "CROSSOVER_FORWARD", forward)
        monkeypatch.setattr(sparse_cpu, "CROSSOVER_WEIGHT_GRAD", weight_grad)
        calls.clear()
        ref, mine, a, b = run_sparse("auto", x, 50, 5)
        assert calls == expected
        if not expected:
            assert_identical(a, b)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_ROWS", 13)  # fewer rows: dense, the rate not counted
    monkeypatch.setattr(sparse_cpu, "spike_count", lambda *a: pytest.fail("counted the spikes"))
    calls.clear()
    assert_identical(*run_sparse("auto", x, 50, 5)[2:])
    assert calls == []


@pytest.mark.parametrize("sparse", [True, "auto"])
def test_a_sparse_layer_keeps_its_weight_and_gradient_input_major(sparse):
    """The layout the sparse products read (``W.T``) and write (``dW.T``): the gradient reaches ``weight.grad`` in it
    as the kernel wrote it, on the dense path too; the values and ``state_dict`` are ``nn.Linear``'s either way.
    Layers of fewer outputs than ``INPUT_MAJOR_MIN_OUT``, and dense ones, keep torch's layout."""
    torch.manual_seed(0)
    n = sl.INPUT_MAJOR_MIN_OUT
    dense = nn.Linear(40, n)
    layer = SpikeLinear(40, n, sparse=sparse)
    assert input_major(layer.weight) and not input_major(SpikeLinear(40, n).weight)
    assert not input_major(SpikeLinear(40, n - 1, sparse=sparse).weight)
    layer.load_state_dict(dense.state_dict())
    assert torch.equal(layer.weight, dense.weight) and input_major(layer.weight)
    for p in (0.05, 0.9):  # auto: the sparse products, then torch's
        layer.weight.grad = None
        layer(spikes((3, 4, 40), seed=3, p=p)).sum().backward()
        assert input_major(layer.weight.grad)
    plain = nn.Linear(40, n)
    plain.load_state_dict(layer.state_dict())
    assert torch.equal(plain.weight, layer.weight)


def test_sparse_reads_a_neurons_bits_without_packing(monkeypatch):
    """Spikes whose bits a neuron kernel made: the sparse products read them; the input is not packed again."""
    from spikefuse.ops import bitpack

    x = spikes((3, 4, 24), seed=8, p=0.3)
    bitpack.remember(x, bitpack.pack_torch(x), spikes=True)
    torch.manual_seed(0)
    ref, mine = pair(nn.Linear(24, 5), SpikeLinear(24, 5, sparse=True))
    ya = ref(x)
    monkeypatch.setattr(bitpack, "_pack_new", lambda *a: pytest.fail("packed the input again"))
    yb = mine(x)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(1))
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


def test_sparse_under_no_grad():
    """sparse=True packs the input itself (checking it) where no neuron made its bits; ``auto`` does not pack only
    to count, and gives torch's output there."""
    from spikefuse.ops.spike_layers import reference

    torch.manual_seed(0)
    ref, layer = pair(nn.Linear(30, 6), SpikeLinear(30, 6, sparse=True))
    x = spikes((2, 3, 30), seed=9, p=0.1)
    with torch.no_grad():
        y = layer(x)
        assert torch.equal(y.reshape(-1, 6), reference.linear_reference(x.reshape(-1, 30), layer.weight, layer.bias))
        layer.sparse = "auto"
        assert torch.equal(layer(spikes((2, 3, 30), seed=10, p=0.1)), ref(spikes((2, 3, 30), seed=10, p=0.1)))


def counts(shape, seed=0, p=0.3, dtype=torch.float32):
    """Framed events: nonzero with probability ``p``, then 1, 2 or 3 events."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < p).to(dtype) * torch.randint(1, 4, shape, generator=g).to(dtype)


@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (1, 3, 13), (4, 1, 13), (3, 2, 70), (2, 5, 3, 9)], ids=lambda s: "x".join(map(str, s))
)
def test_sparse_true_takes_counts_by_their_values(shape):
    """A non-binary input (found so by the packing's check) takes the CSR with values: the output and weight gradient
    are the same-order references' bits and torch's to rounding; the input and bias gradients torch's."""
    from spikefuse.ops.spike_layers import reference

    x = counts(shape, seed=sum(shape), p=0.4)
    x.view(-1)[0] = 2.0  # not binary, whatever the draw
    ref, mine, a, b = run_sparse(True, x, shape[-1], 7)
    x2, g2 = x.reshape(-1, shape[-1]), torch.randn(a[0].shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(b[0].reshape(-1, 7), reference.linear_reference(x2, mine.weight, mine.bias))
    assert torch.equal(mine.weight.grad, reference.weight_grad_reference(g2.reshape(-1, 7), x2))
    for name, u, v in zip(("output", "grad_input", "grad_weight", "grad_bias"), a, b):
        torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad():
        assert torch.equal(mine(x), b[0])


def test_sparse_counts_empty_and_all_active_rows_and_gradcheck_float64():
    x = counts((3, 2, 40), seed=12, p=0.2, dtype=torch.float64)
    x[0, 0] = 0
    x[1, 1] = 3
    x[2] = 0
    layer = SpikeLinear(40, 6, sparse=True).double()
    ref = nn.Linear(40, 6).double()
    ref.load_state_dict(layer.state_dict())
    y = layer(x)
    assert torch.equal(y[2], layer.bias.detach().expand(2, 6))
    torch.testing.assert_close(y, ref(x), rtol=1e-12, atol=1e-12)
    w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda w, b: torch.func.functional_call(layer, {"weight": w, "bias": b}, (x,)), (w, b)
    )


def test_sparse_auto_picks_for_counts_by_their_nonzero_share(monkeypatch):
    """``auto`` on counts: the CSR below ``CROSSOVER_VALUES``, torch's product (``nn.Linear``'s bits, the input kept
    for backward) from it on and for fewer rows than ``CROSSOVER_ROWS`` (without checking the input then, spikes or
    counts); under no_grad torch's product without a count (nothing to keep for backward)."""
    from spikefuse.ops import bitpack
    from spikefuse.ops.spike_layers import autograd as spike_autograd, cpu as sparse_cpu

    calls = []
    monkeypatch.setattr(
        spike_autograd.CSRLinearFunction,
        "apply",
        lambda *a, f=spike_autograd.CSRLinearFunction.apply: calls.append(1) or f(*a),
    )
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_ROWS", 12)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_WORK", 0)
    x = counts((4, 3, 50), seed=13, p=0.2)
    for crossover, expected in ((0.3, [1]), (0.1, [])):
        monkeypatch.setattr(sparse_cpu, "CROSSOVER_VALUES", crossover)
        calls.clear()
        ref, mine, a, b = run_sparse("auto", x, 50, 5)
        assert calls == expected
        if expected:
            for u, v in zip(a, b):
                torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-5)
        else:
            assert_identical(a, b)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_VALUES", 0.3)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_ROWS", 13)
    monkeypatch.setattr(sparse_cpu, "nonzero_counts", lambda *a: pytest.fail("counted the entries"))
    calls.clear()
    products = []  # one dense product (it once ran one, failed to pack the input and ran a second)
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: products.append(1) or linear(*a))
    pack = bitpack._pack_new
    monkeypatch.setattr(bitpack, "_pack_new", lambda *a: pytest.fail("checked a small product's input"))
    assert_identical(*run_sparse("auto", x, 50, 5)[2:])
    assert_identical(*run_sparse("auto", spikes((4, 3, 50), seed=16), 50, 5)[2:])
    assert len(products) == 4  # nn.Linear's and the layer's, for counts and spikes
    monkeypatch.setattr(bitpack, "_pack_new", pack)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_ROWS", 12)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_WORK", 0)
    with torch.no_grad():
        assert torch.equal(mine(x), ref(x))
    assert calls == []


def test_sparse_auto_checks_a_layer_fed_values_by_its_count_first(monkeypatch):
    """After a call with values, ``auto`` counts the next input and tells binary from values in that one pass instead
    of failing to pack it first; a binary input then takes the spikes' path (packed) again, the same bits either
    way."""
    from spikefuse.ops import bitpack
    from spikefuse.ops.spike_layers import cpu as sparse_cpu

    monkeypatch.setattr(sparse_cpu, "CROSSOVER_ROWS", 12)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_WORK", 0)
    x = counts((4, 3, 50), seed=14, p=0.05)
    x.view(-1)[0] = 2.0
    ref, mine, a, b = run_sparse("auto", x, 50, 5)  # the first call finds values by the failed packing
    assert mine._values_seen
    mine.zero_grad()
    pack = bitpack._pack_new
    monkeypatch.setattr(bitpack, "_pack_new", lambda *a: pytest.fail("packed an input known to hold values"))
    assert_identical(run_both(ref, mine, x)[1], b)
    monkeypatch.setattr(bitpack, "_pack_new", pack)
    s = spikes((4, 3, 50), seed=15, p=0.05)
    want = run_sparse(True, s, 50, 5)[3]
    mine.zero_grad()
    assert_identical(run_both(ref, mine, s)[1], want)
    assert not mine._values_seen


def test_sparse_auto_takes_counts_where_the_sparse_kernels_cannot_run():
    """Under autocast (the sparse kernels take float32/float64), for a frozen weight: torch's product, not a
    refusal; ``sparse=False`` still refuses counts it must keep as bits, by message."""
    layer, ref = SpikeLinear(4, 2, sparse="auto"), nn.Linear(4, 2)
    ref.load_state_dict(layer.state_dict())
    x = torch.tensor([[[0.0, 1.0, 2.0, 1.0]]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), ref(x))
    layer.weight.requires_grad_(False)
    assert torch.equal(layer(x), ref(x))
    with pytest.raises(ValueError, match=r"because it saves its input as bits for backward; got 2\.0"):
        SpikeLinear(4, 2)(x)


def test_sparse_debug_mode_lets_counts_through_on_the_cpu():
    previous = sl.set_debug(True)
    try:
        layer = SpikeLinear(4, 2, sparse=True)
        x = torch.tensor([[[0.0, 1.0, 2.0, 1.0]]])
        torch.testing.assert_close(layer(x), sl.F.linear(x, layer.weight, layer.bias))
        with pytest.raises(ValueError, match=r"expects binary spikes \(0 or 1\) as input.*got 2\.0"):
            SpikeLinear(4, 2)(x)
    finally:
        sl.set_debug(previous)


def test_sparse_true_refuses_what_the_kernels_cannot_run_by_message():
    x = spikes((2, 2, 6), seed=11, p=0.5)
    with pytest.raises(
        ValueError,
        match=r"cannot use the sparse products: the sparse CPU kernels take float32 or float64 input and weight of "
        r"one dtype, got a torch.bfloat16 input.*Use sparse='auto'",
    ):
        SpikeLinear(6, 3, sparse=True).bfloat16()(x.bfloat16())
    with (
        pytest.raises(ValueError, match=r"under autocast the product runs in torch.bfloat16"),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        SpikeLinear(6, 3, sparse=True)(x)
    auto = SpikeLinear(6, 3, sparse="auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert auto(x).dtype == torch.bfloat16  # the dense path, as autocast has it
    with pytest.raises(ValueError, match=r"sparse must be True, False or 'auto', got 'yes'"):
        SpikeLinear(6, 3, sparse="yes")


# ------------------------------------------------------------------------------------- sparse output gradients
def run_sparse_grad(sparse, sparse_grad, x, out_features, p_grad, seed=0, dtype=torch.float32):
    """nn.Linear and SpikeLinear(sparse=..., sparse_grad=...) with the same weights, forward + backward with the same
    output gradient, of which a share ``p_grad`` is nonzero (a zero row first)."""
    torch.manual_seed(seed)
    in_features = x.shape[-1]
    ref, mine = pair(
        nn.Linear(in_features, out_features),
        SpikeLinear(in_features, out_features, sparse=sparse, sparse_grad=sparse_grad),
        dtype,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (*x.shape[:-1], out_features)
    g = (torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < p_grad)).to(dtype)
    g.view(-1, out_features)[0] = 0
    out = []
    for layer in (ref, mine):
        leaf = x.clone().requires_grad_()
        layer(leaf).backward(g)
        out.append((leaf.grad, layer.weight.grad, layer.bias.grad))
    return mine, g.reshape(-1, out_features), *out


@pytest.mark.parametrize(
    "sparse, values",
    [(False, False), (True, False), (True, True), ("auto", False), ("auto", True)],  # sparse=False takes spikes only
    ids=["dense-spikes", "sparse-spikes", "sparse-counts", "auto-spikes", "auto-counts"],
)
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (1, 3, 13), (4, 1, 13), (3, 2, 70), (2, 5, 3, 9)], ids=lambda s: "x".join(map(str, s))
)
def test_sparse_grad_reads_the_nonzero_gradients(sparse, values, shape):
    """T=1, B=1, extra dims, spikes and counts, with each ``sparse``: the input gradient and (where not read from the
    input's bits) the weight gradient are the same-order references' bit for bit, every gradient torch's to
    rounding."""
    from spikefuse.ops.spike_layers import reference

    x = (counts if values else spikes)(shape, seed=sum(shape), p=0.3)
    mine, g2, ref_grads, grads = run_sparse_grad(sparse, True, x, 7, p_grad=0.2)
    x2, w = x.reshape(-1, shape[-1]), mine.weight.detach()
    assert torch.equal(grads[0].reshape(x2.shape), reference.linear_reference(g2, w.t()))
    if sparse is False:  # the weight gradient from the gradient's CSR (with sparse, from the input's own sparsity)
        assert torch.equal(grads[1], reference.weight_grad_reference(x2, g2).t())
    assert torch.equal(grads[2], g2.sum(0))
    for name, u, v in zip(("grad_input", "grad_weight", "grad_bias"), ref_grads, grads):
        torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-5, msg=name)


def test_sparse_grad_auto_counts_and_picks(monkeypatch):
    """``auto``: the gradient's CSR below ``CROSSOVER_GRAD`` nonzero, torch's products (bit-identical to nn.Linear)
    from it on; also behind ``sparse='auto'``'s torch product for dense counts."""
    from spikefuse.ops.spike_layers import cpu as sparse_cpu
    from spikefuse.ops.spike_layers import reference

    made = []
    monkeypatch.setattr(sparse_cpu, "to_csr", lambda x, c=None, f=sparse_cpu.to_csr: made.append(x.shape) or f(x, c))
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_ROWS", 12)
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_WORK", 0)
    x = spikes((4, 3, 50), seed=7, p=0.2)
    for crossover, expected in ((0.3, [(12, 6)]), (0.1, [])):
        monkeypatch.setattr(sparse_cpu, "CROSSOVER_GRAD", crossover)
        made.clear()
        _, _, ref_grads, grads = run_sparse_grad(False, "auto", x, 6, p_grad=0.2)
        assert made == expected
        if not expected:
            assert_identical((None, *ref_grads), (None, *grads))
    dense_counts = counts((4, 3, 50), seed=8, p=0.9)  # above CROSSOVER_VALUES: torch's forward, keeping the input
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_GRAD", 0.3)
    made.clear()
    mine, g2, ref_grads, grads = run_sparse_grad("auto", "auto", dense_counts, 6, p_grad=0.2)
    assert made == [(12, 6)]
    assert torch.equal(grads[1], reference.weight_grad_reference(dense_counts.reshape(12, 50), g2).t())


def test_sparse_grad_behind_a_windowed_neuron():
    """SpikeLinear(sparse_grad=True) -> LIF with a windowed surrogate -> SpikeLinear: the gradients of nn.Linear's
    network to rounding, the first layer's output gradient mostly zero."""
    from spikefuse.nn import LIF
    from spikefuse.surrogate import Windowed

    torch.manual_seed(3)
    nets = []
    for make in (nn.Linear, lambda i, o: SpikeLinear(i, o, sparse_grad=True)):
        nets.append(nn.Sequential(make(60, 40), LIF(surrogate=Windowed("sigmoid", 0.05)), make(40, 5)))
    nets[1].load_state_dict(nets[0].state_dict())
    x = spikes((6, 4, 60), seed=9, p=0.2)
    seen = []

    def keep_output_grad(module, inputs, y):
        y.register_hook(seen.append)

    nets[1][0].register_forward_hook(keep_output_grad)
    for net in nets:
        net(x).square().sum().backward()
    assert float((seen[0] != 0).double().mean()) < 0.5
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)


def test_sparse_grad_refuses_what_the_kernels_cannot_run_by_message():
    x = spikes((2, 2, 6), seed=11, p=0.5)
    with pytest.raises(
        ValueError,
        match=r"cannot read its output gradient sparsely: the sparse CPU kernels take float32 or float64 input and "
        r"weight of one dtype.*Use sparse_grad='auto'",
    ):
        SpikeLinear(6, 3, sparse_grad=True).bfloat16()(x.bfloat16())
    with (
        pytest.raises(ValueError, match=r"cannot read its output gradient sparsely: under autocast"),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        SpikeLinear(6, 3, sparse_grad=True)(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert SpikeLinear(6, 3, sparse_grad="auto")(x).dtype == torch.bfloat16  # the dense products
    with torch.no_grad():  # no backward: nothing to refuse
        SpikeLinear(6, 3, sparse_grad=True).bfloat16()(x.bfloat16())
    with pytest.raises(ValueError, match=r"sparse_grad must be True, False or 'auto', got 'yes'"):
        SpikeLinear(6, 3, sparse_grad="yes")
    assert "sparse_grad='auto'" in repr(SpikeLinear(6, 3, sparse_grad="auto"))
