"""The compiled optimiser step behind :func:`fluxlike.update`.

One ``mx.compile``-d function per :class:`~fluxlike.OptState` runs the optimiser's
``apply_gradients`` (and, with a loss scale, the unscaling, finite check, ``mx.where`` keep
and scale adjustment), with the optimiser and loss-scale state captured as the same live
dicts, so that MLX fuses each parameter's arithmetic into one kernel instead of dispatching
about ten ops per parameter. Traces are keyed by what they bake in: the gradients' paths,
shapes and dtypes, and the Python settings of the optimiser and loss scale.
"""

from __future__ import annotations

import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from operator import is_
from types import MethodType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from .. import native
from .._mlxtyping import tree_flatten
from ..precision.lossscale import LossScale, sum_finite
from .rules import KEEP


def assign(
    live: Any, values: dict[str, mx.array], prefix: str = "", prune: bool = False
) -> None:
    """Replace the array leaves of the nested dicts/lists ``live`` in place (so that a tree
    captured by ``mx.compile`` stays the same object), taking ``values[dotted path]``;
    ``prune=True`` deletes dict entries that ``values`` does not have."""
    items = live.items() if isinstance(live, dict) else enumerate(live)
    for key, value in list(items):
        path = f"{prefix}{key}"
        if isinstance(value, mx.array):
            if path in values or not prune:
                live[key] = values[path]
            elif isinstance(live, dict):
                del live[key]
        elif isinstance(value, (dict, list)):
            assign(value, values, path + ".", prune)


class _Interrupts:
    """Ctrl-C (SIGINT) held back while a step changes the model and its state, then delivered:
    a signal handled half-way through a step (or through its rollback) would leave some
    parameters stepped and others not.

    The handler is installed once (again only if someone replaced it) and chains to the one it
    found; a step only counts itself in and out (:meth:`enter`/:meth:`exit`), so that the
    guard costs no signal installation per step. Only the main thread receives signals;
    elsewhere :meth:`enter` does nothing."""

    def __init__(self) -> None:
        self.depth = 0
        self.held: tuple[int, Any] | None = None
        self.previous: Any = None
        self.handler = self._handle  # one bound method: compared by identity below

    def _handle(self, signum: int, frame: Any) -> None:
        if self.depth:
            self.held = (signum, frame)
        else:
            self._deliver(signum, frame)

    def _deliver(self, signum: int, frame: Any) -> None:
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous == signal.SIG_DFL:
            raise KeyboardInterrupt

    def enter(self) -> bool:
        """Count a step in; ``False`` (nothing to :meth:`exit`) where no guard is possible."""
        if threading.get_ident() != _MAIN_THREAD:
            return False
        current = _getsignal(_SIGINT)  # reads Python's table: no system call
        if current is not self.handler:
            if current is None:  # installed from C: cannot be chained
                return False
            # the handler to chain to is known before ours is installed: a Ctrl-C arriving
            # just after the installation is delivered to it, not to the one before
            earlier, self.previous = self.previous, current
            try:
                signal.signal(signal.SIGINT, self.handler)
            except (ValueError, OSError):  # no signals here (an embedded interpreter)
                self.previous = earlier
                return False
        self.depth += 1
        return True

    def exit(self) -> None:
        """Count a step out; deliver a Ctrl-C held back meanwhile."""
        self.depth -= 1
        if not self.depth and self.held is not None:
            held, self.held = self.held, None
            self._deliver(*held)


