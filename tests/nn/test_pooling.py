"""spikefuse.nn.MaxPool2d against torch.nn.MaxPool2d: output, indices and gradients bit for bit, on ties, NaN and
signed zeros, and torch's layer where the kernel does not apply."""

import pytest
import torch
import torch.nn.functional as F

from spikefuse.nn import MaxPool2d
from spikefuse.ops.maxpool import cpu as maxpool_cpu


def _inputs():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(4, 3, 9, 7, generator=g)
    yield torch.randint(0, 3, (2, 5, 16, 16), generator=g).float()  # ties everywhere
    x = torch.randn(2, 2, 8, 8, generator=g)
    x[0, 0, :3, :3] = float("nan")
    x[0, 0, 1, 1] = 1.0
    x[0, 1] = 0.0
    x[0, 1, ::2, 1::3] = -0.0  # equal to 0.0: the first of them is the maximum, sign and all
    x[1, 0] = -float("inf")
    yield x


@pytest.mark.parametrize("args", [(3, 2, 1), (2, 2, 0), (3, 1, 1), ((3, 2), (2, 1), (1, 0), (2, 1))])
def test_outputs_indices_and_gradients_are_torchs(args):
    ours, theirs = MaxPool2d(*args), torch.nn.MaxPool2d(*args)
    for x in _inputs():
        xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yo, yt = ours(xo), theirs(xt)
        assert torch.equal(yo.view(torch.int32), yt.view(torch.int32))  # NaN and -0.0 too
        grad = torch.randn(yt.shape, generator=torch.Generator().manual_seed(1))
        yo.backward(grad)
        yt.backward(grad)
        assert torch.equal(xo.grad, xt.grad)
        kernel, stride, padding, dilation = (tuple(v) if isinstance(v, tuple) else (v, v) for v in (*args, 1)[:4])
        _, indices = maxpool_cpu.forward_with_indices(x, yt.shape, kernel, stride, padding, dilation)
        assert torch.equal(indices.long(), F.max_pool2d(x, *args, return_indices=True)[1])


def test_keeps_only_int32_indices_for_backward():
    saved = []
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        MaxPool2d(3, 2, 1)(x)
    assert [t.dtype for t in saved] == [torch.int32]


@pytest.mark.parametrize(
    "pool, x",
    [
        (MaxPool2d(3, 2, 1), torch.randn(2, 3, 8, 8, dtype=torch.float64)),
        (MaxPool2d(3, 2, 1), torch.randn(2, 3, 8, 8).transpose(2, 3)),
        (MaxPool2d(3, 2, 1, ceil_mode=True), torch.randn(2, 3, 8, 8)),
        (MaxPool2d(3, 2, 1), torch.randn(3, 8, 8)),
    ],
)
def test_other_inputs_run_torchs_layer(pool, x):
    x = x.requires_grad_()
    y = pool(x)
    assert y.grad_fn.name().startswith("MaxPool2DWithIndicesBackward")
    assert torch.equal(y, F.max_pool2d(x, 3, 2, 1, ceil_mode=pool.ceil_mode))


def test_arguments_torch_refuses_are_refused():
    with pytest.raises(RuntimeError):
        MaxPool2d(3, 2, 2)(torch.randn(1, 1, 8, 8))
    with pytest.raises(RuntimeError):
        MaxPool2d(5, 1, 0)(torch.randn(1, 1, 3, 3))


def test_compiles_without_a_graph_break_to_torchs_values():
    pool = MaxPool2d(3, stride=2, padding=1)
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    assert torch._dynamo.explain(pool)(x).graph_break_count == 0
    compiled = torch.compile(pool, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert torch.equal(out, F.max_pool2d(x, 3, stride=2, padding=1))
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(grad, torch.autograd.grad(F.max_pool2d(x, 3, stride=2, padding=1).sum(), x)[0])
