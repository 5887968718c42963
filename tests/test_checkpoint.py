import json

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from fluxlike import (
    Adam,
    AdamW,
    BatchNorm,
    Chain,
    ClipNorm,
    DataLoader,
    Dense,
    Descent,
    DynamicLossScale,
    Momentum,
    Nesterov,
    OptimiserChain,
    RMSProp,
    loadcheckpoint,
    loadmodel,
    relu,
    savemodel,
    setup,
    state,
    train,
    trainmode,
)
from fluxlike.losses import logitcrossentropy


def make_model(hidden: int = 8) -> Chain:
    return Chain(Dense(4, hidden), BatchNorm(hidden, relu), Dense(hidden, 3))


def trained_stats(model: Chain) -> Chain:
    """Move the BatchNorm running statistics away from their initial values."""
    trainmode(model)
    model(mx.random.normal((16, 4)) * 3 + 1)
    trainmode(model, "auto")
    return model


def snapshot(tree) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(tree) if isinstance(v, mx.array)}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


class TestStateAndLoadmodel:
    def test_state_holds_every_array_including_running_stats(self):
        names = [k for k, _ in tree_flatten(state(make_model()))]
        assert names == [
            "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias",
            "layers.1.running_mean", "layers.1.running_var", "layers.2.weight", "layers.2.bias",
        ]

    def test_round_trip_with_batchnorm(self):
        source = trained_stats(make_model())
        target = make_model()
        assert not np.allclose(np.array(target.layers[1].running_mean),
                               np.array(source.layers[1].running_mean))
        assert loadmodel(target, state(source)) is target
        assert_same(snapshot(target.parameters()), snapshot(source.parameters()))
        x = mx.random.normal((5, 4))
        np.testing.assert_array_equal(np.array(target(x)), np.array(source(x)))

    def test_flat_dotted_names_and_models_are_accepted(self):
        source = trained_stats(make_model())
        target = loadmodel(make_model(), dict(tree_flatten(state(source))))
        assert_same(snapshot(target.parameters()), snapshot(source.parameters()))
        target = loadmodel(make_model(), source)
        assert_same(snapshot(target.parameters()), snapshot(source.parameters()))

    def test_numpy_arrays_are_accepted(self):
        source = make_model()
        flat = {k: np.array(v) for k, v in tree_flatten(state(source))}
        target = loadmodel(make_model(), flat)
        assert_same(snapshot(target.parameters()), snapshot(source.parameters()))

    def test_dtypes_are_converted_to_the_models(self):
        source = make_model()
        half = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(state(source))}
        target = loadmodel(make_model(), half)
        for k, v in tree_flatten(state(target)):
            assert v.dtype == mx.float32, k
            np.testing.assert_array_equal(np.array(v), np.array(half[k].astype(mx.float32)))

    def check_rejected(self, source, message: str) -> None:
        target = trained_stats(make_model())
        before = snapshot(target.parameters())
        with pytest.raises(ValueError, match=message):
            loadmodel(target, source)
        assert_same(snapshot(target.parameters()), before)

    def test_shape_mismatch_names_the_array(self):
        self.check_rejected(
            state(make_model(hidden=6)),
            r"^\[loadmodel\] shape mismatch at 'layers.0.weight': model has \(8, 4\), "
            r"checkpoint has \(6, 4\)$",
        )

    def test_mismatch_in_the_last_array_changes_nothing(self):
        flat = dict(tree_flatten(state(make_model())))
        flat["layers.2.bias"] = mx.zeros((4,))
        self.check_rejected(flat, r"shape mismatch at 'layers.2.bias'")

    def test_missing_name(self):
        flat = dict(tree_flatten(state(make_model())))
        del flat["layers.1.running_var"]
        self.check_rejected(flat, r"^\[loadmodel\] missing 'layers.1.running_var'")

    def test_extra_name(self):
        flat = dict(tree_flatten(state(make_model())))
        flat["layers.3.weight"] = mx.zeros((3, 3))
        self.check_rejected(flat, r"^\[loadmodel\] unexpected 'layers.3.weight'")

    def test_wrong_kind_of_dtype(self):
        flat = dict(tree_flatten(state(make_model())))
        flat["layers.0.bias"] = mx.zeros((8,), dtype=mx.int32)
        self.check_rejected(flat, r"dtype mismatch at 'layers.0.bias': model has mlx.core.float32")

    def test_non_array_leaf(self):
        flat = dict(tree_flatten(state(make_model())))
        flat["layers.0.bias"] = 1.0
        self.check_rejected(flat, r"type mismatch at 'layers.0.bias'")

    def test_bad_arguments(self):
        with pytest.raises(TypeError, match=r"\[loadmodel\] expected a state dict"):
            loadmodel(make_model(), "weights.safetensors")
        with pytest.raises(TypeError, match=r"\[state\] expected a model"):
            state({"w": mx.zeros(2)})


