"""Bounded resources: a peer that sends garbage, connects too often, crawls, or vanishes
mid-frame costs the server a bounded amount of memory, descriptors and log, and the
legitimate worker keeps training. Real server processes, loopback only."""

import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

import aps
from aps.errors import ErrorCode
from aps.wire.protocol import DType, Op, encode_init, pack_header
from aps.wire.segments import default_socket_path
from aps.server.connection import MAX_BAD_FRAMES, WARNINGS_PER_WINDOW
from aps.testing.fuzzing import Target
from aps.testing import RawClient, RawShmClient


from aps.testing import TOKEN


def trained(server, transport="tcp", steps=3, token=None) -> bool:
    with aps.Worker(server.address, 0, 1, transport=transport, token=token) as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        for _ in range(steps):
            worker.push_pull(worker.grads)
        return worker.version >= steps


def test_a_connection_sending_only_bad_frames_is_closed_and_its_warnings_are_few(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp")
    raw = RawClient.to(server, transport)
    for i in range(MAX_BAD_FRAMES):
        raw.frame(0x42, b"x" * 100, request_id=i + 1)  # and it reads none of the replies
    assert raw.closed_by_peer()
    raw.close()
    log = server.wait_for_log(f"{MAX_BAD_FRAMES} refused frames in a row")
    assert log.count("UNKNOWN_OP") <= WARNINGS_PER_WINDOW + 1
    assert "more warnings about it were not logged" in server.wait_for_log("were not logged")
    assert trained(server, transport)


def test_a_good_request_resets_the_count_of_bad_ones(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    raw = RawClient(server.port)
    for round_ in range(3):
        for _ in range(MAX_BAD_FRAMES - 1):
            raw.frame(0x42)
            assert raw.error()[0] == ErrorCode.UNKNOWN_OP
        raw.frame(Op.PING)
        assert raw.reply()[0].op == Op.PING_REPLY
    raw.close()


def test_error_replies_wait_for_the_reader_like_any_reply(server_process):
    """A peer that pipelines bad frames and does not read: the server answers one and waits."""
    server = server_process("--workers", "1", "--sync", "asp")
    raw = RawClient(server.port)
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    big = b"y" * 60_000
    for i in range(MAX_BAD_FRAMES - 2):  # each refused frame is answered only after the last answer left
        raw.frame(0x42, big, request_id=i + 1)
    time.sleep(0.5)
    assert server.alive() and trained(server)
    ids = [raw.reply()[0].request_id for _ in range(MAX_BAD_FRAMES - 2)]
    assert ids == list(range(1, MAX_BAD_FRAMES - 1))  # all answered, in order
    raw.close()


def test_connections_beyond_the_limit_are_refused_cleanly(server_process, transport):
    """When every connection is a trusted one (it proved the token), one more is refused."""
    server = server_process("--workers", "1", "--sync", "asp", "--max-connections", "4", "--token", TOKEN)
    path = server.unix_path  # asked (over a connection of its own) before the server is full
    time.sleep(0.3)  # that connection's close reaches the server

    def connect(authenticate=True):
        raw = RawClient(server.port) if transport == "tcp" else RawShmClient(path)
        if authenticate:
            Target(server.port, None, TOKEN.encode()).handshake(raw.sock)
        return raw

    held = [connect() for _ in range(4)]
    extra = connect(authenticate=False)
    code, message = extra.error()
    assert code == ErrorCode.OVERLOADED and "--max-connections" in message
    assert extra.closed_by_peer()
    extra.close()
    with pytest.raises(aps.errors.ServerOverloaded):  # a worker hears it too, with a clear error
        with aps.Worker(server.address, 0, 1, transport=transport, token=TOKEN) as worker:
            worker.init({"w": np.zeros(4, np.float32)})
    for raw in held:
        raw.close()
    time.sleep(0.2)
    assert trained(server, transport, token=TOKEN)


def test_strangers_make_room_for_newcomers(server_process, transport):
    """Peers that only hold a connection (they never authenticate) cannot lock the workers out:
    at the limit, the oldest of them is dropped to let a new connection in."""
    server = server_process("--workers", "1", "--sync", "asp", "--max-connections", "4", "--token", TOKEN)
    path = server.unix_path
    time.sleep(0.3)
    squatters = []
    try:
        for _ in range(4):
            raw = RawClient(server.port) if transport == "tcp" else RawShmClient(path)
            squatters.append(raw)
            raw.frame(Op.HELLO, os.urandom(32))  # a HELLO now and then, never an AUTH
            assert raw.reply()[0].op == Op.HELLO_REPLY
        assert trained(server, transport, token=TOKEN)  # the worker gets in all the same
        assert "made room for a newer connection" in server.log()  # at the cost of a squatter
        assert sum(raw.closed_by_peer(timeout=1) for raw in squatters) >= 1
    finally:
        for raw in squatters:
            raw.close()


def test_slow_and_silent_peers_are_closed_at_the_handshake_deadline(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp", "--handshake-timeout", "1", "--insecure")
    silent = RawClient.to(server, transport)
    crawling = RawClient.to(server, transport)
    start = time.monotonic()
    frame = pack_header(Op.PING)
    for byte in frame[:20]:  # a byte every 0.2 s: never a whole frame
        try:
            crawling.send(bytes([byte]))
        except OSError:  # closed by the server: what should happen
            break
        time.sleep(0.2)
    assert silent.closed_by_peer(timeout=5) and crawling.closed_by_peer(timeout=5)
    assert time.monotonic() - start < 6
    silent.close()
    crawling.close()
    assert "completed no frame within 1 s" in server.log()
    with aps.Worker(server.address, 0, 1, transport=transport, heartbeat=0.2) as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        time.sleep(2)  # a joined worker is not held to the handshake deadline
        worker.push_pull(worker.grads)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux) to lower the descriptor limit")
def test_running_out_of_descriptors_neither_spins_nor_floods_the_log(tmp_path):
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["prlimit", "--nofile=48:48", sys.executable, "-m", "aps", "serve", "--host", "127.0.0.1", "--port", "0",
             "--workers", "1", "--sync", "asp", "--handshake-timeout", "60"],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
    try:
        address = proc.stdout.readline().split()[-1]
        port = int(address.rsplit(":", 1)[1])
        socks = []
        for _ in range(60):
            socks.append(socket.create_connection(("127.0.0.1", port)))
        for _ in range(60):
            unix = socket.socket(socket.AF_UNIX)
            unix.connect(default_socket_path(port))
            socks.append(unix)
        server = psutil.Process(proc.pid)
        before = sum(server.cpu_times()[:2])
        time.sleep(2)
        assert sum(server.cpu_times()[:2]) - before < 0.5  # no busy loop on the pending connections
        for s in socks:
            s.close()
        time.sleep(0.6)
        with aps.Worker(address, 0, 1) as worker:  # and it serves again once descriptors are free
            worker.init({"w": np.zeros(4, np.float32)})
            worker.push_pull(worker.grads)
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
    assert log_path.read_text().count("accepting a connection failed") <= 5


def test_a_dropped_connection_frees_its_buffers_at_once(tmp_path):
    """A connection that dies in the middle of 256 MiB of initial weights gives the memory back
    right away, with the garbage collector off (no reference cycle keeps the buffer)."""
    code = "import gc, sys; gc.disable(); from aps.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--host", "127.0.0.1", "--port", "0",
                             "--workers", "2", "--sync", "asp", "--log-level", "error"],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().split()[-1].rsplit(":", 1)[1])
        server = psutil.Process(proc.pid)
        base = server.memory_info().rss
        layout = aps.Layout(("w",), ((64 << 20,),))
        block = encode_init(0, 2, layout)
        for _ in range(3):
            raw = RawClient(port)
            raw.send(pack_header(Op.INIT, 0, DType.FLOAT32, 1, 0, len(block), len(block) + layout.nbytes), block)
            raw.sock.sendall(bytes(layout.nbytes // 2))
            time.sleep(0.3)
            raw.close()
            time.sleep(0.3)
            assert server.memory_info().rss - base < 64 << 20
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def test_a_stale_unix_socket_is_replaced_and_a_live_one_kept(server_process):
    directory = os.path.dirname(default_socket_path(1))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    stale_path = os.path.join(directory, "1.sock")  # as a server on port 1 killed with -9 would leave it
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(stale_path)
    stale.close()
    live = server_process("--workers", "1", "--sync", "asp")
    assert not os.path.exists(stale_path)
    other = server_process("--workers", "1", "--sync", "asp")
    assert os.path.exists(live.unix_path) and os.path.exists(other.unix_path)
    assert trained(live, "shm") and trained(other, "shm")


def test_a_stranger_that_only_keeps_its_connection_is_closed(server_process, transport):
    """A peer that never joins (no token) is closed at the handshake deadline, however busy it keeps."""
    server = server_process("--workers", "1", "--sync", "asp", "--handshake-timeout", "1", "--insecure")
    raw = RawClient.to(server, transport)
    start = time.monotonic()
    try:
        while time.monotonic() - start < 5:
            raw.frame(Op.PING)
            assert raw.reply()[0].op == Op.PING_REPLY
            time.sleep(0.2)
    except (OSError, EOFError, AssertionError):
        pass
    assert raw.closed_by_peer(timeout=2) and time.monotonic() - start < 4
    assert "neither joined nor left within 1 s" in server.log()
    raw.close()


def test_init_headers_alone_cost_the_server_nothing(server_process):
    """A header promising a 4 MiB layout block reserves nothing until the bytes arrive."""
    server = server_process("--workers", "2", "--sync", "asp", "--max-connections", "300", "--insecure")
    before = psutil.Process(server.proc.pid).memory_info().rss
    promises = []
    for _ in range(200):
        raw = RawClient(server.port)
        raw.send(pack_header(Op.INIT, 0, DType.FLOAT32, 1, 0, 4 << 20, 4 << 20))
        promises.append(raw)
    time.sleep(0.5)
    grew = psutil.Process(server.proc.pid).memory_info().rss - before
    assert grew < 64 << 20, f"{grew >> 20} MiB for 200 headers"
    for raw in promises:
        raw.close()
