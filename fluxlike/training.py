"""The training step and loop, as in Flux: ``trainstep`` takes one step, ``train`` makes one
pass over the data (a loop over ``trainstep``).

Float16 gradients underflow, so ``autocast=mx.float16`` scales the loss with a
:class:`~fluxlike.DynamicLossScale` by default; the scale lives in ``opt_state.loss_scale``,
so it carries over from one call to the next and into checkpoints. A step whose loss or
gradients are not finite is not taken: whether they are is read with the loss (one device
read per step), and the rare step that must not be taken is undone from the arrays of
before it, kept (MLX arrays are immutable), not copied.

The eager step of a model seen before takes :mod:`fluxlike.eagerstep`'s short path; the
compiled one is :mod:`fluxlike.compiledstep`.
"""

from __future__ import annotations

import inspect
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sized
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from . import (
    eagerstep,
    workarounds,  # noqa: F401  (registers the exit guard for worker threads)
)
from .checks import check_bool_argument
from .compiledstep import compiled_step
from .gradients import _check_autocast, _value_and_grad
from .optimisers.compiled import INTERRUPTS, put_back
from .optimisers.state import OptState, _update, claim
from .precision import lossscale
from .precision.dynamicscale import DynamicLossScale
from .precision.lossscale import LossScale, NoOpLossScale, StaticLossScale


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


def _batch_args(batch: Any) -> tuple:
    """A tuple batch is splatted into the loss; anything else is one argument."""
    return batch if isinstance(batch, tuple) else (batch,)


def _choose_scale(opt_state: OptState, loss_scale: Any, dtype: mx.Dtype | None,
                  where: str) -> LossScale:
    """Set ``opt_state.loss_scale`` from the ``loss_scale`` argument (see :func:`trainstep`),
    keeping the one it has when the argument asks for the same (so that a compiled step
    made for it is reused); refused before anything changes."""
    current = opt_state.loss_scale
    if isinstance(loss_scale, str) and loss_scale == "auto":
        if isinstance(current, NoOpLossScale) and dtype is not None and dtype == mx.float16:
            opt_state.loss_scale = DynamicLossScale()
        return opt_state.loss_scale
    if loss_scale is None and isinstance(current, NoOpLossScale) or loss_scale is current:
        return current
    new = lossscale.resolve(loss_scale, where)
    if isinstance(new, StaticLossScale) and isinstance(current, StaticLossScale) and (
        current.loss_scale.item() == new.loss_scale.item()
    ):
        return current
    claim(new, opt_state, where)  # refused before anything changes
    opt_state.loss_scale = new
    return new


def _check_args(model: Any, opt_state: Any, autocast: Any, where: str) -> mx.Dtype | None:
    dtype = _check_autocast(autocast, where)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an mlx.nn.Module, got {type(model).__name__}")
    if not isinstance(opt_state, OptState):
        raise TypeError(f"{where}: expected an OptState from setup(), got {opt_state!r}")
    return dtype


# MLX's random state: one list-like object for the process, its key replaced in place (read
# once here: the module attribute takes longer to read than the key from it, every step)
_RANDOM_STATE: Any = mx.random.state  # type: ignore[attr-defined]  # (MLX's stub lacks it)


def _reseed(key: Any) -> None:
    """Put the random state back to ``key`` (taken before a step), if the step moved it."""
    if _RANDOM_STATE[0] is not key:
        # mx.random.state takes no assignment: seed to the key (a list: [key]).
        hi, lo = key.tolist()
        mx.random.seed((hi << 32) | lo)


def _step(loss: Callable, model: nn.Module, args: tuple, opt_state: OptState,
          dtype: mx.Dtype | None, compile: bool, where: str,
          with_grads: bool = False) -> tuple[float, bool, dict | None]:
    """One step: ``(loss value, whether the step was taken, gradients)``, with one device
    read. A step whose loss or (unscaled) gradients are not finite is undone when that read
    shows it (rare): the arrays of before it are put back (kept, not copied: MLX arrays are
    immutable), so the graph of every step carries no selections for it. The gradients are
    ``None`` from a compiled step unless ``with_grads``."""
    key = _RANDOM_STATE[0]
    scale, optimizer = opt_state.loss_scale, opt_state.optimizer
    scale_before = dict(scale.state)  # a few scalars
    fresh: list = []
    # The step is taken, read and, if need be, undone as one: a Ctrl-C meanwhile is held
    # back until it is over (the forward and backward only build the graph: the arithmetic
    # is the evaluation below, so this delays a Ctrl-C by no more than the step itself).
    guarded = INTERRUPTS.enter()
    try:
        if compile:
            out = compiled_step(loss, model, args, opt_state, dtype, where, with_grads)
        else:  # the same model and state as before: one walk, one gradient, one update
            out = eagerstep.step(loss, model, args, opt_state, dtype, where)
        if out is not None:
            value, finite, grads, new_params, fresh_arrays, before, state_before = out
        else:  # the long way: everything validated (an optimiser that cannot be captured)
            value, (g, *_) = _value_and_grad(loss, (model, *args), dtype, scale, where,
                                             wrt_arrays=False, fresh_state=fresh)
            value = value[0] if isinstance(value, tuple) else value
            if opt_state.distributed is not None:  # the group's mean: every rank decides alike
                value = opt_state.distributed.mean(value)
            new_params, finite, grads, state_before, before = _update(opt_state, model, g,
                                                                      False, where)
            fresh_arrays = [v for _, _, new in fresh for v in new.values()]
            if not compile and not fresh:
                eagerstep.remember(opt_state, model, grads, where)
        mx.eval(value, finite, new_params, optimizer.state, scale.state, fresh_arrays)
        loss_value = cast(float, value.item())
        taken = math.isfinite(loss_value) and cast(bool, finite.item())
        if not taken:  # model, optimiser, running statistics and random state as before
            model.update(before)
            for m, old, _ in fresh:
                m.update(old)
            put_back(optimizer.state, state_before)
            if not math.isfinite(loss_value):  # no overflow of the gradients: scale as before
                scale.state.update(scale_before)
            _reseed(key)
    except BaseException as e:
        _reseed(key)  # (a failure before the step changed anything: the loss, a trace)
        if isinstance(e, TypeError):  # say how the loss is called, if that is what failed
            _check_call(loss, model, args, None, where)
        raise
    finally:
        if guarded:
            INTERRUPTS.exit()
    return loss_value, taken, grads


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


