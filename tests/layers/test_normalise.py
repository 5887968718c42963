import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import (
    assert_unchanged,
    check_gradients,
    check_layer_gradients,
    normal,
    np64,
    snapshot,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

import fluxlike  # fluxlike.testmode: a bare `testmode` would be collected by pytest
from fluxlike import (
    AlphaDropout,
    BatchNorm,
    Chain,
    Dense,
    Dropout,
    GroupNorm,
    InstanceNorm,
    LayerNorm,
    RMSNorm,
    autocast,
    relu,
    trainmode,
)
from fluxlike.modes import differentiating
from fluxlike.precision.policy import policy_of

EPS = 1e-5


def randomise_affine(layer, seed=1):
    """Give weight/bias non-trivial values so the affine part is really tested."""
    rng = np.random.default_rng(seed)
    for name in ("weight", "bias"):
        p = getattr(layer, name)
        if p is not None:
            setattr(layer, name, mx.array(rng.normal(size=p.shape).astype(np.float32)))
    return layer


# --- numpy references ---------------------------------------------------------------------

def ref_affine(y, layer):
    w = 1.0 if layer.weight is None else np64(layer.weight)
    b = 0.0 if layer.bias is None else np64(layer.bias)
    return y * w + b


def ref_batchnorm_train(x, layer, running_mean, running_var, momentum):
    """Returns output, new running mean, new running var."""
    axes = tuple(range(x.ndim - 1))
    n = np.prod([x.shape[a] for a in axes])
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    y = ref_affine((x - mean) / np.sqrt(var + EPS), layer)
    new_mean = (1 - momentum) * running_mean + momentum * mean
    new_var = (1 - momentum) * running_var + momentum * var * n / (n - 1)
    return y, new_mean, new_var


def ref_layernorm(x, k):
    axes = tuple(range(x.ndim - k, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(x.var(axis=axes, keepdims=True) + EPS)


def ref_rmsnorm(x, k):
    axes = tuple(range(x.ndim - k, x.ndim))
    return x / np.sqrt((x**2).mean(axis=axes, keepdims=True) + EPS)


def ref_groupnorm(x, groups):
    out = np.empty_like(x)
    size = x.shape[-1] // groups
    for n in range(x.shape[0]):
        for g in range(groups):
            block = x[n, ..., g * size:(g + 1) * size]
            out[n, ..., g * size:(g + 1) * size] = (block - block.mean()) / np.sqrt(
                block.var() + EPS)
    return out


def ref_instancenorm(x):
    axes = tuple(range(1, x.ndim - 1))
    mean = x.mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(x.var(axis=axes, keepdims=True) + EPS)


# --- BatchNorm ----------------------------------------------------------------------------

class TestBatchNorm:
    def test_construction_positional_and_keyword(self):
        a = BatchNorm(4, relu)
        b = BatchNorm(channels=4, act="relu", momentum=0.2, eps=1e-3, affine=False,
                      track_stats=False)
        assert a.weight.shape == a.bias.shape == a.running_mean.shape == (4,)
        np.testing.assert_array_equal(np64(a.weight), 1)
        np.testing.assert_array_equal(np64(a.bias), 0)
        np.testing.assert_array_equal(np64(a.running_var), 1)
        assert a.act is relu and b.act is relu and a.active is None
        assert b.weight is None and b.bias is None and b.running_mean is None
        assert b.running_var is None and b.parameters() == {}
        assert (b.momentum, b.eps) == (0.2, 1e-3)

    def test_running_stats_are_parameters_but_not_trainable(self):
        layer = BatchNorm(3)
        assert set(layer.parameters()) == {"weight", "bias", "running_mean", "running_var"}
        assert set(layer.trainable_parameters()) == {"weight", "bias"}
        layer.unfreeze()
        assert set(layer.trainable_parameters()) == {"weight", "bias"}

    @pytest.mark.parametrize("unfreeze", [
        lambda m: m.unfreeze(),
        lambda m: m.unfreeze(keys=["running_mean", "weight"]),
        lambda m: m.layers[1].unfreeze(recurse=False),
    ])
    def test_unfreezing_a_parent_leaves_running_stats_frozen_and_updated(self, unfreeze):
        # mlx's unfreeze clears each submodule's frozen set directly, past BatchNorm.unfreeze
        model = Chain(Dense(2, 2), BatchNorm(2))
        model.freeze()
        unfreeze(model)
        trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
        assert not trainable & {"layers.1.running_mean", "layers.1.running_var"}
        x = normal(16, 2, seed=7, loc=3.0, scale=2.0)
        fluxlike.gradient(lambda m: mx.sum(m(x)), model)
        assert np.all(np64(model.layers[1].running_mean) != 0)
        copied = copy.deepcopy(model)  # the pinned names survive a copy
        copied.unfreeze()
        assert "layers.1.running_var" not in dict(tree_flatten(copied.trainable_parameters()))

    def test_train_mode_output_and_running_stats_after_two_steps(self):
        layer = trainmode(randomise_affine(BatchNorm(3, momentum=0.3)))
        mean, var = np.zeros(3), np.ones(3)
        for step in range(2):
            x = normal(4, 5, 3, seed=step, loc=step + 1.0, scale=2.0)
            expected, mean, var = ref_batchnorm_train(np64(x), layer, mean, var, 0.3)
            np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np64(layer.running_mean), mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np64(layer.running_var), var, rtol=1e-5, atol=1e-6)

    def test_test_mode_uses_running_stats(self):
        layer = randomise_affine(BatchNorm(3, relu))
        layer.running_mean = mx.array([0.5, -1.0, 2.0])
        layer.running_var = mx.array([4.0, 0.25, 1.0])
        x = normal(6, 3, seed=3)
        expected = np.maximum(
            ref_affine((np64(x) - [0.5, -1.0, 2.0]) / np.sqrt(np.array([4.0, 0.25, 1.0]) + EPS),
                       layer), 0)
        before = snapshot(layer)
        np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-5, atol=1e-6)
        out = fluxlike.testmode(layer)(x)
        np.testing.assert_allclose(np64(out), expected, rtol=1e-5, atol=1e-6)
        assert_unchanged(layer, before)  # inactive calls never touch the statistics

    def test_without_track_stats_always_uses_batch_stats(self):
        layer = BatchNorm(2, track_stats=False, affine=False)
        x = normal(7, 2, seed=4, loc=3.0)
        expected = (np64(x) - np64(x).mean(0)) / np.sqrt(np64(x).var(0) + EPS)
        np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np64(trainmode(layer)(x)), expected, rtol=1e-5, atol=1e-5)

    def test_active_inside_differentiating_and_gradient_updates_stats(self):
        layer = BatchNorm(3)
        x = normal(8, 3, seed=5, loc=2.0)
        with differentiating():
            _, grads = nn.value_and_grad(layer, lambda x: mx.sum(layer(x) ** 2))(x)
        assert set(grads) == {"weight", "bias"}
        # the statistics written inside the gradient trace are ordinary, finite arrays
        np.testing.assert_allclose(np64(layer.running_mean), 0.1 * np64(x).mean(0), rtol=1e-5)

    def test_no_gradient_flows_through_running_stats(self):
        layer = trainmode(BatchNorm(3, affine=False))
        x = normal(4, 3, seed=22)

        def stats_only(x):
            layer(x)
            return mx.sum(layer.running_mean) + mx.sum(layer.running_var)

        np.testing.assert_array_equal(np64(mx.grad(stats_only)(x)), 0)

    @settings(max_examples=15, deadline=None)
    @given(momentum=st.floats(0.0, 1.0), steps=st.integers(1, 4), seed=st.integers(0, 99))
    def test_running_stats_recurrence(self, momentum, steps, seed):
        layer = trainmode(BatchNorm(2, momentum=momentum))
        mean, var = np.zeros(2), np.ones(2)
        for k in range(steps):
            x = normal(3, 2, 2, seed=seed + k, loc=k)
            _, mean, var = ref_batchnorm_train(np64(x), layer, mean, var, momentum)
            layer(x)
        np.testing.assert_allclose(np64(layer.running_mean), mean, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np64(layer.running_var), var, rtol=1e-4, atol=1e-5)

    def test_compiled_update_matches_eager(self):
        eager, compiled = trainmode(BatchNorm(3)), trainmode(BatchNorm(3))
        step = mx.compile(lambda x: compiled(x), inputs=compiled.state, outputs=compiled.state)
        for seed in range(2):
            x = normal(4, 3, seed=seed, loc=1.0)
            np.testing.assert_allclose(np64(step(x)), np64(eager(x)), rtol=1e-5, atol=1e-6)
        for name in ("running_mean", "running_var"):
            np.testing.assert_allclose(np64(compiled[name]), np64(eager[name]), rtol=1e-6)

    def test_checkpoint_keeps_running_stats(self, tmp_path):
        layer = trainmode(BatchNorm(3))
        layer(normal(5, 3, loc=4.0))
        layer.save_weights(str(tmp_path / "bn.safetensors"))
        fresh = BatchNorm(3)
        fresh.load_weights(str(tmp_path / "bn.safetensors"))
        np.testing.assert_array_equal(np64(fresh.running_mean), np64(layer.running_mean))
        assert set(fresh.trainable_parameters()) == {"weight", "bias"}

    def test_shapes(self):
        for shape in [(4, 3), (2, 5, 3), (2, 4, 4, 3), (2, 2, 2, 2, 3)]:
            assert trainmode(BatchNorm(3))(normal(*shape)).shape == shape

    @pytest.mark.parametrize("mode", [True, False])
    def test_gradients_float64(self, mode):
        layer = trainmode(randomise_affine(BatchNorm(3, mx.tanh)), mode)
        check_layer_gradients(layer, normal(4, 2, 3, seed=6))
        assert "running_mean" not in layer.trainable_parameters()

    def test_repr(self):
        assert repr(BatchNorm(64, relu)) == (
            "BatchNorm(64, relu)  # 128 parameters, plus 128 non-trainable")
        assert repr(BatchNorm(4, eps=1e-3, track_stats=False)) == (
            "BatchNorm(4, eps=0.001, track_stats=False)  # 8 parameters")
        assert repr(BatchNorm(2, affine=False, track_stats=False, momentum=0.5)) == (
            "BatchNorm(2, momentum=0.5, affine=False, track_stats=False)")
        assert repr(trainmode(BatchNorm(2))).startswith("BatchNorm(2, active=True)")
        assert repr(Chain(Dense(3, 2), BatchNorm(2))).splitlines()[2] == (
            "  BatchNorm(2),  # 4 parameters, plus 4 non-trainable")

    def test_wrong_channels_leaves_model_unchanged(self):
        layer = trainmode(BatchNorm(4))
        before = snapshot(layer)
        with pytest.raises(ValueError, match=r"\[BatchNorm\] expected input with 4 channels.*"
                                             r"\(2, 5, 3\)"):
            layer(mx.ones((2, 5, 3)))
        with pytest.raises(ValueError, match=r"\[BatchNorm\] .*more than one value per channel"):
            layer(mx.ones((1, 4)))
        with pytest.raises(ValueError, match=r"\[BatchNorm\] expected input of at least 2 dim"):
            layer(mx.ones((4,)))
        with pytest.raises(TypeError, match=r"\[BatchNorm\] expected a floating-point input"):
            layer(mx.ones((2, 4), dtype=mx.int32))
        assert_unchanged(layer, before)

    @pytest.mark.parametrize("kwargs, message", [
        ({"eps": 0}, "eps must be a positive number, got 0"),
        ({"eps": -1e-5}, "eps must be a positive number"),
        ({"momentum": -0.1}, r"momentum must be in \[0, 1\], got -0.1"),
        ({"momentum": 1.5}, r"momentum must be in \[0, 1\]"),
        ({"active": "yes"}, "active must be True, False or None"),
    ])
    def test_bad_options(self, kwargs, message):
        with pytest.raises(ValueError, match=r"\[BatchNorm\] " + message):
            BatchNorm(3, **kwargs)

    def test_bad_channels(self):
        with pytest.raises(ValueError, match=r"\[BatchNorm\] channels must be a positive"):
            BatchNorm(0)


