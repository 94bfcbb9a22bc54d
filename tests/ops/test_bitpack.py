"""spikefuse.ops.bitpack: pack/unpack round trips (CPU numba path and the plain-torch path), layout, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spikefuse.ops import bitpack
from spikefuse.ops.bitpack import pack, pack_torch, packed_numel, remember, unpack, unpack_torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

shapes = st.lists(st.integers(0, 13), min_size=0, max_size=4).map(tuple)


def spikes(shape, dtype, seed, p=0.4):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < p).to(dtype)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), p=st.sampled_from([0.0, 0.3, 1.0]))
def test_round_trip(shape, dtype, seed, p):
    x = spikes(shape, dtype, seed, p)
    packed, s = pack(x)
    assert s == x.shape
    assert packed.dtype == torch.uint8 and packed.dim() == 1 and packed.numel() == packed_numel(x.numel())
    y = unpack(packed, s, dtype)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert torch.equal(y, x)
    # the plain-torch path (used for CUDA tensors) makes the same bytes and reads them back the same
    assert torch.equal(pack_torch(x), packed)
    assert torch.equal(unpack_torch(packed, s, dtype), x)


# whole 64-bit words and not
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 129, 1000, 70001])
def test_sizes_not_multiple_of_8_and_bit_order(n):
    x = spikes((n,), torch.float32, n)
    packed, _ = pack(x)
    assert packed.numel() == (n + 7) // 8
    # element 8*j + k is bit k of byte j; padding bits are 0
    bits = torch.zeros(packed.numel() * 8)
    bits[:n] = x
    expected = (bits.view(-1, 8) * (2 ** torch.arange(8))).sum(1).to(torch.uint8)
    assert torch.equal(packed, expected)
    assert torch.equal(unpack(packed, (n,), torch.float32), x)


def test_one_element_and_empty():
    for v in (0.0, 1.0):
        x = torch.tensor([v])
        packed, s = pack(x)
        assert packed.tolist() == [int(v)]
        assert torch.equal(unpack(packed, s, torch.float32), x)
    x = torch.ones(())
    assert torch.equal(unpack(*pack(x), torch.float32), x)
    x = torch.empty(0, 5)
    packed, s = pack(x)
    assert packed.numel() == 0 and unpack(packed, s, torch.float16).shape == (0, 5)


def test_non_contiguous_input_packs_in_logical_order():
    x = spikes((6, 10), torch.float32, 1).t()
    assert not x.is_contiguous()
    assert torch.equal(unpack(*pack(x), torch.float32), x)


def test_negative_zero_is_zero_and_other_dtypes():
    x = torch.tensor([-0.0, 1.0, 0.0, 1.0, -0.0])
    assert torch.equal(unpack(*pack(x), torch.float32), torch.tensor([0.0, 1, 0, 1, 0]))
    b = torch.tensor([True, False, True] * 5)
    assert torch.equal(unpack(*pack(b), torch.bool), b)
    i = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1], dtype=torch.int64)
    assert torch.equal(unpack(*pack(i), torch.int64), i)
    # unpacking to another dtype than packed
    assert torch.equal(unpack(*pack(b), torch.float64), b.double())


def test_bad_arguments():
    packed, s = pack(torch.ones(10))
    with pytest.raises(ValueError, match="needs 2"):
        unpack(packed[:1], s, torch.float32)
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack(packed.float(), s, torch.float32)
    with pytest.raises(TypeError, match="does not support dtype"):
        pack(torch.ones(3, dtype=torch.complex64))


# The Triton kernels that pack and unpack CUDA tensors, under Triton's interpreter on CPU tensors (on the GPU with
# SPIKEFUSE_TEST_TRITON=cuda).
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 8 * 1024 + 3, 70001])
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool, torch.int32, torch.uint8])
def test_triton_kernels_make_the_cpu_bytes(n, dtype):
    bitpack_triton = pytest.importorskip("spikefuse.ops.bitpack_triton", reason="needs triton")
    x = spikes((n,), dtype, n + 11)
    packed = bitpack_triton.pack(x)
    want, _ = pack(x)
    assert packed.dtype == torch.uint8 and torch.equal(packed, want)
    y = bitpack_triton.unpack(want, x.shape, dtype)
    assert y.dtype == dtype and y.is_contiguous() and torch.equal(y, x)


def test_triton_kernels_nonzero_is_one_and_minus_zero_is_zero():
    bitpack_triton = pytest.importorskip("spikefuse.ops.bitpack_triton", reason="needs triton")
    x = torch.tensor([0.0, -0.0, 1.0, 2.5, -3.0, float("nan"), float("inf"), 0.0, 1e-45, 0.0])
    assert torch.equal(bitpack_triton.pack(x), pack(x)[0])
    assert pack(x)[0].tolist() == [0b01111100, 0b00000001]
    y = bitpack_triton.unpack(bitpack_triton.pack(x), (2, 5), torch.float32)
    assert torch.equal(y, (x != 0).float().view(2, 5)) and not torch.signbit(y).any()


def test_triton_kernels_refuse_unsupported_dtypes():
    bitpack_triton = pytest.importorskip("spikefuse.ops.bitpack_triton", reason="needs triton")
    with pytest.raises(TypeError, match="bitpack does not support dtype torch.complex64"):
        bitpack_triton.pack(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="bitpack does not support dtype torch.complex64"):
        bitpack_triton.unpack(torch.zeros(1, dtype=torch.uint8), (3,), torch.complex64)


def test_packing_again_reuses_the_bits_until_the_tensor_changes(monkeypatch):
    """A tensor packed once (or a contiguous view of all of it: a residual block's input, packed by its convolution
    and its residual add) is not packed again; a change in place, a part of it or ``reuse=False`` packs anew."""
    made = []
    pack_cpu = bitpack._pack_cpu
    monkeypatch.setattr(bitpack, "_pack_cpu", lambda x: made.append(x.shape) or pack_cpu(x))
    x = spikes((4, 3, 16), torch.float32, 0)
    first, _ = pack(x)
    assert pack(x)[0] is first and pack(x.flatten(0, 1))[0] is first and pack(x.view(2, 2, 48))[0] is first
    assert len(made) == 1
    again, _ = pack(x, reuse=False)
    assert again is not first and torch.equal(again, first) and len(made) == 2
    part, _ = pack(x[1:])  # a part: its own bits
    assert torch.equal(part, pack_torch(x[1:])) and len(made) == 3
    swapped, _ = pack(x.transpose(1, 2))  # another order: its own bits
    assert torch.equal(swapped, pack_torch(x.transpose(1, 2))) and len(made) == 4
    x[0, 0, 0] = 1 - x[0, 0, 0]  # in place: the version counter moves on
    changed, _ = pack(x.flatten(0, 1))
    assert changed is not first and torch.equal(changed, pack_torch(x)) and len(made) == 5
    changed.zero_()  # the bits changed in place: not handed out again
    assert torch.equal(pack(x)[0], pack_torch(x)) and len(made) == 6


def test_remembered_bits_are_what_pack_returns(monkeypatch):
    """``remember`` hands bits made elsewhere (a neuron kernel's) to the next ``pack`` of the tensor, of the whole
    tensor only; under inference mode nothing is remembered (no version counter to tell a change)."""
    monkeypatch.setattr(bitpack, "_pack_cpu", lambda x: pytest.fail("packed again"))
    x = spikes((3, 40), torch.float32, 1)
    bits = pack_torch(x)
    remember(x, bits)
    assert pack(x.view(3, 5, 8))[0] is bits
    monkeypatch.undo()
    y = spikes((3, 40), torch.float32, 2)
    remember(y[1:], pack_torch(y[1:]))  # a part of y: not y's bits, not remembered
    assert torch.equal(pack(y)[0], pack_torch(y))
    with torch.inference_mode():
        z = spikes((2, 16), torch.float32, 3)
        first, _ = pack(z)
        assert pack(z)[0] is not first and torch.equal(pack(z)[0], first)


def test_spike_bits_only_of_tensors_known_to_be_spikes():
    """``spike_bits`` hands out bits only where they are all of the tensor: a neuron kernel's (``remember(...,
    spikes=True)``) or the CPU packer's of a tensor it read as binary; not of a tensor holding other values (its
    bits are remembered all the same); an in-place change forgets them."""
    counts = spikes((4, 24), torch.float32, 4) * 2
    pack(counts)
    assert bitpack.spike_bits(counts) is None and bitpack._remembered(counts) is not None
    x = spikes((4, 24), torch.float32, 5)
    assert bitpack.spike_bits(x) is None
    made, _ = pack(x)
    assert bitpack.spike_bits(x) is made
    bits = pack_torch(x)
    remember(x, bits, spikes=True)
    assert bitpack.spike_bits(x) is bits and bitpack.spike_bits(x.view(2, 2, 24)) is bits
    assert pack(x)[0] is bits
    x.mul_(1.0)
    assert bitpack.spike_bits(x) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8])
@pytest.mark.parametrize("n", [1, 63, 64, 200, 4096 + 5])
def test_pack_binary_refuses_other_values_on_the_cpu(dtype, n):
    """``pack(binary=True)``: the CPU kernel tells, as it packs, whether every element was 0 or 1 (-0.0 counts as 0):
    one other value anywhere, in a whole 64-element word or in the tail, raises; bits remembered for such a tensor
    by a plain ``pack`` are not handed out to a ``binary`` one."""
    g = torch.Generator().manual_seed(n)
    x = (torch.rand(n, generator=g) < 0.3).to(dtype)
    if dtype.is_floating_point:
        x[torch.rand(n, generator=g) < 0.1] = -0.0
    assert torch.equal(pack(x, reuse=False, binary=True)[0], pack_torch(x))
    for at in {0, n // 2, n - 1}:
        bad = x.clone()
        bad[at] = 2
        with pytest.raises(bitpack.NotBinaryError, match="values other than 0 and 1"):
            pack(bad, binary=True)
        assert torch.equal(pack(bad)[0], pack_torch(bad))  # a plain pack keeps x != 0 of any tensor
        with pytest.raises(bitpack.NotBinaryError):
            pack(bad, binary=True)
    if dtype.is_floating_point:
        for value in (float("nan"), 0.5, -1.0):
            bad = x.clone()
            bad[n - 1] = value
            with pytest.raises(bitpack.NotBinaryError):
                pack(bad, reuse=False, binary=True)


def test_pack_custom_ops_pass_opcheck_and_compile_in_a_spike_layer():
    """Under torch.compile packing and unpacking are custom ops (dynamo traced into numba and failed on its uint64
    view): opcheck of both, and a compiled SpikeLinear with no graph break and the eager gradients."""
    from spikefuse.nn import SpikeLinear

    x = spikes((5, 3, 13), torch.float32, 6)
    torch.library.opcheck(bitpack.pack_op, (x, True))
    torch.library.opcheck(bitpack.unpack_op, (pack_torch(x), list(x.shape), torch.float64))
    torch.manual_seed(0)
    eager, traced = SpikeLinear(13, 4), SpikeLinear(13, 4)
    traced.load_state_dict(eager.state_dict())
    assert torch._dynamo.explain(traced)(x).graph_break_count == 0
    compiled = torch.compile(traced, fullgraph=True, backend="aot_eager")
    eager(x).square().sum().backward()
    compiled(x).square().sum().backward()
    assert torch.equal(traced.weight.grad, eager.weight.grad) and torch.equal(traced.bias.grad, eager.bias.grad)
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        compiled(x * 2)