def trainstep(
    loss: Callable[..., mx.array],
    model: nn.Module,
    batch: Any,
    opt_state: OptState,
    *,
    autocast: mx.Dtype | None = None,
    loss_scale: Any = "auto",
    compile: bool = False,
) -> float:
    """One training step, Flux's ``trainstep!``: ``loss(model, *batch)``, its gradient and an
    :func:`~fluxlike.update`; returns the loss as a float. ``model`` and ``opt_state`` change
    in place.

    A ``batch`` that is a tuple is splatted into ``loss``; anything else (an array, a dict) is
    passed as one argument. ``loss`` may return ``(loss, aux...)``: the first is the loss.
    ``autocast`` is as in :func:`~fluxlike.gradient`.

    ``loss_scale``: ``"auto"`` uses ``opt_state.loss_scale``, making a
    :class:`~fluxlike.DynamicLossScale` there when it has none and ``autocast=mx.float16``
    (bfloat16 and float32 need none); ``None`` (no scale), a number (a static scale) or a
    loss-scale object replaces ``opt_state.loss_scale`` (a number equal to the static scale
    it holds keeps that one).

    A step whose loss is inf or nan, or whose (unscaled) gradients are, is not taken: the
    model (running statistics included), ``opt_state`` (the loss scale too, after a
    non-finite loss) and the random state are as before it, and the loss is returned all the
    same, for the caller to decide (:func:`train` raises). After gradients that overflow a
    loss scale, the scale is lowered, as :func:`~fluxlike.update` does. Whether they are
    finite is read with the loss: one device read per step; a step that must not be taken
    is undone from the arrays of before it (kept, not copied).

    ``compile=True`` runs the whole step (forward, backward, loss scaling, the rule) as one
    ``mx.compile``-d function with the model, optimiser, loss-scale and random state
    captured. It is cached with ``opt_state`` (and freed with it, holding the loss weakly),
    keyed by what makes a trace differ (the loss function: its code and the objects its
    closure and defaults hold, which the trace bakes in; the batch's shapes and dtypes,
    ``autocast`` and the enclosing autocast scope, the loss scale and optimiser and their
    Python settings, the model's modules, their train/eval mode and what is frozen), so
    later calls and :func:`train` calls reuse it; a new key traces anew (so an array the
    loss closes over and replaces every step is traced every step: pass it in the batch).
    The loss must then be traceable (no ``.item()`` inside), as for ``mx.compile``.

    With data parallelism (``setup(..., distributed=...)``) the loss is averaged over the
    group, so every rank returns the same loss and takes the same decision; every rank must
    call ``trainstep`` for every step.

    Errors (a ``TypeError`` or ``ValueError`` naming ``trainstep``) are raised before anything
    changes.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, Descent, setup, trainstep
    >>> model = Dense(1, 1)
    >>> x = mx.array([[0.0], [1.0], [2.0]]); y = 2 * x + 1
    >>> opt_state = setup(Descent(0.1), model)
    >>> mse = lambda m, x, y: ((m(x) - y) ** 2).mean()
    >>> losses = [trainstep(mse, model, (x, y), opt_state) for _ in range(200)]
    >>> losses[-1] < 1e-6, round(model.weight.item(), 3), round(model.bias.item(), 3)
    (True, 2.0, 1.0)
    >>> trainstep(lambda m, x, y: mse(m, x, y) * mx.nan, model, (x, y), opt_state)
    nan
    >>> round(model.weight.item(), 3)  # the step was not taken
    2.0
    """
    where = "trainstep"
    dtype = _check_args(model, opt_state, autocast, where)
    compile = check_bool_argument(compile, where, "compile")
    _choose_scale(opt_state, loss_scale, dtype, where)
    return _step(loss, model, _batch_args(batch), opt_state, dtype, compile, where)[0]


