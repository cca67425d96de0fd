"""What only the shared-memory transport has: selection, its socket, its control frames, no leaks."""

import os
import signal
import stat

import numpy as np
import pytest

import aps
from aps.errors import ErrorCode
from aps.wire.protocol import DType, Flag, Op, pack_header
from aps.wire.segments import Segment, scm_rights
from aps.testing import workers as _workers
from aps.testing import SPAWN, RawShmClient, ServerProcess, mapped_memfds, memfd_inodes, run_processes, wait_for

N = 8


def test_auto_picks_shared_memory_on_the_same_host(server_process):
    server = server_process("--workers", "3", "--sync", "asp")
    workers = [aps.Worker(server.address, r, 3, transport=kind) for r, kind in enumerate(["auto", "tcp", "shm"])]
    assert [w.transport for w in workers] == ["shm", "tcp", "shm"]
    for w in workers:
        w.close()


def test_no_unix_socket_means_tcp(server_process):
    server = server_process("--workers", "1", "--unix-socket", "none")
    assert server.unix_path == ""
    with aps.Worker(server.address, 0, 1) as worker:
        assert worker.transport == "tcp"
    with pytest.raises(aps.ConfigurationError, match="does not share this host"):
        aps.Worker(server.address, 0, 1, transport="shm")


def test_the_socket_is_private_and_removed_on_exit(tmp_path):
    path = str(tmp_path / "private" / "aps.sock")
    server = ServerProcess("--workers", "1", "--unix-socket", path)
    try:
        assert server.unix_path == path
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    finally:
        assert server.stop() == 0
    assert not os.path.exists(path)


def test_a_stale_socket_left_by_a_killed_server_is_replaced(tmp_path):
    path = str(tmp_path / "aps.sock")
    first = ServerProcess("--workers", "1", "--unix-socket", path)
    first.proc.kill()  # SIGKILL: no chance to remove its socket
    first.proc.wait()
    first.stop()
    assert os.path.exists(path)
    second = ServerProcess("--workers", "1", "--unix-socket", path)
    try:
        with aps.Worker(second.address, 0, 1, transport="shm") as worker:
            worker.init({"w": np.zeros(2, np.float32)})
    finally:
        second.stop()


def test_a_live_socket_is_not_taken_over(tmp_path, server_process):
    path = str(tmp_path / "aps.sock")
    server_process("--workers", "1", "--unix-socket", path)
    with pytest.raises(RuntimeError, match="another server listens"):
        ServerProcess("--workers", "1", "--unix-socket", path)


