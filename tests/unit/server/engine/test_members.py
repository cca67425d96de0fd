"""A worker's place (aps.server.engine.members): the ``Roster`` the engine's parts share (its
one method makes a seat), a ``Seat`` as a checkpoint keeps it (through JSON), and a
``Member``'s receive buffers, the seam between a connection and training."""

import json

import numpy as np

from aps import _core
from aps.server.engine.members import Member, PushResult, Roster, Seat


def test_a_roster_makes_a_seat_once_and_keeps_it():
    roster = Roster()
    assert roster.members == {} and not (roster.started or roster.below_quorum or roster.draining)
    seat = roster.seat(3)
    assert roster.seat(3) is seat and roster.seats == {3: seat}


def test_a_seat_goes_through_a_checkpoint_as_it_was_and_recognises_its_last_push():
    seat = Seat()
    seat.clock, seat.held, seat.credit, seat.push_id, seat.push_clock = 7, True, 2, 41, 6
    seat.result = PushResult(12, 7, False, 3, 0.5)
    again = Seat.from_json(json.loads(json.dumps(seat.to_json())))
    assert (again.clock, again.held, again.credit, again.result) == (7, True, 2, seat.result)
    assert again.is_duplicate(41, 6) and not again.is_duplicate(41, 7) and not again.is_duplicate(42, 6)
    assert again.left == -1  # (when it left is not kept)
    assert not Seat().is_duplicate(0, -1)  # request id 0 names no request


def test_a_push_sent_before_the_last_one_taken_was_taken_before_it():
    """A pipeline's pushes sent again after a reconnect: those the server took already were
    sent before the last one taken, by request id (at most MAX_IN_FLIGHT before) and by
    clock; the ones after it are new, and a new process's requests (ids from 1 again, clocks
    from where it was seated) are not mistaken for old ones."""
    seat = Seat()
    seat.push_id, seat.push_clock = 41, 6
    assert seat.is_duplicate(38, 3) and seat.is_duplicate(40, 5)
    assert not seat.is_duplicate(42, 7) and not seat.is_duplicate(43, 6)  # (sent after it)
    assert not seat.is_duplicate(40, 6) and not seat.is_duplicate(40, 9)  # (a clock not below)
    assert not seat.is_duplicate(0, 3)  # (id 0 names no request)
    far = Seat()
    far.push_id, far.push_clock = 5000, 600
    assert not far.is_duplicate(3, 2)  # (ids from 1 again: more than MAX_IN_FLIGHT before)
    wrapped = Seat()
    wrapped.push_id, wrapped.push_clock = 2, 50  # (ids went past 2**32-1 and start at 1 again)
    assert wrapped.is_duplicate(0xFFFFFFFE, 48) and wrapped.is_duplicate(1, 49)
    forgotten = Seat()  # (a new process for the rank: nothing is a duplicate)
    assert not forgotten.is_duplicate(38, 3)
