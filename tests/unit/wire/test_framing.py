"""The frame parser, fed the same byte stream in every possible chunking."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aps.errors import BadMagic, FrameTooLarge
from aps.wire.protocol import HEADER_SIZE, Op, pack_header
from aps.wire.framing import FrameReader


class Recorder:
    """A handler that sends payloads of op PUSH to fresh buffers and discards the rest."""

    def __init__(self, reader_holder=None):
        self.frames = []
        self.progress = []
        self.hold_next = False
        self.reader = None

    def frame_buffer(self, header):
        if header.op == Op.PUSH and header.length:
            return memoryview(bytearray(header.length))
        return None

    def frame_received(self, header, payload):
        self.frames.append((header.op, header.request_id, bytes(payload)))
        if self.hold_next:
            self.reader.hold()

    def payload_progress(self, filled):
        self.progress.append(filled)


def stream_of(frames):
    return b"".join(pack_header(op, request_id=i, length=len(p)) + p for i, (op, p) in enumerate(frames))


def feed(reader, data, cuts):
    """Feed ``data`` through get_buffer/buffer_updated, cutting reads at ``cuts``."""
    pos = 0
    cuts = sorted(set(c for c in cuts if 0 < c < len(data))) + [len(data)]
    for cut in cuts:
        while pos < cut:
            buf = reader.get_buffer()
            assert len(buf) > 0
            n = min(len(buf), cut - pos)
            buf[:n] = data[pos : pos + n]
            pos += n
            reader.buffer_updated(n)


frame_st = st.tuples(st.sampled_from([Op.PUSH, Op.PULL]), st.binary(max_size=300))


@given(st.lists(frame_st, max_size=8), st.lists(st.integers(0, 4000), max_size=20), st.sampled_from([40, 64, 100, 4096]))
def test_any_chunking_delivers_the_same_frames(frames, cuts, staging):
    frames = [(op, p if op == Op.PUSH else b"") for op, p in frames]
    handler = Recorder()
    reader = FrameReader(handler, staging_size=staging)
    data = stream_of(frames)
    feed(reader, data, cuts)
    assert handler.frames == [(op, i, p) for i, (op, p) in enumerate(frames)]
    assert reader.idle


def test_large_payload_is_read_in_place():
    payload = np.arange(100_000, dtype=np.float32)
    dest = memoryview(bytearray(payload.nbytes))

    class Handler(Recorder):
        def frame_buffer(self, header):
            return dest

    handler = Handler()
    reader = FrameReader(handler, staging_size=1024)
    data = pack_header(Op.PUSH, length=payload.nbytes) + payload.tobytes()
    # After the staging buffer's worth, the reader hands out the destination itself.
    first = reader.get_buffer()
    first[: len(first)] = data[: len(first)]
    reader.buffer_updated(len(first))
    direct = reader.get_buffer()
    assert direct.obj is dest.obj
    rest = data[len(first) :]
    direct[: len(rest)] = rest
    reader.buffer_updated(len(rest))
    assert np.array_equal(np.frombuffer(dest, np.float32), payload)
    assert handler.progress[-1] == payload.nbytes
    assert handler.progress == sorted(handler.progress)


def test_hold_keeps_later_frames_until_release():
    handler = Recorder()
    reader = FrameReader(handler)
    handler.reader = reader
    handler.hold_next = True
    data = stream_of([(Op.PULL, b""), (Op.PUSH, b"abc"), (Op.PULL, b"")])
    feed(reader, data, [])
    assert [f[1] for f in handler.frames] == [0]
    handler.hold_next = False
    reader.release()
    assert [f[1] for f in handler.frames] == [0, 1, 2]


def test_staging_full_while_held():
    handler = Recorder()
    reader = FrameReader(handler, staging_size=64)
    handler.reader = reader
    handler.hold_next = True
    feed(reader, stream_of([(Op.PULL, b"")]), [])
    assert reader.held and not reader.staging_full()
    buf = reader.get_buffer()
    buf[:] = b"\0" * len(buf)
    reader.buffer_updated(len(buf))
    assert reader.staging_full()


def test_discarded_payloads_keep_framing():
    handler = Recorder()
    reader = FrameReader(handler, staging_size=64)
    frames = [(Op.PULL, b""), (Op.PUSH, b"x" * 500), (Op.PULL, b"")]
    data = b"".join(
        pack_header(op, request_id=i, length=len(p) if op == Op.PUSH else 200) + (p if op == Op.PUSH else b"y" * 200)
        for i, (op, p) in enumerate(frames)
    )
    feed(reader, data, [])
    assert [(f[0], f[1], len(f[2])) for f in handler.frames] == [(Op.PULL, 0, 0), (Op.PUSH, 1, 500), (Op.PULL, 2, 0)]


def test_fatal_header_errors():
    reader = FrameReader(Recorder(), max_payload=100)
    buf = reader.get_buffer()
    data = pack_header(Op.PUSH, length=101)
    buf[: len(data)] = data
    with pytest.raises(FrameTooLarge):
        reader.buffer_updated(len(data))
    reader = FrameReader(Recorder())
    buf = reader.get_buffer()
    buf[:HEADER_SIZE] = b"HTTP" + b"\0" * (HEADER_SIZE - 4)
    with pytest.raises(BadMagic):
        reader.buffer_updated(HEADER_SIZE)


def test_partial_frame_is_visible():
    reader = FrameReader(Recorder())
    assert not reader.in_frame
    data = pack_header(Op.PUSH, length=10) + b"12345"
    buf = reader.get_buffer()
    buf[: len(data)] = data
    reader.buffer_updated(len(data))
    assert reader.in_frame


class InParts:
    """Takes a payload in parts: the first ``head`` bytes, then (by what they say) the
    rest into a buffer of its own, or nowhere (read and discarded)."""

    def __init__(self, head: int) -> None:
        self.head = head
        self.frames = []
        self.parts = []
        self.rest = None

    def frame_buffer(self, header):
        self.rest = None
        return memoryview(bytearray(min(self.head, header.length)))

    def frame_more(self, header, got):
        if got == self.head and self.parts_wanted(header):
            self.rest = memoryview(bytearray(header.length - got))
            return self.rest
        return None

    def parts_wanted(self, header):
        return header.op == Op.PUSH  # PULL frames here carry a payload nobody wants

    def frame_received(self, header, payload):
        self.frames.append((header.op, bytes(payload), None if self.rest is None else bytes(self.rest)))


@given(st.lists(st.tuples(st.sampled_from([Op.PUSH, Op.PULL]), st.binary(min_size=1, max_size=300)), max_size=6),
       st.lists(st.integers(0, 3000), max_size=20), st.sampled_from([40, 64, 4096]), st.integers(0, 40))
def test_a_payload_taken_in_parts_arrives_whole_or_is_discarded(frames, cuts, staging, head):
    handler = InParts(head)
    reader = FrameReader(handler, staging_size=staging)
    feed(reader, stream_of(frames), cuts)
    assert len(handler.frames) == len(frames)
    for (op, payload), (got_op, last, rest) in zip(frames, handler.frames):
        assert got_op == op
        if len(payload) <= head:  # it all fit in the first part
            assert last == payload and rest is None
        elif op == Op.PUSH:  # the rest went where frame_more said
            assert rest == payload[head:] and last == payload[head:]
        else:  # the rest was read and dropped
            assert rest is None


def test_a_reader_handed_to_another_handler_delivers_it_the_next_frames():
    """An asyncio worker's pipeline takes the reader for its answers between frames, and hands
    it back: a half-read frame stays with the handler that began it."""
    first, second = Recorder(), Recorder()
    reader = FrameReader(first)
    data = stream_of([(Op.PUSH, b"abc"), (Op.PUSH, b"defg"), (Op.PULL, b"")])
    one = len(pack_header(Op.PUSH, length=3)) + 3
    feed(reader, data[: one + HEADER_SIZE + 2], [])  # the first frame, and part of the second
    with pytest.raises(RuntimeError, match="being read"):
        reader.hand_to(second)
    feed(reader, data[one + HEADER_SIZE + 2 : one + HEADER_SIZE + 4], [])
    reader.hand_to(second)
    feed(reader, data[one + HEADER_SIZE + 4 :], [])
    assert [f[2] for f in first.frames] == [b"abc", b"defg"]
    assert [f[0] for f in second.frames] == [Op.PULL] and second.progress == []
