"""``EmbeddingBag``: bags of indices, each reduced to one vector of an embedding table
(:class:`~fluxlike.Embedding`'s lookup, in :mod:`.basic`, then a sum, mean or maximum)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np

from ..checks import check_size, initialise
from .base import Layer
from .basic import _standard_normal, lookup

REDUCTIONS = ("mean", "sum", "max")
_FUNCTIONS = {mx.mean: "mean", mx.sum: "sum", mx.max: "max"}


class EmbeddingBag(Layer):
    """An embedding table whose lookups are reduced over bags of indices, Flux's (and
    PyTorch's) ``EmbeddingBag``: each bag of indices gives one vector, the mean (default), sum
    or maximum of its rows of ``weight``.

    ``EmbeddingBag(vocab, dims, reduction="mean", *, init=standard normal)``: ``weight`` has
    shape ``(vocab, dims)``, as :class:`~fluxlike.Embedding`'s; ``reduction`` is ``"mean"``,
    ``"sum"`` or ``"max"`` (or ``mx.mean``, ``mx.sum``, ``mx.max``). Indices are 0-based,
    checked as :class:`~fluxlike.Embedding` checks them. The bags are given as

    - an integer array ``(..., L)``: bags of equal length ``L`` on the last axis, giving
      ``(..., dims)`` (a 1-D array is one bag, giving ``(dims,)``; Flux's bags are columns);
    - ``bag(indices, offsets)``: PyTorch's and Flux's ragged form, a 1-D array of every bag's
      indices one after the other and the 0-based start of each bag (``offsets[0] == 0``,
      non-decreasing), giving ``(len(offsets), dims)``; the offsets are read on the host;
    - a list of 1-D index arrays or lists (one per bag, of any lengths).

    An empty bag gives zeros. Precision: policy "none"; the output has the weight's dtype
    (float32 under autocast, like :class:`~fluxlike.Embedding`'s).

    >>> import mlx.core as mx
    >>> from fluxlike import EmbeddingBag
    >>> bag = EmbeddingBag(10, 4)
    >>> bag
    EmbeddingBag(10 => 4)  # 40 parameters
    >>> bag(mx.array([[1, 2, 3], [4, 5, 9]])).shape
    (2, 4)
    >>> bag(mx.array([1, 2, 3, 4, 5]), [0, 2]).shape  # bags [1, 2] and [3, 4, 5]
    (2, 4)
    >>> EmbeddingBag(10, 4, "sum")([[1, 2], [3], []]).shape
    (3, 4)
    >>> EmbeddingBag(10, 4, "max")
    EmbeddingBag(10 => 4, reduction='max')  # 40 parameters
    """

    def __init__(
        self,
        vocab: int,
        dims: int,
        reduction: str | Callable = "mean",
        *,
        init: Callable[[tuple[int, ...]], mx.array] = _standard_normal,
    ):
        super().__init__()
        vocab = check_size(vocab, "EmbeddingBag", "vocab")
        dims = check_size(dims, "EmbeddingBag", "dims")
        if callable(reduction):
            reduction = _FUNCTIONS.get(reduction, reduction)
        if reduction not in REDUCTIONS:
            raise ValueError(f"[EmbeddingBag] reduction must be one of {list(REDUCTIONS)} "
                             f"(or mx.mean, mx.sum, mx.max), got {reduction!r}")
        self.reduction = reduction
        self.weight = initialise(init, (vocab, dims), "EmbeddingBag")

    def __call__(self, x: mx.array | Sequence[Any], offsets: Any = None) -> mx.array:
        if offsets is not None:
            return self._ragged(x, offsets)
        if isinstance(x, (list, tuple)):
            return self._ragged(*_concatenated(x))
        rows = lookup(self["weight"], x, "EmbeddingBag")  # (..., L, dims)
        x = cast("mx.array", x)  # (lookup checked it)
        if x.ndim == 0:
            raise ValueError("[EmbeddingBag] expected a bag of indices (..., L), got a 0-d "
                             "array; one index is a bag of one: x.reshape(1)")
        if x.shape[-1] == 0:  # bags of length zero
            return mx.zeros((*x.shape[:-1], rows.shape[-1]), dtype=rows.dtype)
        if self.reduction == "mean":
            return rows.mean(axis=-2)
        return rows.sum(axis=-2) if self.reduction == "sum" else rows.max(axis=-2)

    def _ragged(self, indices: Any, offsets: Any) -> mx.array:
        """Bags ``indices[offsets[b]:offsets[b + 1]]``, padded on the host into a
        ``(bags, longest)`` block and reduced with its mask."""
        if not isinstance(indices, mx.array) or indices.ndim != 1:
            got = (f"shape {tuple(indices.shape)}" if isinstance(indices, mx.array)
                   else type(indices).__name__)
            raise ValueError(f"[EmbeddingBag] bag(indices, offsets) takes a 1-D array of "
                             f"indices, got {got}")
        starts = np.asarray(offsets.tolist() if isinstance(offsets, mx.array) else offsets)
        n = indices.shape[0]
        if (starts.ndim != 1 or starts.size == 0 or not np.issubdtype(starts.dtype, np.integer)
                or starts[0] != 0 or (np.diff(starts) < 0).any() or starts[-1] > n):
            raise ValueError(
                f"[EmbeddingBag] offsets must be the 0-based start of each bag: a non-empty "
                f"1-D list of integers starting at 0, non-decreasing, at most the number of "
                f"indices ({n}), got {offsets!r}"
            )
        lengths = np.diff(np.append(starts, n))
        weight = self["weight"]
        if n == 0:
            return mx.zeros((starts.size, weight.shape[1]), dtype=weight.dtype)
        steps = np.arange(max(int(lengths.max()), 1))
        mask = steps < lengths[:, None]  # (bags, longest)
        positions = np.where(mask, starts[:, None] + steps, 0)
        rows = lookup(weight, indices[mx.array(positions)], "EmbeddingBag")
        keep = mx.array(mask)[..., None]
        if self.reduction == "max":
            low = mx.array(-np.inf, dtype=rows.dtype)
            top = mx.where(keep, rows, low).max(axis=1)
            return mx.where(mx.array(lengths > 0)[:, None], top, mx.zeros_like(top))
        total = mx.where(keep, rows, mx.zeros_like(rows)).sum(axis=1)
        if self.reduction == "sum":
            return total
        return total / mx.array(np.maximum(lengths, 1)[:, None], dtype=total.dtype)

    def signature(self) -> str:
        vocab, dims = self.weight.shape
        extra = "" if self.reduction == "mean" else f", reduction={self.reduction!r}"
        return f"EmbeddingBag({vocab} => {dims}{extra})"


def _concatenated(bags: Sequence[Any]) -> tuple[mx.array, list[int]]:
    """A list of bags (1-D arrays or lists of ints) as ``(indices, offsets)``."""
    parts, offsets, start = [], [], 0
    for k, bag in enumerate(bags):
        values = np.asarray(bag.tolist() if isinstance(bag, mx.array) else bag)
        if values.ndim != 1 or not (values.size == 0 or np.issubdtype(values.dtype, np.integer)):
            raise TypeError(f"[EmbeddingBag] each bag must be a 1-D list or array of integer "
                            f"indices, got {bag!r} for bag {k}")
        parts.append(values.astype(np.int64))
        offsets.append(start)
        start += values.size
    if not offsets:
        raise ValueError("[EmbeddingBag] expected at least one bag, got an empty list")
    return mx.array(np.concatenate(parts).astype(np.int32)), offsets
