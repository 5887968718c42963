"""The LoRA fine-tuning example, examples/finetune_lm.py: mlx-lm's Llama with mlx-lm's LoRA
adapters, trained by fluxlike's ``train`` in float32, bfloat16 and float16 from the same start.
Here a tiny model for a few steps."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="the example fine-tunes mlx-lm's Llama: "
                    "pip install -e '.[examples]'")

_path = Path(__file__).parent.parent / "examples" / "finetune_lm.py"
_spec = importlib.util.spec_from_file_location("finetune_lm_example", _path)
finetune = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = finetune  # its dataclass looks its module up
_spec.loader.exec_module(finetune)

SMALL = ["--dims", "32", "--heads", "2", "--layers", "2", "--lora-layers", "1", "--rank", "4",
         "--context", "16", "--batchsize", "8", "--steps", "30", "--eval-every", "10",
         "--val-batches", "2", "--sample-length", "12"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("finetune") / "curves.png"
    return finetune.main([*SMALL, "--plot", str(path)]), path


def test_only_the_adapters_train():
    args = finetune.parse_args(SMALL)
    model = finetune.make_model(args)
    from mlx.utils import tree_flatten

    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert trainable and all(".lora_" in k for k in trainable)
    assert all(k.startswith("model.layers.1.") for k in trainable)  # the last block only


def test_three_precisions_fine_tune_from_the_same_start(short_run):
    runs, _ = short_run
    assert list(runs) == ["float32", "bfloat16", "float16"]
    for run in runs.values():
        assert run.steps == [10, 20, 30]
        assert run.train_loss[-1] < run.train_loss[0]
        assert run.tokens_per_second > 0 and run.peak_memory > 0
        assert run.sample.startswith("The ")
    first = [run.val_loss[0] for run in runs.values()]
    assert max(first) - min(first) < 0.05 * first[0]  # same weights, adapters and batches
    last = [run.train_loss[-1] for run in runs.values()]
    assert max(last) - min(last) < 0.05 * last[0]  # the half curves follow float32's


def test_the_plot_is_written(short_run):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    _, path = short_run
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_plot_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    path = tmp_path / "curves.png"
    finetune.main([*SMALL, "--steps", "2", "--eval-every", "2", "--precisions", "bfloat16",
                   "--plot", str(path)])
    assert not path.exists()
    out = capsys.readouterr().out
    assert "matplotlib is not installed" in out and "tokens/s" in out and "MiB" in out


@pytest.mark.parametrize(
    "argv",
    [["--steps", "0"], ["--precisions", "float64"], ["--precisions", "float32,float32"],
     ["--dims", "30", "--heads", "4"], ["--lr", "nan"], ["--lora-layers", "3"],
     ["--plot", "x.pdf"], ["--plot", "/no/such/folder/x.png"], ["--prompt", ""]],
)
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        finetune.main(argv)
    assert "error" in capsys.readouterr().err
