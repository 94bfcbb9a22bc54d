"""What the numba (:mod:`.cpu`) and Triton (:mod:`.triton`) step-kernel generators emit alike from a
:class:`~spikefuse.neurons.NeuronModel`: the states the backward keeps, the forward step's statements and the
derivatives, with the same variable names in both."""

from __future__ import annotations

from typing import NamedTuple

from ..engine import emit
from ...neurons.model import RECURRENT_INPUT


def kept_states(model) -> tuple[str, ...]:
    """The states whose every step the backward reads (all of them for a neuron with a handoff, whose gradients
    start from every state after the last step)."""
    return model.states if model.handoff else model.states_read_backward(param_grads=True)


class StepSource(NamedTuple):
    fire: str  # u_ = the fire expression
    step: list[str]  # v_<state> = ... of the recurrent step, in order
    handoff: list[str]  # v_<state> = ... of the handoff
    sym: dict  # the derivatives' names, for emit.assignments
    fire_d: dict
    step_d: dict
    handoff_d: dict

    @property
    def derivs(self) -> dict:
        return {**self.fire_d, **self.step_d, **self.handoff_d}


def step_source(model, surrogate_type, dialect: emit.Dialect) -> StepSource:
    """The forward statements in ``dialect`` (states ``v_<name>``, parameters ``p_<name>``, the input ``x_``, the
    previous spike ``s_``, the recurrent current ``r_``) and the derivatives of ``model``'s recurrent step."""
    names = {
        **{k: f"v_{k}" for k in model.states},
        **{p: f"p_{p}" for p in model.params},
        "x": "x_",
        "s": "s_",
        RECURRENT_INPUT: "r_",
    }
    sym, fire_d, step_d = emit.backward_expressions(model, surrogate_type)
    return StepSource(
        fire=f"u_ = {emit.step_source(model.fire, names, dialect)}",
        step=[f"v_{k} = {emit.step_source(e, names, dialect)}" for k, e in model.recurrent_step],
        handoff=[f"v_{k} = {emit.step_source(e, names, dialect)}" for k, e in model.handoff],
        sym=sym,
        fire_d=fire_d,
        step_d=step_d,
        handoff_d=emit.handoff_expressions(model),
    )
