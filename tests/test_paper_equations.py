"""Our reference against a hand transcription of the temporal-fusion paper's Eq. (1)-(3).

The transcription works on plain Python floats, one neuron at a time, so it shares no code with the library.
Eq. (3) as printed omits the ``V_rest * delta`` term of d v[t+1] / d v[t]; with V_rest = 0 it is exact, with
V_rest != 0 the printed form is wrong (so is the paper's CUDA backward) and the corrected form is what autograd
gives. Both facts are checked.
"""

import math

import pytest
import torch

import spikefuse


def sigmoid_grad(u, alpha=4.0):
    s = 1.0 / (1.0 + math.exp(-alpha * u))
    return alpha * s * (1.0 - s)


def paper_forward(xs, k, v_rest, th):
    """Eq. (1)-(2) with v(0) = V_rest and y(0) = H(V_rest - V_th)."""
    v, y = v_rest, float(v_rest >= th)
    vs, ys = [], []
    for x in xs:
        v = k * v * (1 - y) + v_rest * y + x
        y = 1.0 if v - th >= 0 else 0.0
        vs.append(v)
        ys.append(y)
    return vs, ys


def paper_backward(vs, ys, grad_y, k, v_rest, th, corrected):
    """Eq. (3): grad_x[t] = k*grad_v[t+1]*[1 - y[t] - v[t]*delta(v[t])] + grad_y[t]*delta(v[t]).

    ``corrected`` adds the V_rest*delta(v[t]) term that Eq. (3) omits (d v[t+1]/d y[t] = V_rest - k*v[t]).
    """
    grad_next, grads = 0.0, [0.0] * len(vs)
    for t in reversed(range(len(vs))):
        d = sigmoid_grad(vs[t] - th)
        through = k * (1 - ys[t] - vs[t] * d) + (v_rest * d if corrected else 0.0)
        grads[t] = grad_next * through + grad_y[t] * d
        grad_next = grads[t]  # dL/dv[t] = dL/dx[t] since v[t] = ... + x[t]
    return grads


@pytest.mark.parametrize("v_rest", [0.0, 0.1, -0.2])
def test_reference_matches_eq_1_to_3(v_rest):
    torch.manual_seed(0)
    k, th, t_steps, n = 0.2, 0.3, 12, 7
    x = (torch.rand(t_steps, n, dtype=torch.float64) * 0.8 - 0.1).requires_grad_(True)
    grad_y = torch.randn(t_steps, n, dtype=torch.float64)
    y = spikefuse.lif(x, decay=k, threshold=th, v_reset=v_rest, backend="reference")
    (y * grad_y).sum().backward()
    for i in range(n):
        vs, ys = paper_forward(x[:, i].tolist(), k, v_rest, th)
        assert y[:, i].tolist() == ys
        corrected = paper_backward(vs, ys, grad_y[:, i].tolist(), k, v_rest, th, corrected=True)
        assert x.grad[:, i].tolist() == pytest.approx(corrected, rel=1e-12, abs=1e-12)
        printed = paper_backward(vs, ys, grad_y[:, i].tolist(), k, v_rest, th, corrected=False)
        if v_rest == 0.0:
            assert printed == pytest.approx(corrected, rel=1e-12, abs=1e-12)
    if v_rest != 0.0:
        # The printed Eq. (3) disagrees with the true gradient once a neuron has spiked with V_rest != 0.
        assert any(
            paper_backward(*paper_forward(x[:, i].tolist(), k, v_rest, th), grad_y[:, i].tolist(), k, v_rest, th, False)
            != pytest.approx(x.grad[:, i].tolist(), rel=1e-9)
            for i in range(n)
        )


def test_soft_reset_and_integrate_and_fire_transcriptions():
    torch.manual_seed(1)
    x = torch.rand(20, 5, dtype=torch.float64)
    th = 0.7
    y_soft, v_soft = spikefuse.lif(x, decay=0.6, threshold=th, v_reset=None, backend="reference", return_state=True)
    y_if = spikefuse.if_neuron(x, threshold=th, backend="reference")
    for i in range(5):
        v, s, v_if, s_if = 0.0, 0.0, 0.0, 0.0
        for t in range(20):
            v = 0.6 * (v - th * s) + x[t, i].item()
            s = float(v >= th)
            v_if = v_if * (1 - s_if) + x[t, i].item()
            s_if = float(v_if >= th)
            assert y_soft[t, i].item() == s and y_if[t, i].item() == s_if
        assert v_soft[i].item() == pytest.approx(v)
