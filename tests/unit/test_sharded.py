"""The sharded worker's request machinery, without servers: the order in which a push
leaves for the shards, and Ctrl-C ending every shard's request."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from aps import _sharded
from aps.worker import SEND_TURN


def sharded(count: int, rank: int) -> _sharded.ShardedWorker:
    """A ShardedWorker over ``count`` stand-ins for its shards' workers."""
    worker = object.__new__(_sharded.ShardedWorker)
    worker._shards = [SimpleNamespace(rank=rank, _conn=None) for _ in range(count)]
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
