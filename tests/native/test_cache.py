"""The native companion's primitive cache (native/src/cache.h): one least-recently-used cache
of oneDNN primitives for every op, with its counts. Calls fluxlike_native._ext directly."""

from __future__ import annotations

import os
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest
from helpers import in_threads

if os.environ.get("FLUXLIKE_NATIVE", "").strip().lower() in {"0", "off", "no", "false", "none"}:
    pytest.skip("FLUXLIKE_NATIVE disables the native kernels", allow_module_level=True)
_ext = pytest.importorskip("fluxlike_native._ext")

COUNTS = {"size", "hits", "misses", "creations", "evictions", "create_ns", "work_bytes"}
OPS = {"matmul", "conv", "softmax", "max_pool"}


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    """Each test starts from an empty cache with zeroed counts, its float32 matmuls on cached
    primitives (not on oneDNN's GEMM without one, as below AVX-512), and leaves the capacity
    and that mode as it found them."""
    capacity = _ext.set_cache_capacity(4096)
    mode = _ext.set_matmul_mode("primitive")
    _ext.clear_cache()
    yield
    _ext.set_cache_capacity(capacity)
    _ext.set_matmul_mode(mode)
    _ext.clear_cache()


def matmul(m: int, k: int = 8, n: int = 4) -> None:
    """One native matmul of a new (m, k) @ (k, n) problem, checked against mx.matmul."""
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    y = _ext.matmul(a, b)
    mx.eval(y)
    np.testing.assert_allclose(np.array(y), np.array(a @ b), rtol=1e-5, atol=1e-5)


def info(op: str = "matmul") -> dict:
    return _ext.cache_info()["ops"][op]


def test_cache_info_has_totals_capacity_and_each_op():
    matmul(3)
    mx.eval(_ext.softmax(mx.random.normal((2, 5))))
    mx.eval(_ext.max_pool(mx.random.normal((1, 4, 4, 2)), [2, 2], [2, 2], [0, 0], [0, 0], False))
    total = _ext.cache_info()
    assert set(total) == COUNTS | {"capacity", "ops", "pending"} and total["capacity"] == 4096
    assert set(total["ops"]) == OPS
    for op in total["ops"].values():
        assert set(op) == COUNTS
    for key in COUNTS:
        assert total[key] == sum(op[key] for op in total["ops"].values()), key
    assert [total["ops"][op]["size"] for op in ("matmul", "softmax", "max_pool", "conv")] == [
        1, 1, 1, 0]
    # the per-op functions written before cache_info read the same cache
    assert _ext.cache_size() == 1 and _ext.softmax_cache_size() == 1
    assert _ext.pool_cache_size() == 1 and _ext.conv_cache_size() == 0
    assert sum(n for _, n in _ext.cache_impls()) == 1
    assert sum(n for _, n in _ext.pool_cache_impls()) == 1 and _ext.conv_cache_impls() == []


def test_hits_misses_and_creations_are_counted():
    matmul(5)
    assert info() | {"create_ns": 0, "work_bytes": 0} == {
        "size": 1, "hits": 0, "misses": 1, "creations": 1, "evictions": 0,
        "create_ns": 0, "work_bytes": 0}
    matmul(5)  # the same description: found
    matmul(5)
    assert (info()["hits"], info()["misses"], info()["creations"]) == (2, 1, 1)
    matmul(6)  # another shape: created
    assert (info()["size"], info()["hits"], info()["misses"], info()["creations"]) == (2, 2, 2, 2)


def test_time_spent_creating_is_counted():
    assert info()["create_ns"] == 0
    matmul(7)
    first = info()["create_ns"]
    assert first > 0
    matmul(7)  # a hit creates nothing
    assert info()["create_ns"] == first
    matmul(9)
    assert info()["create_ns"] > first


def test_clear_cache_drops_entries_and_zeroes_counts():
    matmul(3)
    matmul(3)
    _ext.clear_cache()
    total = _ext.cache_info()
    assert all(total[key] == 0 for key in COUNTS)
    matmul(3)  # made again
    assert (info()["misses"], info()["creations"], info()["size"]) == (1, 1, 1)


def test_least_recently_used_is_evicted_and_touching_an_entry_keeps_it():
    _ext.set_cache_capacity(2)
    matmul(11)  # A
    matmul(12)  # B
    matmul(11)  # A again: now the most recently used
    assert info()["hits"] == 1
    matmul(13)  # C: the cache is full, B (least recently used) goes
    assert (info()["size"], info()["evictions"]) == (2, 1)
    matmul(11)  # A is still there
    assert (info()["hits"], info()["misses"]) == (2, 3)
    matmul(12)  # B was evicted: created again (evicting C)
    assert (info()["hits"], info()["misses"], info()["evictions"]) == (2, 4, 2)
    matmul(11)  # and A stayed
    assert info()["hits"] == 3


def test_results_stay_right_under_a_tiny_capacity():
    _ext.set_cache_capacity(1)
    for _ in range(2):
        for m in range(1, 6):
            matmul(m)  # each evicts the one before
    assert (info()["size"], info()["misses"], info()["evictions"]) == (1, 10, 9)
    _ext.set_cache_capacity(0)  # keeps nothing: every call creates its primitive
    matmul(4)
    matmul(4)
    assert (info()["size"], info()["misses"], info()["creations"]) == (0, 12, 12)


def test_set_cache_capacity_returns_the_old_one_and_evicts_down_to_the_new():
    assert _ext.set_cache_capacity(8) == 4096
    for m in range(1, 6):
        matmul(m)
    assert _ext.set_cache_capacity(2) == 8
    assert (info()["size"], info()["evictions"]) == (2, 3)
    assert _ext.cache_info()["capacity"] == 2
    matmul(5)  # the two most recently used stayed
    matmul(4)
    assert info()["hits"] == 2
    with pytest.raises(ValueError, match="capacity must be .* >= 0.*got -1"):
        _ext.set_cache_capacity(-1)
    assert _ext.cache_info()["capacity"] == 2


@pytest.mark.parametrize("capacity", [4096, 3])
def test_concurrent_creation_from_threads(capacity):
    """Several threads build and evaluate matmuls at once: each its own shapes and one shape
    all share (started together, so that they race to create its primitive). The results are
    right and the counts add up, also when the cache evicts under the threads' feet."""
    _ext.set_cache_capacity(capacity)
    threads, rounds = 6, 3

    def work(k: int) -> None:
        matmul(64, 32, 16)  # shared by every thread
        matmul(20 + k)  # this thread's own
        matmul(40 + k, 16, 8)

    in_threads(work, threads, rounds=rounds)
    counts = info()
    calls = threads * rounds * 3
    keys = 1 + 2 * threads
    assert counts["hits"] + counts["misses"] == calls
    assert counts["creations"] == counts["misses"]
    assert counts["size"] == min(keys, capacity)
    # every entry created was stored and is held, was evicted, or lost a race to another
    # thread's (dropped): never more held than created
    assert counts["size"] + counts["evictions"] <= counts["creations"]
    if capacity >= keys:
        assert counts["evictions"] == 0 and counts["size"] == keys
        # each thread's own shapes are missed once, the shared one at most once a thread
        assert counts["misses"] <= 2 * threads + threads