# --- LayerNorm, RMSNorm ---------------------------------------------------------------------

class TestLayerNorm:
    def test_construction_positional_and_keyword(self):
        a = LayerNorm(8)
        b = LayerNorm(dims=(4, 8), affine=False, eps=1e-3)
        assert a.weight.shape == a.bias.shape == (8,) and a.dims == (8,)
        assert b.weight is None and b.bias is None and b.dims == (4, 8) and b.eps == 1e-3

    @pytest.mark.parametrize("dims, shape", [(6, (3, 6)), (6, (2, 3, 6)), ((4, 6), (2, 4, 6))])
    def test_matches_numpy(self, dims, shape):
        layer = randomise_affine(LayerNorm(dims))
        x = normal(*shape, seed=7, loc=2.0, scale=3.0)
        expected = ref_affine(ref_layernorm(np64(x), len(layer.dims)), layer)
        out = layer(x)
        assert out.shape == shape and out.dtype == mx.float32
        np.testing.assert_allclose(np64(out), expected, rtol=1e-4, atol=1e-5)

    def test_gradients_float64(self):
        check_layer_gradients(randomise_affine(LayerNorm((3, 4))), normal(2, 3, 4, seed=8))

    def test_repr(self):
        assert repr(LayerNorm(32)) == "LayerNorm(32)  # 64 parameters"
        assert repr(LayerNorm((4, 8), affine=False, eps=1e-6)) == (
            "LayerNorm((4, 8), affine=False, eps=1e-06)")

    def test_bad_input(self):
        layer = LayerNorm((4, 8))
        before = snapshot(layer)
        with pytest.raises(ValueError, match=r"\[LayerNorm\] expected input with trailing shape "
                                             r"\(4, 8\), got shape \(2, 8, 4\)"):
            layer(mx.ones((2, 8, 4)))
        with pytest.raises(ValueError, match=r"\[LayerNorm\] expected input of at least 2"):
            layer(mx.ones((8,)))
        assert_unchanged(layer, before)
        with pytest.raises(ValueError, match=r"\[LayerNorm\] eps must be a positive number"):
            LayerNorm(4, eps=0.0)
        with pytest.raises(ValueError, match=r"\[LayerNorm\] dims must be a positive integer"):
            LayerNorm(())


