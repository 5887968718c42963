"""Where a warning points: the user's line, not fluxlike's. No imports but the standard
library's (``_blas`` uses it before MLX is loaded)."""

from __future__ import annotations

import os
import sys
from types import FrameType

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _mlx_package() -> str | None:
    module = sys.modules.get("mlx")
    paths = getattr(module, "__path__", None)
    return os.path.abspath(list(paths)[0]) if paths else None


def outside_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for the first frame outside fluxlike, MLX's Python
    (``mlx.nn`` modules that call fluxlike's kernels) and the import machinery (which
    ``warnings`` skips itself), counted from the function that calls ``warnings.warn`` (this
    one's caller).

    >>> def warn_here():
    ...     return outside_stacklevel()
    >>> warn_here()  # called from here, outside fluxlike: the caller of warn_here
    2
    """
    inside = tuple(p + os.sep for p in (_PACKAGE, _mlx_package()) if p)
    frame: FrameType | None = sys._getframe(2)  # the warning function's caller
    level = 2
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
            continue
        if not name.startswith(inside):
            break
        frame, level = frame.f_back, level + 1
    return level
