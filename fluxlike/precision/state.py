"""All of precision's mutable state, in one place and under public names.

Context variables (private to each thread and each asyncio task):

- :data:`compute_dtypes`: the autocast state, a pair ``(cpu_dtype, gpu_dtype)``; ``None``
  means autocast is off for that device type. :data:`OFF` is the one object meaning "off
  everywhere", so the hot path is an identity test.
- :data:`scope_entries`: the live ``autocast`` entries of this context, each ``(scope, device
  slot, that slot's dtype before the entry)``; each exit removes its own.
- :data:`differentiating`: set while fluxlike differentiates (``gradient``, ``train``):
  automatic train mode, no kept casts, row-major weight gradients.
- :data:`shapeless_trace`: set while ``fluxlike.compile(..., shapeless=True)`` traces:
  custom functions (whose output shapes MLX cannot infer) and shape-dependent Python are
  left out of the graph then.

Process-wide: :data:`barrier`, whether autocast has been used in this process (see
:mod:`.policy`), and :data:`mode_fixes`, how many times ``trainmode``/``testmode`` or
``model.train()``/``model.eval()`` fixed a mode (compiled traces bake modes in).
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from typing import Any

import mlx.core as mx

OFF: tuple[mx.Dtype | None, mx.Dtype | None] = (None, None)

compute_dtypes: ContextVar[tuple[mx.Dtype | None, mx.Dtype | None]] = ContextVar(
    "fluxlike_autocast", default=OFF
)
scope_entries: ContextVar[tuple[tuple[Any, int, mx.Dtype | None], ...]] = ContextVar(
    "fluxlike_autocast_entries", default=()
)
differentiating: ContextVar[bool] = ContextVar("fluxlike_differentiating", default=False)
shapeless_trace: ContextVar[bool] = ContextVar("fluxlike_shapeless_trace", default=False)


class _Barrier:
    """Whether the process has crossed the dispatch barrier (``crossed``), and the lock
    under which it is crossed and under which layer classes are routed."""

    __slots__ = ("crossed", "lock")

    def __init__(self) -> None:
        self.crossed = False
        self.lock = threading.RLock()


barrier = _Barrier()


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
    state = compute_dtypes.get()
    if state is OFF:
        return None
    return state[device_index()]


def without_autocast(slot: int) -> tuple[mx.Dtype | None, mx.Dtype | None]:
    """The current state with device ``slot`` switched off."""
    state = list(compute_dtypes.get())
    state[slot] = None
    return OFF if state[0] is None and state[1] is None else (state[0], state[1])
