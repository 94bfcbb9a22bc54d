"""Surrogate gradients of the Heaviside spike function.

Each surrogate is defined once: its two parameters, its derivative in PyTorch (:meth:`Surrogate.derivative`, which
the references run) and the same function as a sympy expression (:meth:`Surrogate.sympy_derivative`), from which
the neuron engine emits the backward of its fused CPU and Triton kernels. A surrogate of the user's is a subclass
with these three methods (docs/custom-neuron.md). ``tests/ops/test_cpu.py`` and
``tests/neurons/test_engine.py`` check every backend's formula against :meth:`Surrogate.derivative` on a grid, so a
formula that drifts in one backend fails there.

All derivatives are functions of ``u = h - threshold`` (the membrane potential relative to the threshold).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .registry import Registered

__all__ = [
    "Surrogate",
    "Sigmoid",
    "Rectangle",
    "ATan",
    "Triangle",
    "FastSigmoid",
    "Windowed",
    "Active",
    "refuse_active",
    "resolve",
    "DEFAULT",
    "SURROGATES",
]


@dataclass(frozen=True)
class Surrogate(Registered):
    """Base class: :meth:`params` (two floats), :meth:`derivative` and :meth:`sympy_derivative` of ``u``."""

    def params(self) -> tuple[float, float]:
        raise NotImplementedError

    def derivative(self, u: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def sympy_derivative(u, p1, p2):
        """The derivative as a sympy expression of ``u`` and the two values of :meth:`params` (symbols), from
        which the generated kernels of :mod:`spikefuse.ops.engine` emit their code."""
        raise NotImplementedError


@dataclass(frozen=True)
class Sigmoid(Surrogate):
    """``d/du sigmoid(alpha*u) = alpha * s * (1 - s)``; the temporal-fusion paper's Eq. (6) with alpha = 4."""

    alpha: float = 4.0

    def params(self):
        return float(self.alpha), 0.0

    def derivative(self, u):
        # alpha * s * (1 - s) as alpha * e / (1 + e)^2 with e = exp(-|alpha*u|): the same (even) function, without
        # the cancellation in 1 - s that loses ~eps / (1 - s) of relative precision far from the threshold
        e = torch.exp(-(self.alpha * u).abs())
        return self.alpha * e / (1 + e) ** 2

    @staticmethod
    def sympy_derivative(u, p1, p2):
        import sympy

        e = sympy.exp(-sympy.Abs(p1 * u))  # as derivative()
        return p1 * e / (1 + e) ** 2


@dataclass(frozen=True)
class ATan(Surrogate):
    """``(alpha/2) / (1 + (pi/2 * alpha * u)^2)``: SpikingJelly's ``ATan`` and snnTorch's ``atan`` (default alpha 2)."""

    alpha: float = 2.0

    def params(self):
        return float(self.alpha), 0.0

    def derivative(self, u):
        z = u * (math.pi / 2 * self.alpha)
        return (self.alpha / 2) / (1 + z * z)

    @staticmethod
    def sympy_derivative(u, p1, p2):
        import sympy

        z = u * (sympy.pi / 2 * p1)
        return (p1 / 2) / (1 + z * z)


@dataclass(frozen=True)
class Rectangle(Surrogate):
    """``height`` inside the open window ``|u| < width/2``, else 0.

    The memory-lean BPTT paper's Eq. (7): with th_f = 0.25 and (th_l, th_r) = (-0.25, 0.75) the window is
    ``width = 1`` around the threshold, and ``height = eta = 1``.
    """

    width: float = 1.0
    height: float = 1.0

    def params(self):
        return float(self.width) / 2, float(self.height)

    def derivative(self, u):
        return torch.where(u.abs() < self.width / 2, self.height, 0.0).to(u.dtype)

    @staticmethod
    def sympy_derivative(u, p1, p2):  # p1 = width / 2, p2 = height
        import sympy

        return sympy.Piecewise((p2, sympy.Abs(u) < p1), (0, True))


@dataclass(frozen=True)
class Triangle(Surrogate):
    """``max(0, alpha - alpha^2 |u|)``: a triangle of area 1 and half-width 1/alpha.

    The same function as SpikingJelly's ``PiecewiseQuadratic`` surrogate (whose primitive is piecewise quadratic).
    """

    alpha: float = 1.0

    def params(self):
        return float(self.alpha), 0.0

    def derivative(self, u):
        return (self.alpha - self.alpha * self.alpha * u.abs()).clamp_min(0)

    @staticmethod
    def sympy_derivative(u, p1, p2):
        import sympy

        return sympy.Max(0, p1 - p1 * p1 * sympy.Abs(u))


