"""Storage converters (fluxlike/precision/convert.py): f32, f64, f16, bf16, f16mix, bf16mix and
the keep_float32 trait."""

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import np64
from mlx.utils import tree_flatten

import fluxlike as fl
from fluxlike import bf16, bf16mix, f16, f16mix, f32, f64, keep_float32
from fluxlike.precision import operands
from fluxlike.precision.convert import keeps_float32

F16, BF16, F32, F64 = mx.float16, mx.bfloat16, mx.float32, mx.float64
FULL = [(f32, F32), (f64, F64), (f16, F16), (bf16, BF16)]
MIXED = [(f16mix, F16), (bf16mix, BF16)]
ALL = FULL + MIXED


class Counter(nn.Module):
    """A layer with integer and boolean leaves and a private (non-parameter) array."""

    def __init__(self):
        super().__init__()
        self.steps = mx.array([3], dtype=mx.int32)
        self.flags = mx.array([True, False])
        self.gain = mx.ones((2,))
        self._buffer = mx.ones((2,))

    def __call__(self, x):
        return x


def model_under_test():
    """One of everything: kept norms (fluxlike's and mlx.nn's), other layers, nested lists."""
    return fl.Chain(
        fl.Dense(4, 6, "relu"),
        fl.BatchNorm(6),
        fl.Chain(fl.Dense(6, 6), fl.GroupNorm(6, 3), fl.LayerNorm(6)),
        nn.BatchNorm(6),
        nn.GroupNorm(3, 6),
        nn.InstanceNorm(6, affine=True),
        fl.InstanceNorm(6, affine=True, track_stats=True),
        fl.Embedding(5, 6),
        nn.Linear(6, 2),
        Counter(),
    )


KEPT = (fl.BatchNorm, fl.GroupNorm, fl.InstanceNorm, nn.BatchNorm, nn.GroupNorm, nn.InstanceNorm)


def leaves_by_owner(model):
    """``(path, owning module, array)`` for every parameter, owned by the module holding it."""
    out = []
    for path, module in model.named_modules():
        for key, value in module.items():
            if key.startswith("_"):
                continue
            for sub, leaf in tree_flatten(value, is_leaf=nn.Module.is_module):
                if isinstance(leaf, mx.array):
                    out.append((".".join(p for p in (path, key, sub) if p), module, leaf))
    return out


def snapshot(model):
    return [(k, v, v.dtype, np.array(v.astype(F32) if v.dtype == BF16 else v))
            for k, v in tree_flatten(model.parameters())]


class TestDtypes:
    @pytest.mark.parametrize("convert, dtype", FULL)
    def test_full_casts_every_floating_leaf(self, convert, dtype):
        model = model_under_test()
        with mx.stream(mx.cpu):
            new = convert(model)
            for key, value in tree_flatten(new.parameters()):
                if key.endswith(("steps", "flags")):
                    continue
                assert value.dtype == dtype, key

    @pytest.mark.parametrize("convert, dtype", MIXED)
    def test_mixed_keeps_norm_statistics_and_affine_float32(self, convert, dtype):
        model = model_under_test()
        new = convert(model)
        owners = leaves_by_owner(new)
        assert len(owners) == len(tree_flatten(new.parameters()))  # every leaf has an owner
        kept = 0
        for path, owner, value in owners:
            if path.endswith(("steps", "flags")):
                continue
            if isinstance(owner, KEPT):
                kept += 1
                assert value.dtype == F32, path
            else:
                assert value.dtype == dtype, path
        # fluxlike BatchNorm 4 + GroupNorm 2 + InstanceNorm 4, mlx.nn 4 + 2 + 2
        assert kept == 18
        bn = new[1]
        assert {bn.weight.dtype, bn.bias.dtype, bn.running_mean.dtype} == {F32}
        assert new[2][2].weight.dtype == dtype  # LayerNorm is not kept (as in Flux)

    @pytest.mark.parametrize("convert, dtype", ALL)
    def test_integer_bool_and_private_leaves_untouched(self, convert, dtype):
        model = model_under_test()
        with mx.stream(mx.cpu):
            new = convert(model)
        counter, old = new[-1], model[-1]
        assert counter.steps is old.steps and counter.flags is old.flags
        assert counter._buffer is old._buffer  # not a parameter (mlx's convention)
        assert counter.gain.dtype == dtype

    def test_converting_back_and_forth(self):
        model = fl.Dense(3, 2)
        x = mx.random.normal((4, 3))
        back = f32(bf16(model))
        assert back.weight.dtype == F32
        np.testing.assert_allclose(np64(back(x)), np64(model(x)), atol=0.05)


