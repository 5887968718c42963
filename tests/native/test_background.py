"""Primitives created on the companion's worker thread (native/src/cache.h: Creator): a call
that can run without its primitive (a float32 convolution's forward pass on MLX's kernel, max
pooling and a mid-sized softmax on loops) never waits for one. A shape's first uses create
nothing; the last of ``uses_without_primitive()`` (the third, by default) queues the creation
and runs without it; once stored, later calls use it.

What is asserted: the calls' results (the other way's before, the primitive's after, the
same as a primitive made on the evaluating thread), the counts, that clearing the cache
waits for the worker, and that a process exits while creations are queued. Calls
fluxlike_native._ext directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import mlx.core as mx
import numpy as np
import pytest
from helpers import in_threads

if os.environ.get("FLUXLIKE_NATIVE", "").strip().lower() in {"0", "off", "no", "false", "none"}:
    pytest.skip("FLUXLIKE_NATIVE disables the native kernels", allow_module_level=True)
_ext = pytest.importorskip("fluxlike_native._ext")

from fluxlike import native  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    """An empty cache in mode ``auto`` with background creation on; leaves them as found."""
    mode = _ext.set_matmul_mode("auto")
    background = _ext.set_background_creation(True)
    _ext.clear_cache()
    yield
    _ext.set_matmul_mode(mode)
    _ext.set_background_creation(background)
    _ext.clear_cache()


def counts(op: str) -> tuple[int, int, int]:
    info = _ext.cache_info()["ops"][op]
    return info["misses"], info["creations"], info["hits"]


def conv(x: mx.array, w: mx.array, b: mx.array) -> mx.array:
    return _ext.conv(x, w, b, [1, 1], [1, 1], [1, 1], [1, 1], 1, False, relu=True)


def pool(x: mx.array) -> mx.array:
    return _ext.max_pool(x, [2, 2], [2, 2], [0, 0], [0, 0], False)


def conv_grads(x: mx.array, w: mx.array, g: mx.array) -> mx.array:
    """A convolution's input and weight gradients (its two backward kinds), flat, joined."""
    dx, dw = mx.vjp(lambda x, w: _ext.conv(x, w, None, [1, 1], [1, 1], [1, 1], [1, 1], 1,
                                           False), [x, w], [g])[1]
    return mx.concatenate([dx.reshape(-1), dw.reshape(-1)])


# (op, the call, its operands): a convolution of (2, 9, 11, 4) with 6 3x3 kernels, one big
# enough for two OpenMP threads (2**22-2**23 multiply-adds: the thread count changes how
# oneDNN splits it), its gradients (two primitives), a pooling and a softmax of 2**15 entries
# (loops on a first use only).
CASES: dict[str, tuple[str, Callable[..., mx.array], tuple[tuple[int, ...], ...]]] = {
    "conv": ("conv", conv, ((2, 9, 11, 4), (6, 3, 3, 4), (6,))),
    "conv two threads": ("conv", conv, ((2, 30, 30, 16), (32, 3, 3, 16), (32,))),
    "conv gradients": ("conv", conv_grads, ((2, 9, 11, 4), (6, 3, 3, 4), (2, 9, 11, 6))),
    "max_pool": ("max_pool", pool, ((2, 10, 12, 8),)),
    "softmax": ("softmax", _ext.softmax, ((64, 512),)),
}


def operands(shapes: tuple[tuple[int, ...], ...]) -> list[mx.array]:
    xs = [mx.random.normal(s) for s in shapes]
    mx.eval(xs)
    return xs


@pytest.fixture(params=[3, 2], ids=["three uses (default)", "two uses"])
def uses(request) -> Iterator[int]:
    """How many uses of a shape run without its primitive (3 by default; 2 as before
    2026-12-05), set for the test and put back."""
    assert _ext.uses_without_primitive() == 3  # the default
    old = _ext.set_uses_without_primitive(request.param)
    yield request.param
    _ext.set_uses_without_primitive(old)


def test_the_count_of_uses_without_a_primitive_is_checked():
    with pytest.raises(ValueError, match="uses must be at least 2"):
        _ext.set_uses_without_primitive(1)
    assert _ext.uses_without_primitive() == 3


@pytest.mark.parametrize("case", CASES)
def test_the_last_use_without_queues_the_primitive_and_later_calls_use_it(case, uses):
    op, call, shapes = CASES[case]
    xs = operands(shapes)
    first = np.array(call(*xs))
    n = counts(op)[0]  # the primitives the call needs (2 for the gradients)
    assert counts(op) == (n, 0, 0)  # a first use creates nothing
    for _ in range(uses - 2):  # nor do the uses before the last
        np.testing.assert_array_equal(np.array(call(*xs)), first)
    native.wait_for_creations()
    assert counts(op) == ((uses - 1) * n, 0, 0)
    last_without = np.array(call(*xs))  # queued: this call runs without them too
    native.wait_for_creations()
    assert counts(op)[:2] == (uses * n, n) and _ext.cache_info()["pending"] == 0
    with_primitive = np.array(call(*xs))
    assert counts(op) == (uses * n, n, n)  # the worker's primitives
    np.testing.assert_array_equal(first, last_without)
    # the same primitive as the evaluating thread makes (for the same thread count)
    _ext.clear_cache()
    _ext.set_background_creation(False)
    for _ in range(uses - 1):
        mx.eval(call(*xs))
    want = np.array(call(*xs))
    assert counts(op)[1] == n
    np.testing.assert_array_equal(with_primitive, want)


