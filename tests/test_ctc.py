"""Tests of fluxlike/losses/_ctc.py through fluxlike.losses.ctc_loss: Flux's hand-computed
values and gradients, a brute-force sum over every alignment, finite differences, batches with
lengths and padding, half precision under autocast, mx.compile, errors."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from helpers import np64

from fluxlike import Dense, autocast, gradient
from fluxlike.losses import ctc_loss


def brute_force(x, labels, blank=-1):
    """``-log`` of the summed probability of every path that collapses to ``labels``
    (repeats merged, then blanks removed), in float64."""
    x = np.asarray(x, np.float64)
    time, classes = x.shape
    blank %= classes
    logp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - x.max(-1, keepdims=True)
    total = 0.0
    for path in itertools.product(range(classes), repeat=time):
        kept = [k for i, k in enumerate(path) if (i == 0 or k != path[i - 1]) and k != blank]
        if kept == list(labels):
            total += np.exp(sum(logp[t, k] for t, k in enumerate(path)))
    return -np.log(total) if total > 0 else np.inf


# Flux's test/ctc.jl (its classes-by-time matrices, transposed; its labels 1-based)
FLUX_CASES = [
    ([[1., 2., 3.], [2., 1., 1.], [3., 3., 2.]], 3.6990738275138035,
     [[-0.317671, -0.427729, 0.665241], [0.244728, -0.0196172, -0.829811],
      [0.0729422, 0.447346, 0.16457]]),
    ([[-3., 12., 8., 15.], [4., 20., -2., 20.], [8., -33., 6., 5.]], 8.02519869363453,
     [[-2.29294774655333e-06, -0.999662657278862, 1.75500863563993e-06, 0.00669284889063],
      [0.017985914969696, 0.999662657278861, -1.9907078755387e-06, -0.006693150917307],
      [-0.01798362202195, -2.52019580677916e-20, 2.35699239251042e-07, 3.02026677058789e-07]]),
]


@pytest.mark.parametrize("x, loss, grad", FLUX_CASES)
def test_flux_values_and_gradients(x, loss, grad):
    logits = mx.array(np.array(x, np.float32).T)  # (time, classes)
    value, g = mx.value_and_grad(lambda v: ctc_loss(v, mx.array([0, 1])))(logits)
    assert value.dtype == mx.float32
    assert value.item() == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(np64(g), np.array(grad).T, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("labels", [[0], [1, 2], [1, 1], [2, 0, 2], [], [0, 0, 1]])
def test_matches_the_sum_over_every_alignment(labels):
    x = np.random.default_rng(len(labels)).normal(size=(5, 4)).astype(np.float32) * 2
    got = ctc_loss(mx.array(x), mx.array(labels, mx.int32)).item()
    assert got == pytest.approx(brute_force(x, labels), rel=1e-5)


def test_batch_with_lengths_padding_and_another_blank():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 5, 4)).astype(np.float32)
    y = np.array([[1, 2, 1], [3, -1, -1], [2, 2, 7]])  # padding past the lengths: anything
    inputs, targets = [5, 3, 4], [3, 1, 2]
    out = ctc_loss(mx.array(x), mx.array(y), input_lengths=inputs, target_lengths=targets,
                   blank=0, agg="none")
    expected = [brute_force(x[b, :inputs[b]], y[b, :targets[b]], blank=0) for b in range(3)]
    assert out.shape == (3,)
    np.testing.assert_allclose(np64(out), expected, rtol=1e-5)
    mean = ctc_loss(mx.array(x), mx.array(y), input_lengths=inputs, target_lengths=targets,
                    blank=0)
    assert mean.item() == pytest.approx(np.mean(expected), rel=1e-5)


def test_gradient_matches_finite_differences_of_the_brute_force():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(4, 3)).astype(np.float64)
    labels = [1, 1]
    with mx.stream(mx.cpu):
        g = np64(mx.grad(lambda v: ctc_loss(v, mx.array(labels)))(mx.array(x, mx.float64)))
    step, numeric = 1e-6, np.empty_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += step
        down[i] -= step
        numeric[i] = (brute_force(up, labels) - brute_force(down, labels)) / (2 * step)
    np.testing.assert_allclose(g, numeric, rtol=1e-4, atol=1e-6)


def test_a_target_that_cannot_fit_is_inf_with_a_finite_gradient():
    x = mx.zeros((2, 2, 4))
    # [1, 1] needs 3 steps (a blank between the repeats); [2] fits in 2
    out, g = mx.value_and_grad(lambda v: ctc_loss(v, mx.array([[1, 1], [2, 2]]),
                                                  target_lengths=[2, 1], agg="sum"))(x)
    assert np.isinf(out.item())
    assert np.isfinite(np64(g)).all()
    per_sample = ctc_loss(x, mx.array([[1, 1], [2, 2]]), target_lengths=[2, 1], agg="none")
    assert np.isinf(np64(per_sample)[0]) and np.isfinite(np64(per_sample)[1])


@pytest.mark.parametrize("half", [mx.float16, mx.bfloat16])
def test_half_logits_give_float32_in_and_out_of_scope(half):
    rng = np.random.default_rng(5)
    x = mx.array(rng.normal(size=(2, 6, 5)).astype(np.float32)).astype(half)
    y = mx.array([[0, 1, 2], [3, 3, 0]])
    exact = ctc_loss(x.astype(mx.float32), y, agg="none")
    outside = ctc_loss(x, y, agg="none")
    with autocast(half, device="cpu"):
        inside = ctc_loss(x, y, agg="none")
    assert outside.dtype == inside.dtype == mx.float32
    np.testing.assert_allclose(np64(outside), np64(exact), rtol=1e-6)
    np.testing.assert_allclose(np64(inside), np64(exact), rtol=1e-6)


@pytest.mark.parametrize("half", [mx.float16, mx.bfloat16])
def test_training_gradients_under_autocast_are_float32(half):
    model = Dense(4, 5)
    x = mx.random.normal((2, 6, 4))
    y = mx.array([[0, 1], [2, 2]])
    (grads,) = gradient(lambda m: ctc_loss(m(x), y), model, autocast=half)
    (exact,) = gradient(lambda m: ctc_loss(m(x), y), model)
    assert grads["weight"].dtype == mx.float32
    np.testing.assert_allclose(np64(grads["weight"]), np64(exact["weight"]), rtol=0.1,
                               atol=0.02)


def test_float64_stays_float64():
    with mx.stream(mx.cpu):
        x = mx.array(np.random.default_rng(6).normal(size=(4, 3)), mx.float64)
        out = ctc_loss(x, mx.array([0, 1]))
        assert out.dtype == mx.float64
        assert out.item() == pytest.approx(brute_force(np.array(x), [0, 1]), rel=1e-6)


def test_under_compile_a_bad_label_gives_nan():
    x = mx.zeros((2, 4, 3))
    f = mx.compile(lambda v, y: ctc_loss(v, y, agg="none"))
    out = np64(f(x, mx.array([[0, 1], [0, 2]])))  # 2 is the blank
    assert np.isfinite(out[0]) and np.isnan(out[1])
    assert out[0] == pytest.approx(brute_force(np.zeros((4, 3)), [0, 1]), rel=1e-5)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"y": [[0, 3]]}, ValueError, r"^\[ctc_loss\] labels must be class indices in \[0, 3\) "
                                  r"other than the blank \(2\), 0-based; .*subtract 1\)$"),
    ({"y": [[0, 2]]}, ValueError, r"other than the blank \(2\)"),
    ({"y": [[0, 1]], "blank": 3}, ValueError,
     r"^\[ctc_loss\] blank must be a class index in \[-3, 3\) \(-1: the last class, as "
     r"Flux\), got 3$"),
    ({"y": [[0, 1]], "input_lengths": [5]}, ValueError,
     r"^\[ctc_loss\] input_lengths must lie in \[1, 4\] \(the time axis\), got values from "
     r"5 to 5$"),
    ({"y": [[0, 1]], "target_lengths": [3]}, ValueError,
     r"^\[ctc_loss\] target_lengths must lie in \[0, 2\]"),
    ({"y": [[0, 1]], "target_lengths": [1, 1]}, ValueError,
     r"^\[ctc_loss\] target_lengths must have shape \(1,\), one length per sample"),
    ({"y": [0, 1]}, ValueError, r"^\[ctc_loss\] y must hold one label sequence per sample, of "
                                r"shape \(1, max_target_length\), got shape \(2,\)$"),
    ({"y": mx.array([[0.0, 1.0]])}, TypeError,
     r"^\[ctc_loss\] y must be the label sequences \(an integer mx.array or a list of ints\), "
     r"got mlx.core.float32 array$"),
    ({"y": [[0, 1]], "agg": "avg"}, ValueError, r"^\[ctc_loss\] agg must be one of"),
])
def test_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        ctc_loss(mx.zeros((1, 4, 3)), **kwargs)


def test_prediction_errors():
    with pytest.raises(ValueError, match=r"^\[ctc_loss\] expected floating logits of shape "
                                         r"\(batch, time, classes\) or \(time, classes\), got "
                                         r"a mlx.core.float32 array of shape \(3,\)$"):
        ctc_loss(mx.zeros(3), [0])
    with pytest.raises(ValueError, match=r"^\[ctc_loss\] lengths are per sample"):
        ctc_loss(mx.zeros((4, 3)), [0], input_lengths=[4])
    with pytest.raises(TypeError, match=r"^\[ctc_loss\] expected the prediction ŷ as an "
                                        r"mx.array"):
        ctc_loss([[0.0]], [0])
