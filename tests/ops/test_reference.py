"""gradcheck of the reference backend in float64, every LIF form.

Spikes are piecewise constant (their backward is the surrogate by design), so gradcheck checks the one output
with an exact derivative: the final state with a detached reset, as a function of x, the leak and v_init. The
fused backends are compared with the reference elsewhere; this checks the reference's own autograd graph.
"""

import pytest
import torch

from tests import lif_spec
from tests.ops.cases import dynamics_combos, make_inputs, make_spec, spec_id
from spikefuse.surrogate import Sigmoid


@pytest.mark.parametrize("combo", dynamics_combos(), ids=lambda c: spec_id(make_spec(*c, Sigmoid(), False)))
def test_gradcheck_reference_state(combo):
    spec = make_spec(*combo, Sigmoid(), True, variant=1)
    x, leak, v = make_inputs((4, 2, 3), spec, torch.float64, 11, per_channel=True, margin=1e-2)

    def state_of(x, leak, v):
        return lif_spec.run(x, leak, spec, v_init=v, backend="reference")[1]

    inputs = tuple(t.clone().requires_grad_(True) for t in (x, leak, v))
    assert torch.autograd.gradcheck(state_of, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
