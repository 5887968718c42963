"""Tests of fluxlike/distributed.py: data parallelism over mx.distributed.

The two-process checks run in one ``mlx.launch -n 2 --backend ring`` group on loopback
(tests/distributed_checks.py, one launch for the module, bounded by a timeout); each rank
writes its results as JSON and the tests below compare them across the ranks and against the
one-process references that rank 0 trains. The rest runs in this process, where
``mx.distributed.init()`` is a group of one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    FullyShardedModule,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)
from mlx.utils import tree_flatten

import fluxlike as fl
from fluxlike.distributed import DataParallel, DataShard, _bucketed, barrier, broadcast

CHECKS = Path(__file__).with_name("distributed_checks.py")
TIMEOUT = 240  # seconds for the whole group; each check is a few tiny steps


def _free_ports(count: int) -> int:
    """A port p with p, p+1, ... p+count-1 free on 127.0.0.1 (the ring listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            start = s.getsockname()[1]
        if start + count > 65535:
            continue
        try:
            held = []
            for port in range(start, start + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no free consecutive ports on 127.0.0.1")


def launcher() -> list[str]:
    """``mlx.launch`` beside this Python, or the same entry point through ``-c``."""
    beside = Path(sys.executable).with_name("mlx.launch")
    if beside.exists():
        return [sys.executable, str(beside)]
    return [sys.executable, "-c",
            "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def launch(*script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (a path and its arguments) in 2 processes on loopback, bounded."""
    command = [*launcher(), "-n", "2", "--backend", "ring", "--hosts", "127.0.0.1",
               "--starting-port", str(_free_ports(2)), "--python", sys.executable, *script]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    try:
        return subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the 2-process group did not finish in {TIMEOUT} s: {e.stdout} {e.stderr}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[dict, dict]:
    outdir = tmp_path_factory.mktemp("distributed")
    done = launch(str(CHECKS), str(outdir))
    results = []
    for rank in range(2):
        path = outdir / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing: {done.stdout}\n{done.stderr}"
        results.append(json.loads(path.read_text()))
    assert done.returncode == 0, done.stderr
    return results[0], results[1]


def result(ranks, name: str) -> tuple[dict, dict]:
    r0, r1 = (r[name] for r in ranks)
    for r in (r0, r1):
        assert "exception" not in r, r["exception"]
    return r0, r1


class TestTwoProcesses:
    @pytest.mark.parametrize(("precision", "tolerance"),
                             [("float32", 1e-6), ("bfloat16", 1e-3), ("float16", 1e-3)])
    def test_batch_b_per_rank_is_one_process_on_the_joined_batch(self, ranks, precision,
                                                                   tolerance):
        r0, r1 = result(ranks, precision)
        # setup gave both ranks rank 0's parameters (they were initialised differently)
        assert r0["after_setup"] == r1["after_setup"]
        # after the steps, parameters and optimiser state are identical on both ranks
        assert r0["params"] == r1["params"] and r0["opt"] == r1["opt"]
        assert r0["mean_loss"] == r1["mean_loss"]
        assert r0["eager"] is None  # the averaging ran inside the compiled step
        assert r0["dtypes"] == ["mlx.core.float32"]  # master weights stay float32
        # ... and match one process trained on the joined batches of 2B (float32 rounding;
        # under autocast, float32 sums in another order round to half differently now and then)
        assert r0["diff_vs_one_process"] <= tolerance
        assert r0["mean_loss"] == pytest.approx(r0["mean_loss_one_process"], rel=1e-5)
        assert r0["batches"] == 3
        if precision == "float16":  # train's default dynamic loss scale, the same everywhere
            assert r0["loss_scale"] == r1["loss_scale"] == r0["ref_loss_scale"] == 2.0**15
        else:  # no loss scale: a NoOpLossScale, whose scale is 1
            assert r0["loss_scale"] == r1["loss_scale"] == 1.0

    def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_both(self, ranks):
        r0, r1 = result(ranks, "nonfinite")
        s0, s1 = r0["steps"], r1["steps"]
        assert s0 == s1  # same parameters, optimiser and loss-scale state after every step
        assert [s["changed"] for s in s0] == [True, False, True]
        assert [s["scale"] for s in s0] == [2.0**15, 2.0**14, 2.0**14]
        assert [s["counter"] for s in s0] == [1, 0, 1]

    def test_a_nonfinite_loss_stops_every_rank_at_the_same_batch(self, ranks):
        r0, r1 = result(ranks, "train_nonfinite_loss")
        assert r0["raised"] == r1["raised"]
        assert "the loss is nan at batch 1" in r0["raised"]
        assert r0["params"] == r1["params"]

    def test_communication_in_bfloat16(self, ranks):
        r0, r1 = result(ranks, "communication_dtype")
        assert r0["params"] == r1["params"]
        assert 0 < r0["diff_vs_float32"] < 1e-2
        # train(compile=True): the averaging traced into the whole step, the same on both
        assert r0["compiled"] == r1["compiled"] and r0["compiled_vs_float32"] <= 1e-6
        assert r0["repr"].endswith(
            "distributed=DataParallel(rank 0 of 2, communication_dtype=bfloat16))")

    def test_sharded_data(self, ranks):
        r0, r1 = result(ranks, "data")
        rng = np.random.default_rng(3)  # the loaders' seed: two epochs, two orders
        orders = [rng.permutation(11).tolist() for _ in range(2)]
        for partial in (True, False):
            a, b = r0[f"partial={partial}"], r1[f"partial={partial}"]
            assert a["len"] == b["len"] == (3 if partial else 2)
            for epoch, order in enumerate(orders):
                seen = a["epochs"][epoch], b["epochs"][epoch]
                assert [len(x) for x in seen[0]] == [len(x) for x in seen[1]]
                assert len(seen[0]) == a["len"]
                if partial:  # padded with the order's first example: it alone is seen twice
                    padded = order + order[:1]
                    for rank, batches in enumerate(seen):
                        assert sum(batches, []) == padded[rank::2]
                    counts = np.bincount(sum(seen[0] + seen[1], []), minlength=11)
                    assert counts.tolist() == [2 if i == order[0] else 1 for i in range(11)]
                else:  # the order's last example dropped, then each rank's short last batch
                    for rank, batches in enumerate(seen):
                        assert sum(batches, []) == order[:10][rank::2][:4]
                    assert len(set(sum(seen[0] + seen[1], []))) == 8
            assert a["epochs"][0] != a["epochs"][1]  # a new order every epoch
        # without a seed each rank's MLX state differs: rank 0's seed is used by all
        assert sorted(sum(r0["rng=None"] + r1["rng=None"], [])) == list(range(10))
        assert r0["unshuffled"] == [[0, 2, 4], [6]] and r1["unshuffled"] == [[1, 3, 5], [0]]
        assert r0["repr"].endswith("shuffle=True, distributed=rank 0 of 2)")
        for r in (r0, r1):
            assert r["mismatch"].startswith("[DataLoader] the ranks of the group hold different")
            assert "rank 1 has 'observations 11' where rank 0 has 'observations 10'" in (
                r["mismatch"])

    def test_batchnorm_statistics_are_identical_on_all_ranks(self, ranks):
        r0, r1 = result(ranks, "batchnorm")
        assert r0["stats"] == r1["stats"] and r0["params"] == r1["params"]
        assert r0["moved"] > 0

    def test_a_checkpoint_of_the_group_continues_identically_in_one_process(self, ranks):
        r0, r1 = result(ranks, "checkpoint")
        assert r0["written"] == r1["written"] == ["group.safetensors"]  # one file, by rank 0
        assert r0["final"] == r1["final"]
        assert r0["loaded_on_every_rank"] and r1["loaded_on_every_rank"]
        assert r0["diff_vs_one_process"] <= 1e-4
        assert r0["scales"][0] == r0["scales"][1]
        assert r0["bad_save"].startswith("ValueError: [savemodel] a checkpoint is a safetensors")
        assert r1["bad_save"].startswith("RuntimeError: [savemodel] failed on rank 0")

    def test_sharded_models_under_autocast_match_their_unsharded_selves(self, ranks):
        r0, r1 = result(ranks, "sharded")
        for r in (r0, r1):
            for name in ("fully_shard compute_dtype=None",
                         "fully_shard compute_dtype=mlx.core.bfloat16", "tensor parallel"):
                got = r[name]
                assert got["loss"][0] == pytest.approx(got["loss"][1], rel=1e-3), name
                assert got["grad_diff"] <= 5e-3, name
                assert got["dtype"] == ["mlx.core.bfloat16"] * 2, name  # computed in bfloat16
                assert got["params"] == got["grads"] == ["mlx.core.float32"], name  # masters
            assert r["fully_shard compute_dtype=None"]["shapes"] == [[8, 6], [8], [2, 16], [2]]
            assert r["fully_shard compute_dtype=None"]["save_refused"].startswith(
                "[savemodel] the model holds shards (at 'the top': fully_shard")
            assert r["quantized"]["dtype"] == "mlx.core.bfloat16"
            assert r["quantized"]["diff"] <= 0.05 * r["quantized"]["scale"]

    def test_ring_still_lacks_sum_scatter(self, ranks):
        """A canary: when MLX's ring backend gets sum_scatter, fit_backend's all_sum
        workaround for fully_shard can go."""
        r0, _ = result(ranks, "sharded")
        assert r0["has_sum_scatter"] is False, "MLX's ring has sum_scatter now: drop fit_backend"

    def test_mismatched_models_raise_a_clear_error_on_every_rank(self, ranks):
        r0, r1 = result(ranks, "mismatch")
        expected = {
            "shape": "rank 1 has 'layers.1.weight float32 (4, 16) trained' where rank 0 has "
                     "'layers.1.weight float32 (3, 16) trained'",
            "dtype": "rank 1 has 'layers.0.weight float16 (16, 6) trained' where rank 0 has "
                     "'layers.0.weight float32 (16, 6) trained'",
            "layers": "rank 1 has 'nothing' where rank 0 has 'layers.1.weight float32 (3, 16) "
                      "trained'",
        }
        for r in (r0, r1):
            for case, text in expected.items():
                error = r[case]["error"]
                assert error.startswith("setup: the ranks of the group hold different models")
                assert text in error and "build the same model on every rank" in error


class TestOneProcess:
    """Without a launcher, mx.distributed.init() is a group of one: no communication."""

    def test_a_group_of_one_trains_as_one_process(self):
        x, y = mx.random.normal((8, 3)), mx.random.normal((8, 2))
        models = []
        for distributed in (None, True):
            mx.random.seed(1)
            model = fl.Dense(3, 2)
            opt = fl.setup(fl.Adam(0.1), model, distributed=distributed)
            fl.train(lambda m, x, y: ((m(x) - y) ** 2).mean(), model,
                     fl.DataLoader((x, y), batchsize=4, distributed=distributed), opt,
                     progress=False)
            models.append(model)
        assert isinstance(opt.distributed, DataParallel) and not opt.distributed.active
        for (_, a), (_, b) in zip(tree_flatten(models[0].parameters()),
                                  tree_flatten(models[1].parameters()), strict=True):
            assert mx.array_equal(a, b)

    def test_bad_arguments_change_nothing(self):
        model = fl.Dense(3, 2)
        before = model.weight
        with pytest.raises(TypeError, match=r"^setup: distributed must be None \(one process\)"):
            fl.setup(fl.Adam(), model, distributed="yes")
        with pytest.raises(ValueError, match="communication_dtype=bfloat16 needs distributed"):
            fl.setup(fl.Adam(), model, communication_dtype=mx.bfloat16)
        with pytest.raises(ValueError, match="communication_dtype must be None .* got "
                                             "mlx.core.int32"):
            fl.setup(fl.Adam(), model, distributed=True, communication_dtype=mx.int32)
        with pytest.raises(TypeError, match=r"^\[DataLoader\] distributed must be None"):
            fl.DataLoader(mx.arange(4), distributed=2)
        assert model.weight is before

    def test_data_shard_pads_or_drops_as_distributed_sampler(self):
        order = mx.array([5, 3, 9, 0, 1, 2, 4, 6, 7, 8])
        padded = [DataShard(r, 3, 10, pad=True).positions(order).tolist() for r in range(3)]
        assert padded == [[5, 0, 4, 8], [3, 1, 6, 5], [9, 2, 7, 3]]
        dropped = [DataShard(r, 3, 10, pad=False).positions(order).tolist() for r in range(3)]
        assert dropped == [[5, 0, 4], [3, 1, 6], [9, 2, 7]]
        assert DataShard(1, 3, 10, pad=True).positions(None).tolist() == [1, 4, 7, 0]

    def test_buckets_keep_each_array_and_dtype(self):
        arrays = [mx.arange(3, dtype=mx.float32), mx.ones((2, 2), mx.bfloat16),
                  mx.arange(5, dtype=mx.float32).reshape(5, 1), mx.zeros(0)]
        calls = []

        def reduce(flat):
            calls.append((flat.dtype, flat.size))
            return flat * 2

        out = _bucketed(arrays, reduce, bucket_bytes=16)
        for a, b in zip(arrays, out, strict=True):
            assert b.dtype == a.dtype and b.shape == a.shape
            assert mx.array_equal(b, a * 2)
        assert calls == [(mx.float32, 8), (mx.float32, 0), (mx.bfloat16, 4)]

    def test_collectives_on_a_group_of_one(self):
        group = mx.distributed.init()
        assert barrier(group) == 0 and barrier(group, failed=True) == 1
        flags = mx.array([True, False])
        got = broadcast([flags, mx.arange(3)], group)
        assert got[0].dtype == mx.bool_ and got[0].tolist() == [True, False]

    def test_savemodel_with_a_group_of_one(self, tmp_path):
        model = fl.Dense(2, 1)
        opt = fl.setup(fl.Adam(), model, distributed=True)
        fl.savemodel(tmp_path / "one.safetensors", model, opt)
        assert sorted(mx.load(str(tmp_path / "one.safetensors")))[:3] == [
            "model.bias", "model.weight", "opt.optimizer.bias.m"]

    def test_sharded_layers_have_policies(self):
        for cls in (AllToShardedLinear, ShardedToAllLinear, QuantizedAllToShardedLinear,
                    QuantizedShardedToAllLinear):
            assert fl.policy_of(cls) == "down"
        assert fl.policy_of(FullyShardedModule) == "none"


def test_the_example_trains_the_digits_cnn_data_parallel(tmp_path):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    example = Path(__file__).parents[1] / "examples" / "digits_distributed.py"
    path = tmp_path / "digits.safetensors"
    done = launch(str(example), "--epochs", "1", "--batchsize", "64", "--precision",
                  "bfloat16", "--communication", "bfloat16", "--save", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("2 process(es), 23 steps of 32 images each per epoch")
    assert sum(line.startswith("final test accuracy") for line in lines) == 1  # rank 0 only
    accuracy = float(lines[-2].split()[-1].rstrip("%"))
    assert accuracy > 25  # well above chance (10%) after one short epoch; ten reach ~98%
    model = fl.loadcheckpoint(path, _digits_model())
    assert model.layers[0].weight.dtype == mx.float32


def _digits_model():
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    try:
        import digits
    finally:
        sys.path.pop(0)
    return digits.build_model()


def test_model_entries_name_each_array_and_its_role():
    from fluxlike.distributed import model_entries

    model = fl.Chain(fl.Dense(3, 4), AllToShardedLinear(4, 2, group=mx.distributed.init()))
    model.layers[0].freeze(keys=["bias"])
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert model_entries(model, trainable) == [
        "layers.0.weight float32 (4, 3) trained", "layers.0.bias float32 (4,) frozen",
        "layers.1.weight float32 (2, 4) trained local to AllToShardedLinear",
        "layers.1.bias float32 (2,) trained local to AllToShardedLinear"]
