"""Train and test modes, as in Flux.

Dropout and BatchNorm are *active* (dropping, using batch statistics) inside
:func:`~fluxlike.gradient`, :func:`~fluxlike.withgradient` and :func:`~fluxlike.train`, and
inactive elsewhere. ``trainmode``/``testmode`` fix a model's mode until it is reset with
``trainmode(model, "auto")``; so do mlx.nn's ``model.train()``/``model.eval()``, for training
loops written in MLX's style (``nn.value_and_grad``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.nn as nn

from .precision.state import context, enter_differentiating, mode_fixes


def mode_changed() -> None:
    """Count a fixed mode (``trainmode``/``testmode``, ``model.train()``/``model.eval()``):
    ``fluxlike.compile`` traces again when the count moves (a trace bakes modes in)."""
    mode_fixes.value += 1


@contextmanager
def differentiating() -> Iterator[None]:
    """Mark the enclosed code as inside a gradient computation (automatic train mode)."""
    token = enter_differentiating()
    try:
        yield
    finally:
        context.reset(token)


def is_active(layer: nn.Module) -> bool:
    """Whether a mode-dependent layer should behave as in training right now."""
    active = getattr(layer, "active", None)
    return context.get().differentiating if active is None else active


def _set_mode(model: nn.Module, active: bool | None, where: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: expected an mlx.nn.Module, got {type(model).__name__}")
    mode_changed()
    for _, module in model.named_modules():
        if "active" in module.__dict__:
            module.active = active
        else:  # a stock mlx.nn layer: it follows mlx's own `training` flag
            module._training = True if active is None else active
    return model


def _mode(mode: bool | str, where: str) -> bool | None:
    """``mode`` as given (``True``/``False``), or ``None`` for ``"auto"``."""
    if isinstance(mode, str) and mode == "auto":
        return None
    if not isinstance(mode, bool):
        raise ValueError(f"{where}: mode must be True, False or 'auto', got {mode!r}")
    return mode


def trainmode(model: nn.Module, mode: bool | str = True) -> nn.Module:
    """Put every layer of ``model`` in training mode (``mode=True``), test mode
    (``False``) or back to automatic (``"auto"``). Returns ``model``, changed in place.

    >>> from fluxlike import Dropout, trainmode
    >>> trainmode(Dropout(0.5)).active
    True
    """
    return _set_mode(model, _mode(mode, "trainmode"), "trainmode")


def testmode(model: nn.Module, mode: bool | str = True) -> nn.Module:
    """Put every layer of ``model`` in test mode (``mode=True``), training mode
    (``False``) or back to automatic (``"auto"``). Returns ``model``, changed in place.

    >>> from fluxlike import Dropout, testmode
    >>> testmode(Dropout(0.5)).active
    False
    """
    test = _mode(mode, "testmode")
    return _set_mode(model, None if test is None else not test, "testmode")
