"""Checkpoints under faults: concurrent saves, killed saves, files changed after a load, and a
generated corpus of hostile files."""

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
    from fluxlike.checkpoint import _HOST
    stale = [tmp_path / f".m.safetensors.{dead_pid}.tmp.safetensors",  # as older versions named
             tmp_path / f".m.safetensors.{_HOST}.{dead_pid}.7.0123abcd.tmp.safetensors",
             tmp_path / f".m.safetensors.far.away.{dead_pid}.7.0123abcd.tmp.safetensors"]
    live = tmp_path / f".m.safetensors.{_HOST}.{os.getppid()}.1.beef.tmp.safetensors"
    remote = tmp_path / f".m.safetensors.far.away.{dead_pid}.8.0123abcd.tmp.safetensors"
    other = tmp_path / f".other.safetensors.{dead_pid}.tmp.safetensors"  # another checkpoint's
    for p in (*stale, live, remote, other):
        p.write_bytes(b"x" * 10)
    day_old = time.time() - 25 * 3600  # another machine's, abandoned a day ago
    os.utime(stale[2], (day_old, day_old))
    savemodel(path, Dense(2, 2))
    # kept: a live writer's, another machine's recent one (its pid means nothing here)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["m.safetensors", live.name, remote.name, other.name])


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
    with pytest.raises(IsADirectoryError, match=r"\[loadcheckpoint\] '.*run.safetensors' is a "
                       r"directory: give the path of a checkpoint file inside it"):
        loadcheckpoint(target, Dense(2, 2))


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


# ---------------------------------------------------------------- a corpus of hostile files

import json  # noqa: E402
import struct  # noqa: E402

from fluxlike import DynamicLossScale, NoOpLossScale  # noqa: E402