def trainstep_withgradient(
    loss: Callable[..., mx.array],
    model: nn.Module,
    batch: Any,
    opt_state: OptState,
    *,
    autocast: mx.Dtype | None = None,
    loss_scale: Any = "auto",
    compile: bool = False,
) -> tuple[float, dict]:
    """:func:`trainstep`, returning ``(loss, grads)``: ``grads`` is the gradient the step
    used, shaped like ``model.trainable_parameters()`` and in the parameters' dtype (float32
    master weights: float32), divided by the loss scale (and averaged over the group, with
    data parallelism), as in Flux's ``trainstep_withgradient!``.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, Descent, setup, trainstep_withgradient
    >>> model = Dense(2, 1)
    >>> opt_state = setup(Descent(0.1), model)
    >>> loss, grads = trainstep_withgradient(lambda m, x: m(x).mean(), model,
    ...                                      mx.ones((4, 2)), opt_state, autocast=mx.float16)
    >>> sorted(grads), grads["weight"].dtype, grads["weight"].tolist()
    (['bias', 'weight'], mlx.core.float32, [[1.0, 1.0]])
    >>> opt_state.loss_scale  # float16: a dynamic scale, made by "auto"
    DynamicLossScale(init_scale=32768.0, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=2000, min_scale=1.0)
    """
    where = "trainstep_withgradient"
    dtype = _check_args(model, opt_state, autocast, where)
    compile = check_bool_argument(compile, where, "compile")
    _choose_scale(opt_state, loss_scale, dtype, where)
    value, _, grads = _step(loss, model, _batch_args(batch), opt_state, dtype, compile,
                            where, with_grads=True)
    return value, cast(dict, grads)


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
    """One pass over ``data``: :func:`trainstep` for each batch. Returns the mean loss over
    the batches as a float (nan, with a warning, for no batches).

    The arguments are :func:`trainstep`'s. A loss that is inf or nan stops training with
    ``FloatingPointError`` naming the batch (0-based); the step was not taken, so the model
    and ``opt_state`` are as they were before that batch. Without a loss scale, so do
    gradients that hold inf or nan for a finite loss; with one, such a step is skipped by
    the scale, silently.

    With data parallelism (``setup(..., distributed=...)``; give each rank its shard with
    ``DataLoader(..., distributed=...)``, which makes every rank's batch count the same) the
    loss of each batch is averaged over the group, so the returned mean, the non-finite-loss
    error and its batch number are the same on every rank.

    ``progress``: a text progress bar on stderr, shown only when stderr is a terminal (and,
    with data parallelism, on rank 0 only). ``compile=True``: see :func:`trainstep`; the
    compiled step is reused across ``train`` calls (epochs) and batches of one shape.

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
    dtype = _check_args(model, opt_state, autocast, where)
    compile = check_bool_argument(compile, where, "compile")
    progress = check_bool_argument(progress, where, "progress")
    if data is None or isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise TypeError(
            f"{where}: data must be an iterable of batches (a DataLoader, or a list of "
            f"(x, y) tuples), got {type(data).__name__}; for one batch pass [(x, y)]"
        )
    scale = _choose_scale(opt_state, loss_scale, dtype, where)
    parallel = opt_state.distributed
    stream = sys.stderr
    bar = None
    if progress and hasattr(stream, "isatty") and stream.isatty() and (
        parallel is None or parallel.rank == 0  # one bar for the group
    ):
        bar = _Progress(len(cast(Sized, data)) if hasattr(data, "__len__") else None, stream)
    total, count = 0.0, 0
    for i, batch in enumerate(data):
        args = _batch_args(batch)
        if i == 0:
            _check_call(loss, model, args, data, where)
        loss_value, taken, _ = _step(loss, model, args, opt_state, dtype, compile, where)
        problem = advice = ""
        if not math.isfinite(loss_value):
            problem = f"the loss is {loss_value} at batch {i} (counting from 0)"
        elif not taken and scale.reports_overflow:
            problem = (f"the gradients hold inf or nan at batch {i} (counting from 0), "
                       f"although the loss is finite ({loss_value:.6g})")
            advice = (" (a loss scale, train(..., loss_scale=DynamicLossScale()), would skip "
                      "such steps instead)")
        if problem:
            if bar is not None:
                bar.stream.write("\n")
            raise FloatingPointError(f"{where}: {problem}; the model and optimiser state are "
                                     f"left as they were before that batch{advice}")
        total, count = total + loss_value, count + 1
        if bar is not None:
            bar.show(count, total / count)
    if bar is not None and count:
        bar.show(count, total / count, final=True)
    if not count:
        warnings.warn(f"{where}: data gave no batches, so nothing was trained (the mean loss "
                      "returned is nan); check the DataLoader's batch size and drop_last",
                      stacklevel=2)
        return math.nan
    return total / count
