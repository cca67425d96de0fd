"""Bad input gets a clear error, changes nothing, and never stops the server.

Rank 0 is a well-behaved ``aps.Worker``; rank 1 (or a stranger) sends the bad
frames by hand. After each case rank 0 keeps training and the weights show
only its own updates. Every test runs over TCP and over shared memory.
"""

import struct
import threading
import time

import numpy as np
import pytest

import aps
from aps.errors import ErrorCode
from aps.wire.protocol import HEADER_SIZE, DType, Flag, Op, pack_header
from aps.testing import RawClient

N = 4


class Cluster:
    def __init__(self, server, good, raw):
        self.server, self.good, self.raw = server, good, raw
        self.good_pushes = 0

    def train(self, steps=2):
        """Rank 0 keeps training; with lr=1 and gradients of ones, w = -pushes."""
        for _ in range(steps):
            self.good.push_pull({"w": np.ones(N, np.float32)})
            self.good_pushes += 1
        assert self.good.weights["w"].tolist() == [-float(self.good_pushes)] * N


def join_pair(server, transport, raw_params=None):
    good = aps.Worker(server.address, 0, 2, transport=transport)
    thread = threading.Thread(target=good.init, args=({"w": np.zeros(N, np.float32)},), daemon=True)
    thread.start()
    raw = RawClient.to(server, transport)
    raw.init(1, 2, raw_params or {"w": np.zeros(N, np.float32)})
    header, _ = raw.reply()
    assert header.op == Op.INIT_REPLY
    thread.join(10)
    return good, raw


@pytest.fixture
def cluster(server_process, transport):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1", "--max-frame-bytes", "1M")
    good, raw = join_pair(server, transport)
    c = Cluster(server, good, raw)
    yield c
    assert server.alive(), "the server must never crash"
    c.train()  # and keeps serving the good worker
    good.close()
    raw.close()


def assert_error(raw, code, text=None, server=None):
    """The next frame is an error with ``code`` (and ``text``); the server logged it."""
    got, message = raw.error()
    assert got == code, f"expected {code.name}, got {got}: {message}"
    if text:
        assert text in message
    if server is not None:
        server.wait_for_log(f"{code.name}: {message}")
    return message


def test_bad_magic_closes_only_that_connection(cluster):
    cluster.raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * HEADER_SIZE)
    assert_error(cluster.raw, ErrorCode.BAD_MAGIC, "magic", server=cluster.server)
    assert cluster.raw.closed_by_peer()
    cluster.server.wait_for_log("BAD_MAGIC")
    cluster.server.wait_for_log("worker 1 disconnected")
    cluster.train()


def test_unsupported_protocol_version(cluster):
    header = bytearray(pack_header(Op.PING))
    struct.pack_into("<H", header, 4, 7)
    cluster.raw.send(bytes(header))
    assert_error(cluster.raw, ErrorCode.UNSUPPORTED_VERSION, "version 7", server=cluster.server)
    assert cluster.raw.closed_by_peer()


def test_unknown_op_keeps_the_connection(cluster):
    cluster.raw.frame(0x42, b"skipped payload")
    assert_error(cluster.raw, ErrorCode.UNKNOWN_OP, "66", server=cluster.server)
    cluster.raw.frame(Op.PULL_REPLY)  # a reply is not a request either
    assert_error(cluster.raw, ErrorCode.UNKNOWN_OP, server=cluster.server)
    cluster.raw.frame(Op.PING)
    assert cluster.raw.reply()[0].op == Op.PING_REPLY


def test_frame_over_the_limit(cluster):
    cluster.raw.send(pack_header(Op.PUSH, dtype=DType.FLOAT32, length=(1 << 20) + 1))
    assert_error(cluster.raw, ErrorCode.FRAME_TOO_LARGE, "limit", server=cluster.server)
    assert cluster.raw.closed_by_peer()
    cluster.train()


def test_payload_that_does_not_match_the_layout(cluster):
    cluster.train(1)
    if cluster.raw.transport == "tcp":
        cluster.raw.push(np.ones(N + 1, np.float32), version=1)
        assert_error(cluster.raw, ErrorCode.PAYLOAD_SIZE_MISMATCH, f"{4 * N} bytes", server=cluster.server)
    else:  # over shared memory a push carries no payload at all
        payload = np.ones(N, np.float32).tobytes()
        cluster.raw.send(pack_header(Op.PUSH, 0, DType.FLOAT32, 0, 0, 1, len(payload)) + payload)
        assert_error(cluster.raw, ErrorCode.MALFORMED_FRAME, "no payload", server=cluster.server)
    cluster.train(1)  # nothing was applied for rank 1


