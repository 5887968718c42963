"""``mx.compile`` that never replays one autocast state's trace under another.

``mx.compile`` traces a function once and replays the graph: Python state read during the
trace (the autocast scope, the train/test mode) is baked in. :func:`compile` keeps one
compiled function per such state, so entering or leaving a scope picks the right trace.

A user calling ``mx.compile`` directly must do the same: compile inside the scope the
function will run in, and keep a separate compiled function for each autocast state (or
call ``fluxlike.compile`` instead). Note that ``mx.compile`` caches traces by the identity of
the Python function: compiling the *same* function object again inside a scope replays the
old trace, so wrap it in a new function (``mx.compile(lambda *a: fn(*a))``) for each state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..checks import check_bool_argument
from .state import context, device_index, enter, mode_fixes


def trace_key() -> tuple:
    """The Python state a trace depends on: the default device type (it picks which slot of
    the autocast state layers read), the autocast dtypes and the automatic train mode."""
    state = context.get()
    return device_index(), state.cpu, state.gpu, state.differentiating


def compile(
    fn: Callable, *, inputs: Any = None, outputs: Any = None, shapeless: bool = False
) -> Callable:
    """Like ``mx.compile(fn, inputs, outputs, shapeless)``, with one trace per autocast state
    and train mode: entering or leaving a scope, ``gradient``'s automatic train mode, and
    fixing the mode of fluxlike's layers (``trainmode``/``testmode``, ``model.train()``/
    ``model.eval()``) each pick or make the right trace.

    As with ``mx.compile``, arrays the function reads from outside (a model's weights) are
    constants of the trace unless they are in ``inputs``: pass ``inputs=model.state`` (and
    ``outputs=`` for what it changes) when the model will be updated.

    With ``shapeless=True`` the CPU's half-precision layers trace as plain casts around their
    float32 kernels (MLX cannot infer the output shapes of the custom gradients they use
    otherwise), and linear layers add their bias after the GEMM (MLX's shapeless ``addmm``
    crashes on a smaller batch): the same computation, up to float32 rounding. As with
    ``mx.compile``, a shapeless trace replays correctly only where the function's Python did
    not depend on the shapes: Dense, Conv, the norms and ``flatten`` do not; the window
    pools, attention's head split and the recurrent layers' time steps do. (MLX 0.32 also
    crashes differentiating a training-mode BatchNorm in a shapeless trace.)

    >>> import mlx.core as mx
    >>> from fluxlike import Dense, autocast, compile
    >>> layer = Dense(3, 2)
    >>> forward = compile(lambda x: layer(x), inputs=layer.state)
    >>> forward(mx.ones((1, 3))).dtype
    mlx.core.float32
    >>> with autocast(mx.float16, device="cpu"):
    ...     forward(mx.ones((1, 3))).dtype
    mlx.core.float16
    """
    if not callable(fn):
        raise TypeError(f"fluxlike.compile: fn must be a function, got {type(fn).__name__}")
    shapeless = check_bool_argument(shapeless, "fluxlike.compile", "shapeless")
    traces: dict[tuple, Callable] = {}
    modes = [mode_fixes.value]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if mode_fixes.value != modes[0]:  # trainmode/testmode, train()/eval(): trace again
            traces.clear()
            modes[0] = mode_fixes.value
        key = trace_key()
        compiled = traces.get(key)
        if compiled is None:
            # mx.compile caches traces by the identity of the Python function, so each
            # state gets its own function object.
            def trace(*args: Any, **kwargs: Any) -> Any:
                token = enter(shapeless=shapeless)
                try:
                    return fn(*args, **kwargs)
                finally:
                    context.reset(token)

            compiled = traces[key] = mx.compile(
                trace, inputs=inputs, outputs=outputs, shapeless=shapeless
            )
        return compiled(*args, **kwargs)

    return run
