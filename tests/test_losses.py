import mlx.core as mx
import numpy as np
import pytest
from helpers import check_gradients, np64
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fluxlike
from fluxlike import autocast
from fluxlike.losses import (
    binary_focal_loss,
    binarycrossentropy,
    crossentropy,
    dice_coeff_loss,
    focal_loss,
    hinge_loss,
    huber_loss,
    kldivergence,
    logitbinarycrossentropy,
    logitcrossentropy,
    mae,
    mse,
    msle,
    poisson_loss,
    siamese_contrastive_loss,
    squared_hinge_loss,
    tversky_loss,
)

EPS32 = float(np.finfo(np.float32).eps)

# ---- independent numpy references: the elementwise / per-sample loss, in float64 ----


def np_softmax(z, axis=-1):
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def xlogy(x, y):
    return np.where(x == 0, 0.0, x * np.log(np.where(x == 0, 1.0, y)))


def ref_huber(p, y, delta=1.0):
    e = np.abs(p - y)
    return np.where(e < delta, 0.5 * e**2, delta * (e - 0.5 * delta))


def ref_focal(p, y, gamma=2, eps=EPS32):
    q = p + eps
    return np.sum(-y * np.maximum(1 - q, 0) ** gamma * np.log(q), axis=-1)


def ref_binary_focal(p, y, gamma=2, eps=EPS32):
    pt = y * (p + eps) + (1 - y) * (1 - p + eps)
    return -np.maximum(1 - pt, 0) ** gamma * np.log(pt)


REFERENCES = {
    "mse": lambda p, y: (p - y) ** 2,
    "mae": lambda p, y: np.abs(p - y),
    "msle": lambda p, y: np.log((p + EPS32) / (y + EPS32)) ** 2,
    "huber_loss": ref_huber,
    "crossentropy": lambda p, y: -np.sum(xlogy(y, p + EPS32), axis=-1),
    "logitcrossentropy": lambda z, y: -np.sum(
        y * (z - np.log(np.sum(np.exp(z), -1, keepdims=True))), axis=-1),
    "binarycrossentropy": lambda p, y: -xlogy(y, p + EPS32) - xlogy(1 - y, 1 - p + EPS32),
    "logitbinarycrossentropy": lambda z, y: -y * np.log(1 / (1 + np.exp(-z)))
    - (1 - y) * np.log(1 - 1 / (1 + np.exp(-z))),
    "kldivergence": lambda p, y: np.sum(xlogy(y, y) - xlogy(y, p + EPS32), axis=-1),
    "focal_loss": ref_focal,
    "hinge_loss": lambda p, y: np.maximum(0, 1 - p * y),
    "squared_hinge_loss": lambda p, y: np.maximum(0, 1 - p * y) ** 2,
    "poisson_loss": lambda p, y: p - xlogy(y, p),
    "siamese_contrastive_loss": lambda p, y: (1 - y) * p**2 + y * np.maximum(0, 1 - p) ** 2,
    "binary_focal_loss": ref_binary_focal,
}
LOSSES = {
    f.__name__: f
    for f in (mse, mae, msle, huber_loss, crossentropy, logitcrossentropy, binarycrossentropy,
              logitbinarycrossentropy, kldivergence, focal_loss, hinge_loss, squared_hinge_loss,
              poisson_loss, siamese_contrastive_loss, binary_focal_loss)
}
CLASS_LOSSES = ("crossentropy", "logitcrossentropy", "kldivergence", "focal_loss")
# MLX's float64 exp is only float32-accurate on the CPU, too noisy for finite differences of
# the MLX function: these take finite differences of the numpy reference instead.
EXP_BASED = ("logitcrossentropy", "logitbinarycrossentropy")


