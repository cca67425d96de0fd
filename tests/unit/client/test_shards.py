"""The sharded worker's request machinery, without servers: the order in which a push
leaves for the shards, and Ctrl-C ending every shard's request."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from aps.client import shards as _sharded
from aps.client.worker import SEND_TURN


def sharded(count: int, rank: int) -> _sharded.ShardedWorker:
    """A ShardedWorker over ``count`` stand-ins for its shards' workers."""
    worker = object.__new__(_sharded.ShardedWorker)
    worker._shards = [SimpleNamespace(rank=rank, _conn=None, clock=0) for _ in range(count)]
    worker._clock_offsets = [0] * count
    worker._pool = ThreadPoolExecutor(max_workers=count - 1)
    worker._lock = threading.RLock()
    worker._closing = False
    worker.address = "tcp://a,tcp://b"
    return worker


@pytest.mark.parametrize("rank", [0, 1, 2, 5])
def test_a_push_leaves_one_shard_at_a_time_starting_at_rank_mod_k(rank):
    count = 3
    worker = sharded(count, rank)
    sent: list[int] = []

    def send(index, _shard):
        time.sleep(random.uniform(0, 0.02))  # the threads reach their send in any order
        turn = SEND_TURN.turn
        turn.wait()
        sent.append(index)
        time.sleep(0.01)
        turn.done()

    for _ in range(5):
        sent.clear()
        worker._each(send, in_turn=True)
        assert sent == [(rank + step) % count for step in range(count)]
    worker._pool.shutdown()


def test_the_clock_is_the_workers_own_when_a_shard_comes_back_older():
    """docs/algorithms.md, "Sharded resume": a shard that lost iterations does not take the
    worker's clock back; only when every shard lost some does it go back (to the most kept)."""
    worker = sharded(2, 0)
    shards = worker._shards

    def step(clocks):
        def call(index, shard):
            shard.clock = clocks[index]
        worker._each(call)
        return worker.clock

    assert step([1, 1]) == 1 and step([2, 2]) == 2
    assert step([3, 1]) == 3  # shard 1 resumed at clock 1: the worker is at 3 still
    assert step([4, 2]) == 4 and step([5, 3]) == 5
    assert step([2, 4]) == 6  # shard 0 resumed too, further back: shard 1 still holds 6
    assert step([3, 5]) == 7
    # both came back older: shard 0 holds identities up to 5 (its count 1 is the worker's 5), shard 1 up to 3
    assert step([1, 1]) == 5
    worker._pool.shutdown()
    del shards


def test_a_shard_that_fails_before_sending_does_not_hold_the_others():
    worker = sharded(3, 0)
    sent: list[int] = []

    def send(index, _shard):
        if index == 0:
            raise ConnectionError("shard 0 is gone")
        SEND_TURN.turn.wait()
        sent.append(index)
        SEND_TURN.turn.done()

    began = time.monotonic()
    with pytest.raises(ConnectionError, match="shard 0 is gone"):
        worker._each(send, in_turn=True)
    assert sorted(sent) == [1, 2] and time.monotonic() - began < 1.0
    worker._pool.shutdown()


def test_ctrl_c_ends_every_shards_request():
    """Interrupted in the calling thread (shard 0), the call shuts the other shards'
    connections so their requests end too, and raises at once: not one press per shard."""
    worker = sharded(2, 0)
    released = threading.Event()
    worker._shards[1]._conn = SimpleNamespace(shutdown=released.set)

    def call(index, _shard):
        if index == 0:
            raise KeyboardInterrupt
        if not released.wait(30):  # a pull held at the gate until its connection is shut
            raise AssertionError("never released")
        raise ConnectionError("connection shut")

    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        worker._each(call)
    assert released.is_set() and time.monotonic() - began < 5.0
    worker._pool.shutdown()