_MAIN_THREAD = threading.main_thread().ident
_SIGINT = int(signal.SIGINT)
# signal.getsignal wraps the C function to turn SIG_DFL/SIG_IGN into enum members, which took
# most of the guard's time per step; the C function answers those as 0 and 1 (equal to them).
_getsignal: Callable[[int], Any] = getattr(signal, "_signal", signal).getsignal
INTERRUPTS = _Interrupts()


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold Ctrl-C back for the block (see :class:`_Interrupts`)."""
    guarded = INTERRUPTS.enter()
    try:
        yield
    finally:
        if guarded:
            INTERRUPTS.exit()


def rollback(model: nn.Module, params: Any, trees: list, before: list[dict]) -> None:
    """Undo a step that was interrupted (Ctrl-C) or failed part-way: put ``params`` (the
    parameters before it, in the structure of the gradients) back into ``model`` and the
    flattened ``before`` values back into the live state ``trees``, so that a step is all or
    nothing."""
    for tree, values in zip(trees, before, strict=True):
        assign(tree, values, prune=True)
    model.update(params)


def init_missing(optimizer: optim.Optimizer, params: Any, where: str = "update") -> None:
    """Give ``optimizer`` state for every parameter of ``params`` (in the structure of the
    gradients) that has none: parameters frozen at ``setup`` and thawed since. An optimiser
    never initialised gets MLX's ``init``; otherwise only the missing entries are made, in
    place (MLX's ``init`` raises on a parameter list shorter than the state's, and replaces
    the lists it extends: see :mod:`fluxlike.workarounds`)."""
    inner = getattr(optimizer, "inner", None)  # fluxlike's OptimiserChain
    if isinstance(inner, optim.Optimizer):
        init_missing(inner, params, where)
        return
    if isinstance(optimizer, optim.MultiOptimizer):  # (which never sets _initialized)
        parts = optimizer._split_dictionary(params)
        for sub, part in zip(optimizer.optimizers, parts, strict=False):
            init_missing(sub, part, where)
        return
    if not getattr(optimizer, "_initialized", True):
        optimizer.init(params)
        return

    def walk(p: Any, s: Any, path: str) -> None:
        if isinstance(p, mx.array):
            if not s:  # MLX's placeholder for a parameter without state
                optimizer.init_single(p, s)
            for name, value in s.items() if isinstance(s, dict) else ():
                # a moment of the parameter's rank has its shape (factored ones have less)
                if isinstance(value, mx.array) and value.ndim == p.ndim and (
                    value.shape != p.shape
                ):
                    raise ValueError(
                        f"{where}: opt_state does not fit the model: its {name!r} for {path!r} "
                        f"has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}; "
                        f"setup() the optimiser for this model"
                    )
            return
        for k, sub in p.items() if isinstance(p, dict) else enumerate(p):
            if isinstance(s, dict) and k not in s:
                s[k] = tree_map(lambda _: {}, sub)
            elif isinstance(s, list) and k >= len(s):
                s.extend(tree_map(lambda _: {}, x) for x in p[len(s):])
            walk(sub, s[k], f"{path}.{k}" if path else str(k))

    walk(params, optimizer.state, "")


def step(optimizer: optim.Optimizer, scale: LossScale, grads: dict, params: dict,
         average: Callable[[dict], dict] | None = None, keep: bool = True,
         ) -> tuple[dict, mx.array, dict, Any]:
    """The optimiser step on arrays: ``(new parameters, finite, gradients, optimiser state
    before)``, the parameters and the (unscaled, averaged) gradients shaped like ``grads``, the
    state before (``keep=False`` only; else ``None``) as :func:`previous` keeps it, which a
    trace returns without a walk in Python; the optimiser and loss-scale
    state change in place, the scale adjusting to whether the gradients are finite. Traced by
    :class:`Compiled`, or run eagerly.

    ``keep=True`` (:func:`~fluxlike.update`): where the gradients are not finite, the
    parameters and optimiser state keep their values (``mx.where``: no host
    synchronisation). ``keep=False`` (:func:`~fluxlike.trainstep`, which reads ``finite``
    with the loss anyway and puts the previous arrays back on the rare skipped step) leaves
    out those selections, a sizeable part of a small model's step.
    ``average`` (data parallelism: :meth:`~fluxlike.distributed.DataParallel.average`) reduces
    the gradients over the group first, so unscaling, the finite check and the rule all see
    the reduced gradients, the same on every rank."""
    if average is not None:
        grads = average(grads)
    grads = scale.unscale(grads)
    finite = sum_finite(grads)
    old_state = previous(optimizer.state)
    # A native Adam update keeps its own parameter and moments (rules.py: KEEP); the rest is
    # selected below (on the CPU by the companion's selection, which reads and writes nothing
    # on a kept step where it can take over the new array's buffer).
    guarded: set[int] = set()
    if keep:
        setattr(optimizer, KEEP, (finite, guarded))
    try:
        new_params = optimizer.apply_gradients(grads, params)
    finally:
        if keep:
            delattr(optimizer, KEEP)
    if keep:
        select = native.keep_kernel() if mx.default_device() == mx.cpu else None

        def kept(new: mx.array, old: mx.array) -> mx.array:
            if new is old or id(new) in guarded:
                return new
            if select is not None and new.shape == old.shape and new.dtype == old.dtype:
                return select(finite, new, old)
            return mx.where(finite, new, old)

        new_params = tree_map(kept, new_params, params)
        assign(optimizer.state, dict(tree_flatten(tree_map(kept, optimizer.state, old_state))))
    scale.adjust(finite)
    return new_params, finite, grads, None if keep else old_state


def previous(tree: Any) -> Any:
    """New containers holding the same arrays: what a step is undone to (MLX arrays are
    immutable, so keeping them is enough)."""
    return tree_map(lambda x: x, tree)


def put_back(live: Any, old: Any) -> None:
    """Put the arrays of ``old`` (made by :func:`previous`) back into the live tree ``live``,
    in place; entries made since (state for a part thawed meanwhile) stay."""
    for key, value in old.items() if isinstance(old, dict) else enumerate(old):
        if isinstance(value, (dict, list)) and not isinstance(value, mx.array):
            put_back(live[key], value)
        else:
            live[key] = value


def averager(opt_state: Any) -> MethodType | None:
    """The gradient averaging of ``opt_state``'s data parallelism, if it has any to do (its
    bound ``average``, a function of the gradients)."""
    parallel = getattr(opt_state, "distributed", None)
    return parallel.average if parallel is not None and parallel.active else None


class _Same:
    """Compares equal only to a wrapper of the same object (which it keeps alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _settings(obj: Any, depth: int = 0) -> Any:
    """A hashable snapshot of the Python values a trace of ``obj``'s step bakes in as constants
    (betas, eps, weight decay, schedules, clipping transforms, loss-scale factor...): the
    attributes of an optimiser or loss scale other than its array state, recursively;
    anything else (functions, arrays, transforms) by identity. (This runs on every step:
    plain values are taken inline, without a call, and each type is classified once.)"""
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    how = _KINDS.get(kind)
    if how is None:
        how = _KINDS[kind] = _classify(kind)
    if depth > 6 or how is _OTHER:
        return _Same(obj)
    if how is _NUMBER:  # a subclass of a plain number (numpy's float64...)
        return obj
    depth += 1
    if how is _SEQUENCE:
        return (kind, *[v if type(v) in _PLAIN else _settings(v, depth) for v in obj])
    items = obj.items() if how is _DICT else vars(obj).items()
    return (kind, *[(k, v if type(v) in _PLAIN else _settings(v, depth)) for k, v in items
                    if how is _DICT or (k != "_state" and k != "_initialized")])


def _kept(obj: Any) -> tuple | None:
    """What :func:`_unchanged` compares ``obj``'s settings with later: a copy of its
    attributes, their types, and for each attribute that may change in place (a list, a
    schedule, a transform) ``(name, copy, its entries' types)`` where it is a list, tuple or
    dict of plain values (an empty one included), else ``(name, snapshot, None)``; ``None``
    for what has no attributes to copy."""
    if _KINDS.get(type(obj)) is not _SETTINGS:
        return None
    attributes = dict(vars(obj))
    others: list[tuple[Any, Any, list[type] | None]] = []
    for k, v in attributes.items():
        if type(v) in _PLAIN or k == "_state" or k == "_initialized":
            continue
        kind = type(v)
        entries = list(v.values() if kind is dict else v) if kind in _FLAT else None
        if entries is not None and all(type(e) in _PLAIN for e in entries):
            others.append((k, kind(v), list(map(type, entries))))
        else:
            others.append((k, _settings(v, 1), None))
    return attributes, list(map(type, attributes.values())), others


def _unchanged(obj: Any, kept: tuple | None) -> bool:
    """Whether ``obj``'s :func:`_settings` are what they were when ``kept`` (:func:`_kept`)
    was taken, without a snapshot: the same attributes holding values of the same types,
    plain values equal (both compared in C; the types only where a value is not the same
    object) and the others' copies (with their entries' types) or snapshots equal. (Its
    state dict is compared by identity first: the caller has checked that it is the
    same.)"""
    if kept is None:
        return False
    attributes, types, others = kept
    current = vars(obj)
    try:
        # (types too: a float replaced by an equal array or numpy scalar is another setting)
        if current != attributes or (
                not all(map(is_, current.values(), attributes.values()))
                and list(map(type, current.values())) != types):
            return False
        for k, copy, entry_types in others:
            value = current[k]
            if entry_types is None:
                if _settings(value, 1) != copy:
                    return False
            elif value != copy or entry_types and list(
                    map(type, value.values() if type(value) is dict else value)) != entry_types:
                return False
    except Exception:  # a value whose == is not a truth value (an array): changed
        return False
    return True


_FLAT = (list, tuple, dict)  # containers whose plain values _unchanged compares with ==


_SEQUENCE, _DICT, _SETTINGS, _NUMBER, _OTHER = "sequence", "dict", "settings", "number", "other"
_KINDS: dict[type, str] = {}


def _classify(kind: type) -> str:
    """How :func:`_settings` snapshots a value of type ``kind``."""
    if issubclass(kind, (list, tuple)):
        return _SEQUENCE
    if issubclass(kind, dict):
        return _DICT
    if issubclass(kind, (optim.Optimizer, LossScale)):
        return _SETTINGS
    if issubclass(kind, (bool, int, float, str)):
        return _NUMBER
    return _OTHER


_PLAIN = frozenset((type(None), bool, int, float, str, mx.Dtype))


_CPU_CACHE_DEFAULT = 32 << 20  # MLX's CPU allocator keeps at most this much freed memory
_cache_limit_set: list[int] = []  # the buffer-cache limit fluxlike last set, if any


def _keep_step_buffers(nbytes: int) -> None:
    """Raise MLX's CPU buffer-cache limit to ``nbytes`` (at most 1/8 of the memory limit) if
    it is MLX's default or the value this function set; never lower it, never override a
    limit the user chose. Without this a step whose arrays exceed the default 32 MiB hands
    them back to the C allocator, which returns them to the OS, and the next step takes them
    again as fresh pages (page faults, a sizeable part of a large MLP's step: see
    ``bench/README.md``, *Figures quoted by the code*)."""
    if mx.default_device() != mx.cpu:
        return
    current = mx.set_cache_limit(sys.maxsize)  # reads the limit (and restores it below)
    mx.set_cache_limit(current)
    if current != _CPU_CACHE_DEFAULT and current not in _cache_limit_set:
        return
    wanted = min(nbytes, mx.get_memory_limit() // 8)
    if wanted > current:
        mx.set_cache_limit(wanted)
        _cache_limit_set[:] = [wanted]


def _footprint(*trees: Any) -> int:
    return sum(x.nbytes for tree in trees for _, x in tree_flatten(tree)
               if isinstance(x, mx.array))


class Compiled:
    """The compiled steps of one :class:`OptState`, keyed by what their traces bake in, or
    why it is updated eagerly."""

    LIMIT = 8  # traces kept per OptState; the oldest is dropped (and traced again if needed)

    def __init__(self) -> None:
        self.steps: dict[tuple, tuple[Callable, list]] = {}
        self.eager: str | None = None
        self.initialised: set[tuple] = set()  # gradient signatures the state was checked for
        # whole training steps (fluxlike.compiledstep): the compiled function and the cell its
        # loss is read from
        self.whole: dict[tuple, tuple[Callable, list]] = {}
        # model trees validated for this state, by fingerprint: their gradient signature,
        # and the last gradient function made, with what it was made for (fluxlike.eagerstep)
        self.fingerprints: dict[tuple, tuple] = {}
        self.gradient: tuple | None = None
        self.last: tuple | None = None  # (what keyed the last update step: objects, values; it)

    def fall_back(self, reason: str) -> None:
        self.steps.clear()
        self.whole.clear()
        self.fingerprints.clear()
        self.gradient = None
        self.last = None
        self.eager = reason

    def step(self, opt_state: Any, model: nn.Module, grads: dict, params: dict,
             signature: tuple, keep: bool = True) -> tuple[dict, mx.array, dict, Any] | str:
        """Take the step through the compiled function for its key, tracing it first if
        needed; ``params`` are the model's parameters in the structure of ``grads``.
        Returns what :func:`step` returns when done, else why
        it must be taken eagerly instead (and then nothing has changed)."""
        optimizer, scale = opt_state.optimizer, opt_state.loss_scale
        average = averager(opt_state)
        live, scale_state = optimizer.state, scale.state
        group = None if average is None else average.__self__
        native_on = native.available()  # (its kernels or MLX's)
        last = self.last
        entry: tuple[Callable, list] | None = None
        if last is not None:
            # What keyed the last step: the same objects, and settings unchanged (checked
            # without a snapshot; no hash of the signature, a pass over every parameter)
            objects, values, kept, entry = last
            if not (objects[0] is signature and objects[1] is optimizer and objects[2] is scale
                    and objects[3] is live and objects[4] is scale_state
                    and objects[5] is group and values[0] == keep and values[1] == native_on
                    and _unchanged(optimizer, kept[0]) and _unchanged(scale, kept[1])):
                entry = None
        if entry is None:
            settings = (_settings(optimizer), _settings(scale))
            key = (signature, keep, optimizer, scale, id(live), id(scale_state), settings,
                   native_on, None if group is None else _Same(group))
            entry = self.steps.get(key)
            if entry is not None:
                self.last = ((signature, optimizer, scale, live, scale_state, group),
                             (keep, native_on), (_kept(optimizer), _kept(scale)), entry)
        captured = [live, scale_state]
        if entry is not None:
            # The compiled call changes the captured state at once, in C++; the guard keeps
            # Ctrl-C from landing between it and the model's update.
            # (trainstep holds the guard already: counted in again only if not)
            guarded = not INTERRUPTS.depth and INTERRUPTS.enter()
            try:
                out = entry[0](grads, params)
                model.update(out[0])
            finally:
                if guarded:
                    INTERRUPTS.exit()
            return out
        # A step frees about the gradients, activations and (eagerly) the old state: keep
        # twice the bytes of parameters, gradients and state for the next step to reuse.
        _keep_step_buffers(2 * _footprint(grads, params, live))
        if live is not optimizer.state:  # e.g. MultiOptimizer builds its state dict anew
            return "optimizer.state is not one live dict"
        before = [dict(tree_flatten(tree)) for tree in captured]
        fn = mx.compile(partial(step, optimizer, scale, average=average, keep=keep),
                        inputs=captured,
                        outputs=captured)
        with uninterrupted():
            try:
                out = fn(grads, params)
            except BaseException as e:
                # MLX leaves its tracers in the captured state when the traced function
                # raises (see fluxlike.workarounds).
                rollback(model, params, captured, before)
                if not isinstance(e, Exception):
                    raise
                return f"tracing failed with {type(e).__name__}: {e}"  # a host sync in a schedule
            try:
                model.update(out[0])
            except BaseException:
                rollback(model, params, captured, before)
                raise
        if settings != (_settings(optimizer), _settings(scale)):
            # The step changed a Python attribute, which a replay would not: this step was
            # right (its Python code ran), later ones must run it again.
            self.fall_back("the step changes Python attributes of the optimizer")
        else:
            if len(self.steps) >= self.LIMIT:
                del self.steps[next(iter(self.steps))]
            self.steps[key] = (fn, captured)
        return out


COMPILED: weakref.WeakKeyDictionary[Any, Compiled] = weakref.WeakKeyDictionary()