class TestRMSNorm:
    def test_construction_positional_and_keyword(self):
        a, b = RMSNorm(8), RMSNorm(dims=(2, 8), affine=False, eps=1e-6)
        assert a.weight.shape == (8,) and a.bias is None and "bias" not in a.parameters()
        assert b.weight is None and b.parameters() == {}

    @pytest.mark.parametrize("dims, shape", [(5, (3, 5)), ((2, 5), (3, 2, 5))])
    def test_matches_numpy(self, dims, shape):
        layer = randomise_affine(RMSNorm(dims))
        x = normal(*shape, seed=9, loc=1.0)
        expected = ref_rmsnorm(np64(x), len(layer.dims)) * np64(layer.weight)
        np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-4, atol=1e-5)

    def test_gradients_float64(self):
        check_layer_gradients(randomise_affine(RMSNorm(5)), normal(3, 5, seed=10))

    def test_repr(self):
        assert repr(RMSNorm(16)) == "RMSNorm(16)  # 16 parameters"
        assert repr(RMSNorm(16, affine=False)) == "RMSNorm(16, affine=False)"

    def test_bad_input(self):
        with pytest.raises(ValueError, match=r"\[RMSNorm\] expected input with 5 channels.*"
                                             r"\(3, 4\)"):
            RMSNorm(5)(mx.ones((3, 4)))
        with pytest.raises(ValueError, match=r"\[RMSNorm\] eps must be a positive number"):
            RMSNorm(4, eps=-1)


