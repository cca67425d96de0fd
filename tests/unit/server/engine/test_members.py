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


def test_a_push_numbered_below_the_last_one_taken_was_taken_before_it():
    """A pipeline's pushes sent again after a reconnect: those the server took already are
    numbered below the last one taken (any request id); the ones after it are new."""
    seat = Seat()
    seat.push_id, seat.push_clock = 41, 6
    assert seat.is_duplicate(38, 3) and seat.is_duplicate(40, 5)
    assert not seat.is_duplicate(42, 7) and not seat.is_duplicate(43, 6)  # (a new push, a new id)
    assert not seat.is_duplicate(0, 3)  # (id 0 names no request)
    forgotten = Seat()  # (a new process for the rank: nothing is a duplicate)
    assert not forgotten.is_duplicate(38, 3)


def test_a_member_receives_a_push_in_the_buffer_of_its_element_type():
    member = Member(0)
    member.grad = np.zeros(4, np.float32)
    member.grad_bytes = memoryview(member.grad).cast("B")
    assert member.receive_gradient(_core.FLOAT32).nbytes == 16 and member.gradient is member.grad
    words = member.receive_gradient(_core.BFLOAT16)
    assert words.nbytes == 8 and member.gradient is member.grad16 and member.grad_dtype == _core.BFLOAT16
    assert member.receive_gradient(_core.FLOAT16).obj is words.obj  # made once
