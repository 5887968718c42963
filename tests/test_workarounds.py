"""Tests of fluxlike/workarounds.py, with a canary for each MLX bug worked around: a canary
passes while the bug is still in MLX, and fails (saying to remove the workaround) once it
is fixed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fluxlike.workarounds import wait_for_exiting_threads

ROOT = Path(__file__).resolve().parent.parent

# Threads call an mx.compile-d function, are joined, and the process exits (MLX 0.32.4:
# ml-explore/mlx#3126, "terminate called without an active exception", SIGABRT).
_PLAIN_MLX = """
    import threading
    import mlx.core as mx
    f = mx.compile(lambda x: x * 2 + 1)
    def work():
        y = mx.ones((4, 8))
        for _ in range(20):
            y = f(y @ mx.ones((8, 8)))
        mx.eval(y)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
"""

# The case: threads running fluxlike layers under autocast (gelu is mx.compile-d)
_FLUXLIKE = """
    import threading
    import mlx.core as mx
    from fluxlike import Chain, Dense, LayerNorm, autocast, gelu
    model = Chain(Dense(8, 16, gelu), LayerNorm(16), Dense(16, 4))
    def work():
        with autocast(mx.bfloat16):
            for _ in range(20):
                y = model(mx.ones((4, 8)))
        mx.eval(y)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
"""


def _aborted(code: str, **env: str) -> bool:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert result.returncode in (0, -6, 134), result.stderr[-2000:]  # ok or SIGABRT only
    return result.returncode != 0


def test_canary_mlx_still_aborts_at_exit_after_compiled_calls_in_threads():
    # Plain MLX aborted in about 60% of runs here (3 in 20 on another machine): up to 12
    # runs, stopping at the first abort; all 12 clean happens by chance about once in 10**4.
    if any(_aborted(_PLAIN_MLX) for _ in range(12)):
        return
    raise AssertionError(
        "MLX may have fixed this: 12 runs of the plain-MLX reproducer of ml-explore/mlx#3126 "
        "(threads calling an mx.compile-d function, then exit) all exited cleanly; remove "
        "the workaround wait_for_exiting_threads in fluxlike/workarounds.py (and its README "
        "note) if it no longer aborts")


def test_threads_that_ran_layers_under_autocast_exit_cleanly():
    # without the exit guard this aborted in 35 of 40 runs here; with it in 0 of 40
    aborts = sum(_aborted(_FLUXLIKE) for _ in range(6))
    assert aborts == 0, f"{aborts} of 6 runs aborted at exit"


def test_the_guard_waits_only_while_threads_end():
    assert wait_for_exiting_threads(quiet=0.001, limit=0.5) < 0.5
    os.environ["FLUXLIKE_EXIT_WAIT"] = "0"
    try:
        assert wait_for_exiting_threads() == 0.0
    finally:
        del os.environ["FLUXLIKE_EXIT_WAIT"]
