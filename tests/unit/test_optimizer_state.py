"""Reading and loading the optimizer's state (STATE, LOAD_STATE): the wire codec, the
optimizers' checks and loads, and the engine's jobs between two updates."""

import json
import struct

import numpy as np
import pytest

from aps.errors import InvalidState, MalformedFrame, NotInitialized
from aps.server.engine.optim import SGD, Adam
from aps.wire.protocol import (
    MAX_STATE_HEAD_BYTES,
    MAX_STEPS,
    StateHead,
    decode_state_head,
    encode_state_head,
    state_digest,
)
from aps.client.payloads import checked_state, state_from_reply, state_payload
from tests.harness import Harness

N = 37


def ramp(scale: float = 1.0, n: int = N) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) - n / 2) * np.float32(scale)


# The codec -------------------------------------------------------------------
def test_a_head_round_trips_and_pads_to_eight_bytes():
    digest = state_digest(5, [ramp()])
    head = encode_state_head("adam", 5, N, ["exp_avg", "exp_avg_sq"], digest=digest)
    assert len(head) % 8 == 0
    assert decode_state_head(head) == StateHead("adam", 5, N, ("exp_avg", "exp_avg_sq"), None, digest, len(head))
    reply = encode_state_head("sgd", 2, N, ["momentum_buffer"], version=9)
    decoded = decode_state_head(reply + ramp().tobytes())
    assert decoded.version == 9 and decoded.digest is None and decoded.payload_bytes == len(reply) + 4 * N


def test_the_digest_is_blake2b_of_steps_then_the_arrays_however_cut():
    import hashlib

    a, b = ramp(), ramp(2.0)
    expected = hashlib.blake2b(struct.pack("<Q", 7) + a.tobytes() + b.tobytes(), digest_size=16).digest()
    assert state_digest(7, [a, b]) == expected
    assert state_digest(7, [a[:5], a[5:], b]) == expected
    assert state_digest(8, [a, b]) != expected


def describe(fields: dict) -> bytes:
    text = json.dumps(fields).encode()
    head = struct.pack("<II", len(text), 0) + text
    return head + b"\0" * (-len(head) % 8)


GOOD = {"optimizer": "sgd", "steps": 1, "numel": N, "arrays": ["momentum_buffer"]}


@pytest.mark.parametrize("payload, error, message", [
    (b"\1\0", MalformedFrame, "too short"),
    (struct.pack("<II", MAX_STATE_HEAD_BYTES + 1, 0), MalformedFrame, "at most"),
    (struct.pack("<II", 40, 0) + b"{}", MalformedFrame, "its description takes"),
    (struct.pack("<II", 4, 0) + b"nope" + bytes(4), MalformedFrame, "not UTF-8 JSON"),
    (describe([1, 2]), MalformedFrame, "not a JSON object"),
    (describe({**GOOD, "optimizer": 3}), MalformedFrame, "names no optimizer"),
    (describe({**GOOD, "steps": -1}), InvalidState, "steps is -1; it must be an integer from 0 to 2**53"),
    (describe({**GOOD, "steps": True}), InvalidState, "steps is True"),
    (describe({**GOOD, "steps": 1.5}), InvalidState, "steps is 1.5"),
    (describe({**GOOD, "steps": MAX_STEPS + 1}), InvalidState, "from 0 to 2**53"),
    (describe({**GOOD, "numel": -3}), MalformedFrame, "numel is -3"),
    (describe({**GOOD, "arrays": "momentum_buffer"}), MalformedFrame, "a JSON list of names"),
    (describe({**GOOD, "digest": "xyz"}), MalformedFrame, "32 hex digits"),
    (describe({**GOOD, "digest": "00" * 8}), MalformedFrame, "32 hex digits"),
], ids=["short", "long-description", "truncated", "not-json", "not-object", "no-optimizer", "negative-steps",
        "bool-steps", "float-steps", "huge-steps", "negative-numel", "arrays-not-list", "digest-not-hex",
        "digest-short"])
