"""What the engine's generated backends share: emitting a neuron's expressions as one backend's kernel code, and
the folder of generated kernel modules.

A :class:`Dialect` says how a backend spells numbers, functions, divisions and selections; the emitters walk

- the step and fire expressions of a :class:`~spikefuse.neurons.NeuronModel` (Python ``ast``), every operation
  parenthesized as parsed, so a kernel performs the reference's floating-point operations in its order;
- the sympy derivatives (:meth:`NeuronModel.derivatives`, a surrogate's ``sympy_derivative``), after common
  subexpression elimination, for the backward pass.

:func:`backward_expressions` gathers what a backward step needs, in the names both kernel generators use
(:func:`handoff_expressions` what the gradients of the states handed out need);
:func:`load_generated` writes a generated module into :func:`cache_dir` once and imports it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import os
import stat
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ...neurons.model import HEAVISIDE, WHERE, sympy_heaviside

__all__ = [
    "Dialect",
    "step_source",
    "sympy_source",
    "assignments",
    "backward_expressions",
    "cache_dir",
    "load_generated",
]


@dataclass(frozen=True)
class Dialect:
    """How one backend writes the pieces of an expression."""

    number: Callable[[float], str]  # a constant in the compute dtype
    functions: dict[str, str]  # exp / log / sqrt -> the callee
    divide: Callable[[str, str], str]  # correctly rounded division (the forward step)
    select: Callable[[str, str, str], str]  # (condition, if true, if false)
    abs: str
    maximum: str
    minimum: str
    power: str | None = None  # a general power's callee; None: the backend has none


_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}


def step_source(expression: str, names: dict[str, str], dialect: Dialect) -> str:
    """A step or fire expression (validated by :class:`NeuronModel`) -> source, names mapped through ``names``."""

    def emit(node) -> str:
        if isinstance(node, ast.BinOp):
            left, right = emit(node.left), emit(node.right)
            if isinstance(node.op, ast.Div):
                return dialect.divide(left, right)
            return f"({left} {_BINARY[type(node.op)]} {right})"
        if isinstance(node, ast.UnaryOp):
            return f"(-{emit(node.operand)})" if isinstance(node.op, ast.USub) else emit(node.operand)
        if isinstance(node, ast.Name):
            return names[node.id]
        if isinstance(node, ast.Constant):
            return dialect.number(float(node.value))
        if isinstance(node, ast.Call):
            if node.func.id == WHERE:  # where(s, a, b): s is 0 or 1
                s, a, b = (emit(arg) for arg in node.args)
                return dialect.select(f"({s} != {dialect.number(0.0)})", a, b)
            if node.func.id == HEAVISIDE:
                return heaviside(emit(node.args[0]), dialect)
            return f"{dialect.functions[node.func.id]}({emit(node.args[0])})"
        raise ValueError(f"cannot emit {type(node).__name__}")  # NeuronModel admits nothing else

    return emit(ast.parse(expression, mode="eval").body)


def heaviside(a: str, dialect: Dialect) -> str:
    """``heaviside(a)``: 1 where ``a > 0``, else 0 (also for a NaN ``a``, as the reference's ``a > 0``)."""
    zero = dialect.number(0.0)
    return dialect.select(f"({a} > {zero})", dialect.number(1.0), zero)


def sympy_source(e, names: dict[str, str], dialect: Dialect) -> str:
    """A sympy expression -> source (integer powers as products, x**(1/2) as sqrt)."""
    import sympy

    def emit(e) -> str:
        if e.is_Symbol:
            return names[e.name]
        if e.is_number:  # a constant, also one written as an expression (1/sqrt(pi))
            return dialect.number(float(e))
        if e.is_Add:
            return "(" + " + ".join(emit(a) for a in e.args) + ")"
        if e.is_Mul:
            return "(" + " * ".join(emit(a) for a in e.args) + ")"
        if e.is_Pow:
            base, exponent = e.args
            if exponent.is_Integer and 0 < int(exponent) <= 4:
                return "(" + " * ".join([emit(base)] * int(exponent)) + ")"
            if exponent.is_Integer and -4 <= int(exponent) < 0:
                return f"({dialect.number(1.0)} / ({' * '.join([emit(base)] * -int(exponent))}))"
            if exponent == sympy.Rational(1, 2):
                return f"{dialect.functions['sqrt']}({emit(base)})"
            if dialect.power is None:
                raise ValueError(f"this backend's kernel generator cannot emit the power {e}")
            return f"{dialect.power}({emit(base)}, {emit(exponent)})"
        if isinstance(e, sympy_heaviside()):
            return heaviside(emit(e.args[0]), dialect)
        if isinstance(e, (sympy.exp, sympy.log)):
            return f"{dialect.functions[type(e).__name__]}({emit(e.args[0])})"
        if isinstance(e, sympy.Abs):
            return f"{dialect.abs}({emit(e.args[0])})"
        if isinstance(e, (sympy.Max, sympy.Min)):
            callee = dialect.maximum if isinstance(e, sympy.Max) else dialect.minimum
            out = emit(e.args[0])
            for a in e.args[1:]:
                out = f"{callee}({out}, {emit(a)})"
            return out
        if isinstance(e, sympy.Piecewise):
            out = dialect.number(0.0)
            for value, condition in reversed(e.args):
                out = emit(value) if condition == sympy.true else dialect.select(emit(condition), emit(value), out)
            return out
        if isinstance(e, sympy.core.relational.Relational):
            return f"({emit(e.lhs)} {e.rel_op} {emit(e.rhs)})"
        raise ValueError(f"the kernel generator cannot emit {type(e).__name__} ({e})")

    return emit(e)


def assignments(exprs: dict[str, object], names: dict[str, str], indent: str, dialect: Dialect) -> list[str]:
    """``name = expression`` lines for sympy expressions, common subexpressions first."""
    import sympy

    keys = list(exprs)
    shared, reduced = sympy.cse([exprs[k] for k in keys], symbols=sympy.numbered_symbols("cse_"))
    names = dict(names)
    lines = []
    for symbol, value in shared:
        names[symbol.name] = symbol.name
        lines.append(f"{indent}{symbol.name} = {sympy_source(value, names, dialect)}")
    lines += [f"{indent}{k} = {sympy_source(v, names, dialect)}" for k, v in zip(keys, reduced)]
    return lines


def backward_expressions(model, surrogate_type) -> tuple[dict, dict, dict]:
    """What one reverse step needs, as sympy expressions: ``(names, fire, step)``.

    ``fire``: ``sg_`` (the surrogate derivative at ``u_``), ``df_<k>`` (du/d new state k) and ``dF_<p>``
    (du/d parameter p); ``step``: ``dx_<k>``, ``ds_<k>``, ``dS_<k>_<old>``, ``dP_<k>_<p>`` (d new state k by
    the input, the previous spike, an old state, a parameter). ``names`` maps their symbols to the kernels'
    locals: ``o_<k>`` old states, ``v_<k>`` new ones, ``p_<p>``, ``x_``, ``s_``, ``u_``, ``sg_p1``, ``sg_p2``.
    """
    import sympy

    S, P, d = model.states, model.params, model.derivatives
    names = {
        **{f"old_{k}": f"o_{k}" for k in S},
        **{f"new_{k}": f"v_{k}" for k in S},
        **{p: f"p_{p}" for p in P},
        "x": "x_",
        "s": "s_",
        "u_": "u_",
        "sg_p1": "sg_p1",
        "sg_p2": "sg_p2",
    }
    sg = surrogate_type.sympy_derivative(sympy.Symbol("u_"), sympy.Symbol("sg_p1"), sympy.Symbol("sg_p2"))
    fire = {
        "sg_": sg,
        **{f"df_{k}": d.fire[i] for i, k in enumerate(S)},
        **{f"dF_{p}": d.fire_param[i] for i, p in enumerate(P)},
    }
    step = {}
    for i, k in enumerate(S):
        step[f"dx_{k}"] = d.input[i]
        step[f"ds_{k}"] = d.spike[i]
        for j, old in enumerate(S):
            step[f"dS_{k}_{old}"] = d.state[i][j]
        for j, p in enumerate(P):
            step[f"dP_{k}_{p}"] = d.param[i][j]
    return names, fire, step


def handoff_expressions(model) -> dict:
    """The derivatives of :attr:`NeuronModel.handoff` in the names of :func:`backward_expressions`: ``dH_<k>_<i>``
    (d handed-out state k / d state i after the last step, ``v_<i>``), ``dHs_<k>`` (by the last step's spike) and
    ``dHP_<k>_<p>`` (by a parameter); empty without a handoff."""
    if not model.handoff:
        return {}
    S, P, d = model.states, model.params, model.derivatives
    out = {}
    for i, k in enumerate(S):
        out.update({f"dH_{k}_{new}": d.handoff_state[i][j] for j, new in enumerate(S)})
        out[f"dHs_{k}"] = d.handoff_spike[i]
        out.update({f"dHP_{k}_{p}": d.handoff_param[i][j] for j, p in enumerate(P)})
    return out


def chain_sum(pairs, derivatives: dict, zero: str, base: str | None = None) -> str:
    """``base + g * d + ...`` over the (gradient, derivative name) ``pairs``, leaving out the derivatives that are
    structurally zero (sympy's 0): such a term adds nothing but work, or a NaN where the gradient is infinite, and the
    reference's autograd has no such term. ``zero``: the expression when nothing is left."""
    terms = ([base] if base else []) + [f"{g} * {d}" for g, d in pairs if derivatives[d] != 0]
    return " + ".join(terms) if terms else zero


def model_facts(model) -> list[str]:
    """Lines of a generated module stating what the engine's wrapping needs to know of ``model`` before a backward,
    read from the module so that a warm process does not derive them (with sympy) again:
    ``BACKWARD_READS_INPUT`` (:attr:`NeuronModel.backward_reads_input`)."""
    return [f"BACKWARD_READS_INPUT = {model.backward_reads_input}", ""]


def _make_private(folder: Path) -> None:
    """Make ``folder`` (mode 0700), or check that the one there is this user's alone: a folder in the shared
    temporary directory that another user made, or can write, could hold modules of theirs, which would be imported
    as kernels (as pip and numba check their caches' owner). Raises PermissionError saying which."""
    folder.mkdir(mode=0o700, exist_ok=True)
    if not hasattr(os, "getuid"):  # no owners or modes to check (Windows: the temporary folder is per user)
        return
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a folder (a link or a file)"
        raise PermissionError(
            f"{kind} of user id {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, not this user's alone "
            f"(user id {os.getuid()}, mode 700): refused, since spikefuse imports the kernel modules it holds"
        )


def cache_dir() -> Path:
    """Where generated kernel sources (and numba's cache of them) live: ``$SPIKEFUSE_CACHE_DIR``, else
    ``~/.cache/spikefuse/kernels``; where that cannot be written (a read-only home), a private folder of this user's
    in the temporary directory (made with mode 0700; one there that is not this user's alone is refused), once,
    with a warning. An error says what to set where neither can be used."""
    base = os.environ.get("SPIKEFUSE_CACHE_DIR")
    if base in _CACHE_DIRS:
        return _CACHE_DIRS[base]
    wanted = Path(base) if base else Path.home() / ".cache" / "spikefuse" / "kernels"
    fallback = Path(tempfile.gettempdir()) / f"spikefuse-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    for folder in (wanted, fallback):
        try:
            if folder == fallback:
                _make_private(folder)
            else:
                folder.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-")
            probe.close()
        except OSError as err:
            failure = f"{folder}: {err.strerror or err}"
            continue
        if folder != wanted:
            warnings.warn(
                f"spikefuse: cannot write the kernel cache folder {wanted} ({failure}); kernels are cached in "
                f"{folder} instead (set SPIKEFUSE_CACHE_DIR to choose)",
                stacklevel=2,
            )
        _CACHE_DIRS[base] = folder
        return folder
    raise RuntimeError(
        f"spikefuse cannot write a folder for its generated kernels: {wanted} and {failure}; set "
        "SPIKEFUSE_CACHE_DIR to a writable folder"
    )


_CACHE_DIRS: dict[str | None, Path] = {}  # by $SPIKEFUSE_CACHE_DIR: checked once per value


_MODULES: dict[tuple, object] = {}
_BY_ID: dict[tuple, tuple] = {}


def _formula_key(surrogate_type) -> str:
    """What identifies a surrogate's formula: the source of its ``sympy_derivative`` (no sympy to import), or where
    the source is not kept (a class defined by ``exec`` or ``python -c``) the expression it returns."""
    try:
        return inspect.getsource(surrogate_type.sympy_derivative)
    except (OSError, TypeError):
        import sympy

        return sympy.srepr(surrogate_type.sympy_derivative(*sympy.symbols("u_ sg_p1 sg_p2")))


def load_generated(backend: str, model, surrogate_type, tag: str, generator: str, make_source: Callable[[], str]):
    """The module of ``backend``'s kernels for ``model`` with ``surrogate_type`` (``tag``: the dtype), imported from
    :func:`cache_dir`; ``make_source()`` writes it the first time. ``generator``: a hash of the generating code."""
    # Looked up by the model's identity first: hashing a model's fields costs microseconds, which a step of a step
    # loop pays at every call (the entry holds the model, so its id is not reused).
    found = _BY_ID.get((backend, id(model), surrogate_type, tag))
    if found is not None:
        return found[1]
    key = (backend, model, surrogate_type, tag)
    if key in _MODULES:
        _BY_ID[(backend, id(model), surrogate_type, tag)] = (model, _MODULES[key])
        return _MODULES[key]
    # The file name holds everything the source depends on (the dynamics, the surrogate's formula, the generator),
    # so an existing file is imported without deriving anything again (sympy costs ~0.5 s).
    inputs = (model.key, _formula_key(surrogate_type), generator, tag)
    digest = hashlib.sha256(repr(inputs).encode()).hexdigest()[:12]
    name = f"spikefuse_{backend}_{model.name}_{surrogate_type.__name__}_{tag}_{digest}"
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    if not path.exists():
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(make_source())
        os.replace(tmp, path)  # atomic: processes starting together (data-parallel ranks) never read half a file
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _MODULES[key] = module
    _BY_ID[(backend, id(model), surrogate_type, tag)] = (model, module)
    return module
