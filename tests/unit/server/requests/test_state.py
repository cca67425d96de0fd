"""The requests about the optimizer (aps.server.requests.state): HYPER, STATE, LOAD_STATE and
LOAD_WEIGHTS.

Seams: ``Hyper.admit`` (nothing read for a stranger; a limit) and ``Hyper.handle`` (the values
set, or only checked with CHECK); ``State.handle`` (the state copied and sent as it is: head
and arrays); ``LoadState.admit`` (before INIT, the dtype, too short: refused before anything is
read; then its 8 fixed bytes only), ``LoadState.more`` (the rest of its head, checked against
the model and the run, and only then its arrays, in pieces as they arrive; none for a state
loaded already), ``LoadState.handle`` (loaded, DROPPED when loaded already, CHECK loads
nothing); ``LoadWeights.admit`` (before INIT, the dtype, the payload's size, each with its
message; then its digest only), ``LoadWeights.more`` (room for the weights once the digest is
checked, none when they were loaded already), ``LoadWeights.handle``."""

import numpy as np
import pytest

from aps.config import ServerConfig
from aps.errors import (
    DTypeMismatch,
    InvalidHyperparameters,
    InvalidState,
    MalformedFrame,
    NotInitialized,
    PayloadSizeMismatch,
    WeightsRefused,
)
from aps.server.engine import Engine
from aps.server.requests import HANDLERS, Request
from aps.server.requests.intake import StateIntake, WeightsIntake
from aps.wire.protocol import (
    MAX_HYPER_BYTES,
    DType,
    Flag,
    HyperGroup,
    Op,
    decode_state_head,
    encode_hyper,
    encode_state_head,
    pack_header,
    state_digest,
    unpack_header,
    weights_digest,
)

from .conftest import Error, FakeExchange, Reply, frame, join, push_frame

N = 32
ADAM = ("exp_avg", "exp_avg_sq")


def admit(conn, data):
    header = unpack_header(data)
    request = Request(header, HANDLERS[header.op])
    return request, request.handler.admit(conn, request)


@pytest.fixture
def adam(loop):
    """An exchange joined to an Adam model of N weights."""
    conn = FakeExchange(Engine(ServerConfig(workers=1, sync="asp", optimizer="adam", lr=0.1)), loop)
    join(conn, N)
    return conn


def state_frame(optimizer="adam", arrays=ADAM, steps=3, numel=N, *, check=False, rid=4, values=None):
    values = [np.full(numel, i + 1.0, np.float32) for i in range(len(arrays))] if values is None else values
    head = encode_state_head(optimizer, steps, numel, arrays, digest=state_digest(steps, values))
    payload = head if check else head + b"".join(v.tobytes() for v in values)
    return pack_header(Op.LOAD_STATE, Flag.CHECK if check else 0, DType.FLOAT32, rid, 0, 0, len(payload)) + payload, \
        len(head)


def weights_frame(values, *, check=False, rid=6, version=0):
    values = np.asarray(values, np.float32)
    payload = weights_digest([values]) + (b"" if check else values.tobytes())
    return pack_header(Op.LOAD_WEIGHTS, Flag.CHECK if check else 0, DType.FLOAT32, rid, 0, version, len(payload)) \
        + payload


def read_state(conn):
    """The optimizer's state, by a STATE request: its head and arrays."""
    conn.feed(frame(Op.STATE, rid=99))
    reply = conn.last
    assert (reply.op, reply.rid, reply.dtype) == (Op.STATE_REPLY, 99, DType.FLOAT32)
    head = decode_state_head(reply.payload)
    arrays = np.frombuffer(reply.payload[head.nbytes :], np.float32).reshape(len(head.arrays), head.numel)
    return head, reply, dict(zip(head.arrays, arrays))


# HYPER -------------------------------------------------------------------------------------------
def test_hyper_is_read_for_members_only_within_its_limit(conn):
    with pytest.raises(NotInitialized, match="HYPER before a successful INIT"):
        admit(conn, frame(Op.HYPER, bytes(40)))
    join(conn, N)
    with pytest.raises(InvalidHyperparameters, match=f"HYPER of {MAX_HYPER_BYTES + 1} bytes"):
        admit(conn, pack_header(Op.HYPER, 0, 0, 1, 0, 0, MAX_HYPER_BYTES + 1))
    assert len(admit(conn, frame(Op.HYPER, bytes(40)))[1]) == 40


