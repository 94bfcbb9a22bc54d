"""spikefuse.ops.spike_layers.cpu: the spike-sparse products bit for bit against their same-order references, to
rounding against torch's dense products; odd shapes, empty and all-active rows, the bits' layouts, errors by message."""

import pytest
import torch
import torch.nn.functional as F

from spikefuse.ops.spike_layers import cpu as sparse_cpu
from spikefuse.ops.spike_layers import reference
from spikefuse.ops.spike_layers import autograd as spike_autograd
from spikefuse.ops.bitpack import pack


def spikes(shape, seed, p, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < p).to(dtype)


def randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def case_seed(shape, p) -> int:
    """Other random inputs for every case."""
    m, k, n = shape
    return m * 1_000_003 + k * 1009 + n * 17 + int(p * 100)


def assert_rounding_close(actual, dense):
    """Equal to the dense product up to the rounding of its other summation order."""
    scale = float(dense.abs().max()) if dense.numel() else 1.0
    torch.testing.assert_close(actual, dense, rtol=1e-6, atol=1e-5 * max(scale, 1.0))


# (M, K, N): one of each, rows shorter and longer than a 64-bit word, rows crossing word boundaries, a bit string
# that does not end on a word
SHAPES = [(1, 1, 1), (1, 700, 3), (5, 1, 4), (37, 13, 5), (9, 64, 17), (10, 65, 8), (3, 130, 33), (70, 9, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("p", [0.0, 0.05, 0.4, 1.0])
def test_linear_equals_its_reference_bit_for_bit(shape, p):
    m, k, n = shape
    seed = case_seed(shape, p)
    s, w, b = spikes((m, k), seed, p), randn((n, k), seed + 1), randn((n,), seed + 2)
    bits, _ = pack(s)
    for bias in (b, None):
        y = sparse_cpu.linear(bits, m, w.t().contiguous(), bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert torch.equal(y, reference.linear_reference(s, w, bias))
        assert_rounding_close(y, F.linear(s, w, bias))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("p", [0.0, 0.05, 0.4, 1.0])
def test_weight_grad_equals_its_reference_bit_for_bit(shape, p):
    m, k, n = shape
    seed = case_seed(shape, p) + 7
    s, g = spikes((m, k), seed, p), randn((m, n), seed + 1)
    bits, _ = pack(s)
    dw = sparse_cpu.weight_grad(g, bits, k)
    assert dw.shape == (n, k) and dw.t().is_contiguous()  # input-major, as a sparse SpikeLinear keeps its weight
    assert torch.equal(dw, reference.weight_grad_reference(g, s))
    assert_rounding_close(dw, g.t().mm(s))


def test_empty_and_all_active_rows_float64():
    """Rows without a spike give the bias (and no weight gradient), rows of all ones the sum of every weight; in
    float64 as in float32."""
    s = spikes((6, 77), 3, 0.2, torch.float64)
    s[0] = 0
    s[3] = 1
    s[5] = 0
    w, b, g = randn((11, 77), 4, torch.float64), randn((11,), 5, torch.float64), randn((6, 11), 6, torch.float64)
    bits, _ = pack(s)
    y = sparse_cpu.linear(bits, 6, w.t().contiguous(), b)
    assert y.dtype == torch.float64
    assert torch.equal(y, reference.linear_reference(s, w, b))
    assert torch.equal(y[0], b) and torch.equal(y[5], b)
    assert_rounding_close(y[3], w.sum(1) + b)
    dw = sparse_cpu.weight_grad(g, bits, 77)
    assert torch.equal(dw, reference.weight_grad_reference(g, s))
    assert_rounding_close(dw, g.t().mm(s))
    silent = s.sum(0) == 0
    assert torch.equal(dw[:, silent], torch.zeros_like(dw[:, silent]))


def test_the_same_bits_on_one_thread_and_two():
    """Each element sums in one order whatever the threads: rows split between tasks (forward), inputs split
    between threads (weight gradient)."""
    s, w, g = spikes((300, 150), 7, 0.1), randn((100, 150), 8), randn((300, 100), 9)
    bits, _ = pack(s)
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(
                (sparse_cpu.linear(bits, 300, w.t().contiguous()).clone(), sparse_cpu.weight_grad(g, bits, 150))
            )
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_bits_of_any_alignment_and_a_neurons_layout():
    """Bits at an odd address (a view into a larger buffer) or of a length not a whole number of words are read
    through a padded copy, with the same result."""
    s, w = spikes((7, 19), 10, 0.3), randn((5, 19), 11)
    bits, _ = pack(s)
    buffer = torch.zeros(bits.numel() + 1, dtype=torch.uint8)
    buffer[1:] = bits
    expected = reference.linear_reference(s, w)
    assert torch.equal(sparse_cpu.linear(buffer[1:], 7, w.t().contiguous()), expected)
    assert torch.equal(sparse_cpu.linear(bits, 7, w.t().contiguous()), expected)


@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 1000])
def test_spike_count(numel):
    s = spikes((numel,), numel, 0.3)
    bits, _ = pack(s)
    assert sparse_cpu.spike_count(bits, numel) == int(s.sum())


def test_no_rows_or_no_outputs():
    w = randn((4, 10), 12)
    assert sparse_cpu.linear(pack(torch.zeros(0, 10))[0], 0, w.t().contiguous()).shape == (0, 4)
    s = spikes((3, 10), 13, 0.5)
    assert sparse_cpu.linear(pack(s)[0], 3, torch.zeros(10, 0)).shape == (3, 0)
    assert torch.equal(sparse_cpu.weight_grad(torch.zeros(0, 4), pack(torch.zeros(0, 10))[0], 10), torch.zeros(4, 10))


def test_references_are_differentiable_and_gradcheck_in_float64():
    s = spikes((5, 9), 14, 0.4, torch.float64)
    w = randn((3, 9), 15, torch.float64).requires_grad_()
    b = randn((3,), 16, torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda w, b: reference.linear_reference(s, w, b), (w, b))
    g = randn((5, 3), 17, torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda g: reference.weight_grad_reference(g, s), (g,))


def test_errors_say_what_is_wrong():
    s, w = spikes((4, 10), 18, 0.5), randn((3, 10), 19)
    bits, _ = pack(s)
    with pytest.raises(ValueError, match=r"bits has 5 bytes, but 50 elements take 7"):
        sparse_cpu.linear(bits, 5, w.t().contiguous())
    with pytest.raises(ValueError, match=r"bits must be a 1-D uint8 CPU tensor, got torch.int64"):
        sparse_cpu.linear(bits.long(), 4, w.t().contiguous())
    with pytest.raises(ValueError, match=r"take float32 or float64 CPU tensors; the weight is torch.bfloat16"):
        sparse_cpu.linear(bits, 4, w.t().contiguous().bfloat16())
    with pytest.raises(ValueError, match=r"the bias is torch.float64, the weight torch.float32: give both one dtype"):
        sparse_cpu.linear(bits, 4, w.t().contiguous(), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\), got \(4,\)"):
        sparse_cpu.linear(bits, 4, w.t().contiguous(), torch.zeros(4))
    with pytest.raises(ValueError, match=r"the gradient is torch.float16"):
        sparse_cpu.weight_grad(torch.zeros(4, 3, dtype=torch.float16), bits, 10)


# ----------------------------------------------------------------------------------------------- inputs with values
def counts(shape, seed, p, dtype=torch.float32):
    """Framed events: nonzero with probability ``p``, then 1, 2 or 3 events; negative and fractional values too
    (the CSR takes any value)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(1, 4, shape, generator=g).to(dtype)
    values[torch.rand(shape, generator=g) < 0.1] = -0.75
    return (torch.rand(shape, generator=g) < p).to(dtype) * values


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("p", [0.0, 0.05, 0.4, 1.0])
def test_csr_products_equal_their_references_bit_for_bit(shape, p):
    m, k, n = shape
    seed = case_seed(shape, p) + 11
    x, w, b, g = counts((m, k), seed, p), randn((n, k), seed + 1), randn((n,), seed + 2), randn((m, n), seed + 3)
    csr = sparse_cpu.to_csr(x)
    assert int(csr.indptr[-1]) == int((x != 0).sum()) and csr.cols == k
    for bias in (b, None):
        y = sparse_cpu.csr_linear(csr, w.t().contiguous(), bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert torch.equal(y, reference.linear_reference(x, w, bias))
        assert_rounding_close(y, F.linear(x, w, bias))
    dw = sparse_cpu.csr_weight_grad(g, csr)
    assert dw.shape == (n, k) and dw.t().is_contiguous()  # input-major, as a sparse SpikeLinear keeps its weight
    assert torch.equal(dw, reference.weight_grad_reference(g, x))
    assert_rounding_close(dw, g.t().mm(x))


def test_csr_of_spikes_gives_the_binary_kernels_bits():
    """Values 1: ``1 * w`` is ``w``, so the CSR products of spikes are the bits' products, bit for bit."""
    s, w, g = spikes((40, 70), 20, 0.2), randn((9, 70), 21), randn((40, 9), 22)
    bits, _ = pack(s)
    csr = sparse_cpu.to_csr(s)
    assert torch.equal(sparse_cpu.csr_linear(csr, w.t().contiguous()), sparse_cpu.linear(bits, 40, w.t().contiguous()))
    assert torch.equal(sparse_cpu.csr_weight_grad(g, csr), sparse_cpu.weight_grad(g, bits, 70))


def test_csr_empty_and_all_active_rows_float64_and_threads():
    x = counts((6, 77), 23, 0.2, torch.float64)
    x[0] = 0
    x[3] = torch.arange(1, 78, dtype=torch.float64)
    x[5] = 0
    w, b, g = randn((11, 77), 24, torch.float64), randn((11,), 25, torch.float64), randn((6, 11), 26, torch.float64)
    csr = sparse_cpu.to_csr(x)
    assert csr.values.dtype == torch.float64 and torch.equal(
        csr.indices[csr.indptr[3] : csr.indptr[4]], torch.arange(77)
    )
    y = sparse_cpu.csr_linear(csr, w.t().contiguous(), b)
    assert torch.equal(y, reference.linear_reference(x, w, b))
    assert torch.equal(y[0], b) and torch.equal(y[5], b)
    assert_rounding_close(y, F.linear(x, w, b))
    previous = torch.get_num_threads()
    try:
        grads = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            grads.append(sparse_cpu.csr_weight_grad(g, csr))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], reference.weight_grad_reference(g, x))
    assert_rounding_close(grads[0], g.t().mm(x))