def test_wrong_dtype(cluster):
    cluster.raw.push(np.ones(N // 2, np.float64), dtype=DType.FLOAT64)
    assert_error(cluster.raw, ErrorCode.DTYPE_MISMATCH, "float64", server=cluster.server)
    cluster.raw.push(np.ones(N, np.float32), dtype=99)
    assert_error(cluster.raw, ErrorCode.DTYPE_MISMATCH, "unknown dtype", server=cluster.server)
    cluster.train()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_is_rejected_and_changes_nothing(cluster, bad):
    grad = np.ones(N, np.float32)
    grad[2] = bad
    cluster.raw.push(grad)
    assert_error(cluster.raw, ErrorCode.NON_FINITE_GRADIENT, "NaN or infinity", server=cluster.server)
    cluster.train(1)
    # The rejected push did not count: rank 1's next push is its first.
    cluster.raw.push(np.zeros(N, np.float32))
    header, _ = cluster.raw.reply()
    assert header.op == Op.PUSH_REPLY and header.clock == 1


def test_non_finite_gradient_raises_a_typed_error_in_the_client(cluster):
    with pytest.raises(aps.NonFiniteGradient) as info:
        cluster.good.push({"w": np.array([1, np.nan, 1, 1], np.float32)})
    assert isinstance(info.value, ValueError) and info.value.code == ErrorCode.NON_FINITE_GRADIENT
    cluster.train()


def test_half_a_frame_then_vanish(cluster):
    cluster.raw.send(pack_header(Op.PUSH, dtype=DType.FLOAT32, length=4 * N)[:22])
    cluster.raw.close()
    cluster.server.wait_for_log("middle of a frame")
    cluster.server.wait_for_log("worker 1 disconnected")
    cluster.train()


def test_requests_with_unexpected_payloads_or_order(cluster):
    cluster.raw.frame(Op.PULL, b"xyz")
    assert_error(cluster.raw, ErrorCode.MALFORMED_FRAME, "no payload", server=cluster.server)
    cluster.raw.init(1, 2, {"w": np.zeros(N, np.float32)})
    assert_error(cluster.raw, ErrorCode.OUT_OF_ORDER, "already joined", server=cluster.server)
    cluster.raw.frame(Op.PING)
    assert cluster.raw.reply()[0].op == Op.PING_REPLY


@pytest.fixture
def waiting_server(server_process, transport):
    """A 3-worker server where only rank 0 has joined (training has not started)."""
    server = server_process("--workers", "3", "--sync", "asp")
    server.transport = transport
    good = aps.Worker(server.address, 0, 3, transport=transport, reconnect=False)
    result = {}

    def init():
        try:
            result["w"] = good.init({"w": np.zeros(N, np.float32)})
        except aps.APSError as exc:  # the test ended before training started
            result["error"] = exc

    thread = threading.Thread(target=init, daemon=True)
    thread.start()
    server.wait_for_log("worker 0 joined")
    yield server, good, thread, result
    assert server.alive()
    if thread.is_alive():
        good.shards[0]._conn.sock.shutdown(2)
    thread.join(10)
    good.close()


@pytest.mark.parametrize(
    "rank, workers, params, code, text",
    [
        (1, 3, {"v": np.zeros(N, np.float32)}, ErrorCode.LAYOUT_MISMATCH, "names"),
        (1, 3, {"w": np.zeros(N + 1, np.float32)}, ErrorCode.LAYOUT_MISMATCH, "shape"),
        (5, 3, {"w": np.zeros(N, np.float32)}, ErrorCode.RANK_OUT_OF_RANGE, "out of range"),
        (0, 3, {"w": np.zeros(N, np.float32)}, ErrorCode.RANK_TAKEN, "already connected"),
        (1, 4, {"w": np.zeros(N, np.float32)}, ErrorCode.WORKER_COUNT_MISMATCH, "--workers 3"),
    ],
    ids=["names", "shapes", "rank-range", "rank-taken", "worker-count"],
)
def test_init_refusals(waiting_server, rank, workers, params, code, text):
    server = waiting_server[0]
    raw = RawClient.to(server, server.transport)
    raw.init(rank, workers, params)
    assert_error(raw, code, text, server=server)
    # The refused connection may try again, correctly this time.
    raw.init(1, 3, {"w": np.zeros(N, np.float32)})
    raw.sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        raw.reply()  # joined: waiting for rank 2, like rank 0
    raw.close()


def test_malformed_init_and_requests_before_init(waiting_server):
    server = waiting_server[0]
    raw = RawClient.to(server, server.transport)
    raw.frame(Op.INIT, b"\x01" * 20, dtype=DType.FLOAT32)
    assert_error(raw, ErrorCode.MALFORMED_FRAME, server=server)
    raw.frame(Op.INIT, b"\x01" * 8, dtype=DType.FLOAT32)
    assert_error(raw, ErrorCode.MALFORMED_FRAME, "too short", server=server)
    raw.frame(Op.INIT, b"\x01" * 64, dtype=DType.FLOAT64)
    assert_error(raw, ErrorCode.DTYPE_MISMATCH, server=server)
    raw.frame(Op.PUSH, dtype=DType.FLOAT32)
    assert_error(raw, ErrorCode.NOT_INITIALIZED, server=server)
    raw.frame(Op.PULL)
    assert_error(raw, ErrorCode.NOT_INITIALIZED, server=server)
    raw.close()


def test_typed_exceptions_through_the_client(waiting_server):
    server, good, thread, result = waiting_server
    with aps.Worker(server.address, 1, 3, transport=server.transport) as w:
        with pytest.raises(aps.LayoutMismatch, match="shape"):
            w.init({"w": np.zeros(N + 2, np.float32)})
    with aps.Worker(server.address, 0, 3, transport=server.transport) as w:
        with pytest.raises(aps.RankTaken):
            w.init({"w": np.zeros(N, np.float32)})
    with pytest.raises(aps.ConfigurationError):
        aps.Worker(server.address, 3, 3)
    # Training still starts once everyone is there.
    others = [aps.Worker(server.address, r, 3, transport=server.transport) for r in (1, 2)]
    threads = [threading.Thread(target=o.init, args=({"w": np.ones(N, np.float32)},)) for o in others]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    thread.join(10)
    assert result["w"]["w"].tolist() == [0.0] * N  # rank 0's values are the initial weights
    for o in others:
        assert o.weights["w"].tolist() == [0.0] * N
        o.close()


def test_push_while_held_is_out_of_order(server_process, transport):
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "0")
    good, raw = join_pair(server, transport)
    raw.push(np.ones(N, np.float32))
    assert raw.reply()[0].op == Op.PUSH_REPLY  # now held: rank 0 has not pushed
    raw.push(np.ones(N, np.float32))
    assert_error(raw, ErrorCode.OUT_OF_ORDER, "held", server=server)
    good.push_pull({"w": np.ones(N, np.float32)})
    raw.frame(Op.PULL)
    header, _ = raw.reply()
    assert header.op == Op.PULL_REPLY and header.version == 2
    np.testing.assert_allclose(good.weights["w"], [-0.02] * N, rtol=1e-6)  # default lr 0.01
    good.close()
    raw.close()


def test_client_side_validation_sends_nothing(cluster):
    with pytest.raises(aps.DTypeMismatch):
        cluster.good.push({"w": np.ones(N, np.int32)})
    with pytest.raises(aps.LayoutMismatch):
        cluster.good.push({"w": np.ones(N + 1, np.float32)})
    with pytest.raises(aps.LayoutMismatch):
        cluster.good.push({"x": np.ones(N, np.float32)})
    with pytest.raises(aps.LayoutMismatch):
        cluster.good.push(np.ones(N + 1, np.float32))
    cluster.train()


def test_pipelined_requests_are_answered_in_order(cluster):
    """A client may send requests without waiting; each is answered in turn."""
    count = 3000  # more than the server's staging buffer holds: reading pauses and resumes
    cluster.raw.send(b"".join(pack_header(Op.PING, request_id=i) for i in range(count)))
    for i in range(count):
        header, _ = cluster.raw.reply()
        assert (header.op, header.request_id) == (Op.PING_REPLY, i)


def test_pipelined_pull_waits_for_the_gate(server_process, transport):
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "0")
    good, raw = join_pair(server, transport)
    raw.push(np.ones(N, np.float32), request_id=1)
    raw.send(pack_header(Op.PULL, request_id=2) + pack_header(Op.PING, request_id=3))
    assert raw.reply()[0].request_id == 1
    raw.sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        raw.reply()  # the pull waits for rank 0; the ping waits behind it
    raw.sock.settimeout(10)
    good.push_pull({"w": np.ones(N, np.float32)})
    assert [raw.reply()[0].request_id for _ in range(2)] == [2, 3]
    good.close()
    raw.close()