@dataclass(frozen=True)
class FastSigmoid(Surrogate):
    """SuperSpike: ``1 / (slope*|u| + 1)^2``; snnTorch's ``fast_sigmoid`` (default slope 25)."""

    slope: float = 25.0

    def params(self):
        return float(self.slope), 0.0

    def derivative(self, u):
        z = self.slope * u.abs() + 1.0
        return 1.0 / (z * z)

    @staticmethod
    def sympy_derivative(u, p1, p2):
        import sympy

        z = p1 * sympy.Abs(u) + 1
        return 1 / (z * z)


@dataclass(frozen=True)
class _WindowedBase(Surrogate):
    """``surrogate``'s derivative where ``|u| <= width``, 0 outside: what :class:`Windowed` and :class:`Active` share.

    Defined once, as any surrogate: :meth:`derivative` for the references, :meth:`sympy_derivative` for the generated
    kernels, whose second parameter (unused by the wrapped formula) carries ``width``. The kernels are keyed by the
    surrogate's type, so each wrapped type gets a subclass of its own (``type(Windowed(Sigmoid(), w))`` is
    ``WindowedSigmoid``), made once."""

    surrogate: Surrogate
    width: float

    #: The wrapped surrogate type of a subclass made for it; None on the classes users call.
    _wraps = None
    #: What to do instead where the wrapped surrogate reads two parameters.
    _two_parameter_hint = ""

    def __new__(cls, surrogate, width):
        if cls._wraps is None:
            cls = _windowed_type(cls, type(resolve(surrogate)))
        return object.__new__(cls)

    def __post_init__(self):
        kind = type(self).__qualname__
        surrogate = resolve(self.surrogate)
        width = self.width
        if isinstance(width, bool) or not isinstance(width, (int, float)) or not (0 < width < math.inf):
            raise ValueError(f"{kind}: width must be a positive finite number, got {width!r}")
        self._check_wrapped(surrogate)
        import sympy

        if sympy.Symbol("p2") in type(surrogate).sympy_derivative(*sympy.symbols("u p1 p2")).free_symbols:
            raise ValueError(
                f"{kind}: {surrogate!r} has two parameters, and the kernels take two in all: the window needs the "
                f"second. {self._two_parameter_hint}"
            )
        object.__setattr__(self, "surrogate", surrogate)
        object.__setattr__(self, "width", float(width))
        super().__post_init__()

    def _check_wrapped(self, surrogate: Surrogate) -> None:
        """A subclass's own refusal of the surrogate it is given."""

    def __reduce__(self):  # the subclass is made at run time: pickled as the call that makes it
        return type(self).__bases__[0], (self.surrogate, self.width)

    def params(self):
        return self.surrogate.params()[0], self.width

    def derivative(self, u):
        return torch.where(u.abs() <= self.width, self.surrogate.derivative(u), 0.0).to(u.dtype)


@dataclass(frozen=True)
class Windowed(_WindowedBase):
    """``surrogate``'s derivative where ``|u| <= width``, 0 outside: the gradient passes only through the neurons
    near the threshold (Perez-Nieves & Goodman, "Sparse Spiking Gradient Descent", NeurIPS 2021), so the neuron's
    backward output is zero wherever no step at or after it comes that near (the leak carries a gradient back in
    time). ``Windowed(Sigmoid(4.0), 0.5)`` or ``Windowed("atan", 0.3)``; any surrogate whose formula reads one
    parameter (all built-in ones but :class:`Rectangle`, which is zero outside its own ``width/2`` already); a
    subclass per wrapped type (``WindowedSigmoid``)."""

    _two_parameter_hint = "Rectangle is zero outside |u| < width/2 already: narrow its width instead"

    def _check_wrapped(self, surrogate: Surrogate) -> None:
        if isinstance(surrogate, Active):
            raise ValueError(
                f"Windowed: {surrogate!r} is an Active surrogate, windowed already, whose gradient path only "
                "spikefuse.recurrent implements; give the surrogate it wraps instead"
            )


