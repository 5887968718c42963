"""MLX functions as the type checker should see them, where MLX's own annotations are looser
than what the functions return (checked on MLX 0.32). At run time each name here is MLX's
own object: nothing is wrapped, only the static types differ.

- ``mlx.utils.tree_flatten`` is annotated as returning a list or a dict (the dict only when a
  dict is passed as ``destination=``, which fluxlike never does): here, the list.
- ``mlx.core.custom_function`` is annotated as returning ``object`` from every call: here,
  the decorated function's own signature, plus ``vjp``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

__all__ = ["custom_function", "tree_flatten"]

if TYPE_CHECKING:
    _P = ParamSpec("_P")
    _R = TypeVar("_R")

    def tree_flatten(
        tree: Any, prefix: str = "", is_leaf: Callable[[Any], bool] | None = None
    ) -> list[tuple[str, Any]]: ...

    class custom_function(Generic[_P, _R]):
        def __init__(self, f: Callable[_P, _R]) -> None: ...
        def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R: ...
        def vjp(self, f: Callable[..., Any]) -> Any: ...

else:
    from mlx.core import custom_function
    from mlx.utils import tree_flatten