# --- GroupNorm, InstanceNorm ------------------------------------------------------------------

class TestGroupNorm:
    def test_construction_positional_and_keyword(self):
        a = GroupNorm(6, 3, relu)
        b = GroupNorm(channels=6, groups=2, act="relu", affine=False, eps=1e-3)
        assert a.weight.shape == (6,) and a.act is relu and (a.channels, a.groups) == (6, 3)
        assert b.weight is None and b.bias is None and b.eps == 1e-3

    @pytest.mark.parametrize("shape", [(2, 6), (2, 5, 6), (2, 3, 4, 6)])
    def test_matches_numpy(self, shape):
        layer = randomise_affine(GroupNorm(6, 2))
        # distinct channel offsets: consecutive vs strided grouping would differ
        x = normal(*shape, seed=11) + mx.arange(6) * 3.0
        expected = ref_affine(ref_groupnorm(np64(x), 2), layer)
        out = layer(x)
        assert out.shape == shape
        np.testing.assert_allclose(np64(out), expected, rtol=1e-4, atol=1e-5)

    def test_gradients_float64(self):
        check_layer_gradients(randomise_affine(GroupNorm(4, 2, mx.tanh)), normal(2, 3, 4, seed=12))

    def test_repr(self):
        assert repr(GroupNorm(32, 4)) == "GroupNorm(32, 4)  # 64 parameters"
        assert repr(GroupNorm(8, 2, relu, affine=False)) == "GroupNorm(8, 2, relu, affine=False)"

    def test_bad_construction_and_input(self):
        with pytest.raises(ValueError, match=r"\[GroupNorm\] channels \(30\) must be divisible "
                                             r"by groups \(4\)"):
            GroupNorm(30, 4)
        with pytest.raises(ValueError, match=r"\[GroupNorm\] groups must be a positive integer"):
            GroupNorm(4, 0)
        with pytest.raises(ValueError, match=r"\[GroupNorm\] eps must be a positive number"):
            GroupNorm(4, 2, eps=0)
        with pytest.raises(ValueError, match=r"\[GroupNorm\] expected input with 4 channels.*"
                                             r"\(2, 3, 6\)"):
            GroupNorm(4, 2)(mx.ones((2, 3, 6)))


class TestInstanceNorm:
    def test_construction_positional_and_keyword(self):
        a = InstanceNorm(4)
        b = InstanceNorm(channels=4, act="relu", affine=True, eps=1e-3, momentum=0.2,
                         track_stats=True)
        assert a.weight is None and a.running_mean is None and a.parameters() == {}
        assert b.weight.shape == (4,) and b.running_var.shape == (4,) and b.act is relu
        assert set(b.trainable_parameters()) == {"weight", "bias"}

    @pytest.mark.parametrize("shape", [(2, 5, 3), (2, 4, 3, 3)])
    def test_matches_numpy(self, shape):
        layer = randomise_affine(InstanceNorm(3, affine=True))
        x = normal(*shape, seed=13, loc=1.5, scale=2.0)
        expected = ref_affine(ref_instancenorm(np64(x)), layer)
        np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-4, atol=1e-5)
        # without track_stats the instance statistics are used in every mode
        np.testing.assert_allclose(np64(trainmode(layer)(x)), expected, rtol=1e-4, atol=1e-5)

    def test_track_stats(self):
        layer = trainmode(InstanceNorm(3, track_stats=True, momentum=0.5))
        x = normal(2, 4, 4, 3, seed=14, loc=2.0)
        layer(x)
        inst_mean = np64(x).mean(axis=(1, 2))
        inst_var = np64(x).var(axis=(1, 2), ddof=1)
        np.testing.assert_allclose(np64(layer.running_mean), 0.5 * inst_mean.mean(0), rtol=1e-5)
        np.testing.assert_allclose(np64(layer.running_var), 0.5 + 0.5 * inst_var.mean(0),
                                   rtol=1e-5)
        fluxlike.testmode(layer)
        expected = (np64(x) - np64(layer.running_mean)) / np.sqrt(np64(layer.running_var) + EPS)
        np.testing.assert_allclose(np64(layer(x)), expected, rtol=1e-5, atol=1e-5)

    def test_gradients_float64(self):
        layer = randomise_affine(InstanceNorm(3, mx.tanh, affine=True, track_stats=True))
        check_layer_gradients(trainmode(layer), normal(2, 4, 3, seed=15))

    def test_repr(self):
        assert repr(InstanceNorm(8)) == "InstanceNorm(8)"
        assert repr(InstanceNorm(8, affine=True, track_stats=True)) == (
            "InstanceNorm(8, affine=True, track_stats=True)  # 16 parameters, "
            "plus 16 non-trainable")

    def test_bad_input_leaves_model_unchanged(self):
        layer = trainmode(InstanceNorm(3, track_stats=True))
        before = snapshot(layer)
        with pytest.raises(ValueError, match=r"\[InstanceNorm\] expected input of at least 3 "
                                             r"dimensions.*\(4, 3\)"):
            layer(mx.ones((4, 3)))
        with pytest.raises(ValueError, match=r"\[InstanceNorm\] expected input with 3 channels"):
            layer(mx.ones((2, 5, 4)))
        with pytest.raises(ValueError, match=r"\[InstanceNorm\] .*more than one value"):
            layer(mx.ones((2, 1, 3)))
        assert_unchanged(layer, before)
        with pytest.raises(ValueError, match=r"\[InstanceNorm\] momentum must be in \[0, 1\]"):
            InstanceNorm(3, momentum=2)
        with pytest.raises(ValueError, match=r"\[InstanceNorm\] eps must be a positive number"):
            InstanceNorm(3, eps=0)


