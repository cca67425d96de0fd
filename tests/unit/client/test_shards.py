"""The sharded worker's request machinery, without servers, over both drivers: the order
in which a push leaves for the shards, the worker's clock when a shard comes back older,
and Ctrl-C ending every shard's request."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

import pytest

from aps.client.aio import AsyncWorker
from aps.client.channel import arun, run
from aps.client.shards import _ShardThreads
from aps.client.steps import SLEEP, TURN
from aps.client.worker import Worker


def stand_ins(count: int, rank: int) -> list[SimpleNamespace]:
    """What the fan-out reads of a shard's channel."""
    return [SimpleNamespace(rank=rank, _conn=None, clock=0, version=0, address=f"tcp://s{index}:1",
                            _stop=threading.Event(), _closing=False) for index in range(count)]


def blocking(count: int, rank: int) -> Worker:
    worker = object.__new__(Worker)
    worker._setup(stand_ins(count, rank))
    worker._pool = _ShardThreads(count - 1)
    worker._lock = threading.RLock()
    return worker


class Driver:
    """Runs a worker's steps with the blocking or the asyncio driver."""

    def __init__(self, name: str) -> None:
        self.name = name

    def make(self, count: int, rank: int):
        return blocking(count, rank) if self.name == "blocking" else AsyncWorker(stand_ins(count, rank))

    def run(self, steps):
        return run(steps) if self.name == "blocking" else asyncio.run(arun(steps))

    def close(self, worker) -> None:
        if self.name == "blocking":
            worker._pool.shutdown()


@pytest.fixture(params=["blocking", "asyncio"])
def driver(request) -> Driver:
    return Driver(request.param)


@pytest.mark.parametrize("rank", [0, 1, 2, 5])
def test_a_push_leaves_one_shard_at_a_time_starting_at_rank_mod_k(driver, rank):
    count = 3
    worker = driver.make(count, rank)
    sent: list[int] = []

    def send(index, channel, turn):
        yield SLEEP, channel, random.uniform(0, 0.02)  # the shards reach their send in any order
        yield TURN, turn
        sent.append(index)
        yield SLEEP, channel, 0.01
        turn.done()

    for _ in range(5):
        sent.clear()
        driver.run(worker._each(send, in_turn=True))
        assert sent == [(rank + step) % count for step in range(count)]
    driver.close(worker)


def test_the_clock_is_the_workers_own_when_a_shard_comes_back_older(driver):
    """docs/algorithms.md, "Sharded resume": a shard that lost iterations does not take the
    worker's clock back; only when every shard lost some does it go back (to the most kept)."""
    worker = driver.make(2, 0)

    def step(clocks):
        def call(index, channel, turn):
            channel.clock = clocks[index]
            return index
            yield  # (a call of no I/O)
        assert driver.run(worker._each(call)) == [0, 1]  # the results in shard order
        return worker.clock

    assert step([1, 1]) == 1 and step([2, 2]) == 2
    assert step([3, 1]) == 3  # shard 1 resumed at clock 1: the worker is at 3 still
    assert step([4, 2]) == 4 and step([5, 3]) == 5
    assert step([2, 4]) == 6  # shard 0 resumed too, further back: shard 1 still holds 6
    assert step([3, 5]) == 7
    # both came back older: shard 0 holds identities up to 5 (its count 1 is the worker's 5), shard 1 up to 3
    assert step([1, 1]) == 5
    driver.close(worker)


def test_a_shard_that_fails_before_sending_does_not_hold_the_others(driver):
    worker = driver.make(3, 0)
    sent: list[int] = []

    def send(index, channel, turn):
        if index == 0:
            raise ConnectionError("shard 0 is gone")
        yield TURN, turn
        sent.append(index)
        turn.done()

    began = time.monotonic()
    with pytest.raises(ConnectionError, match="shard 0 is gone"):
        driver.run(worker._each(send, in_turn=True))
    assert sorted(sent) == [1, 2] and time.monotonic() - began < 1.0
    driver.close(worker)


def test_a_closed_sharded_worker_refuses_requests(driver):
    worker = driver.make(2, 0)
    worker._closing = True

    def call(index, channel, turn):
        raise AssertionError("sent on a closed worker")
        yield

    with pytest.raises(ConnectionError, match="is closed"):
        driver.run(worker._each(call))
    driver.close(worker)


def test_ctrl_c_ends_every_shards_request():
    """Interrupted in the calling thread (shard 0), the call shuts the other shards'
    connections so their requests end too, and raises at once: not one press per shard."""
    worker = blocking(2, 0)
    released = threading.Event()
    worker._channels[1]._conn = SimpleNamespace(shutdown=released.set)

    def call(index, channel, turn):
        if index == 0:
            raise KeyboardInterrupt
        if not released.wait(30):  # a pull held at the gate until its connection is shut
            raise AssertionError("never released")
        raise ConnectionError("connection shut")
        yield

    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run(worker._each(call))
    assert released.is_set() and time.monotonic() - began < 5.0
    # the shards' calls do not get back to their servers by themselves after the interrupt
    assert all(channel._interrupted for channel in worker._channels)

    def nothing(index, channel, turn):
        return channel._interrupted
        yield

    assert run(worker._each(nothing)) == [False, False]  # the next request may again
    worker._pool.shutdown()


def test_the_shards_threads_never_hold_the_process_exit():
    """A shard's request held at the gate when the script ends: its thread is a daemon, so
    the interpreter exits (and the exit hook says goodbye) instead of waiting for it."""
    threads = _ShardThreads(2)
    held = threading.Event()
    future = threads.submit(2, held.wait, 30)
    named = {thread.name: thread for thread in threading.enumerate()}
    assert named["aps-shard-1"].daemon and named["aps-shard-2"].daemon
    assert threads.submit(1, lambda: 7).result(5) == 7  # each shard's thread runs its own calls
    held.set()
    assert future.result(5) is True
    threads.shutdown()


def test_the_asyncio_driver_never_swallows_a_cancellation():
    """Steps that caught the cancellation thrown into them and went on would leave the task
    running: the driver closes them and raises it."""
    closed = []

    def stubborn():
        try:
            while True:
                try:
                    yield SLEEP, SimpleNamespace(_closing=False), 10
                except asyncio.CancelledError:
                    continue  # (no step of aps's does this)
        finally:
            closed.append(True)

    async def main():
        task = asyncio.ensure_future(arun(stubborn()))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert closed == [True]


def test_servers_that_are_not_shards_0_to_k_minus_1_of_one_model_are_refused():
    from aps.client.shards import in_shard_order
    from aps.errors import ConfigurationError

    def server(shard: int) -> SimpleNamespace:
        info = SimpleNamespace(shard=f'{{"shard": {shard}, "shards": 2}}', run_id="run-1")
        return SimpleNamespace(address=f"tcp://s{shard}:1", server_info=info)

    assert [w.address for w in in_shard_order([server(1), server(0)])] == ["tcp://s0:1", "tcp://s1:1"]
    with pytest.raises(ConfigurationError, match="is shard 2 of 2"):
        in_shard_order([server(0), server(2)])
