"""``autocast``: the scope that sets the compute dtype of eligible layers."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from . import policy
from .state import HALF, PLAIN, Context, context, device_index, routing
from .state import scope_entries as _entries

_DEVICE_NAMES = {"cpu": mx.cpu, "gpu": mx.gpu}


def _device_slot(device: Any, where: str) -> int | None:
    """Slot (0 cpu, 1 gpu) of a device argument; ``None`` means "the default device"."""
    if device is None:
        return None
    if isinstance(device, str) and device.lower() in _DEVICE_NAMES:
        return 1 if _DEVICE_NAMES[device.lower()] == mx.gpu else 0
    if isinstance(device, mx.DeviceType):
        return 1 if device == mx.gpu else 0
    if isinstance(device, mx.Device):
        return device_index(device)
    raise ValueError(
        f"{where}: device must be 'cpu', 'gpu', mx.cpu, mx.gpu or an mx.Device, got {device!r}"
    )


def _check_dtype(dtype: Any, enabled: bool, where: str) -> mx.Dtype:
    if dtype is None:
        return mx.bfloat16
    if isinstance(dtype, mx.Dtype) and (dtype in HALF or not enabled):
        return dtype  # a disabled scope computes in nothing: any dtype is as good
    full = "; to compute in float32, leave the scope or use autocast(enabled=False)" \
        if dtype in (mx.float32, mx.float64) else ""
    raise ValueError(
        f"{where}: dtype must be mx.float16 or mx.bfloat16 (None means mx.bfloat16, and any "
        f"dtype is accepted with enabled=False), got {dtype!r}{full}"
    )


class autocast:
    """Run eligible layers in half precision inside a scope; master weights stay float32.

    ``autocast(dtype=None, *, device=None, enabled=True)`` sets, for one device type, the
    compute dtype that layers use according to their policy (see
    :func:`~fluxlike.autocast_policy`): ``Dense``, ``Conv``, recurrent and attention layers
    compute in ``dtype``; normalisation layers, ``softmax`` and losses compute in float32.

    - ``dtype``: ``mx.float16`` or ``mx.bfloat16`` (``None``: bfloat16).
    - ``device``: ``"cpu"``, ``"gpu"``, ``mx.cpu``, ``mx.gpu`` or an ``mx.Device``; ``None``
      means the type of ``mx.default_device()`` when the scope is entered. The other device
      type's state is never touched.
    - ``enabled=False`` switches autocast off for the device inside the scope; ``dtype`` is
      then not used and may be any mlx dtype, so ``with autocast(cfg.dtype,
      enabled=cfg.amp):`` works with ``cfg.dtype = mx.float32``.

    It is a context manager (``as`` gives the scope itself) and a decorator (each call of the
    decorated function, or each run of a decorated ``async def`` coroutine, is in the scope;
    generator functions and classes are refused: use ``with`` inside them). Leaving restores
    its device's state as it was entered from, on exception too; one object may be entered
    again, also while active (each entry is undone by its own exit). The state lives in a
    context variable: each thread and each asyncio task has its own, and a new thread starts
    with autocast off.

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, autocast
    >>> layer = Dense(4, 2)
    >>> with autocast(mx.bfloat16, device="cpu"):
    ...     layer(mx.ones((3, 4))).dtype
    mlx.core.bfloat16
    >>> layer.weight.dtype
    mlx.core.float32
    >>> autocast.is_enabled("cpu")
    False
    """

    __slots__ = ("dtype", "device", "enabled", "_slot")

    def __init__(self, dtype: mx.Dtype | None = None, *, device: Any = None, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast: enabled must be a bool, got {enabled!r}")
        # (the everyday arguments without a call: this runs on every `with`)
        self.dtype = dtype if dtype is mx.bfloat16 or dtype is mx.float16 else _check_dtype(
            dtype, enabled, "autocast")
        self._slot = None if device is None else _device_slot(device, "autocast")
        self.device = device
        self.enabled = enabled

    def __repr__(self) -> str:
        device = "" if self.device is None else f", device={self.device!r}"
        enabled = "" if self.enabled else ", enabled=False"
        return f"autocast({self.dtype}{device}{enabled})"

    def __enter__(self) -> autocast:
        if not routing.on:
            policy.activate()
        slot = self._slot
        if slot is None:
            slot = 1 if mx.default_device().type is mx.gpu else 0  # state.device_index()
        state = context.get()
        before = cast("mx.Dtype | None", state[slot])  # a dtype slot: 0 cpu, 1 gpu
        _entries.set(_entries.get() + ((self, slot, before),))
        dtype = self.dtype if self.enabled else None
        new = state._replace(cpu=dtype) if slot == 0 else state._replace(gpu=dtype)
        context.set(new if new[0] is not None or new[1] is not None or new[2] or new[3]
                    else PLAIN)  # state.with_dtype(), inline: every `with`
        return self

    def __exit__(self, *exc_info: Any) -> None:
        entries = _entries.get()
        for i in range(len(entries) - 1, -1, -1):
            if entries[i][0] is self:
                break
        else:
            raise RuntimeError(f"{self!r} exited in a context where it was not entered")
        _, slot, before = entries[i]
        rest = list(entries[:i] + entries[i + 1 :])
        # Only this device's slot is restored. If a later entry on the same device is still
        # live (exits out of order, e.g. a generator closed inside another scope), the state
        # stays that entry's and that entry will restore ours when it exits.
        for j in range(i, len(rest)):
            if rest[j][1] == slot:
                rest[j] = (rest[j][0], slot, before)
                break
        else:
            state = context.get()
            new = state._replace(cpu=before) if slot == 0 else state._replace(gpu=before)
            context.set(new if new[0] is not None or new[1] is not None or new[2] or new[3]
                    else PLAIN)
        _entries.set(tuple(rest))

    def __call__(self, fn: Callable) -> Callable:
        """Decorate ``fn`` so that each call runs inside this scope."""
        if not callable(fn):
            raise TypeError(f"autocast: can only decorate a callable, got {fn!r}")
        # A generator's body runs after the decorated call has returned (the scope closed),
        # and a decorated class would become a function: refuse both rather than do nothing.
        if inspect.isclass(fn):
            raise TypeError(
                f"autocast: cannot decorate a class ({fn.__name__}); decorate its methods, "
                f"or use `with autocast(...)` inside them"
            )
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            kind = "an async generator" if inspect.isasyncgenfunction(fn) else "a generator"
            raise TypeError(
                f"autocast: cannot decorate {kind} function ({fn.__name__}): its body runs "
                f"after the call has returned, outside the scope; use `with autocast(...)` "
                f"inside the generator"
            )
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return await fn(*args, **kwargs)

            return run_async

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return run

    @staticmethod
    def is_enabled(device: Any = None) -> bool:
        """Whether autocast is on for ``device``'s type (default: the default device)."""
        return autocast.get_dtype(device) is not None

    @staticmethod
    def get_dtype(device: Any = None) -> mx.Dtype | None:
        """The compute dtype in force for ``device``'s type, or ``None`` when off."""
        slot = _device_slot(device, "autocast.get_dtype")
        return cast("mx.Dtype | None", context.get()[device_index() if slot is None else slot])