# --- precision ----------------------------------------------------------------------------

NORMS = [
    lambda: BatchNorm(4),
    lambda: LayerNorm(4),
    lambda: RMSNorm(4),
    lambda: GroupNorm(4, 2),
    lambda: InstanceNorm(4, affine=True),
]


class TestPrecision:
    @pytest.mark.parametrize("make", NORMS)
    @pytest.mark.parametrize("half", [mx.float16, mx.bfloat16])
    @pytest.mark.parametrize("active", [True, False])
    def test_half_input_half_output_float32_compute(self, make, half, active):
        layer = trainmode(randomise_affine(make()), active)
        reference = trainmode(randomise_affine(make()), active)
        x = normal(3, 5, 4, seed=16, loc=2.0, scale=3.0).astype(half)
        out = layer(x)
        assert out.dtype == half and all(p.dtype == mx.float32
                                         for _, p in tree_flatten(layer.parameters()))
        # same as computing on the float32 data, rounded once at the end
        want = reference(x.astype(mx.float32)).astype(half)
        np.testing.assert_array_equal(np64(out), np64(want))
        if isinstance(layer, BatchNorm):  # statistics stay float32 and equal the float32 ones
            for name in ("running_mean", "running_var"):
                assert layer[name].dtype == mx.float32
                np.testing.assert_allclose(np64(layer[name]), np64(reference[name]), rtol=1e-6)

    @pytest.mark.parametrize("make", NORMS)
    def test_half_parameters(self, make):
        # a full f16 conversion: parameters (and statistics) in half, still computed in float32
        layer = trainmode(make())
        layer.update({k: v.astype(mx.float16) for k, v in layer.parameters().items()})
        out = layer(normal(3, 5, 4, seed=17).astype(mx.float16))
        assert out.dtype == mx.float16 and bool(mx.all(mx.isfinite(out)))
        assert all(p.dtype == mx.float16 for _, p in tree_flatten(layer.parameters()))

    def test_batchnorm_float32_params_float16_data_in_a_half_model(self):
        model = Chain(Dense(3, 4), BatchNorm(4, relu))
        model.layers[0].update({k: v.astype(mx.float16)
                                for k, v in model.layers[0].parameters().items()})
        out = trainmode(model)(normal(6, 3, seed=18).astype(mx.float16))
        assert out.dtype == mx.float16 and model.layers[1].running_mean.dtype == mx.float32

    @pytest.mark.parametrize("make, reference", [
        (NORMS[0], lambda x: ref_batchnorm_train(x, BatchNorm(4), 0, 1, 0.1)[0]),
        (NORMS[1], lambda x: ref_layernorm(x, 1)),
        (NORMS[2], lambda x: ref_rmsnorm(x, 1)),
        (NORMS[3], lambda x: ref_groupnorm(x, 2)),
        (NORMS[4], ref_instancenorm),
    ])
    def test_float64_stays_float64_and_exact(self, make, reference):
        x = normal(3, 5, 4, seed=19, loc=1.0).astype(mx.float64)
        with mx.stream(mx.cpu):
            out = trainmode(make())(x)
            assert out.dtype == mx.float64
            np.testing.assert_allclose(np64(out), reference(np64(x)), rtol=1e-10, atol=1e-12)

    @pytest.mark.parametrize("make", NORMS)
    def test_autocast_gives_float32(self, make):
        layer = make()
        assert policy_of(layer) == "fp32"
        x = normal(3, 5, 4, seed=20).astype(mx.float16)
        with autocast(mx.float16, device="cpu"):
            out = layer(x)
        assert out.dtype == mx.float32
        np.testing.assert_allclose(np64(out), np64(layer(x.astype(mx.float32))), rtol=1e-6)
        assert layer(x).dtype == mx.float16  # outside the scope: input dtype again

    def test_dropout_keeps_dtype_under_autocast(self):
        layer = trainmode(Dropout(0.5))
        assert policy_of(layer) == "none"
        with autocast(mx.float16, device="cpu"):
            assert layer(mx.ones((4, 4), dtype=mx.bfloat16)).dtype == mx.bfloat16
            assert layer(mx.ones((4, 4))).dtype == mx.float32


# --- Dropout ------------------------------------------------------------------------------

