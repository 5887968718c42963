import functools
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import check_gradients, np64

import fluxlike
from fluxlike import activations as A
from fluxlike import autocast, leakyrelu, relu


def np_gelu(x):
    return x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


# NNlib's and PyTorch's constants, which fluxlike's selu uses in full
SELU_L, SELU_A = 1.0507009873554804934193349852946, 1.6732632423543772848170429916717


def np_logsumexp(x, axis=-1, keepdims=False):
    m = np.max(x, axis=axis, keepdims=True)
    out = m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))
    return out if keepdims else np.squeeze(out, axis=axis)


def np_softmax(x, axis=-1):
    return np.exp(x - np_logsumexp(x, axis, keepdims=True))


# (function, numpy reference) with the keyword arguments to call both with
ELEMENTWISE = {
    "identity": (A.identity, lambda x: x),
    "relu": (A.relu, lambda x: np.maximum(x, 0)),
    "leakyrelu": (A.leakyrelu, lambda x: np.where(x > 0, x, 0.01 * x)),
    "leakyrelu_a2": (lambda x: A.leakyrelu(x, 2.0), lambda x: np.where(x > 0, x, 2 * x)),
    "elu": (A.elu, lambda x: np.where(x > 0, x, np.expm1(x))),
    "elu_alpha": (lambda x: A.elu(x, 0.5), lambda x: np.where(x > 0, x, 0.5 * np.expm1(x))),
    "gelu": (A.gelu, np_gelu),
    "sigmoid": (A.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    "tanh": (A.tanh, np.tanh),
    "swish": (A.swish, lambda x: x / (1 + np.exp(-x))),
    "softplus": (A.softplus, lambda x: np.logaddexp(x, 0)),
    "relu6": (A.relu6, lambda x: np.clip(x, 0, 6)),
    "hardtanh": (A.hardtanh, lambda x: np.clip(x, -1, 1)),
    "hardsigmoid": (A.hardsigmoid, lambda x: np.clip((x + 3) / 6, 0, 1)),
    "hardswish": (A.hardswish, lambda x: x * np.clip((x + 3) / 6, 0, 1)),
    "selu": (A.selu, lambda x: SELU_L * np.where(x > 0, x, SELU_A * np.expm1(np.minimum(x, 0)))),
    "celu": (A.celu, lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0)))),
    "celu_alpha": (lambda x: A.celu(x, 2.0),
                   lambda x: np.where(x > 0, x, 2 * np.expm1(np.minimum(x, 0) / 2))),
    "mish": (A.mish, lambda x: x * np.tanh(np.logaddexp(x, 0))),
    "softsign": (A.softsign, lambda x: x / (1 + np.abs(x))),
    "tanhshrink": (A.tanhshrink, lambda x: x - np.tanh(x)),
    "logcosh": (A.logcosh, lambda x: np.abs(x) + np.log1p(np.exp(-2 * np.abs(x))) - np.log(2)),
    "lisht": (A.lisht, lambda x: x * np.tanh(x)),
    "gelu_erf": (A.gelu_erf, np_gelu),
    "gelu_tanh": (A.gelu_tanh, lambda x: 0.5 * x * (1 + np.tanh(
        math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))),
}
REDUCING = {
    "softmax": (A.softmax, np_softmax),
    "logsoftmax": (A.logsoftmax, lambda x: x - np_logsumexp(x, keepdims=True)),
    "logsumexp": (A.logsumexp, np_logsumexp),
}
ALL = {**ELEMENTWISE, **REDUCING}
# MLX's float64 exp and erf on the CPU are only float32-accurate (relative error ~1e-7 and
# ~1e-6), too noisy for finite differences of the MLX function itself with a 1e-6 step:
# for these the finite differences are taken of the float64 numpy reference instead.
EXP_BASED = {"gelu", "sigmoid", "swish", "softplus", "softmax", "logsoftmax", "logsumexp",
             "selu", "celu", "celu_alpha", "mish", "tanhshrink", "logcosh", "lisht", "gelu_erf",
             "gelu_tanh"}
