"""Shared segments (aps.wire.segments): a Room holds one message at a time, grows to
twice the need, and is made smaller after a long run of small messages; its segments are
sealed, so a reader cannot be cut short."""

from __future__ import annotations

import fcntl
import os

import numpy as np

from aps.wire.segments import SEALS, Room, map_received


def test_a_room_grows_to_twice_the_need_and_keeps_what_fits():
    room = Room("test-room")
    view, fresh = room.take(10)
    assert fresh and len(view) == 10 and room.segment.nbytes == Room.MIN_BYTES
    view[:] = 7
    first = room.segment
    view, fresh = room.take(Room.MIN_BYTES)
    assert not fresh and room.segment is first and view[0] == 7  # the same memory
    view, fresh = room.take(Room.MIN_BYTES + 1)
    assert fresh and room.segment.nbytes == 3 * Room.MIN_BYTES  # twice the need, in whole 64 KiB
    assert first.fd == -1  # the one before is let go here
    assert fcntl.fcntl(room.segment.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    room.close()
    assert room.segment is None


def test_a_large_room_is_made_smaller_after_a_long_run_of_small_messages():
    room = Room("test-room")
    room.take(Room.SHRINK_ABOVE)  # (a segment of twice that)
    large = room.segment
    for _ in range(Room.SHRINK_AFTER - 1):
        _, fresh = room.take(100)
        assert not fresh
    room.take(Room.SHRINK_ABOVE)  # (over a quarter: the run starts again)
    for _ in range(Room.SHRINK_AFTER - 1):
        assert not room.take(100)[1]
    assert room.segment is large
    _, fresh = room.take(100)
    assert fresh and room.segment.nbytes == Room.MIN_BYTES
    room.close()


def test_a_reader_maps_a_room_read_only():
    room = Room("test-room", shared_read_only=True)
    view, _ = room.take(16)
    view[:] = np.arange(16, dtype=np.uint8)
    mapped = map_received(os.dup(room.segment.read_only_fd()), 16, writable=False).view(np.uint8)
    assert np.array_equal(mapped[:16], np.arange(16)) and not mapped.flags.writeable
    room.close()


def test_a_room_that_may_not_shrink_is_made_again_only_to_grow():
    room = Room("test-room", shrink=False)
    room.take(Room.SHRINK_ABOVE)
    large = room.segment
    for _ in range(2 * Room.SHRINK_AFTER):
        assert not room.take(100)[1]
    assert room.segment is large
    room.close()


def test_a_room_with_a_limit_is_made_no_larger_than_it_or_the_need():
    room = Room("test-room", limit=100_004)
    assert room.take(60_000)[1] and room.segment.nbytes == 100_000  # (not 2 x 60,000: the limit, 8-aligned)
    assert room.take(100_000)[1] is False
    room.take(150_000)
    assert room.segment.nbytes == 150_000  # (a need over the limit: the need)
    room.close()