def test_csr_counts_nan_as_a_value_and_negative_zero_as_zero():
    x = torch.tensor([[0.0, -0.0, float("nan"), 2.0]])
    assert sparse_cpu.nonzero_counts(x).tolist() == [2]
    assert sparse_cpu.nonzero_counts_binary(x)[0].tolist() == [2]
    csr = sparse_cpu.to_csr(x)
    assert csr.indices.tolist() == [2, 3] and csr.values[1] == 2.0 and csr.values[0].isnan()


@pytest.mark.parametrize("shape", [(1, 1, 5), (1, 4, 5), (3, 1, 5), (2, 3, 4, 5)], ids=lambda s: "x".join(map(str, s)))
def test_csr_linear_function_forward_and_backward(shape):
    """T=1, B=1, extra dims: the output and weight gradient are the references' bits; the input and bias gradients
    torch's (``G @ W``, ``G.sum(0)``)."""
    x = counts(shape, sum(shape), 0.4).requires_grad_()
    w, b = randn((3, shape[-1]), 27).requires_grad_(), randn((3,), 28).requires_grad_()
    x2 = x.detach().reshape(-1, shape[-1])
    y = spike_autograd.CSRLinearFunction.apply(x, w, b, sparse_cpu.to_csr(x2))
    assert y.shape == (*shape[:-1], 3)
    assert torch.equal(y.reshape(-1, 3), reference.linear_reference(x2, w, b))
    g = randn(y.shape, 29)
    y.backward(g)
    g2 = g.reshape(-1, 3)
    assert torch.equal(w.grad, reference.weight_grad_reference(g2, x2))
    assert torch.equal(x.grad, g2.mm(w).view(shape)) and torch.equal(b.grad, g2.sum(0))