class TestArgumentUnchanged:
    @pytest.mark.parametrize("convert, dtype", ALL)
    def test_argument_unchanged_and_nothing_mutable_shared(self, convert, dtype):
        model = model_under_test()
        model[0].freeze(keys=["bias"])
        before = snapshot(model)
        repr_before = repr(model)
        with mx.stream(mx.cpu):
            new = convert(model)
        after = snapshot(model)
        assert [(k, d) for k, _, d, _ in after] == [(k, d) for k, _, d, _ in before]
        for (k, v0, _, a0), (_, v1, _, a1) in zip(before, after, strict=True):
            assert v0 is v1, k
            np.testing.assert_array_equal(a0, a1)
        assert repr(model) == repr_before
        olds = dict(model.named_modules())
        news = dict(new.named_modules())
        assert news.keys() == olds.keys()
        for path, m in news.items():
            old = olds[path]
            assert m is not old and type(m) is type(old), path
            assert m._no_grad == old._no_grad and m._no_grad is not old._no_grad, path
            assert m.training == old.training
        assert new.layers is not model.layers and new[2].layers is not model[2].layers
        # Changing the result leaves the argument alone.
        new.layers.append(fl.Dense(2, 2))
        new[0].freeze()
        new[0].weight = mx.zeros_like(new[0].weight)
        new[1].running_mean = new[1].running_mean + 1
        assert len(model.layers) == 10 and "weight" not in model[0]._no_grad
        assert float(mx.abs(model[0].weight).sum()) > 0
        assert float(mx.abs(model[1].running_mean).sum()) == 0

    def test_frozen_parameters_stay_frozen(self):
        model = fl.Chain(fl.Dense(3, 4), fl.BatchNorm(4), nn.BatchNorm(4), fl.Dense(4, 2))
        model[0].freeze(keys=["weight"])
        keys = sorted(k for k, _ in tree_flatten(model.trainable_parameters()))
        for convert, _ in ALL:
            with mx.stream(mx.cpu):
                new = convert(model)
            assert sorted(k for k, _ in tree_flatten(new.trainable_parameters())) == keys
            assert len(tree_flatten(new.parameters())) == len(tree_flatten(model.parameters()))

    def test_same_dtype_leaf_is_reused(self):
        model = model_under_test()
        same = f32(model)
        for (k, a), (_, b) in zip(tree_flatten(model.parameters()),
                                  tree_flatten(same.parameters()), strict=True):
            assert a is b, k
        mixed = f16mix(model)
        assert mixed[1].weight is model[1].weight  # kept float32: not copied
        assert mixed[3].running_var is model[3].running_var
        assert mixed[0].weight is not model[0].weight
        again = f16mix(mixed)
        for (k, a), (_, b) in zip(tree_flatten(mixed.parameters()),
                                  tree_flatten(again.parameters()), strict=True):
            assert a is b, k

    def test_tied_modules_and_arrays_stay_tied(self):
        shared = fl.Dense(3, 3)
        model = fl.Chain(shared, fl.Dense(3, 3), shared)
        model[1].weight = shared.weight
        new = f16(model)
        assert new[0] is new[2] and new[0] is not shared
        assert new[1].weight is new[0].weight and new[0].weight.dtype == F16

    def test_repr_and_class_preserved(self):
        model = fl.Chain(fl.Dense(5, 3, "relu"), fl.BatchNorm(3))
        new = bf16mix(model)
        assert type(new) is fl.Chain and type(new[1]) is fl.BatchNorm
        assert repr(new).splitlines()[1:3] == repr(model).splitlines()[1:3]


