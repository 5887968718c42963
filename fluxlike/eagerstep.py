"""The eager training step of :func:`fluxlike.trainstep` on its common path, at the cost of
its arithmetic.

:func:`fluxlike.trainstep` is ``withgradient`` + ``update``, and each of those validates its
input and walks the model for itself: several walks of the parameter tree and about 100 us of
Python a step, as much as a small model's whole arithmetic. Once a model's step has been
taken the long way (validated, its optimiser state checked and its update traced), the same
model and optimiser state need none of that again: this module remembers the tree by a
*fingerprint* (each trainable array's module, name, shape and dtype, collected in the one
walk that gathers the parameters) and takes later steps with one walk, one call of a
gradient function made once (for the last loss, model and scale) and one call of the
compiled update.

It declines (``None``: the caller takes the long way) for anything but the plain case: a
model with frozen or non-trainable entries (running statistics to carry and restore), a
batch holding a model, an optimiser updated eagerly, a fingerprint not seen before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import MethodType

import mlx.core as mx
import mlx.nn as nn

from .gradients import _split_output, _trainable_parameters
from .optimisers.compiled import COMPILED, Compiled
from .optimisers.state import OptState, _check_grads
from .precision.lossscale import LossScale, NoOpLossScale
from .precision.scope import enter_step, leave_step
from .precision.state import context, enter_differentiating

LIMIT = 8  # fingerprints remembered per OptState (a model trained in a few configurations)


def remember(opt_state: OptState, model: nn.Module, grads: dict, where: str) -> None:
    """Record that ``model``'s tree (as it is now) has taken a step with ``opt_state`` the
    long way, which validated it, with gradients ``grads``."""
    compiled = COMPILED.get(opt_state)
    if compiled is None or compiled.eager is not None:
        return
    signature = _check_grads(grads, model, where)[0]
    leaves: list = []
    _, frozen = _trainable_parameters(model, leaves)
    if frozen:
        return
    known = compiled.fingerprints
    if len(known) >= LIMIT:
        del known[next(iter(known))]
    known[tuple(leaves)] = signature


def _gradient(compiled: Compiled, loss: Callable, model: nn.Module, scale: LossScale,
              where: str) -> tuple[Callable, list]:
    """``(fn, current)``: ``fn = mx.value_and_grad`` of ``loss(model, *args)`` in the model's
    parameters, which reads the loss, model and batch ``args`` from ``current`` (set them for
    the call, clear them after); ``fn(params)`` gives ``(loss, grads)`` (with a loss scale the
    scaled loss is differentiated, the loss itself returned beside it as an auxiliary output).
    The batch is read from ``current``, not passed: ``mx.value_and_grad`` makes a traced copy
    of every argument, a graph node per batch array (a sizeable part of a small model's
    evaluation) that nothing differentiates.
    Made once and kept for the steps that follow with the same loss, model and scale (the
    last ones only), by weak reference: the record lives as long as its optimiser state, and
    a loss that refers back to that state (a trainer's bound method) must not keep it alive."""
    last = compiled.gradient
    if last is not None:
        loss_ref, model_ref, last_scale, last_where, last_fn, last_current = last
        kept = loss_ref()
        if (model_ref() is model and last_scale is scale and last_where == where
                and (kept is loss or (isinstance(loss, MethodType) and kept == loss))):
            return last_fn, last_current
    current: list = [None, None, ()]

    def evaluated(p: dict) -> tuple[mx.array, tuple]:
        """The loss (and its auxiliary outputs) of the model holding parameters ``p``."""
        loss_fn, module, args = current
        module.update(p)
        return _split_output(loss_fn(module, *args), where)

    def inner(p: dict) -> tuple[mx.array, tuple]:
        value, rest = evaluated(p)
        return scale.scale(value), (value, rest)  # (aux outputs are not returned)

    def unscaled(p: dict) -> mx.array:  # no scale: no auxiliary output
        return evaluated(p)[0]

    if isinstance(scale, NoOpLossScale):
        fn = mx.value_and_grad(unscaled)
    else:
        scaled = mx.value_and_grad(inner)

        def fn(p: dict) -> tuple[mx.array, dict]:
            (_, (value, _)), grads = scaled(p)
            return value, grads
    try:
        loss_ref = weakref.WeakMethod(loss) if isinstance(loss, MethodType) else weakref.ref(loss)
        compiled.gradient = (loss_ref, weakref.ref(model), scale, where, fn, current)
    except TypeError:  # a loss that takes no weak reference: made anew each step
        compiled.gradient = None
    return fn, current


def step(loss: Callable, model: nn.Module, args: tuple, opt_state: OptState,
         dtype: mx.Dtype | None, where: str) -> tuple | None:
    """One eager step on the remembered path: ``(loss, finite, grads, new parameters, []
    (no running statistics), parameters before, optimiser state before)``, arrays not
    evaluated and a non-finite step taken (the caller undoes it); ``None`` when this step
    must take the long way (then nothing has changed)."""
    compiled: Compiled | None = COMPILED.get(opt_state)
    if compiled is None or compiled.eager is not None or not compiled.fingerprints:
        return None
    for a in args:
        if not isinstance(a, mx.array):  # (a model or a tree of them in the batch: the long way)
            return None
    leaves: list = []
    params, frozen = _trainable_parameters(model, leaves)
    signature = None if frozen else compiled.fingerprints.get(tuple(leaves))
    if signature is None or signature not in compiled.initialised:
        return None
    fn, current = _gradient(compiled, loss, model, opt_state.loss_scale, where)
    current[:] = loss, model, args
    try:
        if dtype is None:
            token = enter_differentiating()
            try:
                value, grads = fn(params)
            finally:
                context.reset(token)
        else:
            step = enter_step(dtype)
            try:
                value, grads = fn(params)
            finally:
                leave_step(step)
    except BaseException:
        model.update(params)
        raise
    finally:
        current[:] = None, None, ()
    if opt_state.distributed is not None:  # the group's mean: every rank decides alike
        value = opt_state.distributed.mean(value)
    out = compiled.step(opt_state, model, grads, params, signature, keep=False)
    if isinstance(out, str):  # the update must run eagerly now: the long way, from the start
        model.update(params)
        return None
    new_params, finite, grads, state_before = out
    return value, finite, grads, new_params, [], params, state_before
