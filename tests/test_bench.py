"""Smoke test of the benchmark runner (bench/run.py): it runs and prints its tables, with
PyTorch (when installed) in a process of its own (bench/torch_worker.py).

No timing is asserted: only that the command exits 0 and prints the headers and columns, and
that the worker answers, computes the model and ends at the end of its input.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from native_helpers import needs_native

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "run.py"
HAVE_TORCH = importlib.util.find_spec("torch") is not None


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
    headers = [line for line in out.splitlines() if line.startswith("model ")]
    assert len(headers) == 3
    for column in ("fl f32", "fl autocast", "fl bf16mix", "mlx hand", "mlx.nn"):
        assert column in headers[0]
    # The run says whether it imported torch itself (it must not: PyTorch has its own process).
    assert "(torch imported in this process: no" in out
    processor = next(line for line in out.splitlines() if line.startswith("processor: "))
    assert "avx512_bf16" in processor and "amx_bf16" in processor  # it has it, or says "no"
    if HAVE_TORCH:
        for table in headers[:2]:  # inference and training; memory is MLX only
            assert "torch f32" in table and "torch bf16" in table and "torch f32 ms" in table
        assert "torch f32" not in headers[2]
        assert "in a process of its own" in out and "no MLX, no fluxlike loaded there" in out
        assert "the PyTorch process (pid " in out and "exited with 0)" in out
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
    assert "(torch imported in this process: no)" in done.stdout


@pytest.fixture
def worker(monkeypatch):
    if not HAVE_TORCH:
        pytest.skip("torch is not installed")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import torch_worker

    started = torch_worker.TorchWorker(threads=1)
    yield started
    started.close()


def test_torch_worker_computes_the_model_and_ends_at_end_of_input(worker):
    import specs

    assert worker.threads == 1 and worker.loaded == []  # neither MLX nor fluxlike there
    remotes = worker.build("inference", "seed")
    assert list(remotes) == ["torch f32", "torch bf16"]
    # An independent numpy forward pass of the same weights.
    spec = specs.SPECS["seed"]
    x = specs.data(spec)[0]
    for k, (w, b) in enumerate(specs.weights(spec)):
        x = x @ w.T + b
        x = np.maximum(x, 0) if k < len(spec.layers) - 1 else x
    out = remotes["torch f32"].output()
    assert out.shape == (128, 10) and out.dtype == np.float32
    np.testing.assert_allclose(out, x, rtol=1e-4, atol=1e-5)
    assert remotes["torch bf16"].warm_up(1, 1.0) > 0
    assert remotes["torch bf16"].sample(2) > 0
    steps = worker.build("training", "seed")
    assert steps["torch f32"].sample(1) > 0
    with pytest.raises(RuntimeError, match="KeyError"):
        worker.ask("sample", variant="torch f64", calls=1)
    assert worker.cpu_seconds() > 0
    assert worker.close() == 0  # end of input: the worker returns from its loop


def test_unknown_model_is_refused():
    done = bench("--models", "seed,huge")
    assert done.returncode == 2
    assert "unknown model 'huge'" in done.stderr



@pytest.mark.skipif(shutil.which("g++") is None, reason="MLX builds its CPU kernels with g++")
def test_jit_rebuild_reports_each_kernel_and_variant():
    """bench/jit.py: MLX's fused kernels for the seed step, rebuilt with more flags, timed in
    alternating processes; only the report's shape is checked, no timing."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "jit.py"), "--pairs", "1", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    kernels = [line.split() for line in lines if line.startswith("  ") and " -> " in line]
    assert kernels and all(k[0] in ("scalar", "vector") and k[2] in ("scalar", "vector")
                           for k in kernels)
    assert any("Sqrt" in k for k in kernels)  # Adam's update, the kernel this is about
    rows = {line.split(" | ")[0]: line.split(" | ") for line in lines if " | " in line}
    for variant in ("f32", "f32 compiled", "autocast"):
        cells = rows[variant]
        assert len(cells) == 4 and float(cells[1]) > 0 and float(cells[2]) > 0


def test_an_autocast_call_runs_little_python():
    """bench/calls.py's count (deterministic, not a timing): the warm autocast call of
    Chain(Dense, LayerNorm, Dense), the `with` included, makes at most 50 Python calls in
    fluxlike and mlx with at most 20 switches between files; the plain call at most 24 and 8."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "calls.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # this checkout's fluxlike
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split(" | ")[0]: [int(v) for v in line.split(" | ")[1:]]
            for line in done.stdout.splitlines() if line.startswith(("autocast |", "plain |"))}
    assert rows["autocast"][0] <= 50 and rows["autocast"][1] <= 20, rows
    assert rows["plain"][0] <= 24 and rows["plain"][1] <= 8, rows
    assert "fluxlike/precision/kernels.py: linear" in done.stdout  # and the call path is printed


def test_adam_bench_reports_every_variant():
    """bench/adam.py on the seed MLP's parameters, one round: every MLX variant has a time
    and a ratio to fluxlike's update (PyTorch is left out where this Python has no torch);
    only the report's shape is checked, no timing."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "adam.py"), "--models", "seed", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("fl update", "fl -native", "mlx eager", "fl bf16", "fl bf16 -native",
                 "fl rmsprop", "fl rmsprop -native"):
        assert re.search(rf"^  {re.escape(name)} +[0-9.]+ ms +[0-9.]+x$", done.stdout, re.M), name
    assert re.search(r"^  fl update +[0-9.]+ ms +1\.00x$", done.stdout, re.M)
    assert "seed: 134154 parameters" in done.stdout
    from fluxlike import native

    takes = "the native kernel" if native.adam_kernel() is not None else "MLX's update"
    assert f"fl update takes {takes}" in done.stdout