class TestDropout:
    def test_construction(self):
        a, b = Dropout(0.3), Dropout(p=0.3, dims=(0, -1), active=True)
        assert a.p == b.p == 0.3 and a.dims is None and b.dims == (0, -1)
        assert a.active is None and b.active is True and a.parameters() == {}

    def test_identity_by_default_and_in_testmode(self):
        layer = Dropout(0.5)
        x = normal(50, 40)
        assert layer(x) is x
        assert fluxlike.testmode(layer)(x) is x
        trainmode(layer, "auto")
        assert layer.active is None and layer(x) is x

    def test_drops_fraction_and_scales_under_trainmode(self):
        x = normal(200, 100, seed=21)
        y = trainmode(Dropout(0.3))(x)
        dropped = np64(y) == 0
        assert abs(dropped.mean() - 0.3) < 0.02  # 20 000 draws: std ≈ 0.0032
        np.testing.assert_allclose(np64(y)[~dropped], np64(x)[~dropped] / 0.7, rtol=1e-6)

    def test_active_when_differentiating(self):
        layer = Dropout(0.5)
        with differentiating():
            y = layer(mx.ones((100, 100)))
        assert 0.4 < (np64(y) == 0).mean() < 0.6
        assert set(np.unique(np64(y))) == {0.0, 2.0}

    def test_zero_p_is_identity_even_in_training(self):
        x = normal(10, 10)
        assert trainmode(Dropout(0.0))(x) is x

    def test_dims_share_the_mask(self):
        x = mx.ones((4, 6, 6, 8))
        y = np64(trainmode(Dropout(0.5, dims=(0, -1)))(x))
        # one draw per (sample, channel), constant over the spatial axes
        assert (y == y[:, :1, :1, :]).all()
        assert 0 < (y[:, 0, 0, :] == 0).mean() < 1
        y = np64(trainmode(Dropout(0.5, dims=1))(x))
        assert (y == y[:1, :, :1, :1]).all()

    def test_gradient_is_the_mask(self):
        layer = trainmode(Dropout(0.25))
        mx.random.seed(3)
        y = layer(mx.ones((30, 30)))
        mx.random.seed(3)
        g = mx.grad(lambda x: mx.sum(layer(x)))(mx.ones((30, 30)))
        np.testing.assert_array_equal(np64(g), np64(y))

    def test_repr(self):
        assert repr(Dropout(0.5)) == "Dropout(0.5)"
        assert repr(Dropout(0.1, dims=-1)) == "Dropout(0.1, dims=-1)"
        assert repr(fluxlike.testmode(Dropout(0.1))) == "Dropout(0.1, active=False)"

    @pytest.mark.parametrize("p", [-0.1, 1.01, 2, "0.5", True, np.bool_(False), float("nan")])
    def test_bad_p(self, p):
        with pytest.raises(ValueError, match=r"\[Dropout\] p must be a probability in \[0, 1\]"):
            Dropout(p)

    @pytest.mark.parametrize("p", [1, 1.0, np.float32(1)])
    def test_p_one_drops_everything_without_nan(self, p):
        layer = Dropout(p)
        assert repr(layer) == "Dropout(1)" and layer.p == 1.0
        x = normal(6, 5)
        assert layer(x) is x  # inactive: the identity
        trainmode(layer)
        y = layer(x)
        assert y.dtype == x.dtype and np64(y).tolist() == [[0.0] * 5] * 6
        g = mx.grad(lambda v: mx.sum(layer(v) * v))(x)
        assert np64(g).tolist() == [[0.0] * 5] * 6
        half = trainmode(Dropout(p, dims=-1))(mx.ones((2, 3), dtype=mx.float16))
        assert half.dtype == mx.float16 and np64(half).tolist() == [[0.0] * 3] * 2
        with differentiating():
            assert np64(Dropout(p)(x)).tolist() == [[0.0] * 5] * 6

    def test_bad_dims_and_input(self):
        with pytest.raises(ValueError, match=r"\[Dropout\] dims must be None, an axis"):
            Dropout(0.5, dims=[0])
        with pytest.raises(ValueError, match=r"\[Dropout\] dims must be None, an axis"):
            Dropout(0.5, dims=(0, True))
        with pytest.raises(ValueError, match=r"\[Dropout\] dims=3 out of range .*\(2, 2\)"):
            Dropout(0.5, dims=3)(mx.ones((2, 2)))
        with pytest.raises(TypeError, match=r"\[Dropout\] expected a floating-point input"):
            trainmode(Dropout(0.5))(mx.ones((2, 2), dtype=mx.int32))


def test_exported():
    for name in ("BatchNorm", "LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm", "Dropout"):
        assert getattr(fluxlike, name).__module__ == "fluxlike.layers.normalise"


