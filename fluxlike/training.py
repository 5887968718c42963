"""The training loop, as in Flux: ``train`` makes one pass over the data.

Float16 gradients underflow, so ``train(..., autocast=mx.float16)`` scales the loss with a
:class:`~fluxlike.DynamicLossScale` by default; the scale lives in ``opt_state.loss_scale``,
so it carries over from one ``train`` call to the next and into checkpoints.
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from collections.abc import Callable, Iterable, Sized
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from . import workarounds  # noqa: F401  (registers the exit guard for worker threads)
from ._mlxtyping import tree_flatten
from .gradients import _check_autocast, _value_and_grad
from .optimisers.compiled import COMPILED, assign
from .optimisers.state import OptState, claim, update
from .precision import lossscale
from .precision.lossscale import DynamicLossScale, all_finite


def _check_call(loss: Callable, model: nn.Module, args: tuple, data: Any, where: str) -> None:
    """Refuse a first batch that ``loss(model, *batch)`` cannot take, saying how ``train``
    calls it (else the error is Python's, naming neither)."""
    try:
        signature = inspect.signature(loss)
    except (TypeError, ValueError):  # a builtin or the like: let the call speak
        return
    try:
        signature.bind(model, *args)
    except TypeError as e:
        kinds = ", ".join(type(a).__name__ for a in args)
        hint = ""
        if isinstance(data, tuple) and all(isinstance(a, mx.array) for a in data):
            hint = ("; data is a tuple of arrays, so each batch is one of them: for one batch "
                    "(x, y) pass [(x, y)], for batches of it DataLoader((x, y), batchsize=...)")
        raise TypeError(f"{where}: the loss is called as loss(model, *batch), here with a batch "
                        f"of {len(args)} ({kinds}), and cannot take that: {e}{hint}") from None


def _restore(model: nn.Module, opt_state: OptState, scale_state: dict, before: tuple) -> None:
    """Put back the model, optimiser, loss-scale and random state saved before a batch."""
    params, optimizer_state, scale, key = before
    model.update(params)
    assign(opt_state.optimizer.state, optimizer_state, prune=True)
    compiled = COMPILED.get(opt_state)
    if compiled is not None:  # state made for thawed parts may be gone: let update look again
        compiled.initialised.clear()
    scale_state.update(scale)
    # mx.random.state takes no assignment: seed to the key. (MLX's stub lacks mx.random.state,
    # a list: [key].)
    if mx.random.state[0] is not key:  # type: ignore[index]
        hi, lo = key.tolist()
        mx.random.seed((hi << 32) | lo)


class _Progress:
    """A one-line text progress bar on a terminal stream."""

    WIDTH = 30

    def __init__(self, total: int | None, stream: Any):
        self.total, self.stream = total, stream
        self.shown_at = 0.0

    def show(self, done: int, mean_loss: float, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.shown_at < 0.1:  # redraw at most ten times a second
            return
        self.shown_at = now
        if self.total:
            filled = self.WIDTH * done // self.total
            bar = "[" + "=" * filled + " " * (self.WIDTH - filled) + "] "
            count = f"{done}/{self.total}"
        else:
            bar, count = "", f"{done}"
        self.stream.write(f"\r{bar}{count} loss {mean_loss:.4g}" + ("\n" if final else ""))
        self.stream.flush()


def train(
    loss: Callable[..., mx.array],
    model: nn.Module,
    data: Iterable,
    opt_state: OptState,
    *,
    autocast: mx.Dtype | None = None,
    loss_scale: Any = "auto",
    progress: bool = True,
    compile: bool = False,
) -> float:
    """One pass over ``data``: for each batch, ``loss(model, *batch)``, its gradient, and an
    :func:`update`. Returns the mean loss over the batches as a float (nan for no batches).

    A batch that is a tuple is splatted into ``loss``; anything else (an array, a dict)
    is passed as one argument. ``autocast`` is as in :func:`gradient`.

    ``loss_scale``: ``"auto"`` uses ``opt_state.loss_scale`` if it holds one, else makes a
    :class:`~fluxlike.DynamicLossScale` when ``autocast=mx.float16`` (bfloat16 and float32
    need none) and keeps it in ``opt_state.loss_scale``. ``None``, a number or a loss-scale
    object replaces ``opt_state.loss_scale``. A step whose gradients overflow is skipped
    by the loss scale, silently; a loss that is inf or nan stops training with
    ``FloatingPointError`` naming the batch (0-based), and the model and ``opt_state`` are
    left as they were before that batch. Without a loss scale, so do gradients that hold
    inf or nan for a finite loss (checked on the device and read with the loss: no
    further host synchronisation).

    With data parallelism (``setup(..., distributed=...)``; give each rank its shard with
    ``DataLoader(..., distributed=...)``, which makes every rank's batch count the same) the
    loss of each batch is averaged over the group, so the returned mean, the non-finite-loss
    error and its batch number are the same on every rank.

    ``progress``: a text progress bar on stderr, shown only when stderr is a terminal (and,
    with data parallelism, on rank 0 only).
    ``compile=True`` runs each step as one ``mx.compile``-d function (model, optimiser,
    loss-scale and random state captured), traced anew in each ``train`` call.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, Descent, setup, train
    >>> model = Dense(1, 1)
    >>> x = mx.array([[0.0], [1.0], [2.0]]); y = 2 * x + 1
    >>> opt_state = setup(Descent(0.1), model)
    >>> mse = lambda m, x, y: ((m(x) - y) ** 2).mean()
    >>> for epoch in range(200):
    ...     _ = train(mse, model, [(x, y)], opt_state, progress=False)
    >>> round(model.weight.item(), 3), round(model.bias.item(), 3)
    (2.0, 1.0)
    """
    where = "train"
    dtype = _check_autocast(autocast, where)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an mlx.nn.Module, got {type(model).__name__}")
    if not isinstance(opt_state, OptState):
        raise TypeError(f"{where}: expected an OptState from setup(), got {opt_state!r}")
    if data is None or isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise TypeError(
            f"{where}: data must be an iterable of batches (a DataLoader, or a list of "
            f"(x, y) tuples), got {type(data).__name__}; for one batch pass [(x, y)]"
        )
    if isinstance(loss_scale, str) and loss_scale == "auto":
        if opt_state.loss_scale is None and dtype is not None and dtype == mx.float16:
            opt_state.loss_scale = DynamicLossScale()
    else:
        new_scale = lossscale.resolve(loss_scale, where)
        claim(new_scale, opt_state, where)  # refused before anything changes
        opt_state.loss_scale = new_scale
    scale = opt_state.loss_scale
    scale_state = {} if scale is None else scale.state

    parallel = opt_state.distributed  # data parallelism: the loss is the group's mean

    def step(*batch: Any) -> tuple[mx.array, mx.array]:
        value, grads = _value_and_grad(loss, (model, *batch), dtype, scale, where,
                                       wrt_arrays=False)
        # Without a loss scale, non-finite gradients (of a finite loss) would make every
        # weight nan: checked on the device, read with the loss. With one, they are a step
        # the scale skips.
        finite = all_finite(grads[0]) if scale is None else mx.array(True)
        update(opt_state, model, grads[0])
        value = value[0] if isinstance(value, tuple) else value
        if parallel is None:
            return value, finite
        # every rank takes the same decision: the group's mean loss, finite on all ranks
        return parallel.mean(value), parallel.mean(finite.astype(mx.float32)) == 1

    captured = [model.state, opt_state.optimizer.state, scale_state, mx.random.state]
    if compile:
        step = mx.compile(step, inputs=captured, outputs=captured)

    stream = sys.stderr
    bar = None
    if progress and hasattr(stream, "isatty") and stream.isatty() and (
        parallel is None or parallel.rank == 0  # one bar for the group
    ):
        bar = _Progress(len(cast(Sized, data)) if hasattr(data, "__len__") else None, stream)
    total, count = 0.0, 0
    for i, batch in enumerate(data):
        args = batch if isinstance(batch, tuple) else (batch,)
        if i == 0:
            _check_call(loss, model, args, data, where)
        key = mx.random.state[0]  # type: ignore[index]  # MLX's stub lacks mx.random.state
        before = (model.parameters(), dict(tree_flatten(opt_state.optimizer.state)),
                  dict(scale_state), key)
        try:
            value, finite = step(*args)
            mx.eval(value, finite, captured)
        except BaseException:
            # A trace that raised leaves mx.compile's placeholders in everything captured,
            # the random state included: put the arrays of before the batch back.
            _restore(model, opt_state, scale_state, before)
            raise
        loss_value = cast(float, value.item())
        problem = advice = ""
        if not math.isfinite(loss_value):
            problem = f"the loss is {loss_value} at batch {i} (counting from 0)"
        elif not finite.item():
            problem = (f"the gradients hold inf or nan at batch {i} (counting from 0), "
                       f"although the loss is finite ({loss_value:.6g})")
            advice = (" (a loss scale, train(..., loss_scale=DynamicLossScale()), would skip "
                      "such steps instead)")
        if problem:
            _restore(model, opt_state, scale_state, before)
            if bar is not None:
                bar.stream.write("\n")
            raise FloatingPointError(f"{where}: {problem}; the model and optimiser state are "
                                     f"left as they were before that batch{advice}")
        total, count = total + loss_value, count + 1
        if bar is not None:
            bar.show(count, total / count)
    if bar is not None and count:
        bar.show(count, total / count, final=True)
    return total / count if count else math.nan