# (the clamps' kinks are where finite differences disagree: no sample lands within 1e-6 of one)


def check_gradients_vs_reference(fn, ref, x, r, rtol=1e-4, atol=1e-6, step=1e-6):
    """mx.grad of sum(fn(x) * r) against central differences of sum(ref(x) * r) in numpy."""
    with mx.stream(mx.cpu):
        analytic = np64(mx.grad(lambda v: mx.sum(fn(v) * r))(x)).reshape(-1)
    x0, r0 = np64(x), np64(r)
    numeric = np.empty(x0.size)
    for i in range(x0.size):
        up, down = x0.copy().reshape(-1), x0.copy().reshape(-1)
        up[i] += step
        down[i] -= step
        numeric[i] = (np.sum(ref(up.reshape(x0.shape)) * r0)
                      - np.sum(ref(down.reshape(x0.shape)) * r0)) / (2 * step)
    np.testing.assert_allclose(analytic, numeric, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", sorted(ALL))
def test_matches_numpy(name):
    fn, ref = ALL[name]
    x = mx.random.normal((4, 5)) * 4
    out = fn(x)
    assert out.dtype == mx.float32
    np.testing.assert_allclose(np64(out), ref(np64(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(ALL))
def test_gradients_float64(name):
    fn, ref = ALL[name]
    x = (mx.random.normal((3, 4)) * 3).astype(mx.float64)
    r = mx.random.normal((3,) if name == "logsumexp" else (3, 4)).astype(mx.float64)
    if name in EXP_BASED:
        check_gradients_vs_reference(fn, ref, x, r)
    else:  # two arguments: helpers.check_gradients mishandles a single one
        check_gradients(lambda v, w: mx.sum(fn(v) * r) + mx.sum(fn(w) * r), x, x + 0.5)


def test_reductions_along_other_axes():
    x = mx.random.normal((3, 4, 5))
    np.testing.assert_allclose(np64(A.softmax(x, axis=1)), np_softmax(np64(x), axis=1),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np64(A.logsoftmax(x, axis=0)),
                               np64(x) - np_logsumexp(np64(x), axis=0, keepdims=True),
                               rtol=1e-5, atol=1e-6)
    assert A.logsumexp(x, axis=None).shape == ()
    np.testing.assert_allclose(A.logsumexp(x, axis=None).item(),
                               np_logsumexp(np64(x).reshape(-1)), rtol=1e-5)
    assert A.logsumexp(x, axis=1, keepdims=True).shape == (3, 1, 5)


def test_elementwise_large_inputs_stay_finite_with_finite_gradients():
    x = mx.array([-100.0, -20.0, 0.0, 20.0, 100.0])
    for name, (fn, _) in ELEMENTWISE.items():
        out, grad = mx.value_and_grad(lambda v, fn=fn: mx.sum(fn(v)))(x)
        assert np.isfinite(np64(grad)).all(), name
    half = mx.array([12.0, 20.0, -3.0], dtype=mx.float16)  # exp(12) overflows float16
    grad = mx.grad(lambda v: mx.sum(A.elu(v)).astype(mx.float32))(half)
    np.testing.assert_allclose(np64(grad), [1, 1, math.exp(-3)], rtol=1e-2)


@pytest.mark.parametrize("alpha", [1.0, 2.0])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float64, mx.float16])
def test_elu_slope_at_zero_is_alpha(alpha, dtype):
    # PyTorch's (and Flux's, nn.elu's) slope at x == 0 and -0 is the left one, alpha * exp(0).
    x = mx.array([0.0, -0.0, 1e-4, -1e-4], dtype=dtype)
    with mx.stream(mx.cpu):
        grad = mx.grad(lambda v: mx.sum(A.elu(v, alpha).astype(mx.float32)))(x)
    assert grad.dtype == dtype
    np.testing.assert_allclose(np64(grad), [alpha, alpha, 1, alpha * math.exp(-1e-4)],
                               rtol=1e-3)


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_elementwise_keep_half_precision_in_and_out_of_scope(name, dtype):
    fn = ELEMENTWISE[name][0]
    x = mx.random.normal((8,)).astype(dtype)
    assert fn(x).dtype == dtype
    with autocast(mx.float16, device="cpu"):
        assert fn(x).dtype == dtype


@pytest.mark.parametrize("name", sorted(REDUCING))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_reductions_compute_in_float32(name, dtype):
    fn = REDUCING[name][0]
    x = (mx.random.normal((4, 6)) * 5).astype(dtype)
    reference = fn(x.astype(mx.float32))
    outside = fn(x)
    assert outside.dtype == dtype
    with autocast(mx.float16, device="cpu"):
        inside = fn(x)
    assert inside.dtype == mx.float32
    # inside: exactly the float32 computation; outside: that result rounded once to dtype
    np.testing.assert_array_equal(np64(inside), np64(reference))
    np.testing.assert_array_equal(np64(outside), np64(reference.astype(dtype)))


def test_reductions_keep_float32_and_float64():
    for dtype in (mx.float32, mx.float64):
        x = mx.random.normal((2, 3)).astype(dtype)
        with mx.stream(mx.cpu), autocast(mx.bfloat16, device="cpu"):
            assert {A.softmax(x).dtype, A.logsoftmax(x).dtype, A.logsumexp(x).dtype} == {dtype}


def test_softmax_of_large_half_logits_is_finite_and_normalised():
    x = mx.array([[60000.0, 0.0, -60000.0]], dtype=mx.float16)
    out = A.softmax(x)
    np.testing.assert_allclose(np64(out), [[1, 0, 0]], atol=1e-3)
    assert np.isfinite(np64(A.logsoftmax(x))[0, :2]).all()


def test_public_names():
    for name in ALL:
        if name in ("leakyrelu_a2", "elu_alpha", "celu_alpha"):
            continue
        assert getattr(fluxlike, name) is getattr(A, name)


class TestResolve:
    def test_names_callables_and_none(self):
        assert A.resolve(None, "Dense") is A.identity
        assert A.resolve("relu", "Dense") is A.relu
        assert A.resolve("softmax", "Dense") is A.softmax
        assert A.resolve(mx.tanh, "Dense") is mx.tanh

        def custom(x):
            return x

        assert A.resolve(custom, "Dense") is custom

    def test_unknown_name_lists_the_choices(self):
        with pytest.raises(ValueError, match=r"\[Conv\] unknown activation 'rleu'; expected a "
                                             r"callable or one of \[.*'relu'.*\]"):
            A.resolve("rleu", "Conv")

    @pytest.mark.parametrize("bad", [3, 1.5, ["relu"]])
    def test_non_callable_is_a_type_error(self, bad):
        with pytest.raises(TypeError, match=r"\[Dense\] activation must be callable or a name"):
            A.resolve(bad, "Dense")


def test_every_public_function_has_a_doctest_example():
    import doctest
    import inspect

    finder = doctest.DocTestFinder(recurse=False)
    public = [f for name, f in vars(A).items()
              if inspect.isfunction(f) and f.__module__ == A.__name__ and not name.startswith("_")]
    assert len(public) >= 13
    missing = [f.__name__ for f in public if not any(t.examples for t in finder.find(f))]
    assert missing == []


@pytest.mark.parametrize("name", sorted(REDUCING))
def test_reductions_document_the_dtype_they_return(name):
    doc = REDUCING[name][0].__doc__
    assert "in at least float32" not in doc
    assert "returned in its dtype outside" in doc or "returned in its own dtype outside" in doc


class TestActIsChecked:
    """``act=`` refuses what cannot be an activation, at construction."""

    @pytest.mark.parametrize(("act", "message"), [
        (nn.ReLU, r"act=nn.ReLU is a class, not an activation: pass an instance, nn.ReLU\(\), "
                  r"or the function relu"),
        (nn.GELU, r"act=nn.GELU is a class, not an activation: pass an instance, nn.GELU\(\), "
                  r"or the function gelu"),
        (str, r"act=str is a class, not an activation: pass a function of an array such as "
              r"relu"),
        (len, r"act=len is a Python builtin, not an activation"),
        (print, r"act=print is a Python builtin"),
        (lambda x: None, r"act=<lambda> is not an activation: for an array it returns "
                         r"NoneType, not an array"),
        (lambda x: 3, r"act=<lambda> is not an activation: for an array it returns int"),
    ])
    @pytest.mark.parametrize("layer", ["Dense", "Conv"])
    def test_refused_naming_the_layer_and_the_fix(self, act, message, layer):
        from fluxlike import Conv, Dense
        with pytest.raises(TypeError, match=rf"^\[{layer}\] {message}"):
            Dense(2, 3, act) if layer == "Dense" else Conv((3, 3), 1, 2, act)

    @pytest.mark.parametrize("act", [
        relu, nn.relu, mx.tanh, abs, nn.ReLU(), nn.GELU(), lambda x: x * 2,
        functools.partial(leakyrelu, a=0.2), "gelu",
    ])
    def test_functions_and_modules_are_kept(self, act):
        from fluxlike import Dense
        layer = Dense(2, 3, act)
        assert isinstance(layer(mx.ones((1, 2))), mx.array)

    def test_trying_a_random_activation_leaves_the_random_state(self):
        noisy = lambda x: x + mx.random.normal(x.shape)  # noqa: E731
        mx.random.seed(3)
        expected = mx.random.normal((4,))
        mx.random.seed(3)
        assert A.resolve(noisy, "Dense") is noisy
        assert mx.array_equal(mx.random.normal((4,)), expected).item()


@pytest.mark.parametrize("name", sorted(set(ELEMENTWISE) - {"leakyrelu_a2", "elu_alpha",
                                                             "celu_alpha"}))
def test_every_elementwise_activation_resolves_by_name(name):
    assert A.resolve(name, "Dense") is ELEMENTWISE[name][0]


@pytest.mark.parametrize("name", ["selu", "celu", "mish", "logcosh", "gelu_tanh", "hardswish",
                                  "softsign", "lisht", "tanhshrink"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_new_activations_in_half_precision_are_close_to_float32(name, dtype):
    # policy "none": computed in the input's dtype, inside a scope too; the error is that of
    # a few half-precision roundings
    fn, ref = ELEMENTWISE[name]
    x = mx.random.normal((64,)) * 3
    with autocast(dtype, device="cpu"):
        out = fn(x.astype(dtype))
    assert out.dtype == dtype
    tol = 1e-2 if dtype == mx.float16 else 5e-2
    np.testing.assert_allclose(np64(out), ref(np64(x.astype(dtype))), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float64, mx.float16])
def test_celu_and_selu_slopes_at_zero(dtype):
    # the left slope, as elu's: celu's is 1, selu's is lambda * alpha (PyTorch, NNlib)
    x = mx.array([0.0, -0.0], dtype=dtype)
    with mx.stream(mx.cpu):
        celu_grad = mx.grad(lambda v: mx.sum(A.celu(v, 2.0).astype(mx.float32)))(x)
        selu_grad = mx.grad(lambda v: mx.sum(A.selu(v).astype(mx.float32)))(x)
    np.testing.assert_allclose(np64(celu_grad), [1, 1], rtol=1e-3)
    np.testing.assert_allclose(np64(selu_grad), [SELU_L * SELU_A] * 2, rtol=1e-3)


def test_selu_keeps_unit_variance():
    # the self-normalising fixed point: standard normal in, mean ~0 and variance ~1 out
    y = np64(A.selu(mx.random.normal((200_000,))))
    assert abs(y.mean()) < 0.01 and abs(y.var() - 1) < 0.01


def test_logcosh_is_finite_where_cosh_overflows():
    x = mx.array([-1000.0, 1000.0])
    np.testing.assert_allclose(np64(A.logcosh(x)), [1000 - math.log(2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(np64(mx.grad(lambda v: mx.sum(A.logcosh(v)))(x)), [-1, 1])
    half = A.logcosh(mx.array([20.0], dtype=mx.float16))  # cosh(20) overflows float16
    assert half.dtype == mx.float16 and abs(half.item() - (20 - math.log(2))) < 0.05
