import json

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from fluxlike import (
    AccumGrad,
    AdaBelief,
    AdaDelta,
    AdaGrad,
    Adam,
    AdaMax,
    AdamW,
    AMSGrad,
    BatchNorm,
    Chain,
    ClipNorm,
    ClipValue,
    DataLoader,
    Dense,
    Descent,
    DynamicLossScale,
    Lion,
    Momentum,
    NAdam,
    Nesterov,
    OAdam,
    OptimiserChain,
    RAdam,
    RMSProp,
    Rprop,
    SignDecay,
    Signum,
    WeightDecay,
    adjust,
    loadcheckpoint,
    loadmodel,
    relu,
    savemodel,
    setup,
    state,
    train,
    trainmode,
    update,
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

    @pytest.mark.filterwarnings(r"ignore:\[loadcheckpoint\] the optimiser state in")
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

    @pytest.mark.filterwarnings(r"ignore:\[loadcheckpoint\] the optimiser state in")
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


# ---------------------------------------------------------------- the rule's hyperparameters

BETAS = {"lr": 0.05, "betas": (0.5, 0.6), "eps": 1e-3}
# every rule fluxlike has, and hyperparameters other than its defaults to adjust it to
RULES = [
    (Descent(), {"lr": 0.05}),
    (Momentum(), {"lr": 0.05, "rho": 0.5}),
    (Nesterov(), {"lr": 0.05, "rho": 0.5}),
    (RMSProp(), {"lr": 0.05, "rho": 0.5, "eps": 1e-3}),
    (Adam(), BETAS),
    (AdamW(), {**BETAS, "weight_decay": 0.2}),
    (Lion(), {"lr": 0.05, "betas": (0.5, 0.6), "weight_decay": 0.2}),
    (AdaGrad(), {"lr": 0.05, "eps": 1e-3}),
    (AdaDelta(), {"rho": 0.5, "eps": 1e-3}),
    (AdaMax(), BETAS), (NAdam(), BETAS), (RAdam(), BETAS), (OAdam(), BETAS),
    (AdaBelief(), BETAS), (AMSGrad(), BETAS),
    (Rprop(), {"lr": 0.05, "etas": (0.3, 1.5), "step_sizes": (1e-4, 10.0)}),
    (Signum(), {"lr": 0.05, "beta": 0.5}),
    (OptimiserChain(ClipNorm(1.0), ClipValue(1.0), WeightDecay(), SignDecay(), Adam()),
     {**BETAS, "max_norm": 0.5, "delta": 0.3, "decay": 0.01}),
    (AccumGrad(2, OptimiserChain(ClipNorm(1.0), Momentum())),
     {"n": 3, "lr": 0.05, "rho": 0.5, "max_norm": 0.5}),
]


def settings(optimizer: optim.Optimizer) -> dict:
    """An mlx optimizer's Python settings (the inner optimizers' too), without its state."""
    return {k: settings(v) if isinstance(v, optim.Optimizer) else v
            for k, v in vars(optimizer).items() if k not in ("_state", "_initialized")}


def steps(opt_state, model, grads) -> None:
    for g in grads:
        update(opt_state, model, {k: mx.array(v) for k, v in g.items()})


def problem(steps: int = 3):
    rng = np.random.default_rng(0)
    model = Dense(3, 2)
    grads = [{"weight": rng.normal(size=(2, 3)).astype(np.float32),
              "bias": rng.normal(size=(2,)).astype(np.float32)} for _ in range(steps)]
    return model, grads


def adjusted(tmp_path, rule=None, changes=BETAS, name="run.safetensors"):
    """A model and state of ``rule`` (``Adam()``) stepped once and adjusted by ``changes``,
    saved."""
    model, grads = problem(1)
    opt_state = setup(Adam() if rule is None else rule, model)
    steps(opt_state, model, grads)
    adjust(opt_state, **changes)
    path = tmp_path / name
    savemodel(path, model, opt_state)
    return path, model, opt_state


def unchanged(opt_state, model):
    """What a refused load must leave as it was: the rule, the optimiser's settings, the
    state's and the model's arrays."""
    return (repr(opt_state), opt_state.rule, settings(opt_state.optimizer),
            snapshot(opt_state.state), snapshot(model.parameters()))


def assert_unchanged(before, opt_state, model) -> None:
    after = unchanged(opt_state, model)
    assert after[:3] == before[:3]
    assert_same(after[3], before[3])
    assert_same(after[4], before[4])


class TestHyperparameters:
    @pytest.mark.parametrize(("rule", "changes"), RULES,
                             ids=[type(r).__name__ for r, _ in RULES])
    def test_every_hyperparameter_comes_back_and_training_goes_on_as_uninterrupted(
            self, tmp_path, rule, changes):
        path, model, opt_state = adjusted(tmp_path, rule, changes)
        assert opt_state.rule != rule  # (the adjustment changed it)
        resumed = Dense(3, 2)
        resumed_opt = setup(rule, resumed)  # set up with the hyperparameters of the start
        loadcheckpoint(path, resumed, resumed_opt)
        assert resumed_opt.rule == opt_state.rule
        assert repr(resumed_opt) == repr(opt_state)
        assert repr(resumed_opt.optimizer) == repr(opt_state.optimizer)
        assert settings(resumed_opt.optimizer) == settings(opt_state.optimizer)
        _, grads = problem(3)
        steps(opt_state, model, grads)  # the uninterrupted run
        steps(resumed_opt, resumed, grads)
        assert_same(snapshot(resumed.parameters()), snapshot(model.parameters()))
        assert_same(snapshot(resumed_opt.state), snapshot(opt_state.state))

    @pytest.mark.parametrize("autocast", [None, mx.float16])
    def test_resumed_after_adjust_matches_uninterrupted(self, tmp_path, autocast):
        model = make_model()
        opt_state = setup(OptimiserChain(ClipNorm(1.0), Adam(1e-2)), model)
        run(model, opt_state, 1, autocast)
        adjust(opt_state, 5e-2, betas=(0.5, 0.6), eps=1e-3, max_norm=0.5)
        run(model, opt_state, 1, autocast)
        path = tmp_path / "run.safetensors"
        savemodel(path, model, opt_state)
        run(model, opt_state, 2, autocast)

        resumed = make_model()
        resumed_opt = setup(OptimiserChain(ClipNorm(1.0), Adam(1e-2)), resumed)
        loadcheckpoint(path, resumed, resumed_opt)
        assert resumed_opt.rule == OptimiserChain(ClipNorm(0.5), Adam(5e-2, (0.5, 0.6), 1e-3))
        run(resumed, resumed_opt, 2, autocast)
        assert_same(snapshot(resumed.parameters()), snapshot(model.parameters()))
        assert_same(snapshot(resumed_opt.state), snapshot(opt_state.state))

    def test_the_file_records_the_live_rule(self, tmp_path):
        model = make_model()
        opt_state = setup(Adam(1e-3), model)
        opt_state.optimizer.learning_rate = 0.25  # as docs/training.md's loop does
        path = tmp_path / "run.safetensors"
        savemodel(path, model, opt_state)
        assert json.loads(mx.load(str(path), return_metadata=True)[1]["rule"]) == {
            "type": "Adam", "fields": {"lr": 0.25, "betas": [0.9, 0.999], "eps": 1e-8}}

    def test_the_repr_after_a_load_shows_the_loaded_values(self, tmp_path):
        path, _, _ = adjusted(tmp_path)
        opt_state = setup(Adam(1e-3), Dense(3, 2))
        loadcheckpoint(path, Dense(3, 2), opt_state)
        shown = "Adam(lr=0.05, betas=(0.5, 0.6), eps=0.001)"
        assert repr(opt_state) == f"OptState({shown}, loss_scale=NoOpLossScale())"
        assert repr(opt_state.optimizer) == shown
        assert opt_state.optimizer.betas == [0.5, 0.6] and opt_state.optimizer.eps == 1e-3

    def test_a_learning_rate_comes_back_as_given(self, tmp_path):
        path, _, _ = adjusted(tmp_path, changes={"lr": 0.1234567891})
        opt_state = setup(Adam(), Dense(3, 2))
        loadcheckpoint(path, Dense(3, 2), opt_state)
        assert opt_state.rule.lr == 0.1234567891  # not its float32 value, 0.12345679104328156

    def test_another_kind_of_rule_is_refused_changing_nothing(self, tmp_path):
        path, _, _ = adjusted(tmp_path)
        model, opt_state = Dense(3, 2), setup(Descent(0.3), Dense(3, 2))
        before = unchanged(opt_state, model)
        with pytest.raises(ValueError, match=r"^\[loadcheckpoint\] the optimiser state in "
                           r"'.*run.safetensors' was saved from Adam \(mlx Adam\), this opt_state "
                           r"is for Descent \(mlx SGD\); setup\(\) the same rule to resume$"):
            loadcheckpoint(path, model, opt_state)
        assert_unchanged(before, opt_state, model)

    @pytest.mark.parametrize(("saved", "given", "shown"), [
        (OptimiserChain(ClipNorm(1.0), Adam()), Adam(),
         r"OptimiserChain\(ClipNorm\(max_norm=1.0\), Adam\(lr=0.05, betas=\(0.5, 0.6\), "
         r"eps=0.001\)\); this opt_state follows another rule, Adam\(lr=0.001, "),
        (Adam(), AdamW(), r"Adam\(lr=0.05, .*\); this opt_state follows another rule, AdamW\("),
        (NAdam(), RAdam(), r"NAdam\(lr=0.05, .*\); this opt_state follows another rule, RAdam\("),
        (Adam(), optim.Adam(1e-3), r"Adam\(lr=0.05, .*\); this opt_state follows an mlx "
                                   r"optimizer, Adam, whose"),
    ])
    def test_a_related_rule_gets_the_state_alone_with_a_warning(self, tmp_path, saved, given,
                                                                shown):
        path, model, saved_state = adjusted(tmp_path, saved, BETAS)
        target = setup(given, Dense(3, 2))
        before = settings(target.optimizer)
        with pytest.warns(UserWarning, match=r"^\[loadcheckpoint\] the optimiser state in "
                          r"'.*run.safetensors' was saved from " + shown + r".*the state \(the "
                          r"learning rate with it\) is loaded, the other hyperparameters stay "
                          r"those it was set up with. To resume with the saved ones, setup\(\) "
                          r"the saved rule$"):
            loadcheckpoint(path, Dense(3, 2), target)
        assert_same(snapshot(target.state), snapshot(saved_state.state))
        assert settings(target.optimizer) == before
        assert target.optimizer.learning_rate.item() == pytest.approx(0.05)

    def test_files_without_the_rule_load_as_before(self, tmp_path):
        # as earlier versions wrote them: the state and its learning rate come back, the
        # other hyperparameters stay those given to setup
        path, _, saved = adjusted(tmp_path)
        arrays, metadata = mx.load(str(path), return_metadata=True)
        del metadata["rule"]
        mx.save_safetensors(str(path), arrays, metadata=metadata)
        opt_state = setup(Adam(1e-3), Dense(3, 2))
        loadcheckpoint(path, Dense(3, 2), opt_state)
        assert opt_state.rule == Adam(0.05)
        assert_same(snapshot(opt_state.state), snapshot(saved.state))

    def test_a_schedule_given_again_goes_on_and_a_number_replaces_one(self, tmp_path):
        schedule = optim.cosine_decay(1e-2, 100)
        path, model, saved = adjusted(tmp_path, Adam(schedule), {"betas": (0.5, 0.6)})
        resumed, opt_state = Dense(3, 2), setup(Adam(schedule), Dense(3, 2))
        loadcheckpoint(path, resumed, opt_state)
        assert opt_state.rule == Adam(schedule, (0.5, 0.6)) == saved.rule
        _, grads = problem(2)
        steps(saved, model, grads)
        steps(opt_state, resumed, grads)
        assert_same(snapshot(resumed.parameters()), snapshot(model.parameters()))
        # a number saved, a schedule given: the number replaces it, as adjust would, and says so
        path, _, _ = adjusted(tmp_path, Adam(), BETAS, "number.safetensors")
        opt_state = setup(Adam(schedule), Dense(3, 2))
        with pytest.warns(UserWarning, match=r"^\[loadcheckpoint\] the optimiser in "
                          r"'.*number.safetensors' was saved with lr=0.05 where this "
                          r"opt_state's rule has a schedule \(cosine_decay.<locals>.schedule\)"
                          r": the saved number replaces it, as the saved run used it. To go on "
                          r"with the schedule, adjust\(opt_state, lr=schedule\) after loading$"):
            loadcheckpoint(path, Dense(3, 2), opt_state)
        assert opt_state.rule == Adam(**BETAS) and opt_state.optimizer._schedulers == {}

    def test_a_schedule_saved_a_number_given_loads_the_state_alone_with_a_warning(self,
                                                                                  tmp_path):
        # (fine-tuning from the end of a scheduled run, or evaluating it: the examples' demo)
        path, _, _ = adjusted(tmp_path, Adam(optim.cosine_decay(1e-2, 100)), {"eps": 1e-3})
        model, opt_state = Dense(3, 2), setup(Adam(1e-3), Dense(3, 2))
        with pytest.warns(UserWarning, match=r"^\[loadcheckpoint\] the optimiser in "
                          r"'.*run.safetensors' was saved with a schedule for lr "
                          r"\(cosine_decay.<locals>.schedule\), a function, which a checkpoint "
                          r"cannot hold, and this opt_state's rule has lr=0.001 there "
                          r"\(Adam\(.*\)\): the state is loaded"):
            loadcheckpoint(path, model, opt_state)
        saved = mx.load(str(path))
        assert opt_state.optimizer.eps == 1e-8  # as set up: the state alone
        assert opt_state.state["optimizer"]["step"].item() == saved["opt.optimizer.step"].item()

    @pytest.mark.parametrize(("record", "said"), [
        ("{bad", "{bad"),
        ("[1]", "[1]"),
        (json.dumps({"fields": {}}), "a rule's record is an object with a 'type'"),
        (json.dumps({"type": "Adam", "fields": {"lr": 0.05}}),
         "Adam records the fields {'lr': 0.05}, its fields are lr, betas, eps"),
        (json.dumps({"type": "Adam", "fields": {"lr": "fast", "betas": [0.9, 0.99],
                                                "eps": 1e-8}}), "Adam records lr=fast, not a"),
        (json.dumps({"type": "Adam", "fields": {"lr": 0.05, "betas": [0.9, 1.5],
                                                "eps": 1e-8}}),
         r"Adam refuses the recorded values: \[Adam\] betas\[1\] must be a number in \[0, 1\)"),
        (json.dumps({"type": "Adam", "fields": {"lr": 0.05, "betas": [0.9, 0.99],
                                                "eps": -1.0}}), "Adam refuses"),
        (json.dumps({"type": "OptimiserChain", "parts": 3}), "OptimiserChain records no list"),
    ])
    def test_unreadable_records_are_refused_changing_nothing(self, tmp_path, record, said):
        path, _, _ = adjusted(tmp_path)
        arrays, metadata = mx.load(str(path), return_metadata=True)
        mx.save_safetensors(str(path), arrays, metadata={**metadata, "rule": record})
        model, opt_state = Dense(3, 2), setup(Adam(1e-3), Dense(3, 2))
        before = unchanged(opt_state, model)
        with pytest.raises(ValueError, match=r"^\[loadcheckpoint\] '.*run.safetensors' has an "
                           r"unreadable 'rule' metadata entry: .*" + said):
            loadcheckpoint(path, model, opt_state)
        assert_unchanged(before, opt_state, model)

    def test_a_load_without_the_optimiser_ignores_the_rule(self, tmp_path):
        path, model, _ = adjusted(tmp_path)
        assert_same(snapshot(loadcheckpoint(path, Dense(3, 2)).parameters()),
                    snapshot(model.parameters()))
