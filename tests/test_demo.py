"""The demo, examples/digits.py, trains a real model on real data (scikit-learn's digits)."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

import fluxlike as fl

pytest.importorskip(
    "sklearn", reason="the digits demo needs scikit-learn: pip install -e '.[examples]'"
)

_path = Path(__file__).parent.parent / "examples" / "digits.py"
_spec = importlib.util.spec_from_file_location("digits_demo", _path)
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)

NEEDS_MATPLOTLIB = "the plot needs matplotlib: pip install -e '.[examples]'"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The demo with its default settings (10 epochs, float32), saving a checkpoint."""
    path = tmp_path_factory.mktemp("digits") / "digits.safetensors"
    accuracy = digits.main(["--save", str(path)])
    return accuracy, path


def test_data_split_is_fixed_and_disjoint():
    (x_train, y_train), (x_test, y_test) = digits.load_data()
    assert x_train.shape == (1437, 8, 8, 1) and x_test.shape == (360, 8, 8, 1)
    assert x_train.dtype == mx.float32 and 0 <= x_train.min().item() < x_train.max().item() <= 1
    assert sorted(set(y_test.tolist())) == list(range(10))
    (again, _), _ = digits.load_data()
    assert mx.array_equal(again, x_train)
    # together the two parts are exactly the 1797 images: a partition, no image twice
    from sklearn.datasets import load_digits

    every = sorted(map(tuple, (load_digits().images.reshape(-1, 64) / 16.0).tolist()))
    parts = mx.concatenate([x_train, x_test]).reshape(-1, 64).tolist()
    assert sorted(map(tuple, parts)) == every


def test_default_run_reaches_97_percent(default_run, capsys):
    accuracy, _ = default_run
    assert accuracy >= 0.97


def test_short_run_reaches_95_percent(capsys):
    accuracy = digits.main(["--epochs", "3", "--seed", "1"])
    out = capsys.readouterr().out
    assert accuracy >= 0.95
    assert out.count("epoch ") == 3 and f"final test accuracy: {100 * accuracy:.2f}%" in out


def test_checkpoint_restores_the_trained_model(default_run):
    accuracy, path = default_run
    model = digits.build_model()
    (_, _), (x_test, y_test) = digits.load_data()
    assert digits.accuracy(model, x_test, y_test, None) < 0.5  # untrained
    opt_state = fl.setup(fl.Adam(1e-3), model)  # (the run's rule had a cosine schedule)
    with pytest.warns(UserWarning, match="saved with a schedule for lr"):
        fl.loadcheckpoint(path, model, opt_state)
    assert digits.accuracy(model, x_test, y_test, None) == accuracy
    assert opt_state.state["optimizer"]["step"].item() == 10 * 45  # 45 batches per epoch


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_autocast_run_within_one_point_of_float32(default_run, precision, capsys):
    """The demo under autocast reaches within one percentage point of its
    float32 accuracy (same seed, same data order)."""
    float32_accuracy, _ = default_run
    accuracy = digits.main(["--precision", precision])
    assert abs(accuracy - float32_accuracy) <= 0.01
    assert f"test images, {precision}" in capsys.readouterr().out


def test_half_precision_run(capsys):
    accuracy = digits.main(["--epochs", "3", "--seed", "1", "--precision", "bfloat16"])
    assert accuracy >= 0.95


@pytest.mark.parametrize(
    "argv", [["--epochs", "0"], ["--batchsize", "0"], ["--precision", "float64"],
             ["--save", "model.npz"], ["--save", "/no/such/folder/x.safetensors"],
             ["--lr", "-1"], ["--lr", "nan"]]
)
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        digits.main(argv)
    assert "error" in capsys.readouterr().err


def test_plot_writes_the_loss_curves(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason=NEEDS_MATPLOTLIB)
    path = tmp_path / "digits.png"
    digits.main(["--epochs", "2", "--seed", "1", "--plot", str(path)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote the loss curves to {path}" in capsys.readouterr().out


def test_plot_without_matplotlib_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import fails
    path = tmp_path / "digits.png"
    digits.main(["--epochs", "1", "--plot", str(path)])
    assert not path.exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--plot", "curves.pdf"], ["--plot", "/no/such/folder/x.png"]])
def test_bad_plot_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        digits.main(argv)
    assert "--plot" in capsys.readouterr().err
