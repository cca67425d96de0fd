"""What a handler reads before it hands a request to the engine (aps.server.requests.intake).

Seams: ``InitIntake.next_piece`` (the first piece free, the others drawn from the server's
layout budget; refused, everything given back, when it is spent), ``release`` and ``check``
(the layout block parsed once; values of the wrong size; no values for a model that is not
there); ``StateIntake.next_part`` and ``check`` (the rest of the head, then the head checked
against the model and the request's length, then each array in pieces made as its bytes
arrive; nothing for a state loaded already); ``WeightsIntake.next_part`` and ``check`` (the
digest checked once, room for the weights only when they are to be loaded)."""

import numpy as np
import pytest

from aps.config import ServerConfig
from aps.errors import MalformedFrame, NotInitialized, PayloadSizeMismatch, ServerOverloaded
from aps.layout import Layout
from aps.server.admission import LAYOUT_BUDGET, StrangerGuard
from aps.server.engine import Engine
from aps.server.requests.intake import STATE_FIXED, InitIntake, StateIntake, WeightsIntake
from aps.wire.protocol import (
    MAX_STATE_HEAD_BYTES,
    DType,
    Flag,
    Header,
    Op,
    encode_init,
    encode_state_head,
    state_digest,
    weights_digest,
)

from .conftest import FakeExchange, join

N = 12
ADAM = ("exp_avg", "exp_avg_sq")


def load_header(op, length, flags=0, version=0):
    return Header(op, flags, DType.FLOAT32, 1, 0, version, length)


@pytest.fixture
def adam(loop):
    conn = FakeExchange(Engine(ServerConfig(workers=1, sync="asp", optimizer="adam")), loop)
    join(conn, N)
    return conn.engine


def fill(intake, block: bytes):
    """Hand ``block`` to ``intake`` piece by piece, as the frame parser does."""
    got = 0
    while got < len(block):
        piece = intake.next_piece(got)
        piece[:] = block[got : got + len(piece)]
        got += len(piece)


# InitIntake -------------------------------------------------------------------------------------
def test_the_first_piece_is_free_and_the_others_are_drawn_from_the_budget():
    guard = StrangerGuard()
    intake = InitIntake(3 * InitIntake.PIECE + 8, guard)
    first = intake.next_piece(0)
    assert len(first) == InitIntake.PIECE and guard.layout_free == LAYOUT_BUDGET
    intake.next_piece(InitIntake.PIECE)
    intake.next_piece(2 * InitIntake.PIECE)
    last = intake.next_piece(3 * InitIntake.PIECE)
    assert len(last) == 8 and guard.layout_free == LAYOUT_BUDGET - 2 * InitIntake.PIECE - 8
    intake.release()
    assert guard.layout_free == LAYOUT_BUDGET and intake.pieces == []
    intake.release()  # (idempotent: nothing given back twice)
    assert guard.layout_free == LAYOUT_BUDGET


def test_a_spent_budget_refuses_the_block_and_gives_back_what_it_drew():
    guard = StrangerGuard()
    guard.layout_free = InitIntake.PIECE + 100  # (what other INITs being read left)
    intake = InitIntake(4 * InitIntake.PIECE, guard)
    intake.next_piece(0)
    intake.next_piece(InitIntake.PIECE)
    assert guard.layout_free == 100
    with pytest.raises(ServerOverloaded, match="INIT layout blocks already"):
        intake.next_piece(2 * InitIntake.PIECE)
    assert guard.layout_free == InitIntake.PIECE + 100 and intake.pieces == []


def test_check_parses_the_block_once(engine):
    layout = Layout(("a", "b"), ((3,), (2, 2)))
    block = encode_init(0, 1, layout)
    intake = InitIntake(len(block), StrangerGuard())
    fill(intake, block)
    init = intake.check(engine, len(block) + layout.nbytes)
    assert (init.rank, init.num_workers, init.layout) == (0, 1, layout) and intake.pieces == []
    assert intake.check(engine, 0) is init  # (checked already: the payload's length is not looked at again)


def test_values_of_another_size_than_the_layouts_are_refused(engine):
    layout = Layout(("a",), ((4,),))
    block = encode_init(0, 1, layout)
    intake = InitIntake(len(block), StrangerGuard())
    fill(intake, block)
    with pytest.raises(PayloadSizeMismatch, match="INIT carries 12 bytes of values; its layout needs 16"):
        intake.check(engine, len(block) + 12)