class TestFiles:
    def test_file_is_plain_safetensors(self, tmp_path):
        model = trained_stats(make_model())
        path = tmp_path / "model.safetensors"
        savemodel(path, model)
        arrays, metadata = mx.load(str(path), return_metadata=True)
        assert set(arrays) == {"model." + k for k, _ in tree_flatten(state(model))}
        np.testing.assert_array_equal(np.array(arrays["model.layers.1.running_mean"]),
                                      np.array(model.layers[1].running_mean))
        assert metadata["format"] == "fluxlike"

    def test_model_round_trip(self, tmp_path):
        source = trained_stats(make_model())
        path = tmp_path / "m.safetensors"
        savemodel(str(path), source)
        target = make_model()
        assert loadcheckpoint(path, target) is target
        assert_same(snapshot(target.parameters()), snapshot(source.parameters()))

    def test_path_is_used_exactly_and_overwritten(self, tmp_path):
        path = tmp_path / "ckpt.safetensors"
        savemodel(path, make_model())
        source = make_model()
        savemodel(path, source)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]
        target = loadcheckpoint(path, make_model())
        assert_same(snapshot(target.parameters()), snapshot(source.parameters()))

    @pytest.mark.parametrize(("name", "suggested"), [("m.npz", "m.safetensors"),
                                                     ("ckpt", "ckpt.safetensors"),
                                                     ("run.bin", "run.safetensors")])
    def test_other_extensions_are_refused(self, tmp_path, name, suggested):
        # MLX's save_weights picks the format by the extension: safetensors under another
        # name would be misread (mx.load of an .npz name reads a zip archive)
        with pytest.raises(ValueError, match=rf"^\[savemodel\] a checkpoint is a safetensors "
                           rf"file: name it '{suggested}' \(got '.*{name}'"):
            savemodel(tmp_path / name, make_model(), setup(Adam(), make_model()))
        assert list(tmp_path.iterdir()) == []

    def test_older_files_of_any_name_still_load(self, tmp_path):
        source = trained_stats(make_model())
        savemodel(tmp_path / "m.safetensors", source)
        for name in ("old.npz", "old"):  # as savemodel wrote them before it checked the name
            (tmp_path / "m.safetensors").rename(tmp_path / name)
            target = loadcheckpoint(tmp_path / name, make_model())
            assert_same(snapshot(target.parameters()), snapshot(source.parameters()))
            (tmp_path / name).rename(tmp_path / "m.safetensors")

    @pytest.mark.parametrize("extension", [".safetensors", ".npz"])
    def test_mlx_save_weights_files_load(self, tmp_path, extension):
        source = trained_stats(make_model())
        path = tmp_path / f"w{extension}"
        source.save_weights(str(path))
        target = loadcheckpoint(path, make_model())
        assert_same(snapshot(target.parameters()), snapshot(source.parameters()))

    def test_file_mismatch_leaves_model_unchanged(self, tmp_path):
        path = tmp_path / "small.safetensors"
        savemodel(path, make_model(hidden=6))
        target = make_model()
        before = snapshot(target.parameters())
        with pytest.raises(ValueError, match=r"^\[loadcheckpoint\] shape mismatch at "
                           r"'model.layers.0.weight': model has \(8, 4\), checkpoint has \(6, 4\)"):
            loadcheckpoint(path, target)
        assert_same(snapshot(target.parameters()), before)

    def test_missing_directory(self, tmp_path):
        with pytest.raises(FileNotFoundError, match=r"\[savemodel\] no directory"):
            savemodel(tmp_path / "nope" / "m.safetensors", make_model())

    def test_missing_file(self, tmp_path):
        with pytest.raises(FileNotFoundError, match=r"\[loadcheckpoint\] no checkpoint file"):
            loadcheckpoint(tmp_path / "nope.safetensors", make_model())


