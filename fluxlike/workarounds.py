"""Workarounds for MLX bugs, each naming the MLX version it was seen on and the test that
tells when MLX has fixed it (a canary in ``tests/test_workarounds.py``).

**Abort at exit after worker threads ran compiled functions** (MLX 0.32.4, Linux;
ml-explore/mlx#3126). MLX keeps one compile cache per thread, and a thread's cache is
destroyed by a C++ thread-local destructor after the thread's Python part has finished. That
destructor takes the GIL (the cache holds Python objects). ``Thread.join()`` returns before
it runs, so if the main thread then finalises the interpreter, the exiting thread's attempt
to take the GIL ends it with ``pthread_exit``, whose unwinding through the destructor calls
``std::terminate``: ``terminate called without an active exception``, SIGABRT, exit status
134, in about half the runs of a script whose threads called layers (every ``mlx.nn``
activation such as ``gelu`` is an ``mx.compile``-d function). :func:`wait_for_exiting_threads`,
run by ``atexit`` before the interpreter finalises, waits (with the GIL released) until the
process's set of threads has stopped changing, so such destructors finish first.
"""

from __future__ import annotations

import atexit
import os
import time

_TASKS = "/proc/self/task"  # Linux: one entry per thread of the process


def _threads() -> frozenset[str] | None:
    try:
        return frozenset(os.listdir(_TASKS))
    except OSError:
        return None


def wait_for_exiting_threads(quiet: float = 0.02, limit: float = 1.0) -> float:
    """Wait until no thread of the process has ended for ``quiet`` seconds, at most ``limit``
    seconds; returns the seconds waited. Sleeping releases the GIL, so a thread whose
    thread-local destructors need it can finish. Without ``/proc`` (macOS, Windows) it
    pauses for ``quiet`` seconds. Set ``FLUXLIKE_EXIT_WAIT=0`` to skip it."""
    if os.environ.get("FLUXLIKE_EXIT_WAIT", "1") == "0":
        return 0.0
    start = time.monotonic()
    last = _threads()
    if last is None:
        time.sleep(quiet)
        return time.monotonic() - start
    if len(last) <= 1:  # the main thread alone: no other thread to wait for
        return 0.0
    changed = start
    while True:
        time.sleep(0.001)
        now, current = time.monotonic(), _threads()
        if current != last:
            last, changed = current, now
        if now - changed >= quiet or now - start >= limit or current is None:
            return now - start


atexit.register(wait_for_exiting_threads)
