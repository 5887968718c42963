"""The language-model example, examples/charlm.py: a character transformer trained in float32,
bfloat16 and float16 from the same initial weights. Full-run figures are in the README; here a
small model for a few steps."""

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

_path = Path(__file__).parent.parent / "examples" / "charlm.py"
_spec = importlib.util.spec_from_file_location("charlm_example", _path)
charlm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = charlm  # its dataclass looks its module up
_spec.loader.exec_module(charlm)

SMALL = ["--width", "32", "--heads", "2", "--layers", "1", "--context", "16", "--batchsize", "8",
         "--steps", "40", "--eval-every", "10", "--val-batches", "2", "--sample-length", "20"]

NEEDS_MATPLOTLIB = "the plot needs matplotlib: pip install -e '.[examples]'"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """Each precision for 40 steps of a 1-block, width-32 model, writing the plot (where
    matplotlib is installed)."""
    path = tmp_path_factory.mktemp("charlm") / "curves.png"
    return charlm.main([*SMALL, "--plot", str(path)]), path


def test_data_and_vocabulary_round_trip():
    text = charlm.load_text()
    assert len(text) > 400_000  # pydoc_data.topics: Python's own help pages
    vocabulary = charlm.Vocabulary(text)
    sample = text[:1000]
    assert vocabulary.decode(vocabulary.encode(sample).tolist()) == sample
    x, y = charlm.windows(vocabulary.encode(sample), np.array([0, 5]), 8)
    assert x.shape == y.shape == (2, 8)
    assert mx.array_equal(x[:, 1:], y[:, :-1])  # the targets are the inputs shifted by one


def test_model_is_causal():
    mx.random.seed(0)
    model = charlm.CharTransformer(vocab=10, dims=16, nheads=2, nlayers=1, context=8)
    x = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    changed = mx.array([[1, 2, 3, 4, 5, 6, 7, 0]])  # only the last character differs
    a, b = model(x), model(changed)
    assert a.shape == (1, 8, 10)
    assert mx.allclose(a[:, :-1], b[:, :-1], atol=1e-6) and not mx.allclose(a[:, -1], b[:, -1])


def test_three_precisions_train_from_the_same_start(short_run):
    runs, path = short_run
    assert list(runs) == ["float32", "bfloat16", "float16"]
    for run in runs.values():
        assert run.steps == [10, 20, 30, 40]
        assert run.train_loss[-1] < run.train_loss[0] and run.val_loss[-1] < run.val_loss[0]
        assert run.tokens_per_second > 0 and run.peak_memory > 0
        assert run.sample.startswith("The ") and len(run.sample) == 4 + 20
    # same initial weights and batches: the curves start together
    first = [run.val_loss[0] for run in runs.values()]
    assert max(first) - min(first) < 0.05 * first[0]


def test_the_plot_is_written(short_run):
    pytest.importorskip("matplotlib", reason=NEEDS_MATPLOTLIB)
    _, path = short_run
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prints_speed_memory_and_samples(tmp_path, capsys):
    charlm.main([*SMALL, "--steps", "5", "--eval-every", "5", "--precisions", "bfloat16",
                 "--no-plot"])
    out = capsys.readouterr().out
    assert "tokens/s" in out and "peak memory" in out and "MiB" in out
    assert "--- sample, bfloat16 ---" in out and "wrote" not in out


def test_without_matplotlib_the_plot_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    path = tmp_path / "curves.png"
    charlm.main([*SMALL, "--steps", "2", "--eval-every", "2", "--precisions", "float32",
                 "--plot", str(path)])
    assert not path.exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--steps", "0"], ["--precisions", "float64"], ["--precisions", "float32,float32"],
     ["--width", "30", "--heads", "4"], ["--lr", "nan"], ["--temperature", "0"],
     ["--plot", "x.pdf"], ["--plot", "/no/such/folder/x.png"], ["--prompt", ""]],
)
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        charlm.main(argv)
    assert "error" in capsys.readouterr().err