def make_inputs(name, rng, shape=(6, 5)):
    """(ŷ, y) float32 numpy arrays in the domain of the loss."""
    onehot = np.eye(shape[-1], dtype=np.float32)[rng.integers(0, shape[-1], shape[:-1])]
    if name in ("mse", "mae", "huber_loss"):
        return rng.normal(size=shape) * 2, rng.normal(size=shape)
    if name == "msle":
        return rng.uniform(0.1, 3, shape), rng.uniform(0.1, 3, shape)
    if name in ("crossentropy", "focal_loss"):
        return np_softmax(rng.normal(size=shape)), onehot
    if name == "kldivergence":
        y = np_softmax(rng.normal(size=shape))
        y[0, 0] = 0  # a zero-probability entry (0 log 0 = 0)
        return np_softmax(rng.normal(size=shape)), y / y.sum(-1, keepdims=True)
    if name == "logitcrossentropy":
        return rng.normal(size=shape) * 3, onehot
    if name in ("binarycrossentropy", "binary_focal_loss"):
        return rng.uniform(0.05, 0.95, shape), rng.integers(0, 2, shape)
    if name in ("hinge_loss", "squared_hinge_loss"):
        return rng.normal(size=shape) * 2, rng.choice([-1.0, 1.0], shape)
    if name == "poisson_loss":
        return rng.uniform(0.1, 3, shape), rng.integers(0, 5, shape)
    if name == "siamese_contrastive_loss":
        return rng.uniform(0, 2, shape), rng.integers(0, 2, shape)
    return rng.normal(size=shape) * 3, rng.integers(0, 2, shape)  # logitbinarycrossentropy


def as_mx(*arrays, dtype=mx.float32):
    return [mx.array(np.asarray(a, np.float32)).astype(dtype) for a in arrays]


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("agg", ["mean", "sum", "none", "max"])
def test_matches_numpy_reference(name, agg):
    rng = np.random.default_rng(1)
    p, y = make_inputs(name, rng)
    pm, ym = as_mx(p, y)
    p64, y64 = (np.asarray(a, np.float32).astype(np.float64) for a in (p, y))
    per_sample = REFERENCES[name](p64, y64)
    expected = {"mean": np.mean, "sum": np.sum, "none": lambda a: a, "max": np.max}[agg](per_sample)
    out = LOSSES[name](pm, ym, agg=mx.max if agg == "max" else agg)
    assert out.dtype == mx.float32
    assert out.shape == np.shape(expected)
    np.testing.assert_allclose(np64(out), expected, rtol=2e-5, atol=1e-6)


def test_flux_documented_values():
    # values from Flux's docstrings (their class axis first; ours last)
    y_model = mx.softmax(mx.arange(-7, 8, dtype=mx.float32).reshape(5, 3), axis=-1)
    labels = mx.array([0, 1, 2, 1, 0])
    assert crossentropy(y_model, labels).item() == pytest.approx(1.6076053, rel=1e-5)
    assert focal_loss(y_model, labels).item() == pytest.approx(1.1277571935622628, rel=1e-5)
    logits = mx.array(np.concatenate([np.arange(-9, 1), np.arange(0, 10), [7.5]]).reshape(7, 3),
                      dtype=mx.float32)
    assert logitcrossentropy(logits, mx.array([0, 1, 2, 0, 1, 0, 0])).item() == \
        pytest.approx(1.5791205, rel=1e-5)
    assert msle(mx.array([1.1, 2.2, 3.3]), mx.array([1, 2, 3])).item() == \
        pytest.approx(0.009084041, rel=1e-4)
    assert logitbinarycrossentropy(mx.array([2, -1, np.pi]), mx.array([1, 0, 1])).item() == \
        pytest.approx(0.160832, rel=1e-5)


