"""The autocast state: one context variable, read on every dispatching layer call.

The value is a pair ``(cpu_dtype, gpu_dtype)``; ``None`` means autocast is off for that
device type. ``OFF`` is the one object meaning "off everywhere", so the hot path is an
identity test.
"""

from __future__ import annotations

from contextvars import ContextVar

import mlx.core as mx

OFF: tuple[mx.Dtype | None, mx.Dtype | None] = (None, None)

compute_dtypes: ContextVar[tuple[mx.Dtype | None, mx.Dtype | None]] = ContextVar(
    "fluxlike_autocast", default=OFF
)

# Set while fluxlike.compile(..., shapeless=True) traces: custom functions (which MLX cannot
# infer shapes of) and shape-dependent Python (row blocks) are left out of the graph then.
shapeless_trace: ContextVar[bool] = ContextVar("fluxlike_shapeless_trace", default=False)

HALF = (mx.float16, mx.bfloat16)
CASTABLE = (mx.float32, mx.float16, mx.bfloat16)  # float64, integers and bool are never cast


def device_index(device: mx.Device | None = None) -> int:
    """0 for the CPU, 1 for the GPU: the slot of ``device`` (default: the default device)."""
    device = mx.default_device() if device is None else device
    return 1 if device.type is mx.gpu else 0  # an enum member: identity is enough


def current_dtype() -> mx.Dtype | None:
    """The compute dtype in force on the default device, or ``None`` when autocast is off."""
    state = compute_dtypes.get()
    if state is OFF:
        return None
    return state[device_index()]