@dataclass(frozen=True)
class Active(_WindowedBase):
    """Perez-Nieves & Goodman's sparse gradient ("Sparse Spiking Gradient Descent", NeurIPS 2021), an
    APPROXIMATION of the model's gradient: the gradient passes only through neurons whose fire value ``u`` (``v -
    threshold`` for a LIF) is within ``width`` of 0 at that step (the "active" ones); at every other step the
    gradients of the neuron's states after the step are zero, so the leak no longer carries a gradient back in
    time past an inactive step. The spike's derivative is :class:`Windowed`'s, ``surrogate``'s where ``|u| <=
    width``; the forward is unchanged. ``Active(Sigmoid(4.0), 0.5)`` or ``Active("atan", 0.3)``, any surrogate
    whose formula reads one parameter (as :class:`Windowed`); a subclass per wrapped type (``ActiveSigmoid``).

    Read by :func:`spikefuse.recurrent` (backends ``reference``, the oracle, and ``cpu``, whose step kernels zero
    the states' gradients of inactive neurons, so ``sparse_grad`` finds ``G`` sparser); every other entry point
    that takes a surrogate refuses it (:func:`refuse_active`) instead of running the exact gradient.
    """

    _two_parameter_hint = "Wrap a one-parameter surrogate (Active(Triangle(1/width), width) for a compact one)"

    def active(self, u: torch.Tensor) -> torch.Tensor:
        """Where the neurons of fire values ``u`` are active: ``|u| <= width`` (False for NaN)."""
        return u.abs() <= self.width


def _windowed_sympy_derivative(base: type[Surrogate], u, p1, p2):
    import sympy

    return sympy.Piecewise((base.sympy_derivative(u, p1, 0), sympy.Abs(u) <= p2), (0, True))


@functools.cache
def _windowed_type(kind: type[_WindowedBase], base: type[Surrogate]) -> type[_WindowedBase]:
    """The subclass of ``kind`` (:class:`Windowed` or :class:`Active`) for the surrogate type ``base``."""
    return type(
        f"{kind.__name__}{base.__name__}",
        (kind,),
        {
            "__module__": __name__,
            "__qualname__": kind.__name__,  # the dataclass repr: Windowed(surrogate=..., width=...)
            "_wraps": base,
            # A partial, whose source inspect cannot give: the kernels' cache key is then the formula itself, the
            # wrapped one included, not this module's source (which would not change with a user's formula).
            "sympy_derivative": staticmethod(functools.partial(_windowed_sympy_derivative, base)),
        },
    )


def refuse_active(surrogate, where: str, *names) -> None:
    """Raise where ``surrogate`` is :class:`Active`, whose masked gradient ``where`` (an entry point that reads a
    surrogate; ``where.format(*names)``, formatted only then: a layer's every call checks) does not implement: no
    silent exact gradient in its place."""
    if isinstance(surrogate, Active):
        where = where.format(*names)
        raise ValueError(
            f"{where}: {surrogate!r} is Perez-Nieves & Goodman's sparse gradient (spikefuse.surrogate.Active, an "
            "approximation), which only spikefuse.recurrent implements (backend 'cpu' or 'reference'); use it "
            f"there, or give {where} a plain surrogate ({surrogate.surrogate!r}, or Windowed(..., width) for the "
            "exact gradient of the windowed surrogate)"
        )


#: The surrogate of every native entry point given none (the LIF family, the engine's neurons, the recurrent layers,
#: the fused BatchNorm, the time split): the temporal-fusion paper's, Eq. (6). The drop-ins keep their peer's.
DEFAULT = Sigmoid(4.0)

SURROGATES = {
    "sigmoid": Sigmoid,
    "atan": ATan,
    "rectangle": Rectangle,
    "triangle": Triangle,
    "fast_sigmoid": FastSigmoid,
}


def resolve(surrogate) -> Surrogate:
    """Accept a :class:`Surrogate` instance or a name from :data:`SURROGATES` (default parameters)."""
    if isinstance(surrogate, Surrogate) and type(surrogate) is not Surrogate:
        return surrogate
    if isinstance(surrogate, str) and surrogate.lower() in SURROGATES:
        return SURROGATES[surrogate.lower()]()
    raise ValueError(
        f"unknown surrogate {surrogate!r}: use one of {sorted(SURROGATES)} or an instance of "
        + ", ".join(f"spikefuse.surrogate.{cls.__name__}" for cls in SURROGATES.values())
    )