def test_numpy_numbers_are_stored_as_python_numbers_and_bools_refused():
    i64, f32 = np.int64, np.float32
    layers = {
        "BatchNorm(4, momentum=0.25, eps=0.001)": BatchNorm(i64(4), momentum=f32(0.25),
                                                           eps=np.float64(1e-3)),
        "InstanceNorm(3, eps=0.5)": InstanceNorm(np.int32(3), eps=f32(0.5)),
        "GroupNorm(8, 2, eps=0.25)": GroupNorm(i64(8), np.uint8(2), eps=f32(0.25)),
        "LayerNorm(4)": LayerNorm(i64(4)),
        "LayerNorm((4, 8), eps=0.5)": LayerNorm((i64(4), np.int32(8)), eps=np.float16(0.5)),
        "RMSNorm((2, 3))": RMSNorm((np.int16(2), i64(3))),
        "Dropout(0.5, dims=-1)": Dropout(f32(0.5), dims=i64(-1)),
        "Dropout(0.25, dims=(0, -1))": Dropout(np.float64(0.25), dims=(i64(0), np.int8(-1))),
    }
    for text, layer in layers.items():
        assert repr(layer).split("  #")[0] == text
        stored = [getattr(layer, k, None) for k in ("channels", "groups", "eps", "momentum",
                                                      "p", "dims")]
        numbers = [n for v in stored for n in (v if isinstance(v, tuple) else (v,))]
        assert all(type(n) in (int, float) for n in numbers if n is not None), (text, numbers)
    dropout = layers["Dropout(0.5, dims=-1)"]
    assert type(dropout.dims) is int and type(dropout.p) is float
    y = trainmode(dropout)(mx.ones((2, 4)))
    assert set(np64(y).ravel().tolist()) <= {0.0, 2.0}
    assert GroupNorm(i64(8), i64(2))(mx.ones((1, 3, 8))).shape == (1, 3, 8)
    for bad in (True, np.bool_(True)):
        with pytest.raises(ValueError, match=r"\[BatchNorm\] channels must be a positive"):
            BatchNorm(bad)
        with pytest.raises(ValueError, match=r"\[GroupNorm\] groups must be a positive"):
            GroupNorm(4, bad)
        with pytest.raises(ValueError, match=r"\[LayerNorm\] dims must be a positive integer"):
            LayerNorm(bad)
        with pytest.raises(ValueError, match=r"\[RMSNorm\] dims must be a positive integer"):
            RMSNorm((4, bad))
        with pytest.raises(ValueError, match=r"\[BatchNorm\] eps must be a positive number"):
            BatchNorm(4, eps=bad)
        with pytest.raises(ValueError, match=r"\[InstanceNorm\] momentum must be in"):
            InstanceNorm(4, momentum=bad)
        with pytest.raises(ValueError, match=r"\[Dropout\] dims must be None, an axis"):
            Dropout(0.5, dims=bad)


NORM_FLAGS = [
    (BatchNorm, (4,), "affine"), (BatchNorm, (4,), "track_stats"),
    (InstanceNorm, (4,), "affine"), (InstanceNorm, (4,), "track_stats"),
    (GroupNorm, (4, 2), "affine"), (LayerNorm, (4,), "affine"), (RMSNorm, (4,), "affine"),
]


@pytest.mark.parametrize("cls, args, flag", NORM_FLAGS,
                         ids=[f"{c.__name__}-{f}" for c, _, f in NORM_FLAGS])
def test_flags_must_be_bools(cls, args, flag):
    name = cls.__name__
    for bad in ("no", 0, 1, None):
        with pytest.raises(TypeError, match=rf"^\[{name}\] {flag} must be True or False, "
                                            rf"got {bad!r}$"):
            cls(*args, **{flag: bad})
    on, off = cls(*args, **{flag: np.bool_(True)}), cls(*args, **{flag: np.bool_(False)})
    attribute = "weight" if flag == "affine" else "running_mean"
    assert getattr(on, attribute) is not None and getattr(off, attribute) is None
    assert "np." not in repr(on) + repr(off)


def test_active_takes_numpy_bools_as_bools():
    for cls in (BatchNorm, InstanceNorm):
        layer = cls(4, active=np.bool_(True))
        assert layer.active is True and repr(layer).split("  #")[0].endswith("active=True)")
    assert repr(Dropout(0.5, active=np.bool_(False))) == "Dropout(0.5, active=False)"


def test_f16mix_keeps_only_the_statistics_norms_in_float32():
    """What the module docstring says: BatchNorm/InstanceNorm/GroupNorm stay float32 under
    f16mix, LayerNorm/RMSNorm are converted, and all of them still compute in float32."""
    model = Chain(BatchNorm(4), InstanceNorm(4, affine=True), GroupNorm(4, 2), LayerNorm(4),
                  RMSNorm(4))
    half = fluxlike.f16mix(model)
    dtypes = [{p.dtype for _, p in tree_flatten(layer.parameters())} for layer in half]
    assert dtypes == [{mx.float32}] * 3 + [{mx.float16}] * 2
    x = normal(2, 3, 4).astype(mx.float16)
    for layer in half[3:]:
        reference = layer.__class__(4)(x.astype(mx.float32))
        np.testing.assert_allclose(np64(layer(x)), np64(reference), atol=2e-3)


@pytest.mark.parametrize("make", [lambda: BatchNorm(3), lambda: InstanceNorm(3),
                                  lambda: GroupNorm(3, 1)])
@pytest.mark.parametrize("shape, perm", [((4, 3, 7), r"\(0, 2, 1\)"),
                                         ((4, 3, 5, 5), r"\(0, 2, 3, 1\)"),
                                         ((4, 3, 2, 5, 5), r"\(0, 2, 3, 4, 1\)")])
def test_channels_first_input_gets_the_transpose_that_fixes_it(make, shape, perm):
    layer = make()
    before = snapshot(layer)
    with pytest.raises(ValueError, match=rf"channels last.*in MLX: x\.transpose{perm}$"):
        trainmode(layer)(mx.ones(shape))
    assert_unchanged(layer, before)
    assert layer(mx.ones((shape[0], *shape[2:], 3))).shape[-1] == 3