def _server_memory(server) -> int:
    """The server's virtual memory: what it has reserved, touched or not."""
    import psutil

    return psutil.Process(server.proc.pid).memory_info().vms


@pytest.mark.parametrize("case", ["rank", "count", "taken", "layout"])
def test_an_init_is_checked_before_its_values_get_room(waiting_server, case):
    """An INIT declaring 2 GiB of values is refused on its layout block alone: the server
    reserves nothing for values it would refuse (and reads what follows into nothing)."""
    server = waiting_server[0]
    rank, workers, names = {"rank": (7, 3, "w"), "count": (1, 4, "w"), "taken": (0, 3, "w"),
                            "layout": (1, 3, "v")}[case]
    layout = aps.Layout((names,), ((1 << 29,),))  # 2 GiB of float32
    from aps.wire.protocol import encode_init

    block = encode_init(rank, workers, layout)
    before = _server_memory(server)
    raw = RawClient.to(server, server.transport)
    raw.send(pack_header(Op.INIT, 0, DType.FLOAT32, 1, 0, len(block), len(block) + layout.nbytes), block)
    raw.send(b"\0" * (1 << 20))  # some of the values: they are read, and dropped
    time.sleep(0.3)
    assert server.alive() and _server_memory(server) - before < 256 << 20
    raw.close()