def test_csr_linear_function_gradcheck_float64():
    """gradcheck in the weight and bias (the input is data, given as its CSR; its gradient is torch's G @ W)."""
    x = counts((2, 3, 11), 30, 0.4, torch.float64)
    csr = sparse_cpu.to_csr(x.reshape(-1, 11))
    w, b = randn((4, 11), 31, torch.float64).requires_grad_(), randn((4,), 32, torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda w, b: spike_autograd.CSRLinearFunction.apply(x, w, b, csr), (w, b))
    y = spike_autograd.CSRLinearFunction.apply(x, w, b, csr)
    with pytest.raises(RuntimeError, match=r"double backward .* through a sparse linear product"):
        torch.autograd.grad(y.sum(), w, create_graph=True)


def test_csr_errors_say_what_is_wrong():
    x, w = counts((4, 10), 33, 0.5), randn((3, 10), 34)
    csr = sparse_cpu.to_csr(x)
    with pytest.raises(ValueError, match=r"the input must be a matrix \[rows, cols\], got shape \(40,\)"):
        sparse_cpu.to_csr(x.reshape(-1))
    with pytest.raises(ValueError, match=r"take float32 or float64 CPU tensors; the input is torch.int64"):
        sparse_cpu.nonzero_counts(x.long())
    with pytest.raises(ValueError, match=r"counts must be int64 of shape \(4,\), got torch.int64 \(3,\)"):
        sparse_cpu.to_csr(x, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"weight_t must be \[10, N\] for a CSR of 10 columns, got \(3, 10\)"):
        sparse_cpu.csr_linear(csr, w)
    with pytest.raises(ValueError, match=r"the CSR is torch.float32, the weight torch.float64: give both one dtype"):
        sparse_cpu.csr_linear(csr, w.t().contiguous().double())
    with pytest.raises(ValueError, match=r"the gradient has 5 rows, the CSR 4"):
        sparse_cpu.csr_weight_grad(torch.zeros(5, 3), csr)
    with pytest.raises(ValueError, match=r"the CSR is of a \[4, 10\] matrix, the input has 2 rows of 10"):
        spike_autograd.CSRLinearFunction.apply(x[:2], w, None, csr)


