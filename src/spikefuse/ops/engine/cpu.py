"""Fused CPU kernels (numba) generated from a :class:`~spikefuse.neurons.NeuronModel`.

For each (neuron, surrogate type, dtype) this module writes the Python source of parallel numba kernels into the
kernel cache folder (:func:`.emit.cache_dir`) and imports it; numba compiles a kernel on its first call and caches
the machine code beside the source, so a call compiles only the kernels it runs. A call of one block of neurons
(fewer than :data:`SERIAL_WORK` neuron steps, or one thread) calls the block's function itself on the calling thread:
the parallel launcher, whose compile took as long as the block's own, is compiled only for calls that use it.

- ``forward``: each parallel task takes a block of neurons and runs all T steps over it, its states in block-sized
  rows that stay in cache, writing the spikes (and, asked, their bits: :func:`forward`) and the final states;
  nothing is saved for backward
  (``forward_save``, memory="potential": every step's states are also written out for backward). It returns how
  many blocks read a NaN or an inf (an input or an initial state: each row function ORs
  :func:`~spikefuse.ops.numba_common.non_finite` of what it reads), which the caller refuses;
- ``backward`` (``backward_grads`` when a parameter needs a gradient): each task recomputes its block's states over
  the T steps into a block-sized scratch (it stays in cache; a row per step for each state the reverse pass reads,
  :meth:`~spikefuse.neurons.NeuronModel.states_read_backward`, one row for each other, updated in place, which
  halves what CubaLIF's recompute writes), then runs back through time with the derivatives of
  :attr:`NeuronModel.derivatives`, writing the input gradient, the initial states' gradients and (``_grads``)
  per-neuron parameter gradients, reduced per channel afterwards (``backward_saved``: the states read from what
  ``forward_save`` wrote, no recompute; ``backward_over_x``: grad_x written over the input, a transient of the
  caller's; ``backward_src``: the input is the BatchNorm of ``x``, which each block computes into a tile first, see
  :func:`spikefuse.batchnorm.cpu.source_tile`).

Each comes with parameters as scalars (suffix ``_scalar``: every parameter has one value) or as per-channel arrays,
expanded to a block-sized row per parameter. One time step of a block is a row function of its own
(``_forward_row``, ``_recompute_row``) looping over the block's neurons, and so are :func:`row_steps` consecutive
steps of the forward and the recompute (suffix ``_x<steps>``), which run their time loop but for the steps left
over; the reverse pass runs :func:`reverse_steps` steps per row function (``_reverse_rows``, its gradients carried
between them in registers), which also runs the steps left over (``valid`` of them counting), so that no one-step
twin is compiled beside it.
Each row function declares its rows apart (:func:`~spikefuse.ops.numba_common.rows_apart`: the callers pass each row
it writes once), so LLVM vectorizes its loop with no run-time overlap check between its rows (before that promise,
a row function with more rows than LLVM checks at run time stayed scalar).
The backward writes ``exp`` as :func:`spikefuse.ops.numba_common.exp`, which vectorizes (libm's is a scalar call).

The forward writes each spike as ``s * one``: ``one`` is 1.0 for spikes in the compute dtype, and for float16 /
bfloat16 spikes (half-precision inputs, which compute in float32) the bit pattern of 1.0, stored through the output's
16-bit integer view, so no float32 spike tensor is written and converted.

The step's expressions are emitted as written, with every number cast to the compute dtype, so the spikes and
states equal the reference's bit for bit; the derivatives are emitted from sympy after common-subexpression
elimination. Entry points as :mod:`spikefuse.ops.engine.reference`; :func:`forward` and
:func:`backward` take the options of this backend alone as keywords (the ``_src`` kernels, the forward's spike bits), for
the fused BatchNorm (:mod:`spikefuse.batchnorm.autograd`), which calls them by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import torch

from ...batchnorm import cpu as batchnorm_cpu
from ...threads import match_numba_threads
from .. import bitpack, buffers
from ..nonfinite import refuse_non_finite
from ..numerics import reduce_leak_grad
from .. import numba_common
from ..numba_common import block_for
from . import emit
from .emit import Dialect

# Neurons per parallel task: long rows (64 KiB of each [T, N] stream per step) keep the hardware prefetcher streaming
# from one step's row to the next; the recomputing backward's scratch, (T+1) x replayed states x block, is kept to
# about SCRATCH_BYTES (the L2 cache), and no block is smaller than MIN_BLOCK. A fused BatchNorm's backward (``_src``)
# keeps its scratch to SOURCE_SCRATCH_BYTES: it runs at a lean training step's memory peak (the first layer's
# backward), where each running task's scratch adds to the peak.
BLOCK = 16384
MIN_BLOCK = 2048
# Neuron steps (T x N) below which a call runs in one block on the calling thread: the work of two threads differs by
# less than the launch of numba's parallel launcher (measured: a LIF layer's forward+backward at 8 x 2048 neurons
# took 138 us on two threads, 143 on one), and a small layer's call compiles no launcher.
SERIAL_WORK = 1 << 14
SCRATCH_BYTES = 2 << 20
SOURCE_SCRATCH_BYTES = 512 << 10


def row_steps(model) -> int:
    """Steps per row pass of the forward and the recompute: a pass over several steps keeps the states in registers
    between them (each state's row is read and written once per pass, not per step) and streams that many rows of
    each ``[T, N]`` tensor at once, which keeps more memory traffic in flight per core; steps left over at the end
    run one at a time. Four for a neuron of several states, whose rows are most of a pass's cache traffic; two for
    one state: each function of several steps is compiled beside the one-step one, which a cold start (and the test
    suite) pays for, and two keep the default LIF's first call under the 5 s that `spikefuse bench compile` checks.
    (The reverse pass has no one-step twin: see :func:`reverse_steps`.)"""
    return 2 if len(model.states) == 1 else 4


def reverse_steps(grads: bool) -> int:
    """Steps per row pass of the reverse pass, its gradients carried between them in registers, steps left over run
    by the same function (see ``steps_left``): two, and one in the kernels with per-neuron parameter gradients. Its
    row function is the largest, and its compile time grows with the steps: four would put ALIF's first
    forward+backward past the 8 s `spikefuse bench compile` checks."""
    return 1 if grads else 2


READS_HALF = False  # the kernels take numpy arrays of the compute dtype (see spikefuse.ops.engine)
_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}  # the compute dtypes the kernels are made for
_ONE_BITS = {torch.float16: 0x3C00, torch.bfloat16: 0x3F80}  # 1.0 in the half-precision spike outputs' 16 bits
_NO_BITS = np.empty((0, 0), dtype=np.uint8)  # the forward kernels' bits when they pack none
# The generator's version: this file, the emitters and the code the kernels call.
_GENERATOR = hashlib.sha256(
    b"".join(Path(m.__file__).read_bytes() for m in (emit, numba_common, batchnorm_cpu)) + Path(__file__).read_bytes()
).hexdigest()[:12]


#: How the numba kernels spell a neuron's step (numbers cast to the compute dtype ``F``).
NUMBA = Dialect(
    number=lambda v: f"F({v!r})",
    functions={"exp": "np.exp", "log": "np.log", "sqrt": "np.sqrt"},
    divide=lambda a, b: f"({a} / {b})",
    select=lambda c, a, b: f"({a} if {c} else {b})",
    abs="abs",
    maximum="max",
    minimum="min",
    power="np.power",
)

#: The backward's spelling: gradients only, with the vectorizable exp.
NUMBA_GRAD = dataclasses.replace(NUMBA, functions={**NUMBA.functions, "exp": "vexp"})

#: Where a reverse step writes grad_x (see ``reverse_rows``), and the suffix of its functions.
OVER_SUFFIX = {"": "", "state": "_over", "input": "_over_x"}


# --------------------------------------------------------------------------------------------- kernel sources


class _Source:
    """The source of one module's kernels in one parameter layout: ``model``'s step, fire and derivatives spelled
    for numba with ``surrogate_type``'s derivative and ``dtype``, the parameters as per-neuron arrays or (``scalar``,
    suffix ``_scalar``) as scalars, when every parameter has one value and nothing is gathered or loaded per neuron.
    Each method writes one part: a row function, a block's loop over time, a kernel and its launcher."""

    def __init__(self, model, surrogate_type, dtype: torch.dtype, scalar: bool):
        self.model, self.scalar = model, scalar
        self.S, self.P = S, P = model.states, model.params
        self.np_dtype = f"np.{_NP_DTYPES[dtype].__name__}"
        self.step_names = {**{k: f"v_{k}" for k in S}, **{p: f"p_{p}" for p in P}, "x": "x_", "s": "s_"}
        fire_names = {**{k: f"v_{k}" for k in S}, **{p: f"p_{p}" for p in P}}
        self.fire = emit.step_source(model.fire, fire_names, NUMBA)
        self.fired = "(u_ > F(0.0))" if model.strict else "(u_ >= F(0.0))"  # a constant of the code: no branch
        self.step_lines = [f"v_{t} = {emit.step_source(e, self.step_names, NUMBA)}" for t, e in model.step]
        self.sym_names, self.fire_derivs, self.step_derivs = emit.backward_expressions(model, surrogate_type)
        self.handoff_derivs = emit.handoff_expressions(model)
        self.derivs = {**self.fire_derivs, **self.step_derivs, **self.handoff_derivs}
        # With a handoff the initial states are post-reset: the row functions take `fresh` (the first step: no spike).
        self.fresh = "fresh, " if model.handoff else ""
        self.per_pass = row_steps(model)
        self.sfx = "_scalar" if scalar else ""
        self.par = self.args("par_", P)  # the kernels' parameter arguments: scalars or [C] arrays
        self.prow = self.args("p_", P) if scalar else self.args("pv_", P)  # the row functions': scalars or block rows
        self.fin, self.gfin, self.ginit, self.init, self.sav = (
            self.args(f"{name}_", S) for name in ("final", "gfinal", "ginit", "init", "saved")
        )
        self.ind = "        "  # the indent of a row function's loop body

    def first(self, t: str) -> str:
        """The ``fresh`` argument of a row function's call at step ``t``."""
        model = self.model
        return f"{t} == 0, " if model.handoff else ""

    def in_passes(self, call) -> list[str]:
        """A block's loop forward in time over ``T`` steps from ``t``: ``call(steps)`` (the line running steps
        t..t+steps-1) with :func:`row_steps` steps per pass, then with one for each step left over."""
        per_pass = self.per_pass
        return [
            f"    for t in range(0, T - {per_pass - 1}, {per_pass}):",
            call(per_pass),
            f"    for t in range(T - T % {per_pass}, T):",
            call(1),
        ]

    @staticmethod
    def args(prefix: str, names) -> str:
        """``prefix<name>, `` for each name: a list of arguments."""
        return "".join(f"{prefix}{n}, " for n in names)

    def replayed(self, grads: bool) -> tuple[str, ...]:
        """The states whose history a recomputing backward keeps in its scratch (the others are carried through the
        recompute in one row each, ``c_<k>``): those the reverse pass reads, or all with a handoff (its gradients
        read every state after the last step)."""
        S, model = self.S, self.model
        return S if model.handoff else model.states_read_backward(grads)

    def row_list(self, t: str, kept: tuple[str, ...]) -> list[str]:
        """The state rows after step ``t``: of scratch row-block ``t`` (``hist[t*len(kept) + i]``) for the ``kept``
        states, the carried row of the others."""
        S = self.S
        return [f"hist[({t}) * {len(kept)} + {kept.index(k)}]" if k in kept else f"c_{k}" for k in S]

    def rows(self, t: str, kept: tuple[str, ...]) -> str:
        """:func:`row_list` as arguments."""
        args, row_list = self.args, self.row_list
        return args("", row_list(t, kept))

    def param_locals(self, indent: str) -> list[str]:
        P, scalar = self.P, self.scalar
        return [] if scalar else [f"{indent}p_{p} = pv_{p}[j]" for p in P]

    def load_params(self, indent: str) -> list[str]:
        """The block's parameter rows (per-neuron variant) or scalars."""
        P, scalar = self.P, self.scalar
        if scalar:
            return [f"{indent}p_{p} = par_{p}" for p in P]
        return [f"{indent}pv_{p} = np.empty(m, F)\n{indent}channel_row(pv_{p}, par_{p}, n0, inner)" for p in P]

    def load_rows(self, dst: list[str], src: list[str], indent: str) -> list[str]:
        """A per-neuron array's block, or its one value for all (:func:`~spikefuse.ops.numba_common.load_row`)."""
        return [f"{indent}load_row({d}, {s}, n0, m)" for d, s in zip(dst, src)]

    def saved_list(self, t: str) -> list[str]:
        """The block's rows of the states saved for step ``t`` (memory="potential")."""
        S = self.S
        return [f"saved_{k}[{t}, n0:n0 + m]" for k in S]

    def fire_old(self, indent: str, after_step: bool = False) -> list[str]:
        """The previous step's spike, from the states before the step (what the forward wrote); none before the
        first step of a neuron with a handoff; ``after_step``: the spike of the states after the step."""
        fire, fired, model = self.fire, self.fired, self.model
        spike = f"F(1.0) if {fired} else F(0.0)"
        if model.handoff and not after_step:
            spike = f"F(0.0) if fresh else ({spike})"
        return [f"{indent}u_ = {fire}", f"{indent}s_ = {spike}"]

    def last_states(self, rows: str, indent: str) -> list[str]:
        """Neuron ``j``'s parameters, its states after the last step (from ``rows``) in ``v_*`` and their spike."""
        S, fire_old, param_locals = self.S, self.fire_old, self.param_locals
        return [
            *param_locals(indent),
            *[f"{indent}v_{k} = {rows.format(k=k, i=i)}" for i, k in enumerate(S)],
            *fire_old(indent, after_step=True),
        ]

    def hand_off(self, rows: str, indent: str) -> list[str]:
        """Neuron ``j``'s states handed out, from the states after the last step in ``rows`` into ``v_*``."""
        last_states, model, step_names = self.last_states, self.model, self.step_names
        return [
            *last_states(rows, indent),
            *[f"{indent}v_{t} = {emit.step_source(e, step_names, NUMBA)}" for t, e in model.handoff],
        ]

    def step_row(
        self,
        name: str,
        old: str,
        new: str,
        spikes: bool,
        save: bool = False,
        carried: tuple[str, ...] = (),
        steps: int = 1,
    ) -> list[str]:
        """One step of a block: the states from rows ``old`` to rows ``new`` (the same rows, one pointer each,
        for an update in place; likewise for the ``carried`` states, rows ``c_``), with ``spikes`` the spike row
        ``sr``, with ``save`` copies of the new states into rows ``sv_``. With ``steps`` > 1 (suffix ``_x<steps>``)
        that many consecutive steps, each with rows of its own (numbered), the states in registers between
        them; the states updated in place are written after the last."""
        S, args, fire_old, fresh, param_locals, prow, sfx, step_lines = (
            self.S,
            self.args,
            self.fire_old,
            self.fresh,
            self.param_locals,
            self.prow,
            self.sfx,
            self.step_lines,
        )
        src = [f"c_{k}" if k in carried else f"{old}{k}" for k in S]
        dst = [f"c_{k}" if k in carried else f"{new}{k}" for k in S]
        moved = [(k, d) for k, r, d in zip(S, src, dst) if r != d]  # a row per step

        def per_step(row: str, u: int) -> str:
            return f"{row}{u}" if steps > 1 else row

        step_args = [per_step("xr", u) for u in range(steps)]
        if spikes:  # a forward row: returns 1 if it read a NaN or an inf, else 0
            step_args += [per_step("sr", u) for u in range(steps)] + ["one"]
        step_args += src + [per_step(d, u) for u in range(steps) for _, d in moved]
        if save:
            step_args += [per_step(f"sv_{k}", u) for u in range(steps) for k in S]
        body = []
        for u in range(steps):
            body += [
                *fire_old("        ", after_step=u > 0),
                f"        x_ = {per_step('xr', u)}[j]",
                *(["        bad |= non_finite(x_)"] if spikes else []),
                *[f"        {line}" for line in step_lines],
                *(fire_old("        ", after_step=True) if spikes else []),
                *[f"        {per_step(d, u)}[j] = v_{k}" for k, d in moved],
                *([f"        {per_step(f'sv_{k}', u)}[j] = v_{k}" for k in S] if save else []),
                *([f"        {per_step('sr', u)}[j] = s_ * one"] if spikes else []),
            ]
        return [
            "@njit(cache=True, error_model='numpy')",
            f"def {name}{'_x' + str(steps) if steps > 1 else ''}{sfx}({args('', step_args)}{prow}{fresh}m):",
            "    rows_apart()",
            *(["    bad = 0"] if spikes else []),
            "    for j in range(m):",
            *param_locals("        "),
            *[f"        v_{k} = {r}[j]" for k, r in zip(S, src)],
            *body,
            *[f"        {r}[j] = v_{k}" for k, r, d in zip(S, src, dst) if r == d],
            *(["    return bad"] if spikes else []),
            "",
            "",
        ]

    def initial_check(self) -> list[str]:
        """``bad``: 1 if an initial state of the block is NaN or infinite (the forward rows add their inputs')."""
        S = self.S
        return [
            "    bad = 0",
            "    for j in range(m):",
            "        bad |= " + " | ".join(f"non_finite(st_{k}[j])" for k in S),
        ]

    def final_states(self) -> list[str]:
        """The block's final states from its rows ``st_*`` (through the handoff, if any); it returns ``bad``."""
        S, hand_off, model = self.S, self.hand_off, self.model
        # a loop, not a slice assignment: numba would compile the string formatting of its size-mismatch error
        if not model.handoff:
            return ["    for j in range(m):", *[f"        final_{k}[n0 + j] = st_{k}[j]" for k in S], "    return bad"]
        return [
            "    for j in range(m):",
            *hand_off("st_{k}[j]", "        "),
            *[f"        final_{k}[n0 + j] = v_{k}" for k in S],
            "    return bad",
        ]

    def made_rows_setup(self, steps: int) -> list[str]:
        """A block's BatchNorm factor rows and ``steps`` rows to make its input rows in (a fused BatchNorm)."""
        return ["    na, nb = source_factors(n0, m, src)", f"    xs = np.empty(({steps}, m), F)"]

    def made_rows(self, steps: int) -> str:
        """The lines making the input rows of steps t..t+steps-1 into ``xs`` (see :func:`made_rows_setup`)."""
        return "".join(f"        source_row(x, t + {u}, n0, src, na, nb, xs[{u}])\n" for u in range(steps))

    def forward_steps(self, save: bool, source: bool = False) -> list[str]:
        """The forward block's loop over time: row_steps(model) steps per row pass, then the rest one at a time;
        ``source``: each step's input row made from ``x`` into a row of ``xs`` first (a fused BatchNorm,
        :func:`~spikefuse.batchnorm.cpu.source_row`), not read from ``x``."""
        S, args, first, in_passes, made_rows, prow, sfx = (
            self.S,
            self.args,
            self.first,
            self.in_passes,
            self.made_rows,
            self.prow,
            self.sfx,
        )
        name = "_forward_save_row" if save else "_forward_row"

        def call(steps: int) -> str:
            rows = [f"xs[{u}]" if source else f"x[t + {u}, n0:n0 + m]" for u in range(steps)]
            rows += [f"spikes[t + {u}, n0:n0 + m]" for u in range(steps)] + ["one"] + [f"st_{k}" for k in S]
            if save:
                rows += [f"saved_{k}[t + {u}, n0:n0 + m]" for u in range(steps) for k in S]
            suffix = f"_x{steps}" if steps > 1 else ""
            made = made_rows(steps) if source else ""
            packed = "" if save else f"\n        pack_rows(spikes, t, {steps}, n0, m, bits)"
            return f"{made}        bad |= {name}{suffix}{sfx}({args('', rows)}{prow}{first('t')}m){packed}"

        return ["    T = x.shape[0]", *in_passes(call)]

    def chain(self, pairs, base: str | None = None) -> str:
        derivs = self.derivs
        return emit.chain_sum(pairs, derivs, "F(0.0)", base)

    def reverse_rows(self, grads: bool, over: str = "") -> list[str]:
        """``n`` = :func:`reverse_steps` reverse steps of a block, t, t - 1, ..., t - n + 1 (only the first
        ``valid`` of them count: the others' results are dropped), the carried gradients in registers between
        them; ``grads``: with the per-neuron parameter gradients (suffix ``_grads``); ``over``: grad_x written over
        the first state's row of the step (``"state"``, suffix ``_over``: its saved states) or over the input's row
        (``"input"``, suffix ``_over_x``), through that row's own argument (a second one would break the promise of
        :func:`~spikefuse.ops.numba_common.rows_apart`). Rows:
        ``x<u>``, ``g<u>`` (grad of the spikes), ``gx<u>`` of step t - u; ``w<u>_*`` the states after step t - u,
        ``o_*`` before the last step. Every row is read before any is written."""
        P, S, args, chain, fire, fire_derivs, fire_old, ind, model, param_locals, prow, sfx, step_derivs, sym_names = (
            self.P,
            self.S,
            self.args,
            self.chain,
            self.fire,
            self.fire_derivs,
            self.fire_old,
            self.ind,
            self.model,
            self.param_locals,
            self.prow,
            self.sfx,
            self.step_derivs,
            self.sym_names,
        )
        g = OVER_SUFFIX[over] + ("_grads" if grads else "")
        n = reverse_steps(grads)
        outs = [{"": f"gx{u}", "state": f"w{u}_{S[0]}", "input": f"x{u}"}[over] for u in range(n)]
        flags = args("fresh", range(n)) if model.handoff else ""
        names = {**sym_names, **{f"old_{k}": f"o_{k}_" for k in S}}

        def one_step(u: int) -> list[str]:
            """Step t - u, from the states after it (locals ``Lw<u>_<k>_``) and before it (``Lw<u+1>_<k>_``, or
            ``Lo_<k>_`` for the last), the gradients carried in from the later step; its results in ``gx_<u>``,
            ``gS<u>_<k>``, ``gs<u>``, ``a<u>_<p>``."""
            old, new = f"Lw{u + 1}" if u < n - 1 else "Lo", f"Lw{u}"
            carried_s, carried = ("gs[j]", "gS_{k}[j]") if u == 0 else (f"gs{u - 1}", f"gS{u - 1}_{{k}}")
            acc_in = {p: f"acc_{p}[j]" if u == 0 else f"a{u - 1}_{p}" for p in P}
            return [
                *([f"{ind}fresh = fresh{u}"] if model.handoff else []),
                *[f"{ind}o_{k}_ = {old}_{k}_" for k in S],
                *[f"{ind}v_{k} = o_{k}_" for k in S],
                *fire_old(ind),
                *[f"{ind}v_{k} = {new}_{k}_" for k in S],
                f"{ind}u_ = {fire}",
                f"{ind}x_ = x{u}[j]",
                *emit.assignments({**fire_derivs, **step_derivs}, names, ind, NUMBA_GRAD),
                f"{ind}g_s = g{u}[j] + {carried_s}",
                *[f"{ind}g_{k} = " + chain([("g_s * sg_", f"df_{k}")], base=carried.format(k=k)) for k in S],
                f"{ind}gx_{u} = " + chain([(f"g_{k}", f"dx_{k}") for k in S]),
                *(
                    [
                        f"{ind}a{u}_{p} = {acc_in[p]} + "
                        + chain([("g_s * sg_", f"dF_{p}")] + [(f"g_{k}", f"dP_{k}_{p}") for k in S])
                        for p in P
                    ]
                    if grads
                    else []
                ),
                *[f"{ind}gS{u}_{old_k} = " + chain([(f"g_{k}", f"dS_{k}_{old_k}") for k in S]) for old_k in S],
                f"{ind}gs{u} = F(0.0) if detach else " + chain([(f"g_{k}", f"ds_{k}") for k in S]),
            ]

        def last(value) -> str:
            """``value(u)`` of the last step that counts, u = valid - 1."""
            picked = value(0)
            for u in range(1, n):
                picked = f"{value(u)} if valid > {u} else ({picked})"
            return picked

        rows_in = [f"w{u}" for u in range(n)] + ["o"]
        return [
            "@njit(cache=True, error_model='numpy')",
            f"def _reverse_rows{g}{sfx}({args('x', range(n))}{args('g', range(n))}"
            f"{'' if over else args('gx', range(n))}{args('o_', S)}"
            f"{''.join(args(f'w{u}_', S) for u in range(n))}{args('gS_', S)}gs, "
            f"{args('acc_', P) if grads else ''}{prow}sg_p1, sg_p2, detach, {flags}{'valid, ' if n > 1 else ''}m):",
            "    prefer_wide_vectors()",
            "    rows_apart()",
            "    for j in range(m):",
            *param_locals(ind),
            *[f"{ind}L{r}_{k}_ = {r}_{k}[j]" for r in rows_in for k in S],
            *(line for u in range(n) for line in one_step(u)),
            *[f"{ind}gS_{k}[j] = " + last(lambda u, k=k: f"gS{u}_{k}") for k in S],
            f"{ind}gs[j] = " + last(lambda u: f"gs{u}"),
            *([f"{ind}acc_{p}[j] = " + last(lambda u, p=p: f"a{u}_{p}") for p in P] if grads else []),
            *[f"{ind}{out}[j] = gx_{u}" for u, out in enumerate(outs)],
        ]

    def handoff_grads(self, grads: bool, saved: bool) -> list[str]:
        """The gradients of the states handed out (in ``gS_*``) carried back through the handoff: into the states
        after the last step (``gS_*``), its spike (``gs``) and the parameters (``acc_*``)."""
        P, S, chain, handoff_derivs, ind, last_states, sym_names = (
            self.P,
            self.S,
            self.chain,
            self.handoff_derivs,
            self.ind,
            self.last_states,
            self.sym_names,
        )
        last = "saved_{k}[T - 1, n0 + j]" if saved else f"hist[T * {len(S)} + {{i}}, j]"  # all replayed
        sums = [f"{ind}gS_{i}[j] = " + chain([(f"gH_{k}", f"dH_{k}_{i}") for k in S]) for i in S]
        sums.append(f"{ind}gs[j] = F(0.0) if detach else " + chain([(f"gH_{k}", f"dHs_{k}") for k in S]))
        if grads:
            sums += [f"{ind}acc_{p}[j] = " + chain([(f"gH_{k}", f"dHP_{k}_{p}") for k in S]) for p in P]
        return [
            "    for j in range(m):",
            *[f"{ind}gH_{k} = gS_{k}[j]" for k in S],
            *last_states(last, ind),
            *emit.assignments(handoff_derivs, sym_names, ind, NUMBA_GRAD),
            *sums,
        ]

    def initial_grads(self, grads: bool, kept: tuple[str, ...]) -> list[str]:
        """The initial states' (and the parameters') gradients, where the first step's spike is that of the
        initial states (the ``kept`` ones are in ``hist``'s first rows: the others are not read) and its gradient
        flows into them; with a handoff the first step sees no spike."""
        P, S, fire, fire_derivs, model, scalar, sym_names = (
            self.P,
            self.S,
            self.fire,
            self.fire_derivs,
            self.model,
            self.scalar,
            self.sym_names,
        )
        lines = ["    for j in range(m):", "        n = n0 + j"]
        if model.handoff:
            return [
                *lines,
                *[f"        if ginit_{k}.shape[0] == N:\n            ginit_{k}[n] = gS_{k}[j]" for k in S],
                *(
                    [f"        if need_params[{pi}]:\n            gpar_{p}[n] = acc_{p}[j]" for pi, p in enumerate(P)]
                    if grads
                    else []
                ),
            ]
        return [
            *lines,
            *[f"        p_{p} = pv_{p}[j]" for p in ([] if scalar else P)],
            *[f"        v_{k} = hist[{i}, j]" for i, k in enumerate(kept)],
            f"        u_ = {fire}",
            *emit.assignments(fire_derivs, sym_names, "        ", NUMBA_GRAD),
            *[
                f"        if ginit_{k}.shape[0] == N:\n            ginit_{k}[n] = gS_{k}[j] + gs[j] * sg_ * df_{k}"
                for k in S
            ],
            *(
                [
                    f"        if need_params[{pi}]:\n            gpar_{p}[n] = acc_{p}[j] + gs[j] * sg_ * dF_{p}"
                    for pi, p in enumerate(P)
                ]
                if grads
                else []
            ),
        ]

    def backward(self, grads: bool, saved: bool, over: str = "", tile: bool = False) -> list[str]:
        """The backward kernels; ``grads`` as :func:`reverse_rows`; ``saved``: reading the states the forward saved
        (memory="potential", suffix ``_saved``) instead of recomputing them; ``over``: grad_x written over the
        saved first state (``"state"``, suffix ``_saved_over``) or over ``x`` (``"input"``, suffix ``_over_x``),
        with no grad_x argument; ``tile`` (suffix ``_src``): the block's input is made from ``x`` and ``src`` (a
        fused BatchNorm): for a neuron whose reverse pass reads no input (:attr:`NeuronModel.backward_reads_input`)
        each step's row right before its recompute reads it (:func:`~spikefuse.batchnorm.cpu.source_row`, as
        the forward does), otherwise all steps into the tile that :func:`~spikefuse.batchnorm.cpu.source_tile`
        fills, which both passes read."""
        (
            P,
            S,
            args,
            first,
            gfin,
            ginit,
            handoff_grads,
            in_passes,
            init,
            initial_grads,
            load_params,
            load_rows,
            made_rows,
            made_rows_setup,
            model,
            par,
            per_pass,
            prow,
            replayed,
            row_list,
            rows,
            sav,
            saved_list,
            sfx,
        ) = (
            self.P,
            self.S,
            self.args,
            self.first,
            self.gfin,
            self.ginit,
            self.handoff_grads,
            self.in_passes,
            self.init,
            self.initial_grads,
            self.load_params,
            self.load_rows,
            self.made_rows,
            self.made_rows_setup,
            self.model,
            self.par,
            self.per_pass,
            self.prow,
            self.replayed,
            self.row_list,
            self.rows,
            self.sav,
            self.saved_list,
            self.sfx,
        )
        g = "_grads" if grads else ""
        by_row = tile and not model.backward_reads_input
        mode = ("_saved" if saved else "") + OVER_SUFFIX[over] + ("_src" if tile else "")
        acc = args("acc_", P) if grads else ""
        bwd_args = (
            f"grad_spikes, {gfin}x, {'src, ' if tile else ''}{par}{init}{sav if saved else ''}sg_p1, "
            "sg_p2, detach, inner, "
            + ("need_params, " if grads else "")
            + ("" if over else "grad_x, ")
            + ginit
            + (args("gpar_", P) if grads else "")
        )
        row = f"_reverse_rows{OVER_SUFFIX[over]}{g}{sfx}"

        def xrow(t: str) -> str:
            """The block's input row of step ``t`` (by rows: a made row the reverse pass does not read)."""
            return "xs[0]" if by_row else f"xs[{t}]" if tile else f"x[{t}, n0:n0 + m]"

        def call(
            xs: list[str], gys: list[str], gxs: list[str], old: list[str], news: list[list[str]], flags: str
        ) -> str:
            """The row function's call on its steps' rows (``xs``, ``gys``, ``gxs``: input, spike gradient and
            grad_x, one per step), the states before the last step and after each (``old``, ``news``) and the
            trailing flags (``fresh<u>``, ``valid``)."""
            return (
                f"{row}({args('', xs)}{args('', gys)}{'' if over else args('', gxs)}"
                f"{args('', old + [r for new in news for r in new])}{args('gS_', S)}gs, {acc}{prow}sg_p1, "
                f"sg_p2, detach, {flags}m)"
            )

        def step_rows(t: str) -> tuple[str, str, str]:
            """The block's input, spike-gradient and grad_x rows of step ``t``."""
            return xrow(t), f"grad_spikes[{t}, n0:n0 + m]", f"grad_x[{t}, n0:n0 + m]"

        kept = S if saved else replayed(grads)
        n = reverse_steps(grads)

        def after(t: str) -> list[str]:
            """The block's state rows after step ``t``."""
            return saved_list(t) if saved else row_list(f"{t} + 1", kept)

        def group(t: str, old: list[str]) -> str:
            """Steps ``t`` down to ``t - n + 1``, all of them counting, from the states before the last, ``old``
            (``valid`` is n, written as an expression of ``T`` so that numba types it as an integer, not as a
            literal, which would compile the row function once more)."""
            xs, gys, gxs = (list(r) for r in zip(*(step_rows(f"{t} - {u}") for u in range(n))))
            flags = "".join(first(f"{t} - {u}") for u in range(n)) + (f"min(T, {n}), " if n > 1 else "")
            return call(xs, gys, gxs, old, [after(f"{t} - {u}") for u in range(n)], flags)

        def steps_left(initial: list[str]) -> list[str]:
            """The ``T % n`` steps left at the bottom (k - 1 down to 0): the same row function, the steps past
            step 0 not counting. Their input and spike-gradient rows are a zeroed spare, their states a copy of
            the initial ones (the last counting step's old states), and each row they write is a spare of its own:
            a row written twice, or read through another argument, would break the promise of
            :func:`~spikefuse.ops.numba_common.rows_apart` (results undefined)."""
            if n == 1:
                return []
            copies = [f"spare[{i}]" for i in range(len(S))]
            spare_in = f"spare[{len(S)}]"

            def spare_out(u: int) -> str:
                return f"spare[{len(S) + u}]"

            lines = [
                "    if T % " + str(n) + ":",
                f"        spare = np.zeros(({len(S) + n}, m), F)",
                "        for j in range(m):",
                *[f"            spare[{i}, j] = {r}[j]" for i, r in enumerate(initial)],
            ]
            for k in range(1, n):
                rows, news = [], []
                for u in range(n):
                    if u < k:
                        rows.append(step_rows(str(k - 1 - u)))
                        news.append(after(str(k - 1 - u)))
                    else:
                        rows.append((spare_out(u) if over == "input" else spare_in, spare_in, spare_out(u)))
                        news.append([spare_out(u)] + copies[1:] if over == "state" and u > k else copies)
                old = [spare_in] + copies[1:] if over == "state" else copies
                xs, gys, gxs = (list(r) for r in zip(*rows))
                flags = "".join(first(str(k - 1 - u)) for u in range(n)) + f"T % {n}, "
                lines += [
                    f"        {'if' if k == 1 else 'elif'} T % {n} == {k}:",
                    "            " + call(xs, gys, gxs, old, news, flags),
                ]
            return lines

        if saved:  # hist: the initial states only; the others are the forward's
            states = [
                f"    hist = np.empty(({len(S)}, m), F)",
                *load_rows([f"hist[{i}]" for i in range(len(S))], [f"init_{k}" for k in S], "    "),
            ]
            bottom = f"    {group(str(n - 1), row_list('0', S))}"
            steps = [
                f"    for t in range(T - 1, {n - 1}, -{n}):",
                f"        {group('t', saved_list(f't - {n}'))}",
                *([bottom] if n == 1 else [f"    if T % {n} == 0:", "    " + bottom]),
                *steps_left(row_list("0", S)),
            ]
        else:
            carried = [k for k in S if k not in kept]

            def recompute(steps: int) -> str:
                """The recompute of steps t..t+steps-1 into their rows of ``hist``."""
                new_rows = "".join(
                    f"hist[(t + {u + 1}) * {len(kept)} + {i}], " for u in range(steps) for i in range(len(kept))
                )
                suffix = f"_x{steps}" if steps > 1 else ""
                if by_row:
                    made, inputs = made_rows(steps), args("", [f"xs[{u}]" for u in range(steps)])
                else:
                    made, inputs = "", args("", [xrow(f"t + {u}") for u in range(steps)])
                return (
                    f"{made}        _recompute_row{g}{suffix}{sfx}({inputs}{rows('t', kept)}{new_rows}{prow}"
                    f"{first('t')}m)"
                )

            states = [
                *(made_rows_setup(per_pass) if by_row else ["    xs = source_tile(x, n0, m, src)"] if tile else []),
                f"    hist = np.empty(((T + 1) * {len(kept)}, m), F)",
                *[f"    c_{k} = np.empty(m, F)" for k in carried],
                *load_rows(
                    [f"hist[{i}]" for i in range(len(kept))] + [f"c_{k}" for k in carried],
                    [f"init_{k}" for k in (*kept, *carried)],
                    "    ",
                ),
                *in_passes(recompute),
            ]
            steps = [
                f"    for t in range(T - 1, {n - 2}, -{n}):",
                f"        {group('t', after(f't - {n}'))}",
                *steps_left(row_list("0", kept)),
            ]
        return [
            "@njit(cache=True, error_model='numpy')",
            f"def _backward_block{mode}{g}{sfx}({bwd_args}n0, m):",
            "    T = x.shape[0]",
            "    N = x.shape[1]",
            *load_params("    "),
            *states,
            *[f"    gS_{k} = np.empty(m, F)" for k in S],
            *load_rows([f"gS_{k}" for k in S], [f"gfinal_{k}" for k in S], "    "),
            "    gs = np.zeros(m, F)",
            *([f"    acc_{p} = np.zeros(m, F)" for p in P] if grads else []),
            *(handoff_grads(grads, saved) if model.handoff else []),
            *steps,
            *initial_grads(grads, kept),
            "",
            "",
            "@njit(parallel=True, cache=True, error_model='numpy')",
            f"def backward{mode}{g}{sfx}({bwd_args}block):",
            "    N = x.shape[1]",
            "    for b in prange((N + block - 1) // block):",
            "        n0 = b * block",
            f"        _backward_block{mode}{g}{sfx}({bwd_args}n0, min(block, N - n0))",
        ]

    def forward_kernels(self) -> list[str]:
        """The forward kernels: the row functions of one or several steps (also those of the recomputing
        backward), and the blocks and their parallel launchers of the plain forward, of the forward from a fused
        BatchNorm's input (suffix ``_src``) and of the forward that saves every step's states (``_save``)."""
        (
            S,
            fin,
            final_states,
            forward_steps,
            init,
            initial_check,
            load_params,
            load_rows,
            made_rows_setup,
            par,
            per_pass,
            replayed,
            sav,
            sfx,
            step_row,
        ) = (
            self.S,
            self.fin,
            self.final_states,
            self.forward_steps,
            self.init,
            self.initial_check,
            self.load_params,
            self.load_rows,
            self.made_rows_setup,
            self.par,
            self.per_pass,
            self.replayed,
            self.sav,
            self.sfx,
            self.step_row,
        )
        return [
            *(
                line
                for steps in (1, per_pass)
                for line in (
                    *step_row("_forward_row", "st_", "st_", spikes=True, steps=steps),
                    *(
                        line
                        for g in ("", "_grads")
                        for line in step_row(
                            f"_recompute_row{g}",
                            "o_",
                            "w_",
                            spikes=False,
                            steps=steps,
                            carried=tuple(k for k in S if k not in replayed(bool(g))),
                        )
                    ),
                    # memory="potential": the forward also writes every step's states out (rows of `saved`)
                    *step_row("_forward_save_row", "st_", "st_", spikes=True, save=True, steps=steps),
                )
            ),
            "@njit(cache=True, error_model='numpy')",
            f"def _forward_block{sfx}(x, {par}{init}inner, spikes, one, bits, {fin}n0, m):",
            *load_params("    "),
            *[f"    st_{k} = np.empty(m, F)" for k in S],
            *load_rows([f"st_{k}" for k in S], [f"init_{k}" for k in S], "    "),
            *initial_check(),
            *forward_steps(save=False),
            *final_states(),
            "",
            "",
            "@njit(parallel=True, cache=True, error_model='numpy')",
            f"def forward{sfx}(x, {par}{init}inner, spikes, one, bits, {fin}block):",
            "    N = x.shape[1]",
            "    bad = 0",  # neurons that read a NaN or an inf
            "    for b in prange((N + block - 1) // block):",
            "        n0 = b * block",
            f"        bad += _forward_block{sfx}(x, {par}{init}inner, spikes, one, bits, {fin}n0, min(block, N - n0))",
            "    return bad",
            "",
            "",
            # the input is the BatchNorm of x (plus a residual), each block normalizing a step's rows right before it
            "@njit(cache=True, error_model='numpy')",
            f"def _forward_block_src{sfx}(x, src, {par}{init}inner, spikes, one, bits, {fin}n0, m):",
            *made_rows_setup(per_pass),
            *load_params("    "),
            *[f"    st_{k} = np.empty(m, F)" for k in S],
            *load_rows([f"st_{k}" for k in S], [f"init_{k}" for k in S], "    "),
            *initial_check(),
            *forward_steps(save=False, source=True),
            *final_states(),
            "",
            "",
            "@njit(parallel=True, cache=True, error_model='numpy')",
            f"def forward_src{sfx}(x, src, {par}{init}inner, spikes, one, bits, {fin}block):",
            "    N = x.shape[1]",
            "    bad = 0",  # neurons that read a NaN or an inf
            "    for b in prange((N + block - 1) // block):",
            "        n0 = b * block",
            f"        bad += _forward_block_src{sfx}(x, src, {par}{init}inner, spikes, one, bits, {fin}n0, min(block, N - n0))",
            "    return bad",
            "",
            "",
            "@njit(cache=True, error_model='numpy')",
            f"def _forward_block_save{sfx}(x, {par}{init}inner, spikes, one, {fin}{sav}n0, m):",
            *load_params("    "),
            *[f"    st_{k} = np.empty(m, F)" for k in S],
            *load_rows([f"st_{k}" for k in S], [f"init_{k}" for k in S], "    "),
            *initial_check(),
            *forward_steps(save=True),
            *final_states(),
            "",
            "",
            "@njit(parallel=True, cache=True, error_model='numpy')",
            f"def forward_save{sfx}(x, {par}{init}inner, spikes, one, {fin}{sav}block):",
            "    N = x.shape[1]",
            "    bad = 0",  # neurons that read a NaN or an inf
            "    for b in prange((N + block - 1) // block):",
            "        n0 = b * block",
            f"        bad += _forward_block_save{sfx}(x, {par}{init}inner, spikes, one, {fin}{sav}n0, min(block, N - n0))",
            "    return bad",
        ]

    def source(self) -> list[str]:
        """Every kernel of this parameter layout."""
        parts = [self.forward_kernels()]
        parts += [self.reverse_rows(grads, over) for grads in (False, True) for over in OVER_SUFFIX]
        parts += [self.backward(grads, saved) for grads in (False, True) for saved in (False, True)]
        parts += [self.backward(grads, True, over="state") for grads in (False, True)]
        parts += [self.backward(grads, False, over="input") for grads in (False, True)]
        parts += [self.backward(grads, False, tile=True) for grads in (False, True)]
        return [line for part in parts for line in (*part, "", "")]