def test_gradients_are_written_in_shared_memory(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    with aps.Worker(server.address, 0, 1, transport="shm") as worker:
        worker.init({"w": np.zeros(N, np.float32)})
        assert mapped_memfds(os.getpid(), "aps-grad-rank0"), "the gradient buffer is a shared segment"
        worker.grads["w"][:] = 2.0  # computed straight into shared memory ...
        worker.push_pull(worker.grads)  # ... so the push sends a bare header
        assert worker.weights["w"].tolist() == [-2.0] * N
        assert mapped_memfds(server.proc.pid, "aps-grad-rank0"), "the server reads it in place"


@pytest.fixture
def shm_cluster(server_process):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    good = aps.Worker(server.address, 0, 2, transport="shm")
    import threading

    thread = threading.Thread(target=good.init, args=({"w": np.zeros(N, np.float32)},), daemon=True)
    thread.start()
    raw = RawShmClient(server.unix_path)
    raw.init(1, 2, {"w": np.zeros(N, np.float32)})
    assert raw.reply()[0].op == Op.INIT_REPLY
    thread.join(10)
    yield server, good, raw
    assert server.alive()
    good.push_pull({"w": np.ones(N, np.float32)})  # the others keep training
    good.close()
    raw.close()


def test_malformed_control_frames(shm_cluster):
    server, good, raw = shm_cluster
    payload = np.ones(N, np.float32).tobytes()
    raw.send(pack_header(Op.PUSH, 0, DType.FLOAT32, 5, 0, 0, len(payload)) + payload)  # no SHM flag, a payload
    code, message = raw.error()
    assert code == ErrorCode.MALFORMED_FRAME and "no payload" in message
    raw.send(pack_header(Op.PUSH, int(Flag.SHM), DType.FLOAT32, 6, 0, 0, 0)[:30])  # a truncated header ...
    raw.send(pack_header(Op.PUSH, int(Flag.SHM), DType.FLOAT32, 6, 0, 0, 0)[30:])  # ... completed later
    header, _ = raw.reply()
    assert (header.op, header.request_id) == (Op.PUSH_REPLY, 6)
    server.wait_for_log("MALFORMED_FRAME")


def test_init_needs_a_big_enough_segment(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    raw = RawShmClient(server.unix_path)
    raw.init(0, 1, {"w": np.zeros(N, np.float32)}, with_segment=False)
    code, message = raw.error()
    assert code == ErrorCode.MALFORMED_FRAME and "descriptor" in message
    raw.init(0, 1, {"w": np.zeros(N, np.float32)}, segment_numel=N - 1)
    code, message = raw.error()
    assert code == ErrorCode.PAYLOAD_SIZE_MISMATCH
    raw.init(0, 1, {"w": np.zeros(N, np.float32)}, segment_numel=N)
    assert raw.reply()[0].op == Op.INIT_REPLY
    raw.close()


def test_a_flood_of_descriptors_closes_the_connection(shm_cluster):
    server, good, raw = shm_cluster
    segments = [Segment.create(4, "flood") for _ in range(8)]
    raw.sock.sendmsg([pack_header(Op.PING)], scm_rights([s.fd for s in segments]))
    assert raw.closed_by_peer()
    server.wait_for_log("too many file descriptors")
    server.wait_for_log("worker 1 disconnected")
    for s in segments:
        s.close()


def test_a_killed_worker_leaves_no_shared_memory_behind(server_process, tmp_path):
    """kill -9 of a worker: the server unmaps its gradient segment when it leaves."""
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    ready = tmp_path / "ready"
    victim = SPAWN.Process(target=_workers.idle_worker, args=(server.address, 1, 2, 1 << 16, str(ready), "shm"))
    victim.start()
    with aps.Worker(server.address, 0, 2, transport="shm") as worker:
        worker.init({"w": np.zeros(1 << 16, np.float32)})
        wait_for(ready.exists, 10.0, "the worker to join")
        assert mapped_memfds(server.proc.pid, "aps-grad-rank1")
        assert mapped_memfds(victim.pid, "aps-slot")  # it maps the server's snapshot slots
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        server.wait_for_log("worker 1 disconnected")
        worker.push_pull(worker.grads)  # the server runs on, and lets go of the dead worker's memory
        wait_for(lambda: not mapped_memfds(server.proc.pid, "aps-grad-rank1"), 10.0, "the segment to go")
    assert not [name for name in os.listdir("/dev/shm") if "aps" in name]  # nothing named, ever


def test_a_killed_server_leaves_no_shared_memory_behind(tmp_path):
    """kill -9 of the server: its workers learn it and let go of its slots."""
    server = ServerProcess("--workers", "1", "--sync", "asp")
    try:
        others = memfd_inodes(os.getpid(), "aps-slot")  # other tests' servers in this process
        worker = aps.Worker(server.address, 0, 1, transport="shm", heartbeat=None, reconnect=False)
        worker.init({"w": np.zeros(1 << 16, np.float32)})
        slots = memfd_inodes(os.getpid(), "aps-slot") - others
        assert slots
        server.proc.kill()
        server.proc.wait()
        with pytest.raises(aps.APSConnectionError):
            worker.pull()
        worker.close()
        assert not slots & memfd_inodes(os.getpid(), "aps-slot")
        assert not [name for name in os.listdir("/dev/shm") if "aps" in name]
    finally:
        server.stop()


def test_a_worker_killed_mid_push_changes_nothing_it_should_not(server_process):
    """Pushers of constant vectors, one killed at a random moment mid-training:
    the server survives and every snapshot stays a constant vector."""
    numel = 1 << 20
    server = server_process("--workers", "3", "--sync", "asp", "--lr", "1")
    victim = SPAWN.Process(target=_workers.constant_pusher, args=(server.address, 2, 3, numel, 10_000, "shm"))
    victim.start()
    jobs = [("push", (server.address, 0, 3, numel, 60, "shm")), ("check", (server.address, 1, 3, numel, 2.5, "shm"))]
    import threading

    killer = threading.Timer(1.2, lambda: os.kill(victim.pid, signal.SIGKILL))
    killer.start()
    results = run_processes(_workers.run_role, jobs, timeout=120)
    killer.join()
    victim.join(10)
    checks = [r for r in results if len(r) == 4]
    assert checks and checks[0][3] == 0, "a torn snapshot"
    server.wait_for_log("worker 2 disconnected")
    assert server.alive()
    with aps.Worker(server.address, 2, 3, transport="shm") as again:
        weights = again.init({"w": np.zeros(numel, np.float32)})["w"]
        assert (weights == weights[0]).all()


def test_segments_are_sealed_and_slots_are_read_only(server_process):
    """A co-located process can neither shrink a segment under the server's kernel (which
    would kill it with SIGBUS) nor write into a published snapshot."""
    import mmap

    from aps.wire.protocol import decode_slot
    from aps.wire.segments import ANCILLARY_SPACE, fds_from

    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    with aps.Worker(server.address, 0, 1, transport="shm") as worker:
        worker.init({"w": np.zeros(N, np.float32)})
        for size in (0, 4 * N + 4096):
            with pytest.raises(PermissionError):  # the worker's own gradient segment: sealed
                os.ftruncate(worker.shards[0]._conn.grad_segment.fd, size)
    raw = RawShmClient(server.unix_path)  # rejoins as rank 0 and keeps the slot's descriptor as sent
    raw.init(0, 1, {"w": np.zeros(N, np.float32)})
    data, ancdata, _, _ = raw.sock.recvmsg(4096, ANCILLARY_SPACE)
    (slot_fd,) = fds_from(ancdata)
    assert decode_slot(data[40:])[2]  # the reply said a descriptor came with it
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(slot_fd, 4 * N, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(slot_fd, b"\xff" * 16)
        with pytest.raises(OSError):
            os.ftruncate(slot_fd, 0)
        readable = mmap.mmap(slot_fd, 4 * N, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)  # reading is what it is for
        assert np.frombuffer(readable, np.float32).tolist() == [0.0] * N
        readable.close()
    finally:
        os.close(slot_fd)
        raw.close()


def test_the_server_refuses_an_unsealed_or_foreign_descriptor(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    raw = RawShmClient(server.unix_path)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 4 * N)
    raw.segment = Segment(unsealed, np.zeros(N, np.float32))
    raw.init(0, 1, {"w": np.zeros(N, np.float32)})
    code, message = raw.error()
    assert code == ErrorCode.MALFORMED_FRAME and "not sealed" in message
    read_end, write_end = os.pipe()
    raw.segment.close()
    raw.segment = Segment(read_end, np.zeros(N, np.float32))
    raw.init(0, 1, {"w": np.zeros(N, np.float32)})
    code, message = raw.error()
    assert code == ErrorCode.MALFORMED_FRAME and "not a sealable memory segment" in message
    os.close(write_end)
    raw.segment.close()
    raw.segment = None
    raw.init(0, 1, {"w": np.zeros(N, np.float32)})  # a proper one is taken
    assert raw.reply()[0].op == Op.INIT_REPLY
    raw.close()


def test_a_spinning_worker_trains_as_one_that_sleeps(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    with aps.Worker(server.address, 0, 1, transport="shm", spin=0.005) as worker:
        assert worker.shards[0]._conn.spin == 0.005
        worker.init({"w": np.zeros(4, np.float32)})
        for step in range(1, 21):
            assert worker.push_pull({"w": np.ones(4, np.float32)})["w"].tolist() == [-float(step)] * 4
        worker.reconnect()
        assert worker.shards[0]._conn.spin == 0.005, "a new connection spins too"
        assert worker.pull()["w"].tolist() == [-20.0] * 4
    with aps.Worker(server.address, 0, 1, transport="shm") as worker:
        assert worker.shards[0]._conn.spin == 0.0, "off unless asked for"