def test_hyper_sets_the_groups_values(conn, engine):
    join(conn, N)
    conn.feed(frame(Op.HYPER, encode_hyper([HyperGroup(N // 2, 0.5, 0, 0, 0), HyperGroup(N, 0.25, 0, 0, 0)]), rid=3))
    assert conn.last == Reply(Op.HYPER_REPLY, 3)
    conn.feed(push_frame(Op.PUSH, N, 1.0))
    assert (engine.weights[: N // 2] == -0.5).all() and (engine.weights[N // 2 :] == -0.25).all()


def test_hyper_with_check_keeps_the_values_in_force(conn, engine):
    join(conn, N)
    conn.feed(frame(Op.HYPER, encode_hyper([HyperGroup(N, 0.5, 0, 0, 0)]), flags=Flag.CHECK, rid=3))
    assert conn.last == Reply(Op.HYPER_REPLY, 3)
    conn.feed(push_frame(Op.PUSH, N, 1.0))
    assert (engine.weights == -1).all()  # (lr 1, the server's)


def test_hyper_whose_groups_do_not_cut_the_model_is_refused(conn):
    join(conn, N)
    conn.feed(frame(Op.HYPER, encode_hyper([HyperGroup(N - 1, 0.5, 0, 0, 0)]), rid=3))
    assert isinstance(conn.last, Error) and isinstance(conn.last.exc, InvalidHyperparameters) and conn.last.rid == 3


# STATE ------------------------------------------------------------------------------------------
def test_state_before_init_is_refused(conn):
    conn.feed(frame(Op.STATE, rid=2))
    assert isinstance(conn.last.exc, NotInitialized)


def test_state_sends_the_optimizers_state_as_it_is(adam):
    adam.feed(push_frame(Op.PUSH, N, 2.0))
    head, reply, arrays = read_state(adam)
    assert (head.optimizer, head.steps, head.numel, head.arrays) == ("adam", 1, N, ADAM)
    assert reply.version == 1 == head.version and len(reply.payload) == head.nbytes + 2 * 4 * N
    assert np.allclose(arrays["exp_avg"], 0.2) and np.allclose(arrays["exp_avg_sq"], 0.004)  # torch's betas


# LOAD_STATE --------------------------------------------------------------------------------------
def test_load_state_is_refused_before_anything_is_read(conn, adam):
    with pytest.raises(NotInitialized, match="LOAD_STATE before a successful INIT"):
        admit(conn, state_frame()[0])
    data = state_frame()[0]
    with pytest.raises(DTypeMismatch, match="an optimizer state is float32, not float16"):
        admit(adam, pack_header(Op.LOAD_STATE, 0, DType.FLOAT16, 1, 0, 0, 100))
    with pytest.raises(MalformedFrame, match="LOAD_STATE payload of 7 bytes is too short"):
        admit(adam, pack_header(Op.LOAD_STATE, 0, DType.FLOAT32, 1, 0, 0, 7))
    request, room = admit(adam, data)
    assert len(room) == 8 and isinstance(request.intake, StateIntake) and request.intake.arrays == {}


def test_load_state_makes_room_for_its_arrays_only_once_its_head_is_checked(adam):
    data, head_bytes = state_frame()
    adam.feed(data[: 40 + 8])
    intake = adam.request.intake
    assert intake.head is None and intake.rest is not None and intake.arrays == {}
    adam.feed(data[40 + 8 : 40 + head_bytes])
    assert intake.head is not None and intake.head.arrays == ADAM
    assert [len(pieces) for pieces in intake.arrays.values()] == [1, 0]  # (the first array's first piece)
    adam.feed(data[40 + head_bytes :], piece=4 * N)
    assert adam.asked == [8, head_bytes, head_bytes + 4 * N]
    assert adam.last == Reply(Op.LOAD_STATE_REPLY, 4, version=0, flags=0)
    head, _, arrays = read_state(adam)
    assert head.steps == 3 and (arrays["exp_avg"] == 1).all() and (arrays["exp_avg_sq"] == 2).all()


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(optimizer="sgd", arrays=("momentum_buffer",)), InvalidState, "the state is sgd's; this server runs adam"),
    (dict(arrays=("exp_avg_sq", "exp_avg")), InvalidState, "in that order"),
    (dict(numel=N + 1), InvalidState, f"have {N + 1} elements each; the model has {N}"),
])
def test_a_state_that_is_not_the_models_is_refused_before_its_arrays(adam, kwargs, error, message):
    data, head_bytes = state_frame(**kwargs)
    adam.feed(data)
    assert isinstance(adam.last, Error) and isinstance(adam.last.exc, error) and message in adam.last.exc.message
    assert adam.asked == [8, head_bytes]  # (the rest is dropped, nothing made for it)
    assert read_state(adam)[0].steps == 0


def test_a_load_state_of_the_wrong_length_is_refused(adam):
    data, _ = state_frame()
    adam.feed(pack_header(Op.LOAD_STATE, 0, DType.FLOAT32, 4, 0, 0, len(data) - 40 - 4) + data[40:-4])
    assert isinstance(adam.last.exc, PayloadSizeMismatch) and "2 arrays of 32 float32" in adam.last.exc.message


def test_the_same_state_again_is_dropped_unread(adam):
    data, head_bytes = state_frame()
    adam.feed(data)
    adam.feed(data)
    assert adam.last == Reply(Op.LOAD_STATE_REPLY, 4, version=0, flags=Flag.DROPPED)
    assert adam.asked == [8, head_bytes]  # (its arrays read and dropped)


def test_load_state_with_check_loads_nothing(adam):
    data, _ = state_frame(check=True)
    adam.feed(data)
    assert adam.last == Reply(Op.LOAD_STATE_REPLY, 4, version=0, flags=0) and adam.asked == [8]
    assert read_state(adam)[0].steps == 0


def test_a_state_is_not_loaded_into_a_run_that_has_started(adam):
    adam.feed(push_frame(Op.PUSH, N, 1.0))
    adam.feed(state_frame()[0])
    assert isinstance(adam.last.exc, InvalidState) and "has applied 1 updates" in adam.last.exc.message


# LOAD_WEIGHTS -----------------------------------------------------------------------------------
def test_load_weights_is_refused_before_anything_is_read(conn):
    with pytest.raises(NotInitialized, match="LOAD_WEIGHTS before a successful INIT"):
        admit(conn, weights_frame(np.ones(N)))
    join(conn, N)
    with pytest.raises(DTypeMismatch, match="weights are float32, not bfloat16"):
        admit(conn, pack_header(Op.LOAD_WEIGHTS, 0, DType.BFLOAT16, 1, 0, 0, 16 + 4 * N))
    with pytest.raises(PayloadSizeMismatch, match=f"^LOAD_WEIGHTS payload of {16 + 4 * N + 4} bytes; a 16-byte "
                                                  f"digest and {N} float32 weights take {16 + 4 * N}$"):
        admit(conn, weights_frame(np.ones(N + 1)))
    with pytest.raises(PayloadSizeMismatch, match=r"its digest alone \(CHECK\) take 16$"):
        admit(conn, pack_header(Op.LOAD_WEIGHTS, Flag.CHECK, DType.FLOAT32, 1, 0, 0, 16 + 4 * N))
    request, room = admit(conn, weights_frame(np.ones(N)))
    assert len(room) == 16 and isinstance(request.intake, WeightsIntake) and request.intake.values is None


def test_load_weights_makes_room_once_its_digest_is_checked(conn, engine):
    join(conn, N)
    values = np.arange(N, dtype=np.float32)
    data = weights_frame(values)
    conn.feed(data[: 40 + 16])
    intake = conn.request.intake
    assert intake.checked and not intake.kept and intake.values.shape == (N,)
    conn.feed(data[40 + 16 :])
    assert conn.last == Reply(Op.LOAD_WEIGHTS_REPLY, 6, version=0, flags=0)
    assert np.array_equal(engine.weights, values)
    conn.feed(frame(Op.PULL, rid=7))
    assert np.array_equal(conn.last.weights, values)


def test_the_same_weights_again_are_dropped_unread(conn, engine):
    join(conn, N)
    data = weights_frame(np.ones(N))
    conn.feed(data)
    conn.feed(data[: 40 + 16])
    assert conn.request.intake.kept and conn.request.intake.values is None  # (no room: the rest is dropped)
    conn.feed(data[40 + 16 :])
    assert conn.last == Reply(Op.LOAD_WEIGHTS_REPLY, 6, version=0, flags=Flag.DROPPED)


def test_load_weights_with_check_loads_nothing(conn, engine):
    join(conn, N)
    conn.feed(weights_frame(np.ones(N), check=True))
    assert conn.last == Reply(Op.LOAD_WEIGHTS_REPLY, 6, version=0, flags=0) and (engine.weights == 0).all()


def test_weights_are_not_loaded_once_a_gradient_was_taken(conn, engine):
    join(conn, N)
    conn.feed(push_frame(Op.PUSH, N, 1.0))
    data = weights_frame(np.ones(N), version=1)
    conn.feed(data[: 40 + 16])
    assert isinstance(conn.request.error, WeightsRefused) and conn.request.intake.values is None  # (refused unread)
    conn.feed(data[40 + 16 :])
    assert isinstance(conn.last.exc, WeightsRefused) and "the server has applied 1 updates" in conn.last.exc.message
    assert (engine.weights == -1).all()