def kernel_source(model, surrogate_type, dtype: torch.dtype) -> str:
    """The Python source of the forward and backward kernels of ``model`` with ``surrogate_type``'s derivative."""
    per_neuron, scalar = (_Source(model, surrogate_type, dtype, layout) for layout in (False, True))
    header = [
        f'"""Generated by spikefuse.ops.engine.cpu for the neuron {model.name!r} ({model.key}), surrogate '
        f'{surrogate_type.__name__}, {dtype}. Do not edit: rewritten when the generator changes."""',
        "import numpy as np",
        "from numba import njit, prange",
        "from spikefuse.batchnorm.cpu import source_factors, source_row, source_tile",
        (
            "from spikefuse.ops.numba_common import channel_row, exp as vexp, load_row, non_finite, pack_rows, "
            "prefer_wide_vectors, rows_apart"
        ),
        f"F = {per_neuron.np_dtype}",
        "",
        *emit.model_facts(model),
        "# The states each block's scratch keeps every step of, without and with parameter gradients",
        f"REPLAYED_STATES = {{False: {per_neuron.replayed(False)!r}, True: {per_neuron.replayed(True)!r}}}",
        "",
    ]
    return "\n".join(header + per_neuron.source() + ["", ""] + scalar.source()) + "\n"


def kernels(model, surrogate_type, dtype: torch.dtype):
    """The imported module of ``model``'s kernels (generated on first use, then cached on disk)."""
    tag = _NP_DTYPES[dtype].__name__
    return emit.load_generated(
        "cpu", model, surrogate_type, tag, _GENERATOR, lambda: kernel_source(model, surrogate_type, dtype)
    )