def _parse(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _pack(header: dict | bytes, body: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _retyped(header: dict, body: bytes, name: str, dtype: str, values: np.ndarray) -> bytes:
    """The file with entry ``name`` replaced by ``values`` stored as ``dtype``, appended."""
    header = json.loads(json.dumps(header))
    raw = values.tobytes()
    header[name] = {"dtype": dtype, "shape": list(values.shape),
                    "data_offsets": [len(body), len(body) + len(raw)]}
    return _pack(header, body + raw)


def _corpus(valid: bytes) -> dict[str, tuple[bytes, str]]:
    """name: (file content, what the refusal must say)."""
    header, body = _parse(valid)
    meta = header["__metadata__"]
    plain = json.loads(meta["plain"])
    bomb = "[" * 100_000 + "]" * 100_000

    def with_meta(**changes) -> bytes:
        return _pack({**header, "__metadata__": {**meta, **changes}}, body)

    def with_plain(**changes) -> bytes:
        return with_meta(plain=json.dumps({**plain, **changes}))

    def with_entry(name: str, **changes) -> bytes:
        return _pack({**header, name: {**header[name], **changes}}, body)

    def with_rule(drop: str | None = None, **fields) -> bytes:
        rule = json.loads(meta["rule"])
        rule["fields"].update(fields)
        rule["fields"].pop(drop, None)
        return with_meta(rule=json.dumps(rule))

    nested = '{"type": "AccumGrad", "fields": {"n": 2, "rule": ' * 400 + "1" + "}}" * 400

    def scalar(name: str, dtype: str, value) -> bytes:
        np_dtype = {"F32": np.float32, "I32": np.int32, "U64": np.uint64}[dtype]
        return _retyped(header, body, name, dtype, np.array(value, dtype=np_dtype))

    corpus = {
        "empty": (b"", "too few for a safetensors header"),
        "four bytes": (valid[:4], "too few for a safetensors header"),
        "length only": (valid[:8], "its header claims"),
        "mid header": (valid[:40], "its header claims"),
        "mid data": (valid[: len(valid) - len(body) // 2], "a truncated file"),
        "last byte gone": (valid[:-1], "a truncated file"),
        "huge header length": (struct.pack("<Q", 2**62) + valid[8:], "its header claims"),
        "garbage header": (_pack(b"{not json" + b" " * 20, body), "its header is not valid JSON"),
        "binary header": (_pack(b"\xff\xfe" * 10, body), "its header is not valid JSON"),
        "header a list": (_pack(b"[1, 2]", body), "its header is a JSON list"),
        "header bomb": (_pack(bomb.encode(), body), "its header is not valid JSON"),
        "metadata a list": (_pack({**header, "__metadata__": [1]}, body), "'__metadata__'"),
        "metadata numbers": (_pack({**header, "__metadata__": {"format": 3}}, body),
                             "'__metadata__'"),
        "plain not json": (with_meta(plain="{oops"), "unreadable 'plain' metadata"),
        "plain bomb": (with_meta(plain=bomb), "unreadable 'plain' metadata"),
        "plain a list": (with_meta(plain="[1]"), "'plain' metadata entry that is a JSON list"),
        "plain holds a dict": (with_plain(**{"opt.x": {"a": 1}}), "a non-plain value"),
        "optimizer kind garbage": (with_meta(optimizer="{bad"), "unreadable 'optimizer'"),
        "optimizer kind bomb": (with_meta(optimizer=bomb), "unreadable 'optimizer'"),
        "optimizer kind a list": (with_meta(optimizer="[1]"), "unreadable 'optimizer'"),
        "rule garbage": (with_meta(rule="{bad"), "unreadable 'rule'"),
        "rule bomb": (with_meta(rule=bomb), "unreadable 'rule'"),
        "rule a list": (with_meta(rule="[1]"), "unreadable 'rule'"),
        "rule without fields": (with_meta(rule=json.dumps({"type": "Adam"})),
                                "unreadable 'rule' metadata entry: Adam records no object"),
        "rule of nested records": (with_meta(rule=nested), "unreadable 'rule'"),
        "rule a field short": (with_rule(betas=None, drop="eps"), "its fields are lr, betas, eps"),
        "rule betas refused": (with_rule(betas=[0.9, 2.0]), "Adam refuses the recorded values"),
        "rule eps nan": (with_rule(eps=float("nan")), "Adam refuses the recorded values"),
        "rule lr a list": (with_rule(lr=[0.1]), "Adam records lr=[0.1], not a number"),
        "rule eps an object": (with_rule(eps={"a": 1}), "a rule's record is an object with a "
                                                          "'type', got {'a': 1}"),
        "unknown dtype": (with_entry("model.weight", dtype="F8"), "header entry of "
                                                                   "'model.weight' is malformed"),
        "shape of strings": (with_entry("model.weight", shape=["2", "3"]), "is malformed"),
        "negative shape": (with_entry("model.weight", shape=[-2, -3]), "is malformed"),
        "offsets reversed": (with_entry("model.weight", data_offsets=[8, 0]), "is malformed"),
        "offsets past the end": (with_entry("model.weight", data_offsets=[10**9, 10**9 + 24]),
                                 "a truncated file"),
        "size disagrees": (with_entry("model.weight", shape=[4, 4]), "should have 64 bytes"),
        "no offsets": (_pack({**header, "model.weight": {"dtype": "F32", "shape": [2, 3]}},
                             body), "is malformed"),
        "entry not an object": (_pack({**header, "model.weight": 5}, body), "is malformed"),
        "weight as integers": (_retyped(header, body, "model.weight", "I32",
                                        np.zeros((2, 3), np.int32)), "dtype mismatch at "
                                                                     "'model.weight'"),
        "weight wrong shape": (_retyped(header, body, "model.weight", "F32",
                                        np.zeros((3, 2), np.float32)), "shape mismatch"),
        "stray entry": (_retyped(header, body, "junk", "F32", np.zeros(1, np.float32)),
                        "unexpected entry 'junk'"),
        "missing weight": (_pack({k: v for k, v in header.items() if k != "model.weight"},
                                 body), "missing 'model.weight'"),
        "step as float": (scalar("opt.optimizer.step", "F32", 3.0), "'optimizer.step' must be "
                                                                    "a uint64 array"),
        "huge step": (scalar("opt.optimizer.step", "U64", 2**63), "step count past any real"),
        "nan learning rate": (scalar("opt.optimizer.learning_rate", "F32", np.nan),
                              "'optimizer.learning_rate' holds inf or nan"),
        "negative learning rate": (scalar("opt.optimizer.learning_rate", "F32", -0.1),
                                   "'optimizer.learning_rate' is negative"),
        "nan moment": (_retyped(header, body, "opt.optimizer.weight.v", "F32",
                                np.full((2, 3), np.nan, np.float32)), "holds inf or nan"),
        "inf moment": (_retyped(header, body, "opt.optimizer.weight.m", "F32",
                                np.full((2, 3), np.inf, np.float32)), "holds inf or nan"),
        "moment wrong shape": (_retyped(header, body, "opt.optimizer.weight.m", "F32",
                                        np.zeros(6, np.float32)), "'optimizer.weight.m' must "
                                                                  "be a float32 array of shape"),
        "missing moment": (_pack({k: v for k, v in header.items()
                                  if k != "opt.optimizer.weight.m"}, body), "missing entry"),
        "moment in metadata": (_pack({k: v for k, v in header.items()
                                      if k != "opt.optimizer.weight.m"}, body)
                               if False else with_plain(**{"opt.optimizer.weight.m": 1.0}),
                               "'optimizer.weight.m' must be a float32 array"),
        "counter a float": (scalar("opt.loss_scale.counter", "F32", 2.5),
                            "'counter' must be an integer array"),
    }
    for value, said in [(np.nan, "got nan"), (np.inf, "got inf"), (0.0, "got 0.0"),
                        (-4.0, "got -4.0"), (0.5, "at least min_scale=1.0")]:
        corpus[f"loss scale {value}"] = (scalar("opt.loss_scale.loss_scale", "F32", value),
                                         f"'loss_scale' must be finite {'.*' if said else ''}")
        corpus[f"loss scale {value}"] = (corpus[f"loss scale {value}"][0], said)
    corpus["counter negative"] = (scalar("opt.loss_scale.counter", "I32", -1),
                                  "'counter' must be in [0, growth_interval=2000)")
    corpus["counter too big"] = (scalar("opt.loss_scale.counter", "I32", 10**6),
                                 "'counter' must be in [0, growth_interval=2000)")
    corpus["huge min_scale"] = (scalar("opt.loss_scale.min_scale", "F32", 1e30),
                                "at least min_scale=1e+30")
    corpus["nan growth factor"] = (scalar("opt.loss_scale.growth_factor", "F32", np.nan),
                                   "growth_factor must be a positive number, got nan")
    corpus["zero interval"] = (scalar("opt.loss_scale.growth_interval", "I32", 0),
                               "growth_interval must be a positive integer")
    corpus["a 0.1.0 entry"] = (scalar("opt.loss_scale.period", "I32", 3),
                               "unexpected state entry 'period'")
    return corpus


def _valid_checkpoint(tmp_path) -> tuple[bytes, Dense]:
    model = Dense(3, 2)
    opt_state = setup(Adam(0.01), model, loss_scale=DynamicLossScale())
    (g,) = __import__("fluxlike").gradient(lambda m: m(mx.ones((1, 3))).sum(), model)
    from fluxlike import update
    update(opt_state, model, {k: v * 32768.0 for k, v in g.items()})
    path = tmp_path / "valid.safetensors"
    savemodel(path, model, opt_state)
    return path.read_bytes(), model


def test_hostile_checkpoints_are_refused_clearly_changing_nothing(tmp_path):
    valid, _ = _valid_checkpoint(tmp_path)
    corpus = _corpus(valid)
    assert len(corpus) >= 50
    mx.random.seed(1)
    model = Dense(3, 2)
    opt_state = setup(Adam(0.01), model, loss_scale=DynamicLossScale(init_scale=64.0))
    bare = setup(Adam(0.01), Dense(3, 2))  # no loss scale yet: one must not appear
    mx.eval(model.parameters(), opt_state.state, bare.state)
    before = (_arrays(model.parameters()), _arrays(opt_state.state), _arrays(bare.state))
    failures = []
    for i, (name, (content, said)) in enumerate(corpus.items()):
        path = tmp_path / f"hostile{i}.safetensors"
        path.write_bytes(content)
        for target in (opt_state, bare):
            try:
                loadcheckpoint(path, model, target)
            except ValueError as e:
                message = str(e)
                if str(path) not in message or said not in message:
                    failures.append(f"{name}: {message[:300]}")
            except Exception as e:  # noqa: BLE001 - anything else is what this test is for
                failures.append(f"{name}: raw {type(e).__name__}: {str(e)[:300]}")
            else:
                failures.append(f"{name}: loaded")
        assert isinstance(bare.loss_scale, NoOpLossScale), name
    assert not failures, "\n".join(failures)
    after = (_arrays(model.parameters()), _arrays(opt_state.state), _arrays(bare.state))
    for b, a in zip(before, after, strict=True):
        assert b.keys() == a.keys()
        for k in b:
            assert b[k].dtype == a[k].dtype and b[k].tobytes() == a[k].tobytes(), k


def test_a_float64_copy_of_a_checkpoint_loads(tmp_path):
    # every floating entry as F64 (as a float64 writer would store it): loads, cast to the
    # model's and optimiser state's own dtypes
    valid, source = _valid_checkpoint(tmp_path)
    header, body = _parse(valid)
    out_header, out_body = {"__metadata__": header.pop("__metadata__")}, b""
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = {"F32": np.float32, "U64": np.uint64, "I32": np.int32}[info["dtype"]]
        values = np.frombuffer(body[start:end], dtype).reshape(info["shape"])
        stored, raw = info["dtype"], values.tobytes()
        if info["dtype"] == "F32":
            stored, raw = "F64", values.astype(np.float64).tobytes()
        out_header[name] = {"dtype": stored, "shape": info["shape"],
                            "data_offsets": [len(out_body), len(out_body) + len(raw)]}
        out_body += raw
    path = tmp_path / "f64.safetensors"
    path.write_bytes(_pack(out_header, out_body))
    model, opt_state = Dense(3, 2), setup(Adam(0.01), Dense(3, 2))
    loadcheckpoint(path, model, opt_state)
    for k, v in _arrays(source.parameters()).items():
        np.testing.assert_array_equal(_arrays(model.parameters())[k], v)
    assert opt_state.optimizer.state["weight"]["m"].dtype == mx.float32
    assert opt_state.loss_scale.loss_scale.dtype == mx.float32
