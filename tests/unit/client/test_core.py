"""The protocol core without I/O (aps.client.core): what it refuses before the model is
laid out, the worker count it reports once seated, the 16-bit buffer a compressed pull
receives into, and replies it cannot take."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from aps import _core
from aps.client.core import _ClientCore
from aps.errors import LayoutMismatch, MalformedFrame, NotInitialized, ProtocolError
from aps.wire.protocol import DType, Flag, Op, pack_header, unpack_header

MODEL = {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}


def test_requests_before_the_model_is_laid_out_are_refused():
    core = _ClientCore(0, 1)
    with pytest.raises(NotInitialized, match="no model to join with"):
        core.init_request(None)
    for request in (core.pull_request, lambda: core.push_request(np.zeros(5, np.float32), False), core.reseat):
        with pytest.raises(NotInitialized, match="call init"):
            request()
    core.init_request(MODEL)
    assert core.layout is not None and core.layout.numel == 5
    assert unpack_header(core.pull_request()[0]).op == Op.PULL


def test_an_init_sent_again_keeps_the_first_layout_and_takes_none_of_another_shape():
    core = _ClientCore(0, 1)
    core.init_request(MODEL)
    layout = core.layout
    again = core.init_request(None)  # (a rejoin: the same model)
    assert core.layout is layout and unpack_header(again[0]).op == Op.INIT
    with pytest.raises(LayoutMismatch, match="init with a different model than before"):
        core.init_request({"a": np.zeros(4, np.float32)})


def test_the_worker_count_is_the_given_one_until_the_server_says_its_own():
    core = _ClientCore(None, 3)
    assert core.num_workers == 3
    core.min_workers, core.max_workers = 2, 4  # an elastic server (--workers 2:4)
    assert core.num_workers == 2  # (no call answered yet: its MIN)
    core.live = 3
    assert core.num_workers == 3
    core.min_workers = core.max_workers = 4
    assert core.num_workers == 4


def test_a_compressed_pull_receives_into_one_16_bit_buffer():
    core = _ClientCore(0, 1)
    core.compression, core.compress_pulls = _core.BFLOAT16, True
    core.init_request(MODEL)
    head = unpack_header(core.pull_request()[0])
    assert head.dtype == DType.BFLOAT16 and head.flags == Flag.NARROW
    half = core._half_weights
    assert half is not None and half.dtype == np.uint16 and half.size == 5
    reply = unpack_header(pack_header(Op.PULL_REPLY, Flag.NARROW, DType.BFLOAT16, head.request_id, 0, 1, 10))
    target = core.frame_buffer(reply)
    assert target is not None and np.shares_memory(np.frombuffer(target, np.uint16), half)
    target[:] = np.full(5, 0x3F80, np.uint16).tobytes()  # 1.0 in bfloat16
    core.frame_received(reply, target)
    core.finish()
    assert core.flat_weights is not None and core.flat_weights.tolist() == [1.0] * 5 and core.version == 1
    core.pull_request()
    assert core._half_weights is half  # (made once)


def test_replies_the_core_cannot_take():
    core = _ClientCore(0, 1)
    with pytest.raises(ProtocolError, match="no reply has arrived"):
        core.finish()
    core.init_request(MODEL)
    rid = unpack_header(core.pull_request()[0]).request_id
    slot = unpack_header(pack_header(Op.PULL_REPLY, Flag.SHM, DType.FLOAT32, rid, 0, 1, 24))
    with pytest.raises(MalformedFrame, match="unexpected shared-memory weights reply"):
        core.frame_buffer(slot)  # (over TCP)
    with pytest.raises(MalformedFrame, match="unexpected shared-memory weights reply"):
        core.frame_received(slot, memoryview(bytes(24)))


def _pace_reply(core, payload: bytes):
    request, seconds = core.pace_request(42, 2.5)
    request = unpack_header(request)
    assert (request.op, request.version, request.length, bytes(seconds)) == (Op.PACE, 42, 8, struct.pack("<d", 2.5))
    reply = unpack_header(pack_header(Op.PACE_REPLY, 0, 0, request.request_id, 0, 0, len(payload)))
    target = core.frame_buffer(reply)
    target[:] = payload
    core.frame_received(reply, target)
    return core.take_pace()


def test_a_pace_reply_gives_the_rates_and_a_lying_one_is_refused():
    core = _ClientCore(0, 2)
    core.init_request(MODEL)
    assert _pace_reply(core, b'{"rate": 12.5, "fastest": 20}') == (12.5, 20.0)
    assert _pace_reply(core, b'{"rate": null, "fastest": null}') == (None, None)
    for lie in (b"[]", b'{"rate": [1]}', b'{"rate": "1"}', b'{"rate": -1}', b'{"fastest": 0}', b'{"rate": true}',
                b'{"rate": 1e999}', b"{"):
        with pytest.raises(ProtocolError, match="PACE reply"):
            _pace_reply(core, lie)
    with pytest.raises(MalformedFrame, match="PACE_REPLY of"):
        core.frame_buffer(unpack_header(pack_header(Op.PACE_REPLY, 0, 0, 1, 0, 0, (1 << 20) + 1)))
    for steps, seconds in ((-1, 1.0), ((1 << 53) + 1, 1.0), (1.5, 1.0), (True, 1.0), (1, -1.0), (1, float("nan"))):
        with pytest.raises(Exception, match="step count|seconds"):
            core.pace_request(steps, seconds)


def test_int8_error_feedback_stays_finite_and_every_push_goes():
    """A block that gets a gradient once and zeros after: its residual shrinks to subnormals,
    and every push still has scales the server takes; a gradient at float32's largest value
    leaves a finite residual."""
    from aps.wire.quantized import Quantized, scales_problem

    core = _ClientCore(0, 1)
    core.compression = int(DType.INT8Q)
    core.init_request({"w": np.zeros(512, np.float32)})
    gradient = np.zeros(512, np.float32)
    gradient[300] = 1.0
    for push in range(60):
        payload = core._quantized([(gradient if push == 0 else np.zeros(512, np.float32)).data.cast("B")])
        assert scales_problem(Quantized(payload, 512, DType.INT8Q)) is None, push
        assert np.isfinite(core.residual).all()
    core._quantized([np.full(512, np.finfo(np.float32).max, np.float32).data.cast("B")])
    assert np.isfinite(core.residual).all()