@pytest.mark.parametrize("name", CLASS_LOSSES)
def test_class_indices_equal_one_hot(name):
    rng = np.random.default_rng(2)
    p, _ = make_inputs(name if name != "kldivergence" else "crossentropy", rng, (2, 3, 4))
    idx = rng.integers(0, 4, (2, 3))
    onehot = np.eye(4)[idx]
    (pm,) = as_mx(p)
    by_index = LOSSES[name](pm, mx.array(idx), agg="none")
    assert by_index.shape == (2, 3) and by_index.dtype == mx.float32
    np.testing.assert_allclose(np64(by_index), np64(LOSSES[name](pm, *as_mx(onehot), agg="none")),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", CLASS_LOSSES)
def test_class_index_gradients_equal_one_hot_gradients(name):
    rng = np.random.default_rng(8)
    p, _ = make_inputs(name if name != "kldivergence" else "crossentropy", rng, (4, 3))
    idx = rng.integers(0, 3, (4,))
    (pm, onehot) = as_mx(p, np.eye(3)[idx])
    by_index = mx.grad(lambda v: LOSSES[name](v, mx.array(idx)))(pm)
    by_onehot = mx.grad(lambda v: LOSSES[name](v, onehot))(pm)
    np.testing.assert_allclose(np64(by_index), np64(by_onehot), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", CLASS_LOSSES)
@pytest.mark.parametrize("bad", [[1, 3], [-1, 0]])
def test_class_indices_out_of_range(name, bad):
    # e.g. 1-based labels, as a Flux user might pass
    with pytest.raises(ValueError, match=rf"\[{name}\] class indices must lie in \[0, 3\) "
                                         rf"\(0-based\), got values from {min(bad)} to "
                                         rf"{max(bad)}"):
        LOSSES[name](mx.ones((2, 3)) / 3, mx.array(bad))


@pytest.mark.parametrize("name", CLASS_LOSSES)
def test_compiled_out_of_range_index_gives_nan(name):
    p = mx.full((3, 3), 1 / 3)
    out = mx.compile(lambda v, i: LOSSES[name](v, i, agg="none"))(p, mx.array([0, 3, -1]))
    assert np.isfinite(np64(out)[0]) and np.isnan(np64(out)[1:]).all()


@pytest.mark.parametrize("name", CLASS_LOSSES)
def test_class_axis_argument(name):
    rng = np.random.default_rng(3)
    p, y = make_inputs(name, rng, (4, 5))
    pm, ym = as_mx(p, y)
    moved = LOSSES[name](pm.T, ym.T, axis=0, agg="none")
    np.testing.assert_allclose(np64(moved), np64(LOSSES[name](pm, ym, agg="none")), rtol=1e-6)
    idx = rng.integers(0, 5, (4,))
    (onehot,) = as_mx(np.eye(5)[idx])
    np.testing.assert_allclose(np64(LOSSES[name](pm.T, mx.array(idx), axis=0)),
                               np64(LOSSES[name](pm, onehot)), rtol=1e-6)


def check_gradients_vs_reference(fn, ref, p, y, step=1e-6):
    """mx.grad of the mean loss w.r.t. ŷ against central differences of the numpy mean."""
    with mx.stream(mx.cpu):
        analytic = np64(mx.grad(lambda v: fn(v, y))(p)).reshape(-1)
    p0, y0 = np64(p), np64(y)
    numeric = np.empty(p0.size)
    for i in range(p0.size):
        up, down = p0.copy().reshape(-1), p0.copy().reshape(-1)
        up[i] += step
        down[i] -= step
        numeric[i] = (np.mean(ref(up.reshape(p0.shape), y0))
                      - np.mean(ref(down.reshape(p0.shape), y0))) / (2 * step)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_gradients_float64(name):
    rng = np.random.default_rng(4)
    p, y = make_inputs(name, rng, (3, 4))
    if name == "mae":
        p = p + np.sign(p - y) * 0.1  # keep away from the kink at ŷ == y
    pm, ym = (mx.array(np.asarray(a, np.float64), dtype=mx.float64) for a in (p, y))
    if name in EXP_BASED:
        check_gradients_vs_reference(LOSSES[name], REFERENCES[name], pm, ym)
    else:  # two arguments: helpers.check_gradients mishandles a single one
        check_gradients(lambda v, unused: LOSSES[name](v, ym) + 0 * mx.sum(unused), pm,
                        mx.zeros((1,), mx.float64))


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("half", [mx.float16, mx.bfloat16])
def test_half_inputs_give_float32_in_and_out_of_scope(name, half):
    rng = np.random.default_rng(5)
    p, y = make_inputs(name, rng)
    p32, y32 = as_mx(p, y)
    p16, y16 = as_mx(p, y, dtype=half)
    fn = LOSSES[name]
    exact = fn(p16.astype(mx.float32), y16.astype(mx.float32), agg="none")
    outside = fn(p16, y16, agg="none")
    with autocast(mx.float16, device="cpu"):
        inside = fn(p16, y16, agg="none")
    assert outside.dtype == inside.dtype == mx.float32
    # computed in float32 from the half values: the float32 result on those values ...
    np.testing.assert_allclose(np64(outside), np64(exact), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np64(inside), np64(exact), rtol=1e-6, atol=1e-7)
    # ... and close to the float32 loss of the unrounded inputs (rounding of ŷ, y only)
    tol = 2e-2 if half == mx.bfloat16 else 3e-3
    np.testing.assert_allclose(fn(p16, y16).item(), fn(p32, y32).item(), rtol=tol, atol=tol)
    assert fn(p16, y16.astype(mx.int32) if name in ("mse", "mae") else y16).dtype == mx.float32


def test_half_logits_beyond_float16_exp_range():
    logits = mx.array([[30.0, 0.0, -30.0], [0.0, 12.0, 0.0]], dtype=mx.float16)
    loss = logitcrossentropy(logits, mx.array([2, 1]), agg="none")
    np.testing.assert_allclose(np64(loss), [60.0, 2 * np.exp(-12.0)], rtol=1e-3, atol=1e-6)
    assert np.isfinite(logitbinarycrossentropy(logits, mx.zeros((2, 3))).item())


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_float32_and_float64_keep_their_dtype(name):
    p, y = make_inputs(name, np.random.default_rng(6))
    with mx.stream(mx.cpu):
        p64, y64 = (mx.array(np.asarray(a, np.float64), dtype=mx.float64) for a in (p, y))
        assert LOSSES[name](p64, y64).dtype == mx.float64
        assert LOSSES[name](p64, y64.astype(mx.float32)).dtype == mx.float64
        with autocast(mx.bfloat16, device="cpu"):
            assert LOSSES[name](*as_mx(p, y)).dtype == mx.float32
            assert LOSSES[name](p64, y64).dtype == mx.float64


def test_float64_eps_is_float64_machine_epsilon():
    with mx.stream(mx.cpu):
        p = mx.array([[0.0, 1.0]], dtype=mx.float64)
        y = mx.array([[1.0, 0.0]], dtype=mx.float64)
        assert crossentropy(p, y).item() == pytest.approx(-np.log(np.finfo(np.float64).eps))
        assert crossentropy(p, y, eps=1e-3).item() == pytest.approx(-np.log(1e-3))


def test_gradient_flows_to_the_target_too():
    p, y = mx.array([1.0, 4.0]), mx.array([0.0, 1.0], dtype=mx.bfloat16)
    grad = mx.grad(lambda t: mse(p, t))(y)
    assert grad.dtype == mx.bfloat16
    np.testing.assert_allclose(np64(grad), [-1.0, -3.0])


def test_scalar_target_and_integer_prediction():
    assert mse(mx.array([1.0, 3.0]), 1.0).item() == 2.0
    assert mse(mx.array([1.0, 3.0]), 1).item() == 2.0  # an int is a constant here, not a class
    assert binarycrossentropy(mx.array([0.5, 0.5]), 1).item() == pytest.approx(np.log(2))
    assert mae(mx.array([1, 4]), mx.array([0, 0])).item() == 2.5


# ---- Python-number targets of the class-axis losses ----


@pytest.mark.parametrize("name", CLASS_LOSSES)
@pytest.mark.parametrize("label", [0, 3, np.int64(2)])
def test_python_int_target_is_a_class_index(name, label):
    (p,) = as_mx(np_softmax(np.array([0.0, 1.0, 2.0, 3.0])))
    fn = LOSSES[name]
    as_array = mx.array(int(label))
    assert fn(p, label).item() == fn(p, as_array).item()
    np.testing.assert_array_equal(np64(mx.grad(lambda v: fn(v, label))(p)),
                                  np64(mx.grad(lambda v: fn(v, as_array))(p)))
    # with a batch, a single int is rejected exactly as mx.array(label) is
    batch = mx.stack([p, p])
    with pytest.raises(ValueError, match=rf"\[{name}\] prediction shape \(2, 4\) does not match "
                                         r"target shape \(\); integer class indices must have "
                                         r"shape \(2,\)"):
        fn(batch, label)


@pytest.mark.parametrize("name", CLASS_LOSSES)
@pytest.mark.parametrize("label", [4, -1, 2**70])
def test_python_int_target_out_of_range(name, label):
    with pytest.raises(ValueError, match=rf"\[{name}\] class indices must lie in \[0, 4\) "
                                         rf"\(0-based\), got values from {label} to {label}"):
        LOSSES[name](mx.full((4,), 0.25), label)


@pytest.mark.parametrize("name", CLASS_LOSSES)
@pytest.mark.parametrize("target", [0.25, 1.0, True, np.float32(0.5)])
def test_python_float_or_bool_target_is_refused(name, target):
    with pytest.raises(TypeError, match=rf"\[{name}\] expected class indices \(an int array of "
                                        r"shape \(3,\), or a Python int\) or "
                                        r"probabilities/one-hot of shape \(3, 4\), got "
                                        rf"{type(target).__name__} .*mx.full\(\(3, 4\)"):
        LOSSES[name](mx.full((3, 4), 0.25), target)


def test_huber_delta():
    out = huber_loss(mx.array([0.5, 3.0]), mx.array([0.0, 0.0]), delta=2.0, agg="none")
    np.testing.assert_allclose(np64(out), [0.125, 2.0 * (3.0 - 1.0)])
    with pytest.raises(ValueError, match=r"\[huber_loss\] delta must be a positive number"):
        huber_loss(mx.ones(2), mx.ones(2), delta=0)


def test_focal_loss_gamma_zero_is_crossentropy():
    p, y = as_mx(*make_inputs("focal_loss", np.random.default_rng(7)))
    np.testing.assert_allclose(np64(focal_loss(p, y, gamma=0, agg="none")),
                               np64(crossentropy(p, y, agg="none")), rtol=1e-6)
    with pytest.raises(ValueError, match=r"\[focal_loss\] gamma must be a non-negative"):
        focal_loss(p, y, gamma=-1)


# confident predictions: ŷ + eps reaches or passes 1 (the weight's base hits 0)
CONFIDENT = np.array([[1.0, 0.0, 0.0], [1 - 1e-7, 1e-7, 0.0], [1 - 2**-24, 2**-24, 0.0],
                      [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]], np.float32)
CONFIDENT_LABELS = np.array([0, 0, 0, 1, 2])


def ref_focal_grad(p, labels, gamma, eps=EPS32):
    """d mean(focal) / dŷ of Flux's definition, in float64 (the branch decided in float32).

    Where ŷ + eps >= 1 the weight max(1 - ŷ - eps, 0)**gamma is the constant 0 (1 for
    gamma = 0), so its derivative is 0 there; elsewhere it is the derivative of the power."""
    q32 = p[np.arange(len(p)), labels] + np.float32(eps)
    q, base = q32.astype(np.float64), (np.float32(1) - q32).astype(np.float64)
    inside = base > 0
    safe = np.where(inside, base, 1.0)
    if gamma == 0:
        d = -1 / q
    else:
        d = np.where(inside, gamma * safe ** (gamma - 1) * np.log(q) - safe**gamma / q, 0.0)
    grad = np.zeros(p.shape)
    grad[np.arange(len(p)), labels] = d / len(p)
    return grad


@pytest.mark.parametrize("gamma", [0, 0.5, 1, 2])
@pytest.mark.parametrize("target", ["indices", "onehot"])
def test_focal_loss_gradient_finite_for_confident_predictions(gamma, target):
    y = mx.array(CONFIDENT_LABELS) if target == "indices" else \
        mx.array(np.eye(3, dtype=np.float32)[CONFIDENT_LABELS])
    value, grad = mx.value_and_grad(lambda v: focal_loss(v, y, gamma=gamma))(mx.array(CONFIDENT))
    assert np.isfinite(value.item()) and np.isfinite(np64(grad)).all()
    np.testing.assert_allclose(np64(grad), ref_focal_grad(CONFIDENT, CONFIDENT_LABELS, gamma),
                               rtol=1e-5, atol=1e-7)
    expected = ref_focal(CONFIDENT.astype(np.float64), np.eye(3)[CONFIDENT_LABELS], gamma)
    np.testing.assert_allclose(value.item(), expected.mean(), rtol=1e-5)


@pytest.mark.parametrize("target", ["indices", "onehot"])
def test_focal_loss_gamma_zero_gradient_is_crossentropy_gradient(target):
    p = mx.array(np.concatenate([CONFIDENT, make_inputs("focal_loss", np.random.default_rng(9),
                                                        (4, 3))[0].astype(np.float32)]))
    labels = np.concatenate([CONFIDENT_LABELS, [0, 1, 2, 1]])
    y = mx.array(labels) if target == "indices" else mx.array(np.eye(3, dtype=np.float32)[labels])
    focal = mx.value_and_grad(lambda v: focal_loss(v, y, gamma=0))(p)
    cross = mx.value_and_grad(lambda v: crossentropy(v, y))(p)
    assert focal[0].item() == cross[0].item()
    np.testing.assert_array_equal(np64(focal[1]), np64(cross[1]))
    assert np.isfinite(np64(focal[1])).all()


def test_probability_losses_gradient_finite_at_zero_and_one_with_eps_zero():
    # 0 * log(0) terms are 0 by definition; their gradient must not be 0 / 0
    p = mx.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    y = mx.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    for fn in (crossentropy, kldivergence):
        grad = np64(mx.grad(lambda v, fn=fn: fn(v, y, eps=0))(p))
        np.testing.assert_allclose(grad, [[-0.5, 0, 0], [0, -1, 0]], err_msg=fn.__name__)
    grad = np64(mx.grad(lambda v: focal_loss(v, y, eps=0))(p))
    np.testing.assert_allclose(grad, ref_focal_grad(np.array(p), np.array([0, 1]), 2, eps=0),
                               rtol=1e-6)
    # elementwise: -y / ŷ where y = 1, (1 - y) / (1 - ŷ) where y = 0, over 6 entries
    grad = np64(mx.grad(lambda v: binarycrossentropy(v, y, eps=0))(p))
    np.testing.assert_allclose(grad, np.array([[-1, 1, 1], [2, -2, 1]]) / 6, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_shape_mismatch_names_both_shapes(name):
    with pytest.raises(ValueError, match=rf"\[{name}\] .*\(3, 4\).*\(3, 5\)"):
        LOSSES[name](mx.ones((3, 4)), mx.ones((3, 5)))
    with pytest.raises(ValueError, match=rf"\[{name}\] .*\(3, 4\).*\(4,\)"):
        LOSSES[name](mx.ones((3, 4)), mx.ones((4,)))  # no broadcasting


@pytest.mark.parametrize("name", CLASS_LOSSES)
def test_class_target_errors(name):
    with pytest.raises(ValueError, match=r"class indices of shape \(3,\) must be integers, "
                                         r"got mlx.core.float32"):
        LOSSES[name](mx.ones((3, 4)), mx.zeros((3,)))  # float "indices"
    with pytest.raises(ValueError, match=r"prediction shape \(3, 4\) does not match target "
                                         r"shape \(2,\); integer class indices must have "
                                         r"shape \(3,\)"):
        LOSSES[name](mx.ones((3, 4)), mx.array([0, 1]))
    with pytest.raises(ValueError, match=rf"\[{name}\] axis 2 is out of range"):
        LOSSES[name](mx.ones((3, 4)), mx.ones((3, 4)), axis=2)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("agg", ["avg", "", None, 3])
def test_bad_agg_names_loss_and_choices(name, agg):
    with pytest.raises(ValueError, match=rf"\[{name}\] agg must be one of \('mean', 'sum', "
                                         r"'none'\) or a function"):
        LOSSES[name](mx.ones((2, 3)), mx.ones((2, 3)), agg=agg)


def test_bad_argument_types():
    with pytest.raises(TypeError, match=r"\[mse\] expected the prediction ŷ as an mx.array, "
                                        r"got list"):
        mse([1.0], mx.ones(1))
    with pytest.raises(TypeError, match=r"\[crossentropy\] expected the target y as an mx.array "
                                        r"or a number, got str"):
        crossentropy(mx.ones((1, 2)), "cat")


def test_namespace():
    assert fluxlike.losses.mse is mse
    assert "mse" not in dir(fluxlike)


# ---- properties ----

finite64 = st.floats(-30, 30, allow_nan=False, width=64)


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(2, 6)), elements=finite64),
       st.data())
