"""Smoke test of the benchmark runner (bench/run.py): it runs and prints its tables.

No timing is asserted: only that the command exits 0 and prints the headers and columns.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "run.py"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RUN), *args], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )


def test_quick_run_on_the_seed_model_prints_every_table():
    done = bench("--quick", "--models", "seed")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for heading in ("# fluxlike CPU benchmark", "## Inference (per forward pass)",
                    "## Training step (forward + backward + Adam)",
                    "## Peak memory of a training step", "## Acceptance targets"):
        assert heading in out
    header = next(line for line in out.splitlines() if line.startswith("model "))
    for column in ("fl f32", "fl autocast", "fl bf16mix", "mlx hand", "mlx.nn"):
        assert column in header
    assert "BLAS-like libraries mapped" in out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("seed ")]
    assert rows == ["seed"] * 3  # one row in each of the three tables
    assert not any(line.startswith(("large ", "cnn ", "act ")) for line in out.splitlines())
    import mlx.core as mx

    assert f"mlx {mx.__version__}" in out


def test_without_torch_ratios_are_to_fluxlike_float32():
    done = bench("--quick", "--models", "seed", "--only", "inference", "--no-torch")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PyTorch columns skipped" in done.stdout
    assert "ratios to fl f32" in done.stdout
    assert "torch f32" not in done.stdout
    assert "## Training step" not in done.stdout


def test_unknown_model_is_refused():
    done = bench("--models", "seed,huge")
    assert done.returncode == 2
    assert "unknown model 'huge'" in done.stderr

