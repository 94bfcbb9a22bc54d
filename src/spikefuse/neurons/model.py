"""A spiking neuron defined once, as a :class:`NeuronModel`; every backend is generated from it.

A neuron has state variables (``states``, e.g. the synaptic current ``i`` and the membrane ``v``) and parameters
(``params``: numbers, or tensors with one value or one per channel). One time step runs the assignments of
``step`` in order, like Python statements, then fires::

    for name, expression in step:          # e.g. ("i", "alpha*i + x"), ("v", "beta*v + i - s*threshold")
        name = expression                  # x: this step's input; s: the previous step's spike (0 or 1)
    u = fire                               # e.g. "v - threshold"
    s = 1 if u >= 0 else 0                 # u > 0 with strict=True

An expression reads ``x``, ``s``, the parameters and the states (a state assigned earlier in the step has its new
value, as in Python). Operators ``+ - * /`` and parentheses; the functions of :data:`FUNCTIONS`; ``heaviside(a)``:
1 where ``a > 0``, else 0, without a gradient (a reset signal computed from a state, as snnTorch's detached
``mem > threshold``); and in a step ``where(s, a, b)``: ``a`` after a spike, else ``b`` (a reset), exactly (no ``s*a + (1-s)*b`` rounding or
``0*inf``), with the gradient of ``s*a + (1-s)*b`` (``a - b`` for the spike's). The state handed
between calls is the states after the last step; the next call's first step sees the spike of that state
(``s = fire(state)``), so a spike in the last step of one call resets at the start of the next, and a run split
in two calls equals one call.

A neuron whose users hand the state on *after* the reset (SpikingJelly's) gives ``handoff``: assignments, like
``step``'s, that read the states after the last step, their spike ``s`` and the parameters, and give the states
handed out (usually the reset part of ``step``). The initial states are then post-reset ones: the first step sees
no spike (``s = 0``).

The expressions are evaluated as written, in the same floating-point order, by every backend (the serial PyTorch
reference and the generated kernels), so their spikes and states agree bit for bit (except that ``exp`` and
``log`` come from each backend's math library, which may round the last bit differently). The backward pass is derived
from the same expressions symbolically (:meth:`NeuronModel.derivatives`, with sympy): the chain rule through the
step, the surrogate derivative of the spike at ``u``, and nothing written by hand per neuron or per backend.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import keyword
from dataclasses import dataclass

from ..registry import Registered

__all__ = ["NeuronModel", "FUNCTIONS", "HEAVISIDE", "WHERE", "RECURRENT_INPUT", "Derivatives"]

#: The functions an expression may call, with their sympy names.
FUNCTIONS = {"exp": "exp", "log": "log", "sqrt": "sqrt"}

#: The step function without a gradient, ``heaviside(a)``: 1 where ``a > 0``, else 0.
HEAVISIDE = "heaviside"

#: The selection on the previous step's spike, in step expressions: ``where(s, a, b)``.
WHERE = "where"

#: The recurrent current of a recurrent layer in :attr:`NeuronModel.recurrent_step`.
RECURRENT_INPUT = "x_rec"

_RESERVED = {"x", "s", "u", WHERE, HEAVISIDE, RECURRENT_INPUT} | set(FUNCTIONS)
_CALLABLE = (*FUNCTIONS, HEAVISIDE)  # the functions of one argument


def _names(expression: str, what: str, where: bool = False) -> set[str]:
    """The variable names an expression reads; rejects anything but arithmetic on names, numbers and FUNCTIONS (and
    ``where(s, a, b)`` when ``where``: a step's expression)."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"{what}: {expression!r} is not an expression: {err.msg}") from None
    allowed = (
        ast.Expression,
        ast.BinOp,
        ast.UnaryOp,
        ast.Add,
        ast.Sub,
        ast.Mult,
        ast.Div,
        ast.USub,
        ast.UAdd,
        ast.Name,
        ast.Load,
        ast.Constant,
        ast.Call,
    )
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise ValueError(
                f"{what}: {expression!r} uses {type(node).__name__}; expressions may use + - * /, "
                f"numbers, names and {', '.join(_CALLABLE)}"
            )
        if isinstance(node, ast.Constant) and (
            isinstance(node.value, bool) or not isinstance(node.value, (int, float))
        ):
            raise ValueError(f"{what}: {expression!r} holds the constant {node.value!r}; only numbers")
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else None
            if where and callee == WHERE:
                if (
                    node.keywords
                    or len(node.args) != 3
                    or not (isinstance(node.args[0], ast.Name) and node.args[0].id == "s")
                ):
                    raise ValueError(f"{what}: {expression!r}: where takes the spike and two values, where(s, a, b)")
            elif callee not in _CALLABLE or node.keywords or len(node.args) != 1:
                also = f", or {WHERE}(s, a, b)" if where else ""
                raise ValueError(
                    f"{what}: {expression!r} calls something other than {', '.join(_CALLABLE)} of one argument{also}"
                )
        elif isinstance(node, ast.Name):
            names.add(node.id)
    return names - set(_CALLABLE) - {WHERE}


@dataclass(frozen=True)
class Derivatives:
    """The partial derivatives of one step, as sympy expressions of the symbols ``old_<state>``, ``x``, ``s``, the
    parameters and ``new_<state>`` (the step's result; only in ``fire``):

    - ``state[k][i]``: d new_k / d old_i; ``spike[k]``: d new_k / d s; ``input[k]``: d new_k / d x;
      ``param[k][p]``: d new_k / d p;
    - ``fire[k]``: d u / d new_k; ``fire_param[p]``: d u / d p;
    - ``handoff_state[k][i]``: d out_k / d new_i, ``handoff_spike[k]``: d out_k / d s, ``handoff_param[k][p]``: d
      out_k / d p, for the states handed out (``out``, see ``handoff``); empty without a handoff.
    """

    state: tuple
    spike: tuple
    input: tuple
    param: tuple
    fire: tuple
    fire_param: tuple
    handoff_state: tuple = ()
    handoff_spike: tuple = ()
    handoff_param: tuple = ()


@dataclass(frozen=True)
class NeuronModel(Registered):
    """One neuron's dynamics (see the module docstring). ``defaults``: parameter values used when a call leaves a
    parameter out (a parameter without one must be given); ``initial``: the states' values before the first step
    (default 0), each a number or the name of a parameter (a hard-reset LIF's membrane starts at ``v_reset``);
    ``handoff``: the states handed out after the last step (see the module docstring).
    ``equations``: the dynamics in the notation of the literature, for documentation."""

    name: str
    states: tuple[str, ...]
    params: tuple[str, ...]
    step: tuple[tuple[str, str], ...]
    fire: str
    strict: bool = False
    defaults: tuple[tuple[str, float], ...] = ()
    initial: tuple[tuple[str, float | str], ...] = ()
    handoff: tuple[tuple[str, str], ...] = ()
    equations: str = ""

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"a neuron's name must be an identifier, got {self.name!r}")
        for kind, names in (("state", self.states), ("parameter", self.params)):
            if not names and kind == "state":
                raise ValueError(f"neuron {self.name!r}: it needs at least one state variable")
            for n in names:
                if not n.isidentifier() or keyword.iskeyword(n) or n in _RESERVED or n.startswith(("old_", "new_")):
                    raise ValueError(
                        f"neuron {self.name!r}: {kind} name {n!r} is not allowed (identifiers other "
                        f"than {sorted(_RESERVED)} and old_*/new_*)"
                    )
        if len(set(self.states) | set(self.params)) != len(self.states) + len(self.params):
            raise ValueError(f"neuron {self.name!r}: state and parameter names must be distinct")
        known = set(self.states) | set(self.params) | {"x", "s"}
        for target, expression in self.step:
            if target not in self.states:
                raise ValueError(
                    f"neuron {self.name!r}: step assigns {target!r}, which is not a state ({', '.join(self.states)})"
                )
            unknown = _names(expression, f"neuron {self.name!r}, {target} =", where=True) - known
            if unknown:
                raise ValueError(f"neuron {self.name!r}: {target} = {expression} reads unknown names {sorted(unknown)}")
        for target, expression in self.handoff:
            if target not in self.states:
                raise ValueError(
                    f"neuron {self.name!r}: handoff assigns {target!r}, which is not a state ({', '.join(self.states)})"
                )
            unknown = _names(expression, f"neuron {self.name!r}, handoff {target} =", where=True) - (known - {"x"})
            if unknown:
                raise ValueError(
                    f"neuron {self.name!r}: handoff {target} = {expression} reads unknown names "
                    f"{sorted(unknown)} (it sees the states after the last step, their spike s and the "
                    "parameters)"
                )
        unknown = _names(self.fire, f"neuron {self.name!r}, fire") - (set(self.states) | set(self.params))
        if unknown:
            raise ValueError(
                f"neuron {self.name!r}: fire = {self.fire} reads unknown names {sorted(unknown)} "
                "(it sees the states after the step and the parameters)"
            )
        for name, _ in self.defaults:
            if name not in self.params:
                raise ValueError(f"neuron {self.name!r}: a default for {name!r}, which is not a parameter")
        for name, value in self.initial:
            if name not in self.states:
                raise ValueError(f"neuron {self.name!r}: an initial value for {name!r}, which is not a state")
            if isinstance(value, str) and value not in self.params:
                raise ValueError(
                    f"neuron {self.name!r}: the initial value of {name!r} names {value!r}, which is not a parameter"
                )
        super().__post_init__()

    @property
    def key(self) -> str:
        """A short hash of the dynamics: generated kernels are cached under it."""
        text = repr(
            (self.name, self.states, self.params, self.step, self.fire, self.strict)
            + ((self.handoff,) if self.handoff else ())
        )  # the keys of neurons without one stay as they were
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def initial_value(self, state: str) -> float | str:
        """The value ``state`` starts at: a number, or the name of the parameter whose value it takes."""
        return dict(self.initial).get(state, 0.0)

    @functools.cached_property
    def params_read(self) -> tuple[str, ...]:
        """The parameters the dynamics read: a definition may list one it does not use, to share its family's
        arguments (the soft-reset LIF's ``v_reset``)."""
        expressions = [(e, True) for _, e in (*self.step, *self.handoff)] + [(self.fire, False)]
        read = set().union(*(_names(e, self.name, where=where) for e, where in expressions))
        return tuple(p for p in self.params if p in read)

    @functools.cached_property
    def recurrent_step(self) -> tuple[tuple[str, str], ...]:
        """The step of a recurrent layer of these neurons: the recurrent current ``x_rec`` joins the input where the
        step reads it, ``a + x`` becoming ``(a + x) + x_rec`` and any other ``x`` becoming ``(x + x_rec)``. The
        first keeps a sum written left to right in that order (snnTorch's ``beta*mem + input_ + recurrent(spk)``);
        either way the step sees ``x + x_rec`` as its input, so its derivatives are those of :attr:`derivatives`
        with ``x`` that sum."""
        x = ast.Name(id="x", ctx=ast.Load())
        rec = ast.Name(id=RECURRENT_INPUT, ctx=ast.Load())

        class JoinRecurrent(ast.NodeTransformer):
            def visit_BinOp(self, node):
                if isinstance(node.op, ast.Add) and isinstance(node.right, ast.Name) and node.right.id == "x":
                    return ast.BinOp(
                        left=ast.BinOp(left=self.visit(node.left), op=ast.Add(), right=x), op=ast.Add(), right=rec
                    )
                return self.generic_visit(node)

            def visit_Name(self, node):
                return ast.BinOp(left=x, op=ast.Add(), right=rec) if node.id == "x" else node

        return tuple(
            (target, ast.unparse(JoinRecurrent().visit(ast.parse(expression, mode="eval"))))
            for target, expression in self.step
        )

    @functools.cached_property
    def backward_reads_input(self) -> bool:
        """Whether a derivative of the step reads ``x``: if not, a backward from saved states needs no input."""
        d = self.derivatives
        expressions = [*(e for row in d.state + d.param for e in row), *d.spike, *d.input, *d.fire, *d.fire_param]
        return any(symbol.name == "x" for e in expressions for symbol in e.free_symbols)

    def states_read_backward(self, param_grads: bool) -> tuple[str, ...]:
        """The states whose value at every step a backward reads: those the fire reads (a step's spike and the
        surrogate's argument) and those the step's derivatives read (the parameters' too with ``param_grads``). A
        recomputing backward keeps the history of these alone and carries the others through time in place."""
        d = self.derivatives
        expressions = [*(e for row in d.state for e in row), *d.spike, *d.input, *d.fire]
        if param_grads:
            expressions += [*(e for row in d.param for e in row), *d.fire_param]
        read = {symbol.name for e in expressions for symbol in e.free_symbols} | {
            f"new_{k}" for k in _names(self.fire, "fire")
        }
        return tuple(k for k in self.states if {f"old_{k}", f"new_{k}"} & read)

    @functools.cached_property
    def derivatives(self) -> Derivatives:
        import sympy

        old = {n: sympy.Symbol(f"old_{n}") for n in self.states}
        new = {n: sympy.Symbol(f"new_{n}") for n in self.states}
        params = {p: sympy.Symbol(p) for p in self.params}
        x, s = sympy.Symbol("x"), sympy.Symbol("s")
        functions = {name: getattr(sympy, target) for name, target in FUNCTIONS.items()}
        functions[HEAVISIDE] = sympy_heaviside()
        functions[WHERE] = lambda c, a, b: c * a + (1 - c) * b  # differentiated as the blend it equals for c in {0, 1}
        env = dict(old)
        for target, expression in self.step:
            env[target] = sympy.sympify(expression, locals={**env, **params, "x": x, "s": s, **functions})
        result = [env[n] for n in self.states]  # as functions of old_*, x, s and the parameters
        u = sympy.sympify(self.fire, locals={**new, **params, **functions})
        env = dict(new)
        for target, expression in self.handoff:
            env[target] = sympy.sympify(expression, locals={**env, **params, "s": s, **functions})
        out = [env[n] for n in self.states] if self.handoff else []
        return Derivatives(
            state=tuple(tuple(sympy.diff(f, old[i]) for i in self.states) for f in result),
            spike=tuple(sympy.diff(f, s) for f in result),
            input=tuple(sympy.diff(f, x) for f in result),
            param=tuple(tuple(sympy.diff(f, params[p]) for p in self.params) for f in result),
            fire=tuple(sympy.diff(u, new[k]) for k in self.states),
            fire_param=tuple(sympy.diff(u, params[p]) for p in self.params),
            handoff_state=tuple(tuple(sympy.diff(f, new[i]) for i in self.states) for f in out),
            handoff_spike=tuple(sympy.diff(f, s) for f in out),
            handoff_param=tuple(tuple(sympy.diff(f, params[p]) for p in self.params) for f in out),
        )


@functools.cache
def sympy_heaviside():
    """``heaviside`` for sympy: 1 where the argument is positive, else 0, with the derivative 0 (it has no gradient)."""
    import sympy

    class heaviside(sympy.Function):  # noqa: N801 (the expression language's name)
        @classmethod
        def eval(cls, a):
            if a.is_number and a.is_real:
                return sympy.Integer(1) if a > 0 else sympy.Integer(0)
            return None

        def fdiff(self, argindex=1):
            return sympy.Integer(0)

    return heaviside