# ---------------------------------------------------------------------------------------- sparse output gradients
def sparse_grad(shape, seed, p, dtype=torch.float32):
    """An output gradient of which a share ``p`` is nonzero, with a row of zeros and a row of nonzeros."""
    g = randn(shape, seed, dtype) * spikes(shape, seed + 1, p, dtype)
    if shape[0] > 2:
        g[0], g[-1] = 0, randn(shape[1:], seed + 2, dtype)
    return g


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("p", [0.0, 0.05, 0.4, 1.0])
def test_products_of_a_sparse_gradient_equal_their_references_bit_for_bit(shape, p):
    """``G @ W`` and ``G.T @ X`` from the CSR of ``G [M, N]``: the references' order bit for bit, torch's dense
    products to rounding."""
    m, k, n = shape
    seed = case_seed(shape, p)
    g, w, x = sparse_grad((m, n), seed, p), randn((n, k), seed + 3), spikes((m, k), seed + 4, 0.3)
    csr = sparse_cpu.output_grad_csr(g, True)
    grad_x, grad_w = sparse_cpu.input_grad(g, w, csr), sparse_cpu.csr_t_matmul(csr, x)
    assert torch.equal(grad_x, reference.linear_reference(g, w.t()))
    assert torch.equal(grad_w, reference.weight_grad_reference(x, g).t())
    assert_rounding_close(grad_x, g.mm(w))
    assert_rounding_close(grad_w, g.t().mm(x))


def test_output_grad_csr_decides_by_its_setting_and_the_crossover(monkeypatch):
    g = sparse_grad((300, 20), 40, 0.05)
    assert sparse_cpu.output_grad_csr(g, False) is None
    assert sparse_cpu.output_grad_csr(g, True).indptr[-1] == int((g != 0).sum())
    assert sparse_cpu.output_grad_csr(g, "auto") is not None  # 300 rows, under 10% nonzero
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_GRAD", float((g != 0).double().mean()))
    assert sparse_cpu.output_grad_csr(g, "auto") is None  # at the crossover: dense
    monkeypatch.setattr(sparse_cpu, "CROSSOVER_GRAD", 1.0)
    monkeypatch.setattr(sparse_cpu, "nonzero_counts", lambda *a: pytest.fail("counted"))
    assert sparse_cpu.output_grad_csr(g[: sparse_cpu.CROSSOVER_ROWS - 1], "auto") is None  # too few rows: no count