def test_logitcrossentropy_is_crossentropy_of_softmax(logits, data):
    target = data.draw(st.integers(0, logits.shape[-1] - 1))
    with mx.stream(mx.cpu):
        z = mx.array(logits, dtype=mx.float64)
        y = mx.array(np.eye(logits.shape[-1])[np.full(logits.shape[0], target)],
                     dtype=mx.float64)
        # eps=0: the identity is exact (a probability may be as small as e^-60 / 6)
        a = logitcrossentropy(z, y, agg="none")
        b = crossentropy(mx.softmax(z, axis=-1), y, agg="none", eps=0)
        np.testing.assert_allclose(np64(a), np64(b), rtol=1e-6, atol=1e-9)
        # binary: |z| <= 10 keeps 1 - sigmoid(z) >= 4.5e-5, clear of cancellation
        z = mx.clip(z, -10, 10)
        c = logitbinarycrossentropy(z, y, agg="none")
        d = binarycrossentropy(mx.sigmoid(z), y, agg="none", eps=0)
        np.testing.assert_allclose(np64(c), np64(d), rtol=1e-5, atol=1e-9)


confident_probability = st.one_of(st.sampled_from([0.0, 1.0, 1 - 1e-7, 1 - 2**-24, 2**-24]),
                                  st.floats(0, 1, width=32))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(2, 4)),
                  elements=confident_probability),
       st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.floats(0, 4)), st.data())