def test_bad_heads_are_refused(payload, error, message):
    with pytest.raises(error, match=None) as info:
        decode_state_head(payload)
    assert message in str(info.value)


def test_the_worker_checks_what_it_can_and_orders_the_arrays_as_the_optimizer():
    state = {"optimizer": "adam", "steps": 3, "arrays": {"exp_avg_sq": ramp(2.0), "exp_avg": ramp().reshape(1, N)}}
    optimizer, steps, names, arrays = checked_state(state, N)
    assert (optimizer, steps, names) == ("adam", 3, ["exp_avg", "exp_avg_sq"])
    head, sent = state_payload(state, N)
    decoded = decode_state_head(head)
    assert decoded.arrays == ("exp_avg", "exp_avg_sq") and decoded.digest == state_digest(3, [ramp(), ramp(2.0)])
    reply = state_from_reply(memoryview(head + b"".join(a.tobytes() for a in sent)), 11)
    assert reply["version"] == 11 and reply["steps"] == 3
    np.testing.assert_array_equal(reply["arrays"]["exp_avg_sq"], ramp(2.0))
    bad = ramp()
    bad[4] = np.inf
    for state, message in [
        ({"optimizer": "sgd"}, "a mapping of 'optimizer', 'steps' and 'arrays'"),
        ({"optimizer": "sgd", "steps": -1, "arrays": {}}, "steps is -1"),
        ({"optimizer": "sgd", "steps": 1, "arrays": {"momentum_buffer": ramp(n=N + 1)}}, f"the model has {N}"),
        ({"optimizer": "sgd", "steps": 1, "arrays": {"momentum_buffer": bad}}, "momentum_buffer[4] is inf"),
    ]:
        with pytest.raises(InvalidState, match=None) as info:
            checked_state(state, N)
        assert message in str(info.value)
    with pytest.raises(TypeError, match="float64"):
        checked_state({"optimizer": "sgd", "steps": 1, "arrays": {"momentum_buffer": np.zeros(N)}}, N)


# The optimizers ----------------------------------------------------------------
def run(optimizer, w, grads):
    for g in grads:
        out = np.empty_like(w)
        assert optimizer.step(out, w, g)
        optimizer.commit()
        w = out
    return w


@pytest.mark.parametrize("make", [
    lambda k: SGD(N, 0.1, momentum=0.9, dampening=0.0, weight_decay=1e-2, kernels=k),
    lambda k: SGD(N, 0.1, momentum=0.9, nesterov=True, kernels=k),
    lambda k: Adam(N, 1e-2, weight_decay=1e-2, kernels=k),
], ids=["sgd-momentum", "sgd-nesterov", "adam"])
def test_a_loaded_state_goes_on_as_if_never_stopped(kernels, make):
    """State and steps loaded into a fresh optimizer: the next updates are bit for bit the
    uninterrupted run's (SGD's first-step rule does not start the buffer afresh)."""
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(N).astype(np.float32)
    grads = rng.standard_normal((6, N)).astype(np.float32)
    straight = make(kernels)
    w_mid = run(straight, w0, grads[:3])
    saved = {name: array.copy() for name, array in straight.state_arrays().items()}
    fresh = make(kernels)
    pieces = {name: [array[:10], array[10:]] for name, array in saved.items()}  # received in pieces
    assert fresh.state_problem(pieces, 3) is None
    fresh.load_state(pieces, 3)
    assert fresh.steps == 3
    np.testing.assert_array_equal(run(fresh, w_mid, grads[3:]), run(straight, w_mid, grads[3:]))