def test_init_limits_are_checked_before_parsing_grows(waiting_server):
    server = waiting_server[0]
    raw = RawClient.to(server, server.transport)
    from aps.wire.protocol import MAX_LAYOUT_BYTES, MAX_NAME_BYTES, MAX_TENSORS

    too_many = struct.pack("<IIII", 1, 3, MAX_TENSORS + 1, 0)
    raw.frame(Op.INIT, too_many, dtype=DType.FLOAT32, version=len(too_many))
    assert_error(raw, ErrorCode.MALFORMED_FRAME, f"at most {MAX_TENSORS}", server=server)
    long_name = struct.pack("<IIII", 1, 3, 1, 0) + struct.pack("<HBx", MAX_NAME_BYTES + 1, 1)
    long_name += b"n" * (MAX_NAME_BYTES + 1) + struct.pack("<Q", 1)
    long_name += b"\0" * (-len(long_name) % 8)
    raw.frame(Op.INIT, long_name + b"\0" * 4, dtype=DType.FLOAT32, version=len(long_name))
    assert_error(raw, ErrorCode.MALFORMED_FRAME, f"at most {MAX_NAME_BYTES} bytes", server=server)
    raw.frame(Op.INIT, b"\0" * 64, dtype=DType.FLOAT32, version=MAX_LAYOUT_BYTES + 8)
    assert_error(raw, ErrorCode.MALFORMED_FRAME, "layout block", server=server)
    raw.close()


def bf16(values) -> np.ndarray:
    """float32 values as bfloat16 words (exact for the values used here)."""
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_compressed_gradients_are_checked(cluster):
    """A bf16 gradient is taken over TCP only, at half the bytes; a wrong size, NaN or
    infinity in 16 bits, or a narrowed pull of another type, is refused and changes nothing."""
    raw = cluster.raw
    cluster.train(1)
    if raw.transport == "tcp":
        raw.push(bf16(np.ones(N + 2)), dtype=DType.BFLOAT16, version=1)
        assert_error(raw, ErrorCode.PAYLOAD_SIZE_MISMATCH, f"{2 * N} bytes as bfloat16", server=cluster.server)
        for bad in (np.nan, np.inf, -np.inf):
            raw.push(bf16([1, bad, 1, 1]), dtype=DType.BFLOAT16, version=1)
            assert_error(raw, ErrorCode.NON_FINITE_GRADIENT, "NaN or infinity", server=cluster.server)
        half = np.array([1, 1, 1, 1], np.float16)
        half[1] = np.inf
        raw.push(half.view(np.uint16), dtype=DType.FLOAT16, version=1)
        assert_error(raw, ErrorCode.NON_FINITE_GRADIENT, "NaN or infinity", server=cluster.server)
    else:
        raw.send(pack_header(Op.PUSH, 0, DType.BFLOAT16, 0, 0, 1, 0))
        assert_error(raw, ErrorCode.DTYPE_MISMATCH, "only, not shm", server=cluster.server)
    raw.frame(Op.PULL, flags=Flag.NARROW, dtype=DType.FLOAT64)
    assert_error(raw, ErrorCode.DTYPE_MISMATCH, "not float64")  # (the log is rate-limited by now)
    if raw.transport == "shm":
        raw.frame(Op.PULL, flags=Flag.NARROW, dtype=DType.BFLOAT16)
        assert_error(raw, ErrorCode.DTYPE_MISMATCH, "TCP only, not shm")
    cluster.train(1)  # nothing of rank 1's was applied
    raw.push(np.zeros(N, np.float32))
    header, _ = raw.reply()
    assert header.op == Op.PUSH_REPLY and header.clock == 1


