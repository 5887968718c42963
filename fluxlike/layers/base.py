"""The common base of fluxlike layers: a Flux-style ``repr``.

A leaf layer prints its constructor and its parameter count::

    Dense(5 => 2)  # 12 parameters

a container prints its children one per line and a total::

    Chain(
      Dense(5 => 3, relu),  # 18 parameters
      Dense(3 => 2),  # 8 parameters
    )  # Total: 4 arrays, 26 parameters, 104 bytes.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import mlx.nn as nn

from .._mlxtyping import tree_flatten
from ..activations import identity
from ..modes import mode_changed


class Layer(nn.Module):
    """Base class of fluxlike layers: ``nn.Module`` plus the Flux-style ``repr``.

    Subclasses override :meth:`signature` (the one-line constructor form) and, for
    containers, :meth:`shown_children`.
    """

    def signature(self) -> str:
        """The layer as its constructor call, e.g. ``"Dense(5 => 2, relu)"``."""
        return f"{type(self).__name__}()"

    def shown_children(self) -> list[tuple[str | None, Any]] | None:
        """Children to print one per line, as ``(name or None, child)``; ``None`` for a leaf."""
        return None

    def __repr__(self) -> str:
        return show(self)

    def _set_training_mode(self, mode: bool) -> None:
        """mlx.nn's ``model.train()``/``model.eval()`` call this on every module: a layer with
        a train/test mode (attribute ``active``) is then fixed in it, as ``trainmode`` and
        ``testmode`` do, so that mlx-style training loops get batch statistics and dropout."""
        super()._set_training_mode(mode)
        if "active" in self.__dict__:
            self.active: bool | None = mode  # None (automatic) as constructed
            mode_changed()


def act_name(act: Callable) -> str | None:
    """The name an activation prints under, or ``None`` for ``identity``."""
    return None if act is identity else getattr(act, "__name__", repr(act))


def signature_of(args: list[str], name: str, act: Callable | None = None, **options: Any) -> str:
    """``Name(arg, ..., act, key=value, ...)`` leaving out the activation if it is identity."""
    parts = list(args)
    shown = None if act is None else act_name(act)
    if shown is not None:
        parts.append(shown)
    parts += [f"{k}={v}" for k, v in options.items()]
    return f"{name}({', '.join(parts)})"


def count(module: nn.Module) -> tuple[int, int, int, int]:
    """``(arrays, trainable, non-trainable, bytes)`` over a module's parameters."""
    every = tree_flatten(module.parameters())
    trainable = sum(v.size for _, v in tree_flatten(module.trainable_parameters()))
    total = sum(v.size for _, v in every)
    return len(every), trainable, total - trainable, sum(v.nbytes for _, v in every)


def _params_comment(module: nn.Module) -> str:
    _, trainable, frozen, _ = count(module)
    if trainable == 0 and frozen == 0:
        return ""
    text = f"  # {trainable:_} parameters"
    return text + (f", plus {frozen:_} non-trainable" if frozen else "")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3f} {unit}"
    return f"{nbytes} bytes"


def _line(module: Any) -> str:
    if isinstance(module, Layer):
        return module.signature()
    if isinstance(module, nn.Module):  # a stock mlx.nn layer
        return f"{type(module).__name__}({module._extra_repr()})"
    return getattr(module, "__name__", repr(module))


def show(module: Any, name: str | None = None) -> str:
    """The Flux-style text of a layer or container (what ``repr`` prints)."""
    prefix = "" if name is None else f"{name} = "
    children = module.shown_children() if isinstance(module, Layer) else None
    if children is None:
        comment = _params_comment(module) if isinstance(module, nn.Module) else ""
        return f"{prefix}{_line(module)}{comment}"
    body = "".join(textwrap.indent(_show_child(c, n), "  ") + "\n" for n, c in children)
    arrays, trainable, frozen, nbytes = count(module)
    total = f"  # Total: {arrays} arrays, {trainable:_} parameters"
    total += f", plus {frozen:_} non-trainable" if frozen else ""
    return f"{prefix}{type(module).__name__}(\n{body}){total}, {_size(nbytes)}."


def _show_child(child: Any, name: str | None) -> str:
    """A child's text with the separating comma before its comment."""
    text = show(child, name)
    body, newline, last = text.rpartition("\n")
    code, sep, comment = last.partition("  # ")
    return f"{body}{newline}{code},{sep}{comment}"

