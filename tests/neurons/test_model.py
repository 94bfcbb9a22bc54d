"""A NeuronModel rejects what no backend could run, with a message that says what; its derivatives are sympy's."""

import pytest
import sympy

from spikefuse.neurons import ALIF_MODEL, CUBA_LIF, CUBA_LIF_ZERO, NeuronModel
from spikefuse.neurons.model import sympy_heaviside


def _model(**kw):
    base = dict(name="m", states=("v",), params=("k",), step=(("v", "k*v + x"),), fire="v - 1")
    base.update(kw)
    return NeuronModel(**base)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(name="not a name"), "must be an identifier"),
        (dict(states=()), "at least one state variable"),
        (dict(states=("x",)), "state name 'x' is not allowed"),
        (dict(params=("v",)), "names must be distinct"),
        (dict(step=(("w", "x"),)), "assigns 'w', which is not a state"),
        (dict(step=(("v", "k*v + y"),)), r"reads unknown names \['y'\]"),
        (dict(step=(("v", "k*v if x else v"),)), "uses IfExp"),
        (dict(step=(("v", "v ** 2"),)), "uses Pow"),
        (dict(step=(("v", "sin(v)"),)), "calls something other than exp, log, sqrt, heaviside"),
        (
            dict(step=(("v", "heaviside(v, x)"),)),
            "calls something other than exp, log, sqrt, heaviside of one argument",
        ),
        (dict(states=("heaviside",)), "state name 'heaviside' is not allowed"),
        (dict(step=(("v", "k*v +"),)), "is not an expression"),
        (dict(fire="v - x"), r"fire = v - x reads unknown names \['x'\]"),
        (dict(defaults=(("q", 1.0),)), "a default for 'q', which is not a parameter"),
        (dict(initial=(("q", 1.0),)), "an initial value for 'q', which is not a state"),
        (dict(initial=(("v", "q"),)), "the initial value of 'v' names 'q', which is not a parameter"),
        (dict(handoff=(("w", "v"),)), "handoff assigns 'w', which is not a state"),
        (
            dict(handoff=(("v", "v - x"),)),
            r"handoff v = v - x reads unknown names \['x'\] \(it sees the states after "
            r"the last step, their spike s and the parameters\)",
        ),
        (dict(handoff=(("v", "where(v, 0, v)"),)), r"where takes the spike and two values"),
    ],
)
def test_bad_definitions(kw, message):
    with pytest.raises(ValueError, match=message):
        _model(**kw)


def test_derivatives_follow_the_assignments_in_order():
    d = CUBA_LIF.derivatives
    old_i, old_v, alpha, beta, threshold = sympy.symbols("old_i old_v alpha beta threshold")
    # v = beta*v + (alpha*i + x) - s*threshold: v depends on the old current through the new one
    assert d.state[1] == (alpha, beta)
    assert d.spike == (0, -threshold)
    assert d.param[1] == (old_i, old_v, -sympy.Symbol("s"))
    assert d.fire == (0, 1) and d.fire_param == (0, 0, -1)
    # the adaptive threshold enters the spike's derivative through a
    assert ALIF_MODEL.derivatives.fire == (1, -sympy.Symbol("beta"))


def test_states_read_backward():
    """The current's history is read only by its parameters' gradients (d v / d alpha = old_i) unless the reset
    reads it (zero: d v / d s = -(beta*old_v + alpha*old_i + x)); the fire reads both of ALIF's states."""
    assert CUBA_LIF.states_read_backward(False) == ("v",)
    assert CUBA_LIF.states_read_backward(True) == ("i", "v")
    assert CUBA_LIF_ZERO.states_read_backward(False) == ("i", "v")
    assert ALIF_MODEL.states_read_backward(False) == ("v", "a")
    # a state read by nothing but its own step
    assert _model(states=("v", "w"), step=(("w", "w + x"), ("v", "k*v + x"))).states_read_backward(True) == ("v",)


def test_key_changes_with_the_dynamics_only():
    assert _model().key == _model(equations="text").key
    assert _model().key != _model(step=(("v", "k*v + 2*x"),)).key
    assert _model().key != _model(handoff=(("v", "where(s, 0, v)"),)).key


def test_handoff_derivatives():
    """The states handed on after a reset: d out / d the last states, by their spike and by the parameters."""
    model = _model(params=("k", "r"), handoff=(("v", "where(s, r, v)"),))
    d = model.derivatives
    s, new_v = sympy.symbols("s new_v")
    assert d.handoff_state == ((1 - s,),) and d.handoff_spike == (sympy.Symbol("r") - new_v,)
    assert d.handoff_param == ((0, s),)
    assert _model().derivatives.handoff_state == ()


def test_heaviside_has_no_derivative():
    """heaviside(a) is a reset signal without a gradient: d/da is 0, but its value stays in the derivatives of
    what it multiplies (d v / d old_v = k*(1 - H(old_v - 1)))."""
    model = _model(states=("v", "r"), step=(("r", "heaviside(v - 1)"), ("v", "k*(1 - r)*v + x")))
    d = model.derivatives
    old_v, k = sympy.symbols("old_v k")
    h = sympy_heaviside()
    assert d.state[1] == (0, 0)  # r reads v only through heaviside
    assert sympy.simplify(d.state[0][0] - k * (1 - h(old_v - 1))) == 0
    assert h(sympy.Integer(0)) == 0 and h(sympy.Rational(1, 2)) == 1  # 1 where a > 0 only