def test_transpose_hint_only_for_input_that_looks_channels_first():
    with pytest.raises(ValueError, match=r"x\.transpose\(0, 2, 3, 1\)$"):
        BatchNorm(3)(mx.ones((4, 3, 5, 2)))
    with pytest.raises(ValueError, match=r"got shape \(4, 5, 5, 2\)$"):
        BatchNorm(3)(mx.ones((4, 5, 5, 2)))


def test_groupnorm_with_mlx_argument_order_says_fluxlikes():
    with pytest.raises(ValueError, match=r"^\[GroupNorm\] channels \(2\) must be divisible by "
                                         r"groups \(8\); fluxlike's order is GroupNorm\(channels, "
                                         r"groups\) \(mlx.nn's is \(groups, dims\)\)$"):
        GroupNorm(2, 8)
    with pytest.raises(ValueError, match=r"divisible by groups \(4\)$"):  # not swapped
        GroupNorm(6, 4)


ALPHA_PRIME = -1.0507009873554804934193349852946 * 1.6732632423543772848170429916717


class TestAlphaDropout:
    def test_construction_and_repr(self):
        a, b = AlphaDropout(0.3), AlphaDropout(p=0.1, active=True)
        assert a.p == 0.3 and a.active is None and b.active is True and a.parameters() == {}
        assert repr(a) == "AlphaDropout(0.3)" and repr(b) == "AlphaDropout(0.1, active=True)"
        assert repr(fluxlike.testmode(AlphaDropout(0.5))) == "AlphaDropout(0.5, active=False)"
        assert fluxlike.policy_of(AlphaDropout) == "none"

    def test_identity_when_inactive_or_p_zero(self):
        x = normal(20, 10)
        assert AlphaDropout(0.5)(x) is x
        assert fluxlike.testmode(AlphaDropout(0.5))(x) is x
        assert trainmode(AlphaDropout(0.0))(x) is x

    def test_dropped_values_and_affine_map_as_flux(self):
        p = 0.25
        x = normal(300, 100, seed=4)
        y = np64(trainmode(AlphaDropout(p))(x))
        a = 1 / np.sqrt((1 - p) * (1 + p * ALPHA_PRIME**2))
        b = -a * ALPHA_PRIME * p
        dropped = np.isclose(y, a * ALPHA_PRIME + b, rtol=0, atol=1e-6)
        assert abs(dropped.mean() - p) < 0.01  # 30 000 draws: std 0.0025
        np.testing.assert_allclose(y[~dropped], a * np64(x)[~dropped] + b, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("p", [0.05, 0.3, 0.7])
    def test_keeps_zero_mean_and_unit_variance(self, p):
        y = np64(trainmode(AlphaDropout(p))(normal(400_000, seed=5)))
        assert abs(y.mean()) < 0.01 and abs(y.var() - 1) < 0.015

    def test_active_when_differentiating_and_gradient_is_a_times_the_mask(self):
        p = 0.4
        a = 1 / np.sqrt((1 - p) * (1 + p * ALPHA_PRIME**2))
        layer = AlphaDropout(p)
        x = normal(40, 40)
        with differentiating():
            g = np64(mx.grad(lambda v: mx.sum(layer(v)))(x))
        assert set(np.round(np.unique(g), 5)) == {0.0, round(a, 5)}
        assert 0.3 < (g == 0).mean() < 0.5

    def test_gradients_float64_with_a_fixed_mask(self):
        layer = trainmode(AlphaDropout(0.3))
        r = normal(6, 5, seed=9).astype(mx.float64)

        def loss(u, v):  # the same draws on every call
            mx.random.seed(11)
            return mx.sum(layer(u) * r) + mx.sum(layer(v) * r)

        x = normal(6, 5).astype(mx.float64)
        with mx.stream(mx.cpu):
            check_gradients(loss, x, x + 0.5)

    def test_p_one_gives_zeros(self):
        y = trainmode(AlphaDropout(1.0))(normal(5, 5))
        assert (np64(y) == 0).all()

    @pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
    def test_runs_in_the_input_dtype_under_autocast(self, dtype):
        layer = trainmode(AlphaDropout(0.2))
        x = normal(300, 100).astype(dtype)
        with autocast(dtype, device="cpu"):
            y = layer(x)
        assert y.dtype == dtype
        y = np64(y)
        assert abs(y.mean()) < 0.02 and abs(y.var() - 1) < 0.03

    @pytest.mark.parametrize("p", [-0.1, 1.5, "0.5", True])
    def test_bad_p(self, p):
        with pytest.raises(ValueError, match=r"\[AlphaDropout\] p must be a probability"):
            AlphaDropout(p)

    def test_bad_input(self):
        with pytest.raises(TypeError, match=r"\[AlphaDropout\] expected a floating-point "
                                            r"input, got mlx.core.int32"):
            trainmode(AlphaDropout(0.5))(mx.ones((2,), dtype=mx.int32))
        with pytest.raises(ValueError, match=r"\[AlphaDropout\] active must be"):
            AlphaDropout(0.5, active="yes")
