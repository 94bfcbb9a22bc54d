"""The plain-PyTorch references of the sparse products (:mod:`.cpu`), their oracle: the same sums in the same order.

:func:`linear_reference` and :func:`weight_grad_reference` add, for each output element, the terms the kernels add
(``value * weight``: for spikes every value is 1, the weights themselves) in the kernels' order, from zero, one term
at a time, so the kernels equal them bit for bit; against torch's dense product (its own blocked order) both agree to
rounding. The recurrent layer's reference current (:class:`spikefuse.ops.recurrent.SparseCurrent`) is
:func:`linear_reference` too.
"""

from __future__ import annotations

import torch

__all__ = ["linear_reference", "weight_grad_reference"]


def _entries(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, C]`` indices and values: row ``r``'s nonzero columns of ``x [R, C']`` in increasing order and their
    values, padded with ``C'`` (an index past the last column) and 0 to the longest row's count."""
    rows, cols = x.shape
    r, c = x.nonzero(as_tuple=True)  # row-major: columns increasing within a row
    counts = torch.bincount(r, minlength=rows)
    width = int(counts.max()) if rows else 0
    first = torch.cumsum(counts, 0) - counts
    place = (r, torch.arange(r.numel(), device=x.device) - first[r])
    lists = torch.full((rows, width), cols, dtype=torch.long, device=x.device)
    lists[place] = c
    values = x.new_zeros(rows, width)
    values[place] = x[r, c]
    return lists, values


def _summed_in_order(lists: torch.Tensor, values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Row ``r``: ``table[lists[r, 0]] * values[r, 0] + table[lists[r, 1]] * values[r, 1] + ...`` from zero, one
    term at a time, padding reading an appended zero row times 0 (``acc + 0`` is ``acc``: the sum never holds
    -0.0)."""
    table = torch.cat([table, table.new_zeros(1, table.shape[1])])
    acc = table.new_zeros(lists.shape[0], table.shape[1])
    for j in range(lists.shape[1]):
        acc = acc + table[lists[:, j]] * values[:, j, None]
    return acc


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`.cpu.linear` and :func:`.cpu.csr_linear` in plain torch ops, their oracle: ``x [M, K] @ weight.T (+
    bias)`` for ``weight [N, K]``, summing for each row ``value * weight`` over its nonzero inputs from zero in
    increasing ``k`` (for spikes every value is 1: the weights themselves), then adding the bias. Any device;
    differentiable in ``weight`` and ``bias``."""
    acc = _summed_in_order(*_entries(x), weight.t())
    return acc if bias is None else acc + bias


def weight_grad_reference(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """:func:`.cpu.weight_grad` and :func:`.cpu.csr_weight_grad` in plain torch ops, their oracle: ``grad [M, N].T @ x
    [M, K]``, summing for each input ``k`` ``gradient row * value`` over the rows where it is nonzero, from zero in
    increasing ``m``."""
    return _summed_in_order(*_entries(x.t()), grad).t()
