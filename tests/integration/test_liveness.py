"""Nothing waits forever: the worker's heartbeat and requests share one lock, its heartbeat
survives reconnect(), it learns that its server hung, and the server says it is alive while
it holds a request."""

import signal
import socket
import threading
import time

import numpy as np
import pytest

import aps


def test_heartbeats_and_requests_never_race_for_the_request_id(transport):
    """A heartbeat interval shorter than a step makes the heartbeat thread ping between
    (and, before, in the middle of) requests; thousands of steps go through without a protocol error."""
    with aps.Server(workers=1, sync="asp", port=0, log_level="warning").run_in_background() as background:
        with aps.Worker(background.address, 0, 1, transport=transport, heartbeat=0.002) as worker:
            worker.init({"w": np.zeros(16, np.float32)})
            for step in range(2000):
                worker.push_pull(worker.grads)
                if step % 2:
                    time.sleep(0.0015)  # idle long enough, now and then, for a ping to go out
            assert worker.clock == 2000 and worker.ping() == 2000


def test_reconnect_restores_the_heartbeat(server_process, transport, caplog):
    server = server_process("--workers", "1", "--sync", "asp", "--heartbeat-timeout", "1")
    worker = aps.Worker(server.address, 0, 1, transport=transport, heartbeat=0.2)
    worker.init({"w": np.zeros(4, np.float32)})
    worker.shards[0]._conn.sock.shutdown(socket.SHUT_RDWR)  # the connection breaks under the worker while it idles
    deadline = time.monotonic() + 5
    while worker.shards[0]._heartbeat_thread.is_alive():  # its heartbeat fails and stops
        assert time.monotonic() < deadline
        time.sleep(0.02)
    worker.reconnect()
    time.sleep(2.5)  # idle for more than twice the server's heartbeat timeout
    worker.push_pull(worker.grads)  # still seated: the heartbeat came back with the connection
    assert "missed heartbeats" not in server.log()
    worker.close()


def test_a_worker_held_at_the_gate_hears_that_the_server_is_alive(server_process, transport):
    """A pull held for longer than server_timeout is not mistaken for a dead server:
    the server sends ALIVE notices while it holds the request."""
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "0", "--heartbeat-timeout", "1.5")
    fast = aps.Worker(server.address, 0, 2, transport=transport, server_timeout=1.0)
    slow = aps.Worker(server.address, 1, 2, transport=transport, heartbeat=0.2)
    joining = threading.Thread(target=slow.init, args=({"w": np.zeros(4, np.float32)},))
    joining.start()
    fast.init({"w": np.zeros(4, np.float32)})
    joining.join(10)
    fast.push(fast.grads)
    releaser = threading.Timer(3.0, lambda: slow.push(slow.grads))  # three server timeouts later
    releaser.start()
    start = time.monotonic()
    fast.pull()  # held at the gate until the slow worker pushes
    assert time.monotonic() - start > 2.5
    releaser.join()
    fast.close()
    slow.close()


def test_a_hung_server_is_noticed_instead_of_blocking_forever(server_process, transport):
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "0")
    workers = [aps.Worker(server.address, r, 2, transport=transport, server_timeout=1.5, reconnect=False) for r in range(2)]
    joining = threading.Thread(target=workers[1].init, args=({"w": np.zeros(4, np.float32)},))
    joining.start()
    workers[0].init({"w": np.zeros(4, np.float32)})
    joining.join(10)
    workers[0].push(workers[0].grads)
    server.signal(signal.SIGSTOP)  # the server hangs while rank 0 waits at the gate
    try:
        start = time.monotonic()
        with pytest.raises(aps.ServerSilent, match="has sent nothing for 1.5 s") as raised:
            workers[0].pull()
        assert 1.4 < time.monotonic() - start < 10
        assert isinstance(raised.value, TimeoutError) and isinstance(raised.value, ConnectionError)
        with pytest.raises(aps.ServerSilent, match="call reconnect"):
            workers[0].pull()  # the connection was dropped: later calls say why
    finally:
        server.signal(signal.SIGCONT)
    for w in workers:
        w.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_server_stopped_for_good_ends_its_workers_calls_at_once(server_process, client, signum):
    """Without --checkpoint-dir nothing can take the run up again: the workers' calls end with
    ShuttingDown at once (saying so), not after reconnect_timeout seconds of knocking."""
    server = server_process("--workers", "1", "--sync", "asp")
    worker = client(server.address, 0, 1, reconnect_timeout=30)
    worker.init({"w": np.zeros(8, np.float32)})
    worker.push_pull(worker.grads)
    server.signal(signum)
    assert server.proc.wait(10) == 0
    started = time.monotonic()
    with pytest.raises(aps.ShuttingDown) as raised:
        worker.push_pull(worker.grads)
    assert raised.value.resumable is False, raised.value
    assert "for good" in str(raised.value) and "no --checkpoint-dir" in str(raised.value)
    with pytest.raises(aps.ShuttingDown):  # and a later call does not wait either
        worker.pull()
    assert time.monotonic() - started < 3
    worker.close()


def test_a_server_that_can_be_resumed_says_so_and_its_workers_wait_for_it(tmp_path, caplog):
    """With --checkpoint-dir the server checkpoints as it stops and says how to resume it: its
    worker waits (saying how long, and how to stop waiting) and goes on with the resumed server."""
    from aps.testing import ServerProcess

    flags = ("--workers", "1", "--sync", "asp", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0")
    server = ServerProcess(*flags)
    resumed = []
    try:
        worker = aps.Worker(server.address, 0, 1, transport="tcp", reconnect_timeout=30)
        worker.init({"w": np.zeros(8, np.float32)})
        worker.push_pull(worker.grads)
        server.signal(signal.SIGINT)
        assert server.proc.wait(10) == 0
        timer = threading.Timer(0.5, lambda: resumed.append(ServerProcess(*flags, "--resume", "--port",
                                                                          str(server.port))))
        timer.start()
        with caplog.at_level("WARNING", logger="aps.worker"):
            worker.push_pull(worker.grads)  # waits for the resumed server, then goes on
        timer.join()
        assert worker.version == 2 and resumed[0].alive()
        lost = next(r.getMessage() for r in caplog.records if "lost the server" in r.getMessage())
        assert f"it checkpoints to {tmp_path}" in lost and f"--checkpoint-dir {tmp_path} --resume" in lost, lost
        assert "reconnecting for up to 30 s (to stop waiting: Ctrl-C, or reconnect_timeout=" in lost, lost
        worker.close()
    finally:
        server.stop()
        for other in resumed:
            other.stop()