def test_state_problems_are_named(kernels):
    sgd = SGD(N, 0.1, momentum=0.9, kernels=kernels)
    assert "holds the arrays ['momentum_buffer']" in sgd.state_problem({"exp_avg": [ramp()]}, 1)
    assert "has 36 elements; the model has 37" in sgd.state_problem({"momentum_buffer": [ramp()[1:]]}, 1)
    bad = ramp()
    bad[30] = np.nan
    assert sgd.state_problem({"momentum_buffer": [ramp()[:20], bad[20:]]}, 1) == \
        "momentum_buffer[30] is nan: every value must be finite"
    assert "steps is 0 but the momentum buffer is not zero" in sgd.state_problem({"momentum_buffer": [ramp()]}, 0)
    assert sgd.state_problem({"momentum_buffer": [np.zeros(N, np.float32)]}, 0) is None
    adam = Adam(N, 1e-3, kernels=kernels)
    assert "in that order" in adam.state_problem({"exp_avg_sq": [ramp()], "exp_avg": [ramp()]}, 1)
    assert adam.state_problem({"exp_avg": [ramp()], "exp_avg_sq": [ramp()]}, 0) is None
    with pytest.raises(ValueError, match="elements in pieces"):
        adam.load_state({"exp_avg": [ramp(), ramp()], "exp_avg_sq": [ramp()]}, 1)
    assert not adam.exp_avg.any() and adam.steps == 0  # refused whole: nothing copied


# The engine: between two updates ------------------------------------------------------
def load_head(optimizer: str, steps: int, arrays: dict[str, np.ndarray], numel: int = N) -> StateHead:
    head = encode_state_head(optimizer, steps, numel, list(arrays), digest=state_digest(steps, arrays.values()))
    return decode_state_head(head)


def answers():
    got = []
    return got, got.append


def test_a_read_waits_for_the_update_in_flight():
    pending = []
    h = Harness(workers=1, sync="asp", numel=N, momentum=0.9, offload=lambda kernel, done: pending.append((kernel,
                                                                                                           done)))
    h.engine.lane._threshold = 0
    h.join_all()
    member = h.workers[0].member
    h.push(0, ramp())  # its kernel runs "on the helper thread": not finished yet
    copies, done = answers()
    h.engine.loads.read_optimizer_state(member, done, pytest.fail)
    assert not copies and len(pending) == 1
    while pending:
        kernel, finished = pending.pop(0)
        finished(kernel())
    (copy,) = copies
    head = decode_state_head(copy.head)
    assert (head.steps, copy.version, head.arrays) == (1, 1, ("momentum_buffer",))
    np.testing.assert_array_equal(copy.arrays, ramp())  # the buffer of the first step: the gradient
    h.push(0, ramp())
    while pending:
        kernel, finished = pending.pop(0)
        finished(kernel())
    np.testing.assert_array_equal(copy.arrays, ramp())  # its own copy: later updates do not reach it