def test_the_processor_line_names_the_isa_flags(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("machine", ROOT / "bench" / "machine.py")
    machine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(machine)
    amd = tmp_path / "amd"
    amd.write_text("model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    intel = tmp_path / "intel"
    intel.write_text("model name\t: Intel Xeon\nflags\t\t: avx512_bf16 avx512_fp16 amx_bf16\n")
    old = tmp_path / "old"
    old.write_text("model name\t: Old\nflags\t\t: avx2\n")
    assert machine.processor(str(amd)).endswith(": avx512_bf16; no amx_bf16, avx512_fp16")
    assert machine.processor(str(intel)).endswith(": amx_bf16, avx512_bf16, avx512_fp16")
    assert machine.processor(str(old)).endswith(": none of amx_bf16/avx512_bf16/avx512_fp16")
    assert machine.processor(str(tmp_path / "absent"))  # the platform's name instead


def test_step_bench_prints_every_row():
    """bench/step.py (train/trainstep against the plain MLX loop), a few steps: every row of
    its table has a time and a ratio; no timing is asserted."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step.py"), "--steps", "5", "--passes", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^.{31} (\S+(?: \S+)*) +[0-9.]+ +[0-9.]+ +<=[0-9.]+ (ok|OVER)$",
                      done.stdout, re.M)
    assert len(rows) == 10, done.stdout
    assert "# per-step overhead:" in done.stdout


def test_halves_bench_prints_a_row_per_model():
    """bench/halves.py (bfloat16 and float16 steps against float32), one model, one round:
    its row has the float32 time and both ratios, and the processor is named."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "halves.py"), "--models", "seed", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^\| seed \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ / [0-9.]+ / "
                     r"[0-9.]+ \|$", done.stdout, re.M), done.stdout
    assert " cores: " in done.stdout


def test_upstream_models_benchmark_quick_run():
    """bench/upstream.py (real upstream models, float32 against autocast) at its smoke size:
    one row per model, every column filled."""
    models = "bert,llama" if importlib.util.find_spec("mlx_lm") is not None else "bert"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "upstream.py"), "--quick", "--models", models],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "processor:" in done.stdout
    rows = [line for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| model")]
    assert [row.split("|")[1].strip() for row in rows] == models.split(",")
    assert all(len(row.split("|")) == 11 and "x" in row for row in rows)


def test_losses_bench_quick_run():
    """bench/losses.py (the cross entropy and the head's product) at its smoke size: both
    tables, every variant with a time, a ratio and a peak, and the processor named."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "losses.py"), "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^\| ([^|]+) \| [0-9.]+ \| [0-9.]+ \| [0-9]+ \|$", done.stdout, re.M)
    assert [r.strip() for r in rows] == [
        "MLX's cross_entropy", "cross_entropy, fluxlike in use", "fluxlike logitcrossentropy",
        "head float32", "head autocast(bfloat16)"], done.stdout
    assert "MLX " in done.stdout.splitlines()[0]


@needs_native
def test_matmul_bench_quick_run():
    """bench/matmul.py (a product in MLX's graph against the same primitive standalone) at its
    smoke size: a row per dtype the CPU runs natively, each with oneDNN's kernel named, four
    times and a ratio, and the processor named."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "matmul.py"), "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^\| 8 x 16 x 16 \| (\w+) \| [^|]+ \| [0-9]+ \| [0-9]+ \| [0-9]+ "
                      r"\| [0-9.]+ \| (?:[0-9]+ \| [0-9.]+|- \| -) \| [0-9]+ \|$", done.stdout,
                      re.M)
    from fluxlike_native import _ext
    assert rows == (["bfloat16"] if _ext.isa_has_bf16() else []) + ["float32"], done.stdout
    assert "MLX " in done.stdout.splitlines()[0] and "oneDNN " in done.stdout.splitlines()[0]


@needs_native
def test_matmul_bench_rows_run():
    """bench/matmul.py --rows: a bfloat16 layer at each row count asked for, steady and first
    calls, per shape against auto (where the CPU has native bfloat16), the processor named."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "matmul.py"), "--rows", "16x24",
         "--row-counts", "1,9", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) x 16 x 24 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9]+ "
                      r"\| [0-9]+ \|$", done.stdout, re.M)
    from fluxlike_native import _ext
    assert rows == (["1", "9"] if _ext.isa_has_bf16() else []), done.stdout
    assert "any_rows_kernel" in done.stdout.splitlines()[0], done.stdout