class PlainState:
    """A stand-in optimiser state with non-array leaves, following OptState's interface."""

    def __init__(self, tree):
        self.tree = tree

    @property
    def state(self):
        return self.tree

    def load_state(self, tree):
        self.tree = tree


class TestPlainLeaves:
    def test_python_leaves_round_trip_exactly(self, tmp_path):
        tree = {"lr": 0.1, "step": 7, "flag": True, "name": "adam", "none": None,
                "m": [mx.arange(3, dtype=mx.float32)]}
        path = tmp_path / "c.safetensors"
        savemodel(path, make_model(), PlainState(tree))
        assert json.loads(mx.load(str(path), return_metadata=True)[1]["plain"]) == {
            "opt.lr": 0.1, "opt.step": 7, "opt.flag": True, "opt.name": "adam", "opt.none": None}
        target = PlainState({})
        loadcheckpoint(path, make_model(), target)
        m = target.tree.pop("m")
        assert target.tree == {k: v for k, v in tree.items() if k != "m"}
        assert type(target.tree["step"]) is int and m[0].tolist() == [0, 1, 2]

    def test_unstorable_leaf(self, tmp_path):
        with pytest.raises(TypeError, match=r"\[savemodel\] cannot store object at 'opt.x'"):
            savemodel(tmp_path / "c.safetensors", make_model(), PlainState({"x": object()}))
        assert list(tmp_path.iterdir()) == []

    def test_not_an_opt_state(self, tmp_path):
        with pytest.raises(TypeError, match=r"opt_state must be the optimiser state"):
            savemodel(tmp_path / "c.safetensors", make_model(), {"m": mx.zeros(2)})


def loss(m, x, y):
    return logitcrossentropy(m(x), y)


def batches() -> DataLoader:
    x = mx.random.normal((24, 4), key=mx.random.key(1))
    y = mx.random.randint(0, 3, (24,), key=mx.random.key(2))
    return DataLoader((x, y), batchsize=8)


def run(model, opt_state, epochs: int, autocast=None) -> None:
    for _ in range(epochs):
        train(loss, model, batches(), opt_state, autocast=autocast, progress=False)