_STEP_STATES: dict[tuple[int, mx.Dtype], Context] = {}  # enter_step's from PLAIN, made once

Step = tuple  # (context token, scope entries at entry, device slot, its dtype before)


def enter_step(dtype: mx.Dtype) -> Step:
    """The state of an autocast training step's forward and backward: differentiating, under
    ``autocast(dtype)`` on the default device, set as one change of the context variable
    (every step: no scope object entered and left, on the common path no ``_replace``);
    :func:`leave_step` undoes it. ``dtype`` is one :class:`autocast` accepts (the caller has
    checked it).

    >>> import mlx.core as mx
    >>> step = enter_step(mx.bfloat16)
    >>> autocast.get_dtype("cpu"), context.get().differentiating
    (mlx.core.bfloat16, True)
    >>> leave_step(step); context.get() is PLAIN
    True
    """
    current = context.get()
    if not routing.on:
        policy.activate()
    slot = 1 if mx.default_device().type is mx.gpu else 0  # device_index(), inline
    new = _STEP_STATES.get((slot, dtype)) if current is PLAIN else None
    if new is None:
        new = (current._replace(differentiating=True, gpu=dtype) if slot
               else current._replace(differentiating=True, cpu=dtype))
        if current is PLAIN:
            _STEP_STATES[slot, dtype] = new
    return context.set(new), _entries.get(), slot, current[slot]


def leave_step(step: Step) -> None:
    """Undo :func:`enter_step`: the context as the step found it. A scope entered inside the
    step and still open (a generator's, closed later) is given the dtype the step found as
    the one to restore on its exit, as it would have been had the step been an
    :class:`autocast` scope."""
    token, entries, slot, before = step
    now = _entries.get()
    if now is not entries:
        rest = list(now)
        for j, entry in enumerate(rest):
            if entry[1] == slot and not any(entry is e for e in entries):
                rest[j] = (entry[0], slot, before)
                _entries.set(tuple(rest))
                break
    context.reset(token)
