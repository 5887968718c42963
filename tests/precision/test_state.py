"""Precision's mutable state (fluxlike/precision/state.py): the context each thread and task
reads, PLAIN as the one "nothing on" value, and the process-wide routing switch."""

import asyncio
import threading

import mlx.core as mx
import pytest

from fluxlike import autocast
from fluxlike.precision import state
from fluxlike.precision.state import PLAIN, Context, context, current_dtype, device_index


def test_plain_is_the_default_and_comes_back_when_everything_is_off():
    assert context.get() is PLAIN
    token = state.enter(differentiating=True)
    assert context.get() == Context(differentiating=True)
    token2 = state.with_dtype(0, mx.bfloat16)
    assert context.get() == Context(cpu=mx.bfloat16, differentiating=True)
    context.reset(token2)
    context.reset(token)
    assert context.get() is PLAIN
    token = state.with_dtype(1, mx.float16)
    inner = state.with_dtype(1, None)
    assert context.get() is PLAIN  # off again: the identical object the fast paths test for
    context.reset(inner)
    context.reset(token)


def test_autocast_leaves_plain_behind():
    with autocast(mx.bfloat16, device="cpu"):
        assert context.get().cpu == mx.bfloat16
    assert context.get() is PLAIN
    with autocast(mx.bfloat16, device="cpu"), autocast(enabled=False, device="cpu"):
        assert context.get() is PLAIN


def test_device_index():
    assert device_index(mx.Device(mx.cpu)) == 0
    assert device_index(mx.Device(mx.gpu)) == 1
    assert device_index() == (1 if mx.default_device().type == mx.gpu else 0)


def test_current_dtype_reads_the_default_devices_slot():
    assert current_dtype() is None
    slot = device_index()
    token = state.with_dtype(slot, mx.float16)
    try:
        assert current_dtype() == mx.float16
        other = state.with_dtype(1 - slot, mx.bfloat16)
        assert current_dtype() == mx.float16  # the other device's scope is not this one's
        context.reset(other)
    finally:
        context.reset(token)


def test_each_thread_and_task_has_its_own_context():
    seen = {}

    def worker():
        seen["thread"] = context.get()

    with autocast(mx.bfloat16, device="cpu"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()

        async def task():
            with autocast(mx.float16, device="cpu"):
                await asyncio.sleep(0)
                return context.get().cpu

        assert asyncio.run(task()) == mx.float16
        assert context.get().cpu == mx.bfloat16  # the task's scope stayed in the task
    assert seen["thread"] is PLAIN


def test_routing_is_on_once_autocast_was_used():
    with autocast(mx.bfloat16):
        pass
    assert state.routing.on
    assert isinstance(state.routing.lock, type(threading.RLock()))


@pytest.mark.parametrize("dtype", state.CASTABLE)
def test_castable_dtypes_are_the_floating_ones_but_float64(dtype):
    assert mx.issubdtype(dtype, mx.floating) and dtype != mx.float64
    assert set(state.HALF) < set(state.CASTABLE)