def test_compressed_push_and_narrowed_pull_by_hand(server_process):
    """The wire format, byte for byte: a bf16 push is applied as its float32 value, and a
    narrowed pull returns the weights as bf16 words (rounded to nearest even)."""
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    raw = RawClient(server.port)
    raw.init(0, 1, {"w": np.zeros(N, np.float32)})
    assert raw.reply()[0].op == Op.INIT_REPLY
    grad = np.array([1.0, -2.5, 0.0078125, 3.0e-3], np.float32)
    words = (grad.view(np.uint32) + 0x7FFF + ((grad.view(np.uint32) >> 16) & 1)) >> 16
    raw.push(words.astype(np.uint16), op=Op.PUSH_PULL, dtype=DType.BFLOAT16)
    header, payload = raw.reply()
    assert header.op == Op.PUSH_PULL_REPLY and header.dtype == DType.FLOAT32 and len(payload) == 4 * N
    applied = -(words.astype(np.uint32) << 16).view(np.float32)
    assert np.frombuffer(payload, np.float32).tolist() == applied.tolist()
    raw.frame(Op.PULL, flags=Flag.NARROW, dtype=DType.BFLOAT16)
    header, payload = raw.reply()
    assert header.op == Op.PULL_REPLY and header.dtype == DType.BFLOAT16 and len(payload) == 2 * N
    expected = np.empty(N, np.uint16)
    aps._core.narrow(expected, applied, aps._core.BFLOAT16)
    assert np.frombuffer(payload, np.uint16).tolist() == expected.tolist()
    raw.frame(Op.PULL, flags=Flag.NARROW, dtype=DType.FLOAT16)
    header, payload = raw.reply()
    assert header.dtype == DType.FLOAT16
    assert np.frombuffer(payload, np.float16).tolist() == applied.astype(np.float16).tolist()
    raw.close()


def test_a_push_that_skips_a_round_is_refused_unless_bsp_and_empty(cluster):
    """Flag.SKIP (a sharded BSP worker taking no part in a round) is for BSP only, and carries
    nothing; anything else is refused and changes nothing."""
    skip = {"flags": int(Flag.SKIP), "dtype": int(DType.FLOAT32)}
    cluster.raw.frame(Op.PUSH_PULL, **skip)
    assert_error(cluster.raw, ErrorCode.MALFORMED_FRAME, "only a BSP round can be skipped; this server runs asp",
                 server=cluster.server)
    cluster.raw.frame(Op.PUSH_PULL, np.ones(N, np.float32).tobytes(), **skip)
    assert_error(cluster.raw, ErrorCode.MALFORMED_FRAME, "carries nothing: no gradient, no rows")
    cluster.raw.frame(Op.PING)
    assert cluster.raw.reply()[0].op == Op.PING_REPLY


def test_a_push_that_waits_at_the_gate_carries_a_dense_gradient_alone(cluster):
    """Flag.GATE (a pipelined push waits at the SSP/DSSP gate rather than being refused) is for a
    dense gradient alone; with rows it is refused and changes nothing. On a worker the policy
    does not hold (ASP holds none) it is an ordinary push."""
    gate = {"flags": int(Flag.GATE | Flag.ROWS), "dtype": int(DType.FLOAT32)}
    cluster.raw.frame(Op.PUSH, np.ones(N, np.float32).tobytes(), **gate)
    assert_error(cluster.raw, ErrorCode.MALFORMED_FRAME, "carries a dense gradient alone, no rows",
                 server=cluster.server)
    if cluster.raw.transport == "tcp":
        cluster.raw.frame(Op.PUSH, np.zeros(N, np.float32).tobytes(), flags=int(Flag.GATE), dtype=int(DType.FLOAT32))
        header, _ = cluster.raw.reply()
        assert header.op == Op.PUSH_REPLY and header.clock == 1