def test_focal_loss_gradient_always_finite(p, gamma, data):
    labels = np.array(data.draw(st.lists(st.integers(0, p.shape[1] - 1), min_size=len(p),
                                         max_size=len(p))))
    for y in (mx.array(labels), mx.array(np.eye(p.shape[1], dtype=np.float32)[labels])):
        grad = mx.grad(lambda v, y=y: focal_loss(v, y, gamma=gamma))(mx.array(p))
        np.testing.assert_allclose(np64(grad), ref_focal_grad(p, labels, gamma),
                                   rtol=1e-4, atol=1e-6)


# a dyadic grid: the square of any non-zero difference is far from underflow
grid = hnp.arrays(np.float32, st.integers(1, 8),
                  elements=st.integers(-2**20, 2**20).map(lambda k: k / 1024))


@settings(max_examples=100, deadline=None)
@given(grid, st.data())
def test_mse_non_negative_and_zero_iff_equal(a, data):
    b = data.draw(hnp.arrays(np.float32, a.shape,
                             elements=st.integers(-2**20, 2**20).map(lambda k: k / 1024)))
    loss = mse(mx.array(a), mx.array(b)).item()
    assert loss >= 0
    assert (loss == 0) == bool(np.array_equal(a, b))
    assert mse(mx.array(a), mx.array(a)).item() == 0


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(2, 5)),
                  elements=st.floats(-5, 5, width=64)), st.data())
