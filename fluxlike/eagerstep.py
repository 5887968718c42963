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

from collections.abc import Callable
from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn

from .gradients import _split_output, _trainable_parameters
from .optimisers.compiled import COMPILED, Compiled
from .optimisers.state import OptState, _check_grads
from .precision.lossscale import LossScale
from .precision.scope import autocast as autocast_scope
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
              where: str) -> Callable:
    """``mx.value_and_grad`` of ``loss(model, *args)`` in the model's parameters (the scaled
    loss differentiated, the loss itself returned beside it), made once and kept for the
    steps that follow with the same loss, model and scale (the last one only)."""
    last = compiled.gradient
    if last is not None and last[0] is loss and last[1] is model and last[2] is scale and (
            last[3] == where):
        return last[4]

    def inner(p: dict, *args: mx.array) -> tuple[mx.array, tuple]:
        model.update(p)
        value, rest = _split_output(loss(model, *args), where)
        return scale.scale(value), (value, rest)  # (aux outputs are not returned)

    fn = mx.value_and_grad(inner)
    compiled.gradient = (loss, model, scale, where, fn)
    return fn


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
    scale = opt_state.loss_scale
    token = enter_differentiating()
    try:
        with nullcontext() if dtype is None else autocast_scope(dtype):
            (_, (value, _)), grads = _gradient(compiled, loss, model, scale, where)(params, *args)
    except BaseException:
        model.update(params)
        raise
    finally:
        context.reset(token)
    if opt_state.distributed is not None:  # the group's mean: every rank decides alike
        value = opt_state.distributed.mean(value)
    out = compiled.step(opt_state, model, grads, params, signature, keep=False)
    if isinstance(out, str):  # the update must run eagerly now: the long way, from the start
        model.update(params)
        return None
    new_params, finite, grads, state_before = out
    return value, finite, grads, new_params, [], params, state_before