class TestOptimiserState:
    @pytest.mark.parametrize("autocast", [None, mx.float16])
    def test_resumed_training_matches_uninterrupted(self, tmp_path, autocast):
        model = make_model()
        opt_state = setup(Adam(1e-2), model)
        run(model, opt_state, 2, autocast)
        path = tmp_path / "run.safetensors"
        savemodel(path, model, opt_state)
        run(model, opt_state, 2, autocast)

        resumed = make_model()
        resumed_opt = setup(Adam(1e-2), resumed)
        loadcheckpoint(path, resumed, resumed_opt)
        if autocast is not None:  # the saved loss scale came back with the state
            assert isinstance(resumed_opt.loss_scale, DynamicLossScale)
        run(resumed, resumed_opt, 2, autocast)
        assert_same(snapshot(resumed.parameters()), snapshot(model.parameters()))
        assert_same(snapshot(resumed_opt.state), snapshot(opt_state.state))

        # Without the optimiser state (fresh Adam moments and step) the run differs.
        fresh = loadcheckpoint(path, make_model())
        run(fresh, setup(Adam(1e-2), fresh), 2, autocast)
        assert not np.array_equal(np.array(fresh.layers[0].weight),
                                  np.array(model.layers[0].weight))

    def test_dynamic_loss_scale_settings_come_back(self, tmp_path):
        path = tmp_path / "scaled.safetensors"
        model = make_model()
        scale = DynamicLossScale(64.0, growth_interval=5, growth_factor=3.0,
                                 backoff_factor=0.25, min_scale=2.0)
        savemodel(path, model, setup(Adam(), model, loss_scale=scale))
        for target in (setup(Adam(), model), setup(Adam(), model, loss_scale=DynamicLossScale())):
            loadcheckpoint(path, model, target)
            assert repr(target.loss_scale) == repr(scale)

    def test_file_holds_prefixed_optimiser_arrays(self, tmp_path):
        model = make_model()
        opt_state = setup(Adam(), model)
        path = tmp_path / "run.safetensors"
        savemodel(path, model, opt_state)
        names = set(mx.load(str(path)))
        assert {"opt.optimizer.step", "opt.optimizer.layers.0.weight.m",
                "model.layers.1.running_var"} <= names

    def check_unchanged(self, path, message):
        model = trained_stats(make_model())
        opt_state = setup(Adam(1e-2), model)
        run(model, opt_state, 1)
        before = snapshot(model.parameters()), snapshot(opt_state.state)
        with pytest.raises(ValueError, match=message):
            loadcheckpoint(path, model, opt_state)
        assert_same(snapshot(model.parameters()), before[0])
        assert_same(snapshot(opt_state.state), before[1])

    def test_model_mismatch_changes_neither(self, tmp_path):
        path = tmp_path / "small.safetensors"
        small = make_model(hidden=6)
        savemodel(path, small, setup(Adam(), small))
        self.check_unchanged(path, r"\[loadcheckpoint\] shape mismatch at 'model.layers.0.weight'")

    def test_optimiser_shape_mismatch_changes_neither(self, tmp_path):
        path = tmp_path / "mixed.safetensors"
        savemodel(path, make_model(), setup(Adam(), make_model(hidden=6)))
        self.check_unchanged(path, r"\[loadcheckpoint\] optimiser state in .*"
                                   r"'optimizer.layers.0.weight.m'")

    def test_missing_optimiser_entries_change_neither(self, tmp_path):
        path = tmp_path / "frozen.safetensors"
        model, frozen = make_model(), make_model()
        frozen.layers[0].freeze()
        savemodel(path, model, setup(Adam(), frozen))  # no moments for the first layer
        self.check_unchanged(path, r"optimiser state in .*missing entry 'optimizer.layers.0")

    def test_another_rule_changes_neither(self, tmp_path):
        path = tmp_path / "descent.safetensors"
        model = make_model()
        savemodel(path, model, setup(Descent(), model))
        self.check_unchanged(path, r"^\[loadcheckpoint\] the optimiser state in .* was saved "
                                   r"from Descent \(mlx SGD\), this opt_state is for Adam "
                                   r"\(mlx Adam\); setup\(\) the same rule to resume$")

    def test_rules_with_the_same_state_names_are_told_apart(self, tmp_path):
        # Momentum's and RMSProp's states both hold one "v" per parameter
        path = tmp_path / "momentum.safetensors"
        model = make_model()
        momentum = setup(Momentum(), model)
        assert sorted(momentum.state["optimizer"]["layers"][0]["weight"]) == ["v"]
        savemodel(path, model, momentum)
        rms = setup(RMSProp(), model)
        before = snapshot(rms.state)
        with pytest.raises(ValueError, match=r"saved from Momentum \(mlx SGD\), this opt_state "
                           r"is for RMSProp \(mlx RMSprop\)"):
            loadcheckpoint(path, model, rms)
        assert_same(snapshot(rms.state), before)
        # the same kind loads: an mlx optimizer, a chain in front, a subclass (Adam -> AdamW)
        loadcheckpoint(path, model, setup(optim.SGD(0.1, momentum=0.5), model))
        loadcheckpoint(path, model, setup(OptimiserChain(ClipNorm(1.0), Nesterov()), model))
        savemodel(path, model, setup(Adam(), model))
        loadcheckpoint(path, model, setup(AdamW(), model))

    def test_files_without_the_optimiser_kind_still_load(self, tmp_path):
        path = tmp_path / "old.safetensors"
        model = make_model()
        savemodel(path, model, setup(Momentum(), model))
        arrays, metadata = mx.load(str(path), return_metadata=True)
        assert json.loads(metadata.pop("optimizer")) == {"rule": "Momentum", "classes": ["SGD"]}
        mx.save_safetensors(str(path), arrays, metadata=metadata)  # as earlier versions wrote
        loadcheckpoint(path, model, setup(RMSProp(), model))  # unchecked, as before

    def test_extra_optimiser_entries_change_neither(self, tmp_path):
        path = tmp_path / "extra.safetensors"
        model = make_model()
        opt_state = setup(Adam(), model)
        opt_state.optimizer.state["extra"] = mx.zeros(2)
        savemodel(path, model, opt_state)
        self.check_unchanged(path, r"optimiser state in .*unexpected entry 'optimizer.extra'")

    def test_no_optimiser_state_in_file(self, tmp_path):
        path = tmp_path / "model.safetensors"
        savemodel(path, make_model())
        self.check_unchanged(path, r"holds no optimiser state; call loadcheckpoint\(path, model\)")