@pytest.mark.parametrize("case", ["conv", "softmax", "conv gradients"])
def test_the_first_calls_run_the_other_way_and_the_later_ones_the_primitive(case, uses):
    # whatever the worker's timing (the next call makes the primitive itself if the worker
    # has not stored it): a seeded run repeats bit for bit
    op, call, shapes = CASES[case]
    xs = operands(shapes)
    _ext.set_background_creation(False)
    other_way = np.array(call(*xs))
    n = counts(op)[0]  # the primitives the call needs
    for _ in range(uses - 1):
        np.array(call(*xs))
    primitive = np.array(call(*xs))  # (made by the call before, on this thread)
    _ext.set_background_creation(True)
    for _ in range(4):
        _ext.clear_cache()
        got = [np.array(call(*xs)) for _ in range(uses + 4)]
        for i, y in enumerate(got):
            np.testing.assert_array_equal(y, other_way if i < uses else primitive)
        misses, creations, hits = counts(op)
        # (a creation the worker is running when the next call comes is made by that call
        # too: the first stored wins)
        assert n <= creations <= 2 * n and misses + hits == (uses + 4) * n


def test_a_shape_used_twice_creates_nothing():
    """The default: two uses of a shape (image sizes whose pooled sizes two of them share)
    run without its primitive and queue nothing; a third queues it."""
    x, w, b = operands(CASES["conv"][2])
    for _ in range(2):
        mx.eval(conv(x, w, b))
    native.wait_for_creations()
    assert counts("conv")[1] == 0 and _ext.cache_info()["pending"] == 0
    mx.eval(conv(x, w, b))
    native.wait_for_creations()
    assert counts("conv")[1] == 1


def test_a_cache_of_capacity_zero_creates_nothing_for_calls_that_run_without():
    x, w, b = operands(CASES["conv"][2])
    _ext.set_cache_capacity(0)
    try:
        ys = [np.array(conv(x, w, b)) for _ in range(5)]
        native.wait_for_creations()
        assert counts("conv")[1] == 0  # (each would be dropped as soon as it was stored)
        for y in ys[1:]:
            np.testing.assert_array_equal(y, ys[0])
    finally:
        _ext.set_cache_capacity(4096)


def test_clearing_the_cache_waits_for_queued_creations():
    shapes = [(1, n, n, 4) for n in range(6, 26)]
    w, b = mx.random.normal((6, 3, 3, 4)), mx.random.normal((6,))
    for s in shapes:  # each shape twice: twenty creations queued
        x = mx.random.normal(s)
        mx.eval(conv(x, w, b), conv(x, w, b))
    _ext.clear_cache()  # (a creation stored after the clear would outlive it)
    info = _ext.cache_info()
    assert info["pending"] == 0 and info["size"] == 0 and info["creations"] == 0


def test_threads_meeting_shapes_together_get_the_same_results():
    x, w, b = operands(CASES["conv"][2])
    want = np.array(mx.maximum(mx.conv_general(x, w, padding=1) + b, 0))
    ys: list[np.ndarray] = []

    def work(k: int) -> None:
        for _ in range(3):
            ys.append(np.array(conv(x, w, b)))

    in_threads(work, 4, rounds=2)
    native.wait_for_creations()
    assert counts("conv")[0] >= 1 and _ext.cache_info()["ops"]["conv"]["size"] == 1
    for y in ys:  # MLX's kernel or the primitive: the same to float32 rounding
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_the_setting():
    assert native.background_creation() is True
    assert native.background_creation(False) is False and not _ext.background_creation()
    assert native.background_creation(True) is True
    with pytest.raises(TypeError, match="background_creation: on must be True, False or None"):
        native.background_creation(1)  # type: ignore[arg-type]
    native.wait_for_creations()  # nothing queued: returns


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=240, check=False)


def test_a_process_exits_cleanly_with_creations_queued():
    done = run_python("""
        import mlx.core as mx
        from fluxlike_native import _ext
        w = mx.random.normal((8, 3, 3, 4))
        for n in range(8, 60):  # each shape twice: its creation queued, none awaited
            x = mx.random.normal((2, n, n, 4))
            mx.eval(_ext.conv(x, w, None, [1, 1], [0, 0], [0, 0], [1, 1], 1, False))
            mx.eval(_ext.conv(x, w, None, [1, 1], [0, 0], [0, 0], [1, 1], 1, False))
        print("pending", _ext.cache_info()["pending"] >= 0)
    """)
    assert done.returncode == 0, done.stderr
    assert "pending True" in done.stdout