def test_kldivergence_non_negative_and_zero_on_equal(z, data):
    w = data.draw(hnp.arrays(np.float64, z.shape, elements=st.floats(-5, 5, width=64)))
    with mx.stream(mx.cpu):
        p = mx.softmax(mx.array(z, dtype=mx.float64), axis=-1)
        q = mx.softmax(mx.array(w, dtype=mx.float64), axis=-1)
        assert np64(kldivergence(p, q, agg="none")).min() >= -1e-12
        assert abs(kldivergence(p, p).item()) < 1e-12


# ---- hinge, Poisson, contrastive, binary focal, dice and Tversky losses ----


def test_flux_documented_values_of_the_other_losses():
    # Flux's docstrings (float64 there: the float32 results agree to float32 rounding)
    pred, labels = mx.array([0.1, 0.3, 1.0, 1.5]), mx.array([1, -1, 1, 1])
    assert hinge_loss(pred, labels).item() == pytest.approx(0.55, rel=1e-6)
    assert squared_hinge_loss(pred, labels).item() == pytest.approx(0.625, rel=1e-6)
    assert poisson_loss(mx.array([1, 3, 3]), mx.array([1, 2, 3])).item() == \
        pytest.approx(0.5023128522198171, rel=1e-6)
    distances, y3 = mx.array([0.5, 1.5, 2.5]), mx.array([1, 2, 3])
    assert siamese_contrastive_loss(distances, y3).item() == pytest.approx(-4.833333, rel=1e-6)
    assert siamese_contrastive_loss(distances, y3, margin=2).item() == pytest.approx(-4.0)
    assert dice_coeff_loss(mx.array([1.1, 2.1, 3.1]), y3).item() == \
        pytest.approx(0.000992391663909964, rel=2e-4)  # 1 - 0.999: float32 cancellation
    p = mx.array([[0.268941, 0.731059], [0.5, 0.5], [0.268941, 0.731059]])
    assert binary_focal_loss(p, mx.array([[0, 1], [1, 0], [0, 1]])).item() == \
        pytest.approx(0.0728675615927385, rel=1e-5)


