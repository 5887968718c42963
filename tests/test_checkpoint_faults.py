"""Checkpoints under faults: concurrent saves, killed saves, files changed after a load, and a
generated corpus of hostile files (issue 14)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from fluxlike import Adam, Chain, Dense, loadcheckpoint, savemodel, setup

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT, **kwargs)


def _arrays(tree) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(tree) if isinstance(v, mx.array)}


def test_threads_saving_to_one_path_each_leave_one_whole_model(tmp_path):
    # Two threads save different models to one path: every save succeeds, and the file always
    # holds exactly one of the two models (the temporary file was named from the pid alone).
    result = _run(f"""
        import threading
        import mlx.core as mx
        from fluxlike import Chain, Dense, loadcheckpoint, savemodel
        path = {str(tmp_path / "ckpt.safetensors")!r}
        models = [Chain(*[Dense(32, 32) for _ in range(6)]) for _ in range(2)]
        for i, m in enumerate(models):
            m.update({{"layers": [{{"weight": mx.full((32, 32), float(i)),
                                   "bias": mx.full((32,), float(i))}} for _ in range(6)]}})
        mx.eval([m.parameters() for m in models])
        errors, torn = [], 0
        barrier = threading.Barrier(2)
        def save(m):
            for _ in range(15):
                barrier.wait()
                try:
                    savemodel(path, m)
                except Exception as e:
                    errors.append(repr(e))
        for r in range(2):
            threads = [threading.Thread(target=save, args=(m,)) for m in models]
            [t.start() for t in threads]; [t.join() for t in threads]
            values = {{float(layer.weight[0, 0].item()) for layer in
                      loadcheckpoint(path, Chain(*[Dense(32, 32) for _ in range(6)])).layers}}
            torn += len(values) != 1
        print("ERRORS", len(errors), errors[:2])
        print("TORN", torn)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ERRORS 0 []" in result.stdout, result.stdout
    assert "TORN 0" in result.stdout, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def test_a_killed_save_leaves_a_whole_file_and_its_temporary_is_cleaned_at_the_next(tmp_path):
    path = tmp_path / "big.safetensors"
    code = f"""
        import sys
        import mlx.core as mx
        from fluxlike import Dense, savemodel
        model = Dense(2048, 2048)  # 16 MiB
        mx.eval(model.parameters())
        savemodel({str(path)!r}, model)
        print("saved", flush=True)
        while True:
            model.weight = model.weight + 1
            savemodel({str(path)!r}, model)
    """
    leftovers = []
    for _ in range(5):  # the kill may land between saves: try again until one is torn off
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "saved"
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp.safetensors")]
                if leftovers:
                    break
                time.sleep(0.001)
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=10)
        leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp.safetensors")]
        loadcheckpoint(path, Dense(2048, 2048))  # the old or the new file: whole either way
        if leftovers:
            break
    assert leftovers, "no save was interrupted in 5 tries"
    savemodel(path, Dense(2048, 2048))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


def test_stale_temporaries_of_dead_processes_are_removed_live_ones_kept(tmp_path):
    path = tmp_path / "m.safetensors"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=30)
    dead_pid = int(dead.stdout)
    stale = [tmp_path / f".m.safetensors.{dead_pid}.tmp.safetensors",  # as older versions named
             tmp_path / f".m.safetensors.{dead_pid}.7.0123abcd.tmp.safetensors"]
    live = tmp_path / f".m.safetensors.{os.getppid()}.1.beef.tmp.safetensors"  # a running writer
    other = tmp_path / f".other.safetensors.{dead_pid}.tmp.safetensors"  # another checkpoint's
    for p in (*stale, live, other):
        p.write_bytes(b"x" * 10)
    savemodel(path, Dense(2, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["m.safetensors", live.name, other.name])


def test_a_loaded_model_owns_its_data(tmp_path):
    path = tmp_path / "m.safetensors"
    source = Chain(Dense(8, 8), Dense(8, 2))
    savemodel(path, source)
    target = loadcheckpoint(path, Chain(Dense(8, 8), Dense(8, 2)))
    # rewrite in place (as cp or rsync --inplace do), keeping the header: new bytes, same layout
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = bytes(len(data) - header)
    with open(path, "r+b") as f:
        f.write(data)
    expected = _arrays(source.parameters())
    got = _arrays(target.parameters())
    for k in expected:
        np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
    with open(path, "r+b") as f:  # and truncated: the model still works
        f.truncate(10)
    mx.eval(target(mx.ones((1, 8))))


def test_savemodel_onto_a_directory(tmp_path):
    target = tmp_path / "run.safetensors"
    target.mkdir()
    with pytest.raises(IsADirectoryError, match=r"\[savemodel\] '.*run.safetensors' is a "
                       r"directory: give the path of a file inside it"):
        savemodel(target, Dense(2, 2))
    assert list(target.iterdir()) == []


def test_a_float64_checkpoint_loads(tmp_path):
    # written as PyTorch's or the safetensors package's writers do; MLX's reader refuses F64
    import json
    import struct
    weight = np.arange(6, dtype=np.float64).reshape(3, 2) / 7
    bias = np.array([1.5, -2.0, 0.25])
    header = {"__metadata__": {"format": "fluxlike", "plain": "{}"},
              "model.weight": {"dtype": "F64", "shape": [3, 2], "data_offsets": [0, 48]},
              "model.bias": {"dtype": "F64", "shape": [3], "data_offsets": [48, 72]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "f64.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + weight.tobytes() + bias.tobytes())
    model = loadcheckpoint(path, Dense(2, 3))
    assert model.weight.dtype == mx.float32
    np.testing.assert_array_equal(np.array(model.weight), weight.astype(np.float32))
    np.testing.assert_array_equal(np.array(model.bias), bias.astype(np.float32))
    opt_state = setup(Adam(), model)
    savemodel(tmp_path / "again.safetensors", model, opt_state)
    loadcheckpoint(tmp_path / "again.safetensors", Dense(2, 3), setup(Adam(), Dense(2, 3)))