class TestRunning:
    @pytest.mark.parametrize("convert, dtype", MIXED)
    def test_mixed_model_takes_float32_data(self, convert, dtype):
        model = fl.Chain(fl.Dense(4, 8, "relu"), fl.BatchNorm(8), fl.Dense(8, 3))
        x = mx.random.normal((16, 4))
        half = convert(model)
        out = half(x)
        assert out.dtype == dtype
        assert half[:2](x).dtype == dtype  # BatchNorm computes in float32, returns its input's
        np.testing.assert_allclose(np64(out), np64(model(x)), atol=0.1, rtol=0.05)
        trained = fl.trainmode(half)
        trained(x)
        assert half[1].running_mean.dtype == F32  # statistics updated, still float32

    def test_mixed_conv_model(self):
        model = fl.Chain(fl.Conv((3, 3), 2, 4, "relu", padding=1), fl.GroupNorm(4, 2),
                         fl.Conv((3, 3), 4, 2))
        x = mx.random.normal((2, 6, 6, 2))
        half = f16mix(model)
        assert half(x).dtype == F16
        np.testing.assert_allclose(np64(half(x)), np64(model(x)), atol=0.05, rtol=0.05)

    def test_full_half_model_takes_float32_data(self):
        half = f16(fl.Chain(fl.Dense(4, 8), fl.BatchNorm(8), fl.Dense(8, 3)))
        assert half[1].running_var.dtype == F16
        assert half(mx.random.normal((5, 4))).dtype == F16

    def test_f64_model(self):
        model = fl.Chain(fl.Dense(3, 4, "tanh"), fl.LayerNorm(4), fl.Dense(4, 2))
        x = mx.random.normal((5, 3))
        with mx.stream(mx.cpu):
            out = f64(model)(x.astype(F64))
            assert out.dtype == F64
            np.testing.assert_allclose(np.array(out), np64(model(x)), rtol=1e-4, atol=1e-5)

    def test_float64_input_to_a_float32_model_warns_once(self, monkeypatch):
        monkeypatch.setattr(operands, "_warned_float64", set())
        model = f32(fl.Chain(fl.Dense(3, 4), fl.Dense(4, 2)))
        x = mx.ones((2, 3), dtype=F64)
        with mx.stream(mx.cpu):
            with pytest.warns(UserWarning, match=r"\[Dense\] float64 input converted"):
                assert model(x).dtype == F32
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert model(x).dtype == F32

    def test_mlx_nn_model(self):
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm(6), nn.ReLU(), nn.Linear(6, 2))
        half = bf16mix(model)
        assert [half.layers[i].weight.dtype for i in (0, 1, 3)] == [BF16, F32, BF16]
        assert half.layers[1].running_mean.dtype == F32
        assert half(mx.random.normal((3, 4)).astype(BF16)).dtype == F32  # mlx's promotion


class TestTrees:
    def test_arrays_and_parameter_trees(self):
        w = mx.ones((2,))
        assert f16(w).dtype == F16 and f32(w) is w
        tree = {"a": [w, mx.array([1])], "b": (mx.zeros(3, dtype=F16),)}
        new = bf16(tree)
        assert new["a"][0].dtype == BF16 and new["a"][1] is tree["a"][1]
        assert new["b"][0].dtype == BF16 and tree["a"][0] is w
        assert f16mix([fl.BatchNorm(2)])[0].weight.dtype == F32
        assert f16(3.5) == 3.5


class TestKeepFloat32:
    def test_registered_classes(self):
        for cls in KEPT:
            assert keeps_float32(cls), cls
        for cls in (fl.Dense, fl.LayerNorm, nn.LayerNorm, nn.Linear, fl.Chain):
            assert not keeps_float32(cls), cls

    def test_user_class_and_subclasses(self):
        @keep_float32
        class Stats(nn.Module):
            def __init__(self):
                super().__init__()
                self.mean = mx.zeros((2,))

        class MoreStats(Stats):
            pass

        class NoStats(Stats):
            pass

        assert keep_float32(NoStats, False) is NoStats
        assert f16mix(Stats()).mean.dtype == F32
        assert f16mix(MoreStats()).mean.dtype == F32
        assert f16mix(NoStats()).mean.dtype == F16
        assert f16(Stats()).mean.dtype == F16  # a full cast casts everything

        class MyBatchNorm(fl.BatchNorm):
            pass

        assert f16mix(MyBatchNorm(3)).weight.dtype == F32

    def test_children_of_a_kept_layer_stay_float32(self):
        @keep_float32
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = fl.Dense(2, 2)

            def __call__(self, x):
                return self.inner(x)

        block = bf16mix(fl.Chain(Block(), fl.Dense(2, 2)))
        assert block[0].inner.weight.dtype == F32 and block[1].weight.dtype == BF16

    def test_kept_layer_of_a_float64_model_becomes_float32(self):
        with mx.stream(mx.cpu):
            model = f64(fl.Chain(fl.Dense(2, 2), fl.BatchNorm(2)))
            new = f16mix(model)
        assert new[0].weight.dtype == F16 and new[1].running_var.dtype == F32

    def test_bad_arguments(self):
        with pytest.raises(TypeError, match="mlx.nn.Module subclass"):
            keep_float32(int)
        with pytest.raises(TypeError, match="keep must be a bool"):
            keep_float32(fl.Dense, 1)