def test_binary_focal_loss_gamma_zero_is_binarycrossentropy_and_finite_at_the_ends():
    p, y = as_mx(*make_inputs("binary_focal_loss", np.random.default_rng(9)))
    np.testing.assert_allclose(np64(binary_focal_loss(p, y, gamma=0, agg="none")),
                               np64(binarycrossentropy(p, y, agg="none")), rtol=1e-6)
    ends, targets = mx.array([0.0, 1.0, 0.0, 1.0]), mx.array([0.0, 1.0, 1.0, 0.0])
    for gamma in (0, 0.5, 2):
        loss, grad = mx.value_and_grad(lambda v, g=gamma: binary_focal_loss(v, targets,
                                                                            gamma=g))(ends)
        assert np.isfinite(loss.item()) and np.isfinite(np64(grad)).all()
    with pytest.raises(ValueError, match=r"^\[binary_focal_loss\] gamma must be a non-negative"):
        binary_focal_loss(p, y, gamma=-1)


def test_siamese_margin_must_be_non_negative():
    with pytest.raises(ValueError, match=r"^\[siamese_contrastive_loss\] margin must be a "
                                         r"non-negative number, got -1"):
        siamese_contrastive_loss(mx.ones(2), mx.ones(2), margin=-1)


def ref_dice(p, y, axes=None, smooth=1.0):
    return 1 - (2 * np.sum(y * p, axes) + smooth) / (np.sum(y**2, axes) + np.sum(p**2, axes)
                                                     + smooth)


