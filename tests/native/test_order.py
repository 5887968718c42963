"""The order of a backward pass's work (native/src/order.*): a layer's weight and bias gradients
are computed before the gradient it passes down, so that its cotangent is freed at once,
except where those gradients are larger than what computing them early frees (a weight used at
many steps: each use's gradient would be held until MLX sums them at the end).

Peak memory, not time: the kernels on against the same step with them off (MLX's kernels,
MLX's depth-first order), in one process.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import mlx.core as mx
from native_helpers import needs_native

import fluxlike
from fluxlike import native, withgradient


def _peak_mib(step: Callable[[], None], repeats: int = 5) -> float:
    """The median of `repeats` steps' peaks: one step's peak moves with the timing of MLX's
    frees (under AddressSanitizer a single step's went from 3.3 to 4.3 MiB between runs)."""
    step()  # (the kernels' one-time buffers, the caches)
    peaks = []
    for _ in range(repeats):
        mx.synchronize()
        mx.reset_peak_memory()
        step()
        peaks.append(mx.get_peak_memory() / 2**20)
    return statistics.median(peaks)


def _peaks(step: Callable[[], None]) -> tuple[float, float]:
    on = _peak_mib(step)
    with native.disabled():
        off = _peak_mib(step)
    return on, off


@needs_native
def test_a_deep_chain_frees_each_layers_cotangent_at_once() -> None:
    mx.random.seed(0)
    x = mx.random.normal((2048, 256))
    model = fluxlike.Chain(*[fluxlike.Dense(256, 256, fluxlike.relu) for _ in range(8)])
    mx.eval(x, model.parameters())

    def step() -> None:
        mx.eval(withgradient(lambda m: (m(x) ** 2).mean(), model))

    on, off = _peaks(step)
    assert on < 0.75 * off, (on, off)  # measured 40 MiB against 74


@needs_native
def test_a_weight_used_at_every_step_does_not_hold_each_steps_gradient() -> None:
    # A recurrence through one Dense layer: each step's weight gradient (256 KiB) is larger
    # than its cotangent and input (16 KiB); computed early, all 48 were held (10 MiB against
    # MLX's 3.5).
    mx.random.seed(0)
    h0 = mx.random.normal((8, 256))
    cell = fluxlike.Dense(256, 256, fluxlike.tanh)
    mx.eval(h0, cell.parameters())

    def loss(c: fluxlike.Dense) -> mx.array:
        h = h0
        for _ in range(48):
            h = c(h)
        return (h**2).mean()

    def step() -> None:
        mx.eval(withgradient(loss, cell))

    on, off = _peaks(step)
    assert on < 1.25 * off, (on, off)  # measured 4.1 MiB against 3.5


@needs_native
def test_an_lstm_step_peaks_no_higher_than_with_the_kernels_off() -> None:
    mx.random.seed(0)
    x = mx.random.normal((8, 32, 32))
    model = fluxlike.Chain(fluxlike.LSTM(32, 128), fluxlike.Dense(128, 32))
    mx.eval(x, model.parameters())

    def step() -> None:
        mx.eval(withgradient(lambda m: (m(x) ** 2).mean(), model))

    on, off = _peaks(step)
    assert on < 1.25 * off, (on, off)  # measured 7.7 MiB against 7.1 (13.6 before)
