"""Argument checks the layers and losses share: sizes, flags, numbers, train/test mode,
initialisers, and the range of index arrays.

Each check raises a ``ValueError``/``TypeError`` whose message names the layer, the argument
and the value given, and returns the value in a plain Python type (a numpy integer, float or
bool would otherwise show in reprs). Layers run them in their constructors, never per call.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13


def is_int(value: object) -> TypeIs[int | np.integer]:
    """Whether ``value`` is an integer of any type (``int``, ``np.int64``, ...) but no bool.

    >>> import numpy as np
    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_size(value: Any, layer: str, name: str) -> int:
    """``value`` as a positive Python int, or a ``ValueError`` naming the layer and argument.

    Callers store the result (not ``value``): a numpy integer would show in reprs.

    >>> import numpy as np
    >>> check_size(np.int64(4), "Dense", "in_dims")
    4
    >>> check_size(True, "Dense", "in_dims")
    Traceback (most recent call last):
    ValueError: [Dense] in_dims must be a positive integer, got True
    """
    if not is_int(value) or value < 1:
        raise ValueError(f"[{layer}] {name} must be a positive integer, got {value!r}")
    return int(value)


def check_flag(value: Any, layer: str, name: str) -> bool:
    """``value`` as a Python bool; a ``TypeError`` unless it is a bool (``np.bool_`` too).

    Anything else is refused rather than judged by its truth: ``bias="no"`` would switch the
    bias on.

    >>> import numpy as np
    >>> check_flag(np.bool_(False), "Dense", "bias")
    False
    >>> check_flag("no", "Dense", "bias")
    Traceback (most recent call last):
    TypeError: [Dense] bias must be True or False, got 'no'
    """
    return _bool(value, f"[{layer}]", name)


def check_bool_argument(value: Any, function: str, name: str) -> bool:
    """``value`` as a Python bool, as :func:`check_flag`, for a function's keyword argument:
    the ``TypeError`` names the function.

    >>> check_bool_argument("no", "train", "progress")
    Traceback (most recent call last):
    TypeError: train: progress must be True or False, got 'no'
    """
    return _bool(value, f"{function}:", name)


