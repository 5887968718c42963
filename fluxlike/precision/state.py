"""All of precision's mutable state, in one place and under public names.

Context variables (private to each thread and each asyncio task):

- :data:`context`: a :class:`Context`, the autocast compute dtype of each device type
  (``None``: off) and whether fluxlike is differentiating (``gradient``, ``train``:
  automatic train mode, no kept casts, row-major weight gradients) or tracing shapeless
  (``fluxlike.compile(..., shapeless=True)``: custom functions, whose output shapes MLX
  cannot infer, and shape-dependent Python are left out of the graph). :data:`PLAIN` is
  the one object meaning "none of these", so the layers' fast path is an identity test.
- :data:`scope_entries`: the live ``autocast`` entries of this context, each ``(scope, device
  slot, that slot's dtype before the entry)``; each exit removes its own.

Process-wide: :data:`routing`, whether layer calls are routed through their policies (from
the first use of autocast in the process: see :mod:`.policy`), and :data:`mode_fixes`, how
many times ``trainmode``/``testmode`` or ``model.train()``/``model.eval()`` fixed a mode
(compiled traces bake modes in).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any, NamedTuple, cast

import mlx.core as mx


class Context(NamedTuple):
    """What the kernels read on every call: the compute dtype per device type (indexed by
    :func:`device_index`: ``context[0]`` for the CPU, ``context[1]`` for the GPU) and the
    transformation fluxlike is running."""

    cpu: mx.Dtype | None = None
    gpu: mx.Dtype | None = None
    differentiating: bool = False
    shapeless: bool = False


PLAIN = Context()
context: ContextVar[Context] = ContextVar("fluxlike_precision", default=PLAIN)
scope_entries: ContextVar[tuple[tuple[Any, int, mx.Dtype | None], ...]] = ContextVar(
    "fluxlike_autocast_entries", default=()
)


def enter(**changes: Any) -> Token:
    """Set fields of this context's :data:`context` (``PLAIN`` again when all are off);
    ``context.reset(token)`` undoes it."""
    new = context.get()._replace(**changes)
    plain = new.cpu is None and new.gpu is None and not (new.differentiating or new.shapeless)
    return context.set(PLAIN if plain else new)


_DIFFERENTIATING = PLAIN._replace(differentiating=True)


def enter_differentiating() -> Token:
    """``enter(differentiating=True)``, without building a record in the common case (called
    on every training step); fluxlike's first use (:func:`first_use`) if this is it."""
    if not routing.used:
        first_use()
    current = context.get()
    return context.set(_DIFFERENTIATING if current is PLAIN else
                       current._replace(differentiating=True))


def with_dtype(slot: int, dtype: mx.Dtype | None) -> Token:
    """Set the compute dtype of device ``slot`` (0 cpu, 1 gpu)."""
    new = context.get()._replace(cpu=dtype) if slot == 0 else context.get()._replace(gpu=dtype)
    plain = new.cpu is None and new.gpu is None and not (new.differentiating or new.shapeless)
    return context.set(PLAIN if plain else new)


class _Routing:
    """Whether layer calls are routed through their policies (``on``: from the first use of
    autocast), whether the :func:`on_first_use` hooks have run (``used``), and the lock under
    which layer classes are routed."""

    __slots__ = ("on", "used", "lock")

    def __init__(self) -> None:
        self.on = False
        self.used = False
        self.lock = threading.RLock()


routing = _Routing()
_first_use_hooks: list[Callable[[], None]] = []


def on_first_use(hook: Callable[[], None]) -> None:
    """Call ``hook`` at fluxlike's first use in this process: the first ``autocast``,
    converter, ``gradient`` or training step (now if that has been). What it installs acts
    from then on (:mod:`.stock`'s replacements of MLX's functions that upstream models call)."""
    with routing.lock:
        _first_use_hooks.append(hook)
        if routing.used:
            hook()


def first_use() -> None:
    """Run the :func:`on_first_use` hooks unless they have run (all of them: ``used`` is set
    once they have, so that another thread waits on the lock until then, and a hook that
    raises is tried again at the next use). Idempotent, and a hook that uses fluxlike itself
    does not run the hooks again."""
    global _running
    with routing.lock:
        if routing.used or _running:
            return
        _running = True
        try:
            for hook in _first_use_hooks:
                hook()
            routing.used = True
        finally:
            _running = False


_running = False  # (the hooks are running, on the thread holding routing.lock)


class _Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


mode_fixes = _Count()

HALF = (mx.float16, mx.bfloat16)
CASTABLE = (mx.float32, mx.float16, mx.bfloat16)  # float64, integers and bool are never cast


def device_index(device: mx.Device | None = None) -> int:
    """0 for the CPU, 1 for the GPU: the slot of ``device`` (default: the default device)."""
    device = mx.default_device() if device is None else device
    return 1 if device.type is mx.gpu else 0  # an enum member: identity is enough


def current_dtype() -> mx.Dtype | None:
    """The compute dtype in force on the default device, or ``None`` when autocast is off.

    >>> import mlx.core as mx
    >>> from fluxlike import autocast
    >>> current_dtype() is None
    True
    >>> with autocast(mx.float16):
    ...     current_dtype()
    mlx.core.float16
    """
    state = context.get()
    if state is PLAIN:
        return None
    return cast("mx.Dtype | None", state[device_index()])  # a dtype slot: 0 cpu, 1 gpu
