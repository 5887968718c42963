"""The connectionist temporal classification recursion behind
:func:`fluxlike.losses.ctc_loss`: the labels and lengths checked and prepared, then the
forward (alpha) recursion of Graves et al. (2006) in log space, batched, in MLX ops, so that
``mx.grad`` differentiates it."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx

# "log 0" of the recursion: finite, so that the gradient through paths that cannot happen is
# 0 (exp(NEG - x)), where -inf would give exp(-inf - -inf) = NaN. Sums of a few NEG with the
# log-probabilities stay far from float32's limit (3.4e38).
NEG = -1e30


def _int_array(value: Any, name: str, what: str) -> mx.array:
    if isinstance(value, (list, tuple)):
        value = mx.array(value) if value else mx.zeros((0,), mx.int32)
    if not isinstance(value, mx.array) or not mx.issubdtype(value.dtype, mx.integer):
        got = f"{value.dtype} array" if isinstance(value, mx.array) else type(value).__name__
        raise TypeError(f"[ctc_loss] {name} must be {what} (an integer mx.array or a list of "
                        f"ints), got {got}")
    return value


def _read(values: list[mx.array]) -> list[int] | None:
    """Scalars read back to the host in one synchronisation; ``None`` inside ``mx.compile``
    (as :func:`fluxlike.checks.index_range`)."""
    try:
        return cast("list[int]", mx.stack([v.astype(mx.int64) for v in values]).tolist())
    except ValueError as error:
        if "function transformations" not in str(error):
            raise
        return None


def prepare(
    shape: tuple[int, ...], y: Any, input_lengths: Any, target_lengths: Any, blank: int
) -> tuple[mx.array, mx.array, mx.array, int, mx.array]:
    """Check the targets of a ``(batch, time, classes)`` prediction: returns ``(labels,
    input_lengths, target_lengths, blank, valid)`` with the padding past each target length
    replaced by the blank, ``blank`` made non-negative, and ``valid`` whether each sample's
    labels are in range (always true outside ``mx.compile``, where a bad one is a
    ``ValueError``)."""
    batch, time, classes = shape
    if isinstance(blank, bool) or not isinstance(blank, int) or not -classes <= blank < classes:
        raise ValueError(f"[ctc_loss] blank must be a class index in [{-classes}, {classes}) "
                         f"(-1: the last class, as Flux), got {blank!r}")
    blank %= classes
    labels = _int_array(y, "y", "the label sequences")
    if labels.ndim != 2 or labels.shape[0] != batch:
        raise ValueError(f"[ctc_loss] y must hold one label sequence per sample, of shape "
                         f"({batch}, max_target_length), got shape {tuple(labels.shape)}")
    length = labels.shape[1]
    lengths = []
    for name, given, most in (("input_lengths", input_lengths, time),
                              ("target_lengths", target_lengths, length)):
        if given is None:
            lengths.append(mx.full((batch,), most, mx.int32))
            continue
        given = _int_array(given, name, f"one length per sample, at most {most}")
        if given.shape != (batch,):
            raise ValueError(f"[ctc_loss] {name} must have shape ({batch},), one length per "
                             f"sample, got shape {tuple(given.shape)}")
        lengths.append(given)
    inputs, targets = lengths
    used = mx.arange(length)[None, :] < targets[:, None]
    valid = mx.all(~used | ((labels >= 0) & (labels < classes) & (labels != blank)), axis=1)
    read = _read([mx.min(inputs), mx.max(inputs), mx.min(targets), mx.max(targets),
                  mx.all(valid)]) if batch else None
    if read is not None:
        low_in, high_in, low_t, high_t, ok = read
        if low_in < 1 or high_in > time:
            raise ValueError(f"[ctc_loss] input_lengths must lie in [1, {time}] (the time "
                             f"axis), got values from {low_in} to {high_in}")
        if low_t < 0 or high_t > length:
            raise ValueError(f"[ctc_loss] target_lengths must lie in [0, {length}] (y's second "
                             f"axis), got values from {low_t} to {high_t}")
        if not ok:
            raise ValueError(
                f"[ctc_loss] labels must be class indices in [0, {classes}) other than the "
                f"blank ({blank}), 0-based; got one out of range or equal to the blank (Flux's "
                f"labels are 1-based: subtract 1)"
            )
    labels = mx.where(used & (labels >= 0) & (labels < classes), labels, blank)
    return labels, inputs, targets, blank, valid


def _logsumexp3(a: mx.array, b: mx.array, c: mx.array) -> mx.array:
    top = mx.stop_gradient(mx.maximum(mx.maximum(a, b), c))
    return top + mx.log(mx.exp(a - top) + mx.exp(b - top) + mx.exp(c - top))


def negative_log_likelihood(
    logp: mx.array, labels: mx.array, input_lengths: mx.array, target_lengths: mx.array,
    blank: int,
) -> mx.array:
    """``-log p(labels | logp)`` per sample, summed over every alignment: ``logp`` is
    ``(batch, time, classes)`` log-probabilities, ``labels`` ``(batch, S)`` class indices
    (anything past a target length is ignored). ``inf`` where no alignment fits (a target
    longer than its input allows)."""
    batch, time, _ = logp.shape
    dtype = logp.dtype
    blanks = mx.full((batch, 1), blank, labels.dtype)
    # the extended sequence: blank, l1, blank, l2, ..., blank (2S + 1 states)
    extended = mx.concatenate(
        [mx.stack([mx.broadcast_to(blanks, labels.shape), labels], axis=2)
         .reshape(batch, -1), blanks], axis=1)
    states = extended.shape[1]
    emit = mx.take_along_axis(
        logp, mx.broadcast_to(extended[:, None, :], (batch, time, states)), axis=2)
    # a state may be reached from two back: a label other than the blank and the label before
    before = mx.concatenate([mx.full((batch, 2), blank, extended.dtype), extended[:, :-2]],
                            axis=1)
    skip = (extended != blank) & (extended != before)
    neg = mx.array(NEG, dtype)
    position = mx.arange(states)[None, :]
    alpha = mx.where(position < 2, emit[:, 0, :], neg)
    pad1, pad2 = mx.full((batch, 1), NEG, dtype), mx.full((batch, 2), NEG, dtype)
    for t in range(1, time):
        one = mx.concatenate([pad1, alpha[:, :-1]], axis=1)
        two = mx.where(skip, mx.concatenate([pad2, alpha[:, :-2]], axis=1), neg)
        stepped = emit[:, t, :] + _logsumexp3(alpha, one, two)
        alpha = mx.where((t < input_lengths)[:, None], stepped, alpha)
    end = (2 * target_lengths)[:, None]
    last = mx.take_along_axis(alpha, end, axis=1)[:, 0]
    previous = mx.take_along_axis(alpha, mx.maximum(end - 1, 0), axis=1)[:, 0]
    previous = mx.where(target_lengths > 0, previous, neg)
    top = mx.stop_gradient(mx.maximum(last, previous))
    likelihood = top + mx.log(mx.exp(last - top) + mx.exp(previous - top))
    return mx.where(likelihood < NEG / 2, mx.array(float("inf"), dtype), -likelihood)
