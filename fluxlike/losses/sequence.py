"""Sequence losses: ``ctc_loss``."""

from __future__ import annotations

import mlx.core as mx

from ..precision.kernels import stable_logsoftmax
from . import _ctc
from ._common import (
    Agg,
    _aggregate,
    _check_prediction,
    _compute_dtype,
)


def ctc_loss(
    yhat: mx.array,
    y: mx.array | list,
    *,
    input_lengths: mx.array | list | None = None,
    target_lengths: mx.array | list | None = None,
    blank: int = -1,
    agg: Agg = "mean",
) -> mx.array:
    """Connectionist temporal classification loss (Graves et al., 2006): ``-log p(y | ŷ)``,
    summed over every alignment of the label sequence ``y`` to the time steps of ``ŷ``.

    ``ŷ``: the network's raw outputs, ``(batch, time, classes)`` (or ``(time, classes)``
    for one sequence, as Flux's ``ctc_loss``); ``logsoftmax`` over the classes is applied
    here, as in Flux. ``y``: 0-based integer labels, ``(batch, max_target_length)`` (or one
    sequence), without blanks; entries past a sample's ``target_lengths`` are ignored
    (padding). ``input_lengths``/``target_lengths``: each sample's time steps and labels
    (default: all). ``blank``: the blank class (``-1``: the last, as Flux). ``agg`` reduces
    the per-sample losses (PyTorch's ``"mean"`` also divides each by its target length;
    this is Flux's plain mean). A sample whose target cannot fit its input is ``inf``.

    Computed in float32 (float64 inputs in float64) by the log-space forward recursion, one
    step per time step, differentiable by ``mx.grad``. The lengths and labels are checked
    (one host read); inside ``mx.compile`` a bad label makes its sample's loss NaN instead.

    >>> import mlx.core as mx
    >>> from fluxlike.losses import ctc_loss
    >>> logits = mx.array([[1.0, 2.0, 3.0], [2.0, 1.0, 3.0], [3.0, 1.0, 2.0]])  # (time, classes)
    >>> ctc_loss(logits, mx.array([0, 1])).item()  # Flux's test value (its 1-based [1, 2])
    3.69907
    >>> batch = mx.stack([logits, logits])
    >>> ctc_loss(batch, mx.array([[0, 1], [1, -1]]), target_lengths=[2, 1], agg="none")
    array([3.69907, 2.2339], dtype=float32)
    """
    reduce = _aggregate(agg, "ctc_loss")
    _check_prediction(yhat, "ctc_loss")
    if yhat.ndim not in (2, 3) or not mx.issubdtype(yhat.dtype, mx.floating):
        raise ValueError(
            f"[ctc_loss] expected floating logits of shape (batch, time, classes) or (time, "
            f"classes), got a {yhat.dtype} array of shape {tuple(yhat.shape)}"
        )
    one = yhat.ndim == 2
    if one:
        yhat = yhat[None]
        y = _ctc._int_array(y, "y", "a label sequence")[None]
        if input_lengths is not None or target_lengths is not None:
            raise ValueError("[ctc_loss] lengths are per sample: give a batch (batch, time, "
                             "classes) with them, or leave them out for one sequence")
    labels, inputs, targets, blank, valid = _ctc.prepare(
        yhat.shape, y, input_lengths, target_lengths, blank)
    logp = stable_logsoftmax(yhat.astype(_compute_dtype(yhat)), axis=-1)
    losses = _ctc.negative_log_likelihood(logp, labels, inputs, targets, blank)
    losses = mx.where(valid, losses, mx.array(float("nan"), losses.dtype))
    return reduce(losses[0] if one else losses)