def test_a_read_cancels_a_streaming_push_which_is_then_applied_whole():
    h = Harness(workers=1, sync="asp", numel=N, momentum=0.9)
    h.join_all()
    worker = h.workers[0]
    member = worker.member
    stream = h.engine.training.begin_streaming_push(member, 0)
    member.grad[:] = ramp()
    stream.feed(N // 2)  # half of it computed into the spare state
    copies, done = answers()
    h.engine.loads.read_optimizer_state(member, done, pytest.fail)
    assert not stream.active and len(copies) == 1  # the lane was free: read before the push
    assert decode_state_head(copies[0].head).steps == 0 and not copies[0].arrays.any()
    h.engine.training.push(member, 0, worker.results.append, worker.errors.append, stream=stream)
    assert h.engine.version == 1 and not worker.errors
    np.testing.assert_array_equal(h.engine.model.table.optimizer.momentum_buffer, ramp())


def test_readers_of_one_moment_share_one_copy():
    h = Harness(workers=2, sync="asp", numel=N, optimizer="adam", lr=1e-3)
    h.join_all()
    copies, done = answers()
    for worker in h.workers:
        h.engine.loads.read_optimizer_state(worker.member, done, pytest.fail)
    assert copies[0] is copies[1] and copies[0].arrays.size == 2 * N
    h.push(0, ramp())
    h.engine.loads.read_optimizer_state(h.workers[0].member, done, pytest.fail)
    assert copies[2] is not copies[0] and decode_state_head(copies[2].head).steps == 1


def test_a_load_is_taken_before_the_first_update_and_never_after():
    h = Harness(workers=1, sync="asp", numel=N, momentum=0.9)
    engine = h.engine
    with pytest.raises(NotInitialized):
        engine.loads.check_state(load_head("sgd", 2, {"momentum_buffer": ramp()}))
    h.join_all()
    member = h.workers[0].member
    state = load_head("sgd", 2, {"momentum_buffer": ramp()})
    loaded, done = answers()
    errors, failed = answers()
    for wrong, message in [
        (load_head("adam", 2, {"exp_avg": ramp(), "exp_avg_sq": ramp()}), "the state is adam's; this server runs sgd"),
        (load_head("sgd", 2, {"exp_avg": ramp()}), "holds the arrays ['momentum_buffer'], in that order"),
        (load_head("sgd", 2, {"momentum_buffer": ramp(n=N + 2)}, N + 2), f"have {N + 2} elements each; the model "
                                                                          f"has {N}"),
    ]:
        with pytest.raises(InvalidState, match=None) as info:
            engine.loads.check_state(wrong)
        assert message in str(info.value)
    tampered = state._replace(digest=state_digest(3, [ramp()]))
    engine.loads.load_optimizer_state(member, tampered, {"momentum_buffer": [ramp()]}, done, failed)
    assert "do not match the state's digest" in str(errors.pop())
    assert engine.model.table.optimizer.steps == 0 and not engine.model.table.optimizer.momentum_buffer.any()
    engine.loads.load_optimizer_state(member, state, {"momentum_buffer": [ramp()[:7], ramp()[7:]]}, done, failed)
    assert loaded == [True] and engine.model.table.optimizer.steps == 2 and engine.loads.loaded_state == state.digest
    np.testing.assert_array_equal(engine.model.table.optimizer.momentum_buffer, ramp())
    engine.loads.load_optimizer_state(member, state, {}, done, failed)  # the same again: nothing changes
    other = load_head("sgd", 2, {"momentum_buffer": ramp(2.0)})
    engine.loads.load_optimizer_state(member, other, {"momentum_buffer": [ramp(2.0)]}, done, failed)
    assert loaded == [True, False] and "another optimizer state (2 steps) was loaded" in str(errors.pop())
    h.push(0, ramp())
    engine.loads.load_optimizer_state(member, state, {}, done, failed)
    engine.loads.load_optimizer_state(member, other, {"momentum_buffer": [ramp(2.0)]}, done, failed)
    assert loaded == [True, False, False]
    assert "the server has applied 1 updates: optimizer state can only be loaded into a run that has not started" \
        in str(errors.pop())
    assert engine.model.table.optimizer.steps == 3 and not errors
    # the loaded buffer was used by the update (steps 2: not a first step): 0.9 * ramp + ramp
    np.testing.assert_array_equal(engine.model.table.optimizer.momentum_buffer, np.float32(0.9) * ramp() + ramp())


def test_a_resumed_run_knows_the_state_it_loaded():
    """The loaded state's digest is in checkpoints: after a resume, loading it again is a no-op."""
    from tests.unit.server.engine.test_resume import checkpoint_of

    h = Harness(workers=1, sync="asp", numel=N, optimizer="adam", lr=1e-3)
    h.join_all()
    arrays = {"exp_avg": ramp(), "exp_avg_sq": ramp() ** 2}
    state = load_head("adam", 4, arrays)
    loaded, done = answers()
    h.engine.loads.load_optimizer_state(h.workers[0].member, state, {k: [v] for k, v in arrays.items()}, done, pytest.fail)
    h.push(0, ramp())
    checkpoint = checkpoint_of(h)
    assert checkpoint.manifest["optimizer"]["loaded_state"] == state.digest.hex()
    resumed = Harness(workers=1, sync="asp", numel=N, optimizer="adam", lr=1e-3)
    resumed.engine.durability.restore(checkpoint)
    assert resumed.engine.loads.loaded_state == state.digest and resumed.engine.model.table.optimizer.steps == 5
    assert resumed.engine.loads.check_state(state) is True
    with pytest.raises(InvalidState, match="has applied 1 updates"):
        resumed.engine.loads.check_state(load_head("adam", 4, {"exp_avg": ramp(), "exp_avg_sq": ramp()}))