# --------------------------------------------------------------------------------------------------- entry points


def _np(t: torch.Tensor):
    return t.detach().contiguous().numpy()


def _params(params: list, dtype: torch.dtype) -> tuple[str, list]:
    """The kernel variant's suffix and its parameter arguments: scalars when every parameter has one value."""
    if all(p.numel() == 1 for p in params):
        return "_scalar", [_NP_DTYPES[dtype](float(p)) for p in params]
    return "", [_np(p) for p in params]


def _block(n: int, threads: int, scratch_per_neuron: int = 0, scratch_bytes: int = SCRATCH_BYTES) -> int:
    """Neurons per parallel task: :data:`BLOCK`, fewer where the backward's scratch would outgrow ``scratch_bytes``
    (a multiple of 64 neurons, not below :data:`MIN_BLOCK`) or some thread would get no block."""
    block = BLOCK
    if scratch_per_neuron:
        block = max(MIN_BLOCK, min(BLOCK, scratch_bytes // scratch_per_neuron // 64 * 64))
    return block_for(n, threads, block)


def _threads(work: int) -> int:
    """The threads of a call of ``work`` neuron steps: one below :data:`SERIAL_WORK`, else numba's (torch's count)."""
    return 1 if work < SERIAL_WORK else match_numba_threads()


def _launch(module, name: str, args: tuple, n: int, block: int):
    """The kernel ``name`` over ``n`` neurons in blocks of ``block``: its parallel launcher, or for a single block
    the block's function itself, called directly (``_forward_block`` for ``forward``), so that no launcher is
    compiled or its threads woken for it."""
    if n > block:
        return getattr(module, name)(*args, block)
    kind, _, rest = name.partition("_")
    return getattr(module, f"_{kind}_block_{rest}".rstrip("_"))(*args, 0, n) if n else 0


def _surrogate_args(surrogate, dtype) -> tuple:
    """The surrogate's two parameters as scalars of the compute dtype."""
    return tuple(_NP_DTYPES[dtype](v) for v in surrogate.params())


def forward(neuron, inputs, *, save=False, spike_dtype=None, src=None, spike_bits=False):
    """The engine's entry point (arguments as :mod:`spikefuse.ops.engine.reference`), with the options of this
    backend alone, which a caller asks for by calling it by name (the fused BatchNorm,
    :mod:`spikefuse.batchnorm.autograd`), not through the engine's dispatch.

    ``src`` (not with ``save``): the ``src`` argument of the ``_src`` kernels, a fused BatchNorm
    (:func:`spikefuse.batchnorm.cpu.source_args`): ``x`` is the raw input ``[T*B, C, ...]`` merged, and the
    neurons' input is its BatchNorm (plus residual), which each block makes a step's row at a time right before
    reading it, bit-identical to ``native_batch_norm``'s.
    ``spike_bits`` (not with ``save``): each block also packs the spike rows it wrote into bits while they are in
    cache, and :func:`spikefuse.ops.bitpack.remember` hands them to whoever packs these spikes next (a spike layer
    saving its input, :mod:`spikefuse.nn.spike_layers`): no pass over the spikes to pack them. Only where every
    step's row starts on a byte (``N`` a multiple of 8); elsewhere the consumer packs them itself."""
    model, (x2, params, init, inner) = neuron.model, inputs
    t_steps, n = x2.shape
    if save and src is not None:
        raise ValueError("engine cpu backend: src runs the forward that saves nothing (no save)")
    module = kernels(model, type(neuron.surrogate), x2.dtype)
    threads = _threads(t_steps * n)
    spike_dtype = spike_dtype or x2.dtype
    spikes = buffers.empty((t_steps, n), spike_dtype)
    if spike_dtype in _ONE_BITS:  # the kernels write 0 or the bit pattern of 1.0 through a 16-bit integer view
        spike_array, one = spikes.view(torch.int16).numpy(), _NP_DTYPES[x2.dtype](_ONE_BITS[spike_dtype])
    else:
        spike_array, one = spikes.numpy(), _NP_DTYPES[x2.dtype](1.0)
    final = [buffers.empty((n,), x2.dtype) for _ in model.states]
    saved = [buffers.empty((t_steps, n), x2.dtype) for _ in model.states] if save else []
    suffix, par = _params(params, x2.dtype)
    if src is None:
        name, source = "forward_save" if save else "forward", ()
    else:
        name, source = "forward_src", (src,)
    bits = torch.empty((t_steps, n // 8), dtype=torch.uint8) if spike_bits and not save and n % 8 == 0 else None
    bits_arg = () if save else (_NO_BITS if bits is None else bits.numpy(),)
    args = (
        _np(x2),
        *source,
        *par,
        *(_np(v) for v in init),
        int(inner),
        spike_array,
        one,
        *bits_arg,
        *(f.numpy() for f in final),
        *(v.numpy() for v in saved),
    )
    bad = _launch(module, name + suffix, args, n, _block(n, threads))  # the blocks that read a NaN or an inf
    if bad:
        refuse_non_finite(x2, init, otherwise="the fused BatchNorm's output (plus its residual) holds NaN or inf")
    if bits is not None:
        bitpack.remember(spikes, bits.view(-1), spikes=True)
    return spikes, final, saved


def backward(
    neuron,
    inputs,
    grad_spikes,
    grad_final,
    need_param_grads,
    *,
    saved=(),
    overwrite_saved=False,
    overwrite_x=False,
    src=None,
):
    """The engine's entry point (arguments as :mod:`spikefuse.ops.engine.reference`), with the option of this
    backend alone (see :func:`forward`): ``src`` (states recomputed; ``x`` is then not written over), the ``src``
    argument of the ``_src`` kernels: ``x`` is the raw input ``[T*B, C, ...]`` merged, and the neurons' input is its
    BatchNorm (plus residual), which each block computes into a tile in cache, bit-identical to
    ``native_batch_norm``'s."""
    model, surrogate, (x2, params, init, inner) = neuron.model, neuron.surrogate, inputs
    t_steps, n = x2.shape
    if saved and (src is not None or overwrite_x):
        raise ValueError("engine cpu backend: src and overwrite_x need the states recomputed (no saved)")
    module = kernels(model, type(surrogate), x2.dtype)
    threads = _threads(t_steps * n)
    over = bool(saved) and overwrite_saved
    over_x = overwrite_x and src is None
    grad_x = saved[0] if over else x2 if over_x else buffers.empty((t_steps, n), x2.dtype)
    grad_init = [buffers.empty((n if v.numel() == n else 0,), x2.dtype) for v in init]
    per_neuron = [buffers.empty((n if need else 0,), x2.dtype) for need in need_param_grads]
    suffix, par = _params(params, x2.dtype)
    source = () if src is None else (src,)
    head = (
        _np(grad_spikes),
        *(_np(g) for g in grad_final),
        _np(x2),
        *source,
        *par,
        *(_np(v) for v in init),
        *(_np(v) for v in saved),
        *_surrogate_args(surrogate, x2.dtype),
        neuron.detach_reset,
        int(inner),
    )
    outputs = (*(() if over or over_x else (grad_x.numpy(),)), *(g.numpy() for g in grad_init))
    # per neuron of a block: the recomputed states, and the input rows of a fused BatchNorm (every step's, when the
    # reverse pass reads them)
    replayed = len(module.REPLAYED_STATES[any(need_param_grads)])
    made_rows = (t_steps if module.BACKWARD_READS_INPUT else row_steps(model)) if source else 0
    scratch = 0 if saved else ((t_steps + 1) * replayed + made_rows) * x2.element_size()
    block = _block(n, threads, scratch, SOURCE_SCRATCH_BYTES if source else SCRATCH_BYTES)
    name = (
        "backward"
        + ("_saved" if saved else "")
        + ("_over" if over else "")
        + ("_over_x" if over_x else "")
        + ("_src" if source else "")
    )
    if any(need_param_grads):
        args = (*head, np.asarray(need_param_grads, dtype=np.bool_), *outputs, *(g.numpy() for g in per_neuron))
        _launch(module, name + "_grads" + suffix, args, n, block)
    else:
        _launch(module, name + suffix, (*head, *outputs), n, block)
    grad_params = [
        reduce_leak_grad(g, p.numel(), inner if p.numel() > 1 else 1) if need else None
        for g, p, need in zip(per_neuron, params, need_param_grads)
    ]
    return grad_x, [g if g.numel() else None for g in grad_init], grad_params
