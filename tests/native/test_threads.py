"""How many OpenMP threads a native kernel runs on (native/src/cpu.*, engine.*): below
``single_thread_macs()`` multiply-adds one, and no team thread is woken (or even created);
above it oneDNN's OpenMP team. Observed from the threads the process has, in a process of
its own with ``OMP_NUM_THREADS=2`` (so that a team exists on any machine)."""

from __future__ import annotations

import textwrap

import pytest
from native_helpers import _subprocess, needs_native

pytestmark = needs_native

COUNT = """
    import os
    import mlx.core as mx
    import fluxlike
    from fluxlike.native import _loader
    ext = _loader.switch.ext
    threads = lambda: len(os.listdir("/proc/self/task"))
    def run(threshold, m, k, n, what):
        if threshold is not None:
            ext.set_single_thread_macs(threshold)
        x, w = mx.random.normal((m, k)), mx.random.normal((n, k))
        mx.eval(x, w)
        before = threads()
        if what == "matmul":
            y = ext.matmul(x, w, None, False, True, False, None, False, False)
        elif what == "conv":   # m images of k x k pixels, n channels in and out, 3 x 3
            x, w = mx.random.normal((m, k, k, n)), mx.random.normal((n, 3, 3, n))
            y = ext.conv(x, w, None, [1, 1], [1, 1], [1, 1], [1, 1], 1, False)
        elif what == "adam":   # m * k * n elements
            p = mx.random.normal((m * k * n,))
            c = mx.array(0.5)
            y = ext.adam_step(p, p, p, p, c, c, None, 0.9, 0.999, 1e-8)[0]
        mx.eval(y)
        print(what, m, k, n, "new threads:", threads() - before)
"""


def new_threads(calls: str) -> list[int]:
    result = _subprocess(textwrap.dedent(COUNT) + textwrap.dedent(calls), OMP_NUM_THREADS="2")
    assert result.returncode == 0, result.stderr
    return [int(line.rsplit(":", 1)[1]) for line in result.stdout.splitlines()
            if "new threads:" in line]


def test_the_threshold_is_a_number_of_multiply_adds_that_can_be_set():
    result = _subprocess("""
        import math
        import fluxlike
        from fluxlike.native import _loader
        ext = _loader.switch.ext
        default = ext.single_thread_macs()
        assert default == 2.0**22, default
        assert ext.set_single_thread_macs(0) == default and ext.single_thread_macs() == 0
        assert ext.set_single_thread_macs(math.inf) == 0
        try:
            ext.set_single_thread_macs(-1)
        except ValueError as error:
            assert "set_single_thread_macs" in str(error) and "-1" in str(error), error
        else:
            raise AssertionError("a negative threshold was taken")
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_kernels_below_the_threshold_start_no_team():
    """Under the default threshold (2**22 multiply-adds) matmuls up to 128 x 128 x 128, a small
    convolution and an Adam update of 65,536 entries (counted 32 each) wake no team thread,
    in their implementation on any ISA (AVX2's gemm:jit takes OpenMP's thread count when it
    runs, brgemm when it is created: both are one)."""
    counts = new_threads("""
        run(None, 16, 32, 32, "matmul")
        run(None, 64, 128, 128, "matmul")
        run(None, 128, 128, 128, "matmul")
        run(None, 8, 28, 4, "conv")
        run(None, 256, 256, 1, "adam")
    """)
    assert counts == [0, 0, 0, 0, 0], counts


@pytest.mark.parametrize("what, shape", [("matmul", (256, 256, 256)), ("conv", (16, 28, 16)),
                                         ("adam", (512, 512, 4))])
def test_the_threshold_decides_between_one_thread_and_the_team(what, shape):
    """The same kernel on one thread under an infinite threshold, on the team (one more
    thread in the process, libgomp's) under threshold 0."""
    m, k, n = shape
    counts = new_threads(f"""
        import math
        run(math.inf, {m}, {k}, {n}, "{what}")
        run(0, {m}, {k}, {n}, "{what}")
    """)
    assert counts == [0, 1], counts