def _bool(value: Any, prefix: str, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{prefix} {name} must be True or False, got {value!r}")
    return bool(value)


def check_active(active: Any, layer: str) -> bool | None:
    """A train/test mode argument: ``None`` (automatic), ``True`` or ``False`` (``np.bool_``
    too), as a Python bool or ``None``; anything else is a ``ValueError``.

    >>> check_active(None, "Dropout") is None
    True
    >>> check_active("yes", "Dropout")
    Traceback (most recent call last):
    ValueError: [Dropout] active must be True, False or None, got 'yes'
    """
    if active is not None and not isinstance(active, (bool, np.bool_)):
        raise ValueError(f"[{layer}] active must be True, False or None, got {active!r}")
    return None if active is None else bool(active)


def check_real(value: Any, layer: str, name: str, ok: Callable[[float], bool], want: str) -> float:
    """``value`` as a Python float if it is a real number of any type (``np.float32`` too;
    no bool) for which ``ok`` holds, else a ``ValueError`` saying it must be ``want``.

    >>> import numpy as np
    >>> check_real(np.float32(0.5), "Dropout", "p", lambda v: 0 <= v <= 1, "in [0, 1]")
    0.5
    >>> check_real(2, "Dropout", "p", lambda v: 0 <= v <= 1, "in [0, 1]")
    Traceback (most recent call last):
    ValueError: [Dropout] p must be in [0, 1], got 2
    """
    ok_type = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if not ok_type or not ok(value):
        raise ValueError(f"[{layer}] {name} must be {want}, got {value!r}")
    if isinstance(value, np.floating) and value.dtype.itemsize < 8:
        return float(str(value))  # np.float32(0.1) is 0.1, not 0.10000000149011612, in reprs
    return float(value)


def check_features(x: Any, expected: int, layer: str, axis: int = -1, hint: str = "") -> None:
    """Raise unless ``x`` is an array with ``expected`` entries on ``axis``; ``hint`` (the
    fix, e.g. ``"; flatten it first"``) ends the message.

    >>> import mlx.core as mx
    >>> check_features(mx.ones((2, 3)), 4, "Dense")
    Traceback (most recent call last):
    ValueError: [Dense] expected input with 4 features on axis -1, got shape (2, 3)
    """
    if not isinstance(x, mx.array):
        raise TypeError(f"[{layer}] expected an mx.array input, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[axis] != expected:
        raise ValueError(
            f"[{layer}] expected input with {expected} features on axis {axis}, "
            f"got shape {tuple(x.shape)}{hint}"
        )


_CHANNELS_LAST = {3: "sequences are channels last (NLC)", 4: "images are channels last (NHWC)",
                  5: "volumes are channels last (NDHWC)"}


def channels_last_fix(ndim: int, maybe: bool = False) -> str:
    """The message ending that tells how to move the channels of an ``ndim``-d
    channels-first input (PyTorch's and Flux's habit) to the last axis; ``maybe`` where the
    input only might be channels first.

    >>> channels_last_fix(4)
    '; images are channels last (NHWC) in MLX: x.transpose(0, 2, 3, 1)'
    >>> channels_last_fix(3, maybe=True)
    '; if it is channels first: sequences are channels last (NLC) in MLX: x.transpose(0, 2, 1)'
    """
    layout = _CHANNELS_LAST.get(ndim, "inputs are channels last")
    condition = "if it is channels first: " if maybe else ""
    return f"; {condition}{layout} in MLX: x.transpose{(0, *range(2, ndim), 1)}"


def channels_first_hint(shape: tuple[int, ...], channels: int) -> str:
    """:func:`channels_last_fix` for an input of ``shape`` that looks channels first: axis 1
    has ``channels`` entries and the last axis does not; else ``""``. For error branches
    only (it is not free).

    >>> channels_first_hint((8, 3, 32, 32), 3)
    '; images are channels last (NHWC) in MLX: x.transpose(0, 2, 3, 1)'
    >>> channels_first_hint((8, 32, 32, 4), 3)
    ''
    """
    if len(shape) < 3 or shape[1] != channels or shape[-1] == channels:
        return ""
    return channels_last_fix(len(shape))


def initialise(init: Any, shape: tuple[int, ...], layer: str) -> mx.array:
    """``init(shape)``, checked to be a floating ``mx.array`` of exactly ``shape``.

    A wrong shape would otherwise change the layer's sizes (its repr and checks read them
    from the parameters).

    >>> import mlx.core as mx
    >>> initialise(mx.zeros, (2, 3), "Dense").shape
    (2, 3)
    >>> initialise(lambda s: mx.ones((5, 7)), (2, 3), "Dense")
    Traceback (most recent call last):
    ValueError: [Dense] init returned shape (5, 7), expected (2, 3)
    """
    if not callable(init):
        raise TypeError(f"[{layer}] init must be a function of a shape, got {init!r}")
    value = init(shape)
    if not isinstance(value, mx.array):
        raise TypeError(f"[{layer}] init must return an mx.array, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"[{layer}] init returned shape {tuple(value.shape)}, "
                         f"expected {tuple(shape)}")
    if not mx.issubdtype(value.dtype, mx.floating):
        raise TypeError(f"[{layer}] init returned an array of dtype {value.dtype}, expected a "
                        f"floating dtype; return e.g. value.astype(mx.float32)")
    return value


def checked_init(init: Any, layer: str) -> Callable[[tuple[int, ...]], mx.array]:
    """``init`` checked as by :func:`initialise` under the name ``layer``: for a layer that
    hands its ``init`` to layers it builds, so that an error names it and not them.

    >>> import mlx.core as mx
    >>> checked_init(mx.zeros, "MultiHeadAttention")((2, 2)).dtype
    mlx.core.float32
    """
    if not callable(init):
        raise TypeError(f"[{layer}] init must be a function of a shape, got {init!r}")
    return lambda shape: initialise(init, shape, layer)


def index_range(x: mx.array) -> tuple[int, int] | None:
    """``(min, max)`` of an integer array, read back to the host (one synchronisation).

    ``None`` for an empty array, and inside ``mx.compile``/``mx.vmap``, where nothing can
    be read back. MLX's gathers do not check bounds (an index past the end reads arbitrary
    memory or crashes), so index-taking code checks with this before gathering.

    >>> import mlx.core as mx
    >>> from fluxlike.checks import index_range
    >>> index_range(mx.array([[3, 1], [7, 2]]))
    (1, 7)
    """
    if x.size == 0:
        return None
    try:
        low, high = cast("list[int]", mx.stack([mx.min(x), mx.max(x)]).tolist())
    except ValueError as error:
        if "function transformations" not in str(error):  # MLX's message for a traced eval
            raise
        return None
    return low, high