def test_no_values_are_refused_while_there_is_no_model(engine):
    layout = Layout(("a",), ((4,),))
    block = encode_init(0, 1, layout)
    intake = InitIntake(len(block), StrangerGuard())
    fill(intake, block)
    with pytest.raises(NotInitialized, match="no initial values"):
        intake.check(engine, len(block))


def test_a_block_that_is_not_a_layout_is_malformed(engine):
    intake = InitIntake(24, StrangerGuard())
    fill(intake, bytes(range(24)))
    with pytest.raises(MalformedFrame):
        intake.check(engine, 24)


# StateIntake -------------------------------------------------------------------------------------
def state_payload(numel=N, steps=2):
    arrays = [np.full(numel, 1.0, np.float32), np.full(numel, 2.0, np.float32)]
    head = encode_state_head("adam", steps, numel, ADAM, digest=state_digest(steps, arrays))
    return head, arrays


def test_a_state_is_read_head_first_then_its_arrays_in_pieces(adam, monkeypatch):
    monkeypatch.setattr(StateIntake, "PIECE", 5)
    head, _ = state_payload()
    header = load_header(Op.LOAD_STATE, len(head) + 2 * 4 * N)
    intake = StateIntake()
    intake.fixed[:] = head[:STATE_FIXED]
    rest = intake.next_part(adam, header, STATE_FIXED)
    assert len(rest) == len(head) - STATE_FIXED and intake.head is None and intake.arrays == {}
    rest[:] = head[STATE_FIXED:]
    got, sizes = len(head), []
    while got < header.length:
        piece = intake.next_part(adam, header, got)
        sizes.append(len(piece) // 4)
        got += len(piece)
    assert intake.head.arrays == ADAM and not intake.kept
    assert sizes == [5, 5, 2, 5, 5, 2]  # (each array in pieces of at most PIECE elements)
    assert [[len(p) for p in pieces] for pieces in intake.arrays.values()] == [[5, 5, 2], [5, 5, 2]]


def test_a_state_head_is_checked_against_the_requests_length(adam):
    head, _ = state_payload()
    intake = StateIntake()
    intake.fixed[:] = head[:STATE_FIXED]
    header = load_header(Op.LOAD_STATE, len(head) + 4)
    intake.next_part(adam, header, STATE_FIXED)[:] = head[STATE_FIXED:]
    with pytest.raises(PayloadSizeMismatch, match=f"2 arrays of {N} float32 after a {len(head)}-byte head"):
        intake.next_part(adam, header, len(head))
    assert intake.head is None and intake.arrays == {}


def test_a_state_head_longer_than_the_limit_is_malformed(adam):
    intake = StateIntake()
    intake.fixed[:] = (MAX_STATE_HEAD_BYTES + 1).to_bytes(4, "little") + bytes(4)
    with pytest.raises(MalformedFrame, match="description of"):
        intake.next_part(adam, load_header(Op.LOAD_STATE, 1 << 20), STATE_FIXED)


def test_a_state_with_check_is_its_head_alone(adam):
    head, _ = state_payload()
    intake = StateIntake()
    intake.fixed[:] = head[:STATE_FIXED]
    header = load_header(Op.LOAD_STATE, len(head), Flag.CHECK)
    intake.next_part(adam, header, STATE_FIXED)[:] = head[STATE_FIXED:]
    assert intake.check(adam, header).numel == N


# WeightsIntake --------------------------------------------------------------------------------------
def test_weights_get_room_once_their_digest_is_checked(adam):
    intake = WeightsIntake(N)
    intake.digest[:] = weights_digest([np.ones(N, np.float32)])
    room = intake.next_part(adam, load_header(Op.LOAD_WEIGHTS, 16 + 4 * N), 16)
    assert intake.checked and not intake.kept and len(room) == 4 * N and intake.values.shape == (N,)


def test_weights_of_the_wrong_size_are_refused_by_the_run(adam):
    intake = WeightsIntake(N + 1)
    with pytest.raises(PayloadSizeMismatch, match=f"LOAD_WEIGHTS of {N + 1} weights; the model has {N}"):
        intake.next_part(adam, load_header(Op.LOAD_WEIGHTS, 16 + 4 * (N + 1)), 16)
    assert intake.values is None
