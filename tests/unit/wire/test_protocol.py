import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aps.errors import (
    BadMagic,
    ErrorCode,
    FrameTooLarge,
    LayoutMismatch,
    MalformedFrame,
    NonFiniteGradient,
    PayloadSizeMismatch,
    ServerError,
    UnsupportedVersion,
    error_from_code,
)
from aps.layout import Layout
from aps.wire.protocol import (
    HEADER_SIZE,
    MAGIC,
    DType,
    Header,
    Op,
    decode_error,
    decode_init,
    encode_error,
    encode_init,
    is_known_op,
    pack_header,
    unpack_header,
)

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)


@given(op=st.sampled_from(list(Op)), flags=st.integers(0, 255), dtype=st.sampled_from(list(DType)),
       request_id=u32, clock=u64, version=u64, length=u64)
def test_header_round_trip(op, flags, dtype, request_id, clock, version, length):
    data = pack_header(op, flags=flags, dtype=dtype, request_id=request_id, clock=clock, version=version, length=length)
    assert len(data) == HEADER_SIZE == 40
    assert unpack_header(data) == Header(op, flags, dtype, request_id, clock, version, length)


def test_header_is_little_endian_with_magic_first():
    data = pack_header(Op.PUSH, request_id=7, length=4096)
    assert data[:4] == b"APS1"
    assert struct.unpack_from("<I", data, 0)[0] == MAGIC
    assert struct.unpack_from("<H", data, 4)[0] == 1  # protocol version
    assert data[6] == Op.PUSH
    assert struct.unpack_from("<Q", data, 32)[0] == 4096


def test_bad_magic_is_rejected():
    data = bytearray(pack_header(Op.PING))
    data[0] ^= 0xFF
    with pytest.raises(BadMagic):
        unpack_header(bytes(data))


def test_unsupported_version_is_rejected():
    data = bytearray(pack_header(Op.PING))
    data[4] = 99
    with pytest.raises(UnsupportedVersion):
        unpack_header(bytes(data))


def test_frame_limit():
    data = pack_header(Op.PUSH, length=1 << 20)
    assert unpack_header(data, max_payload=1 << 20).length == 1 << 20
    with pytest.raises(FrameTooLarge):
        unpack_header(data, max_payload=(1 << 20) - 1)


def test_unknown_op_is_left_to_the_receiver():
    header = unpack_header(pack_header(0x42))
    assert header.op == 0x42 and not is_known_op(0x42)
    assert is_known_op(Op.PUSH) and is_known_op(Op.ERROR)


@given(code=st.sampled_from(list(ErrorCode)), message=st.text(max_size=200))
def test_error_payload_round_trip(code, message):
    got_code, got_message = decode_error(encode_error(code, message))
    assert got_code == code
    assert got_message == message.encode("utf-8", "replace").decode("utf-8", "replace")
    exc = error_from_code(got_code, got_message)
    assert isinstance(exc, ServerError) and exc.code == code


def test_error_codes_map_to_builtin_friendly_classes():
    assert isinstance(error_from_code(ErrorCode.NON_FINITE_GRADIENT, "x"), (NonFiniteGradient, ValueError))
    assert isinstance(error_from_code(ErrorCode.LAYOUT_MISMATCH, "x"), ValueError)
    unknown = error_from_code(9999, "from the future")
    assert type(unknown) is ServerError and "9999" in str(unknown)


names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
shapes = st.lists(st.integers(0, 5), max_size=4).map(tuple)


@given(st.dictionaries(names, shapes, min_size=1, max_size=6), st.integers(0, 63), st.integers(1, 64))
def test_init_round_trip(spec, rank, num_workers):
    layout = Layout(tuple(spec), tuple(spec.values()))
    block = encode_init(rank, num_workers, layout)
    assert len(block) % 8 == 0
    values = np.arange(layout.numel, dtype=np.float32).tobytes()
    request = decode_init(block + values)
    assert (request.rank, request.num_workers, request.layout) == (rank, num_workers, layout)
    assert request.values_offset == len(block)


def test_init_with_wrong_values_size():
    layout = Layout(("w",), ((3,),))
    block = encode_init(0, 1, layout)
    with pytest.raises(PayloadSizeMismatch):
        decode_init(block + b"\0" * 8)


@given(st.binary(max_size=64))
def test_init_garbage_never_crashes(data):
    try:
        decode_init(data)
    except (MalformedFrame, PayloadSizeMismatch, LayoutMismatch):
        pass


def test_init_truncated_layout():
    layout = Layout(("weight", "bias"), ((4, 2), (4,)))
    block = encode_init(0, 2, layout)
    with pytest.raises(MalformedFrame):
        decode_init(block[:30])


def test_init_duplicate_names_are_a_layout_error():
    block = struct.pack("<IIII", 0, 1, 2, 0)
    for _ in range(2):
        block += struct.pack("<HBx", 1, 1) + b"w" + struct.pack("<Q", 1)
    block += b"\0" * (-len(block) % 8)
    with pytest.raises(LayoutMismatch):
        decode_init(block + b"\0" * 8)