@pytest.mark.parametrize("shape", [(1, 1, 5, 1), (1, 4, 9, 3), (3, 1, 70, 2), (2, 3, 2, 13, 6)], ids=str)
def test_sparse_grad_linear_function(shape):
    """Forward torch's product; backward from the gradient's CSR: the references bit for bit, T=1, B=1, a zero
    gradient row."""
    *lead, k, n = shape
    x = counts((*lead, k), 41, 0.3).requires_grad_()
    w, b = randn((n, k), 42).requires_grad_(), randn((n,), 43).requires_grad_()
    y = spike_autograd.SparseGradLinearFunction.apply(x, w, b, True)
    assert torch.equal(y, F.linear(x, w, b))
    g = sparse_grad(y.reshape(-1, n).shape, 44, 0.2).view(y.shape)
    y.backward(g)
    g2, x2 = g.reshape(-1, n), x.detach().reshape(-1, k)
    assert torch.equal(x.grad, reference.linear_reference(g2, w.detach().t()).view(x.shape))
    assert torch.equal(w.grad, reference.weight_grad_reference(x2, g2).t())
    assert torch.equal(b.grad, g2.sum(0))


def test_sparse_grad_linear_function_gradcheck_float64():
    """gradcheck in the input, weight and bias, the gradient made sparse by a windowed surrogate's own derivative
    (its definition, zero where ``|u| > width``) as a neuron's backward would."""
    from spikefuse.surrogate import Windowed

    x = counts((2, 3, 11), 45, 0.4, torch.float64).requires_grad_()
    w, b = randn((4, 11), 46, torch.float64).requires_grad_(), randn((4,), 47, torch.float64).requires_grad_()
    window = Windowed("sigmoid", 0.3).derivative(randn((2, 3, 4), 48, torch.float64))
    assert 0 < int((window == 0).sum()) < window.numel()

    def f(x, w, b):
        return spike_autograd.SparseGradLinearFunction.apply(x, w, b, True) * window

    assert torch.autograd.gradcheck(f, (x, w, b))
    with pytest.raises(RuntimeError, match=r"double backward .* through a sparse linear product"):
        torch.autograd.grad(f(x, w, b).sum(), w, create_graph=True)


def test_csr_t_matmul_errors_say_what_is_wrong():
    csr = sparse_cpu.to_csr(counts((4, 10), 49, 0.5))
    with pytest.raises(ValueError, match=r"the dense operand has 5 rows, the CSR 4"):
        sparse_cpu.csr_t_matmul(csr, torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"the dense operand must be a matrix \[rows, cols\], got shape \(4,\)"):
        sparse_cpu.csr_t_matmul(csr, torch.zeros(4))
    with pytest.raises(ValueError, match=r"the CSR is torch.float32, the weight torch.float64: give both one dtype"):
        sparse_cpu.csr_t_matmul(csr, torch.zeros(4, 3, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_nonzero_counts_binary_tells_spikes_from_values(dtype):
    """The counts of :func:`nonzero_counts` and whether every entry is 0 or 1, in one pass: -0 is 0, NaN and any other
    value is not binary; an empty matrix is binary."""
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(37, 71, generator=g) < 0.2).to(dtype)
    counts, binary = sparse_cpu.nonzero_counts_binary(x)
    assert binary and torch.equal(counts, sparse_cpu.nonzero_counts(x))
    x[5, 3] = -0.0
    assert sparse_cpu.nonzero_counts_binary(x)[1]
    for value in (2.0, -1.0, 0.5, float("nan"), float("inf")):
        y = x.clone()
        y[36, 70] = value
        counts, binary = sparse_cpu.nonzero_counts_binary(y)
        assert not binary and torch.equal(counts, sparse_cpu.nonzero_counts(y))
    counts, binary = sparse_cpu.nonzero_counts_binary(torch.zeros(0, 4, dtype=dtype))
    assert binary and counts.shape == (0,) and counts.dtype == torch.int64