def ref_tversky(p, y, axes=None, beta=0.7):
    tp = np.sum(y * p, axes)
    return 1 - (tp + 1) / (tp + beta * np.sum((1 - y) * p, axes)
                           + (1 - beta) * np.sum(y * (1 - p), axes) + 1)


OVERLAP = {"dice_coeff_loss": (dice_coeff_loss, ref_dice),
           "tversky_loss": (tversky_loss, ref_tversky)}


def _masks(rng, shape=(3, 4, 4, 2)):
    """Batch-first, channels-last predicted probabilities and binary masks."""
    return rng.uniform(0, 1, shape), rng.integers(0, 2, shape)


@pytest.mark.parametrize("name", sorted(OVERLAP))
@pytest.mark.parametrize("agg", [None, "mean", "sum", "none"])
def test_overlap_losses_match_numpy_over_all_entries_or_per_sample(name, agg):
    fn, ref = OVERLAP[name]
    p, y = _masks(np.random.default_rng(10))
    out = fn(*as_mx(p, y), agg=agg)
    p, y = (np.asarray(a, np.float32).astype(np.float64) for a in (p, y))
    if agg is None:
        expected = ref(p, y)
    else:
        per_sample = ref(p, y, (1, 2, 3))
        expected = {"mean": np.mean, "sum": np.sum, "none": lambda a: a}[agg](per_sample)
    assert out.dtype == mx.float32 and out.shape == np.shape(expected)
    np.testing.assert_allclose(np64(out), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(OVERLAP))
@pytest.mark.parametrize("agg", [None, "mean"])
def test_overlap_loss_gradients_float64(name, agg):
    fn, _ = OVERLAP[name]
    p, y = _masks(np.random.default_rng(11), (2, 3, 2))
    pm, ym = (mx.array(np.asarray(a, np.float64), dtype=mx.float64) for a in (p, y))
    check_gradients(lambda v, unused: fn(v, ym, agg=agg) + 0 * mx.sum(unused), pm,
                    mx.zeros((1,), mx.float64))


@pytest.mark.parametrize("name", sorted(OVERLAP))
@pytest.mark.parametrize("half", [mx.float16, mx.bfloat16])
def test_overlap_losses_half_inputs_give_float32_in_and_out_of_scope(name, half):
    fn, _ = OVERLAP[name]
    p, y = _masks(np.random.default_rng(12))
    p16, y16 = as_mx(p, y, dtype=half)
    exact = fn(p16.astype(mx.float32), y16.astype(mx.float32))
    with autocast(half, device="cpu"):
        inside = fn(p16, y16, agg="none")
    outside = fn(p16, y16)
    assert inside.dtype == outside.dtype == mx.float32
    np.testing.assert_allclose(np64(outside), np64(exact), rtol=1e-6)
    assert inside.shape == (3,)


def test_overlap_loss_errors():
    with pytest.raises(ValueError, match=r"^\[dice_coeff_loss\] agg needs a batch axis: .* got "
                                         r"a prediction of shape \(3,\); for one loss over all "
                                         r"entries leave agg=None$"):
        dice_coeff_loss(mx.ones(3), mx.ones(3), agg="mean")
    with pytest.raises(ValueError, match=r"^\[dice_coeff_loss\] smooth must be a non-negative"):
        dice_coeff_loss(mx.ones(3), mx.ones(3), smooth=-1)
    with pytest.raises(ValueError, match=r"^\[tversky_loss\] beta must be a number in \[0, 1\], "
                                         r"got 1.5$"):
        tversky_loss(mx.ones(3), mx.ones(3), beta=1.5)
    with pytest.raises(ValueError, match=r"^\[tversky_loss\] prediction shape \(2, 3\) does not "
                                         r"match target shape \(3,\)"):
        tversky_loss(mx.ones((2, 3)), mx.ones(3))
    with pytest.raises(ValueError, match=r"^\[tversky_loss\] agg must be one of"):
        tversky_loss(mx.ones((2, 3)), mx.ones((2, 3)), agg="avg")
