import re

import mlx.core as mx
import numpy as np
import pytest

from fluxlike.checks import (
    channels_first_hint,
    channels_last_fix,
    check_active,
    check_features,
    check_flag,
    check_real,
    check_size,
    checked_init,
    initialise,
)


def test_check_size_returns_plain_ints_and_refuses_bools():
    for value in (3, np.int64(3), np.uint8(3), np.int32(3)):
        assert type(check_size(value, "L", "n")) is int
    for bad in (0, -1, 2.0, True, np.bool_(True), "3", None):
        with pytest.raises(ValueError, match=r"\[L\] n must be a positive integer"):
            check_size(bad, "L", "n")


def test_check_flag_takes_bools_only():
    for value, expected in ((True, True), (False, False), (np.bool_(True), True),
                            (np.bool_(False), False)):
        result = check_flag(value, "Dense", "bias")
        assert type(result) is bool and result is expected
    for bad in ("no", "yes", 0, 1, None, np.int64(1), 1.0, [True]):
        message = f"[Dense] bias must be True or False, got {bad!r}"
        with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
            check_flag(bad, "Dense", "bias")


def test_check_active():
    assert check_active(None, "L") is None
    assert check_active(np.bool_(False), "L") is False
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match=r"\[L\] active must be True, False or None"):
            check_active(bad, "L")


def test_check_real_takes_any_real_type_but_bools():
    def in_unit(v):
        return 0 <= v <= 1
    for value in (0.5, np.float32(0.5), np.float64(0.5), np.float16(0.5), 1, np.int64(0)):
        result = check_real(value, "L", "p", in_unit, "in [0, 1]")
        assert type(result) is float and result == float(value)
    for bad in (True, np.bool_(False), "0.5", None, 1.5, float("nan"), 1 + 0j):
        with pytest.raises(ValueError, match=r"\[L\] p must be in \[0, 1\], got"):
            check_real(bad, "L", "p", in_unit, "in [0, 1]")


def test_initialise_checks_the_result():
    assert initialise(mx.ones, (2, 3), "Dense").tolist() == [[1, 1, 1]] * 2
    assert initialise(lambda s: mx.zeros(s, mx.float64), (2,), "Dense").dtype == mx.float64
    with pytest.raises(ValueError, match=r"^\[Dense\] init returned shape \(5, 7\), "
                                         r"expected \(2, 3\)$"):
        initialise(lambda s: mx.ones((5, 7)), (2, 3), "Dense")
    with pytest.raises(ValueError, match=r"\[Dense\] init returned shape \(3, 2\)"):
        initialise(lambda s: mx.ones(s[::-1]), (2, 3), "Dense")
    with pytest.raises(TypeError, match=r"\[Dense\] init must return an mx.array, got ndarray"):
        initialise(np.ones, (2, 3), "Dense")
    with pytest.raises(TypeError, match=r"\[Dense\] init returned an array of dtype "
                                        r"mlx.core.int32, expected a floating dtype"):
        initialise(lambda s: mx.zeros(s, mx.int32), (2, 3), "Dense")
    with pytest.raises(TypeError, match=r"\[Dense\] init must be a function of a shape, got 3"):
        initialise(3, (2, 3), "Dense")


def test_checked_init_names_the_outer_layer():
    init = checked_init(lambda s: mx.ones((1,)), "MultiHeadAttention")
    with pytest.raises(ValueError, match=r"\[MultiHeadAttention\] init returned shape \(1,\)"):
        init((2, 2))
    with pytest.raises(TypeError, match=r"\[MultiHeadAttention\] init must be a function"):
        checked_init("glorot", "MultiHeadAttention")


@pytest.mark.parametrize("shape, fix", [
    ((2, 3, 10), "sequences are channels last (NLC) in MLX: x.transpose(0, 2, 1)"),
    ((2, 3, 10, 10), "images are channels last (NHWC) in MLX: x.transpose(0, 2, 3, 1)"),
    ((2, 3, 4, 5, 6), "volumes are channels last (NDHWC) in MLX: x.transpose(0, 2, 3, 4, 1)"),
    ((2, 3, 4, 5, 6, 7), "inputs are channels last in MLX: x.transpose(0, 2, 3, 4, 5, 1)"),
])
def test_channels_first_hint_gives_the_permutation_for_the_rank(shape, fix):
    assert channels_first_hint(shape, 3) == "; " + fix
    assert channels_last_fix(len(shape), maybe=True) == "; if it is channels first: " + fix


def test_channels_first_hint_only_when_axis_1_alone_matches():
    assert channels_first_hint((2, 3, 5, 5), 3) != ""
    for shape in [(2, 3), (2, 5, 5, 4), (2, 3, 5, 3), (3,)]:
        assert channels_first_hint(shape, 3) == ""


def test_check_features_ends_with_the_hint():
    with pytest.raises(ValueError, match=r"got shape \(2, 3\); do this$"):
        check_features(mx.ones((2, 3)), 4, "Dense", hint="; do this")


def test_narrow_numpy_floats_are_stored_as_they_print():
    assert check_real(np.float32(0.1), "BatchNorm", "momentum", lambda v: 0 <= v <= 1,
                      "in [0, 1]") == 0.1
    assert check_real(np.float16(0.5), "Dropout", "p", lambda v: 0 <= v <= 1, "in [0, 1]") == 0.5
