"""Workers leaving, dying and rejoining (docs/algorithms.md, Membership)."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import aps
from aps.testing import workers as _workers
from aps.testing import SPAWN


def start_idle_worker(address, rank, workers, numel, tmp_path, transport="auto"):
    ready = tmp_path / f"ready-{rank}"
    proc = SPAWN.Process(
        target=_workers.idle_worker, args=(address, rank, workers, numel, str(ready), transport), daemon=True
    )
    proc.start()
    return proc, ready


def wait_for(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def init_in_thread(worker, params):
    thread = threading.Thread(target=worker.init, args=(params,), daemon=True)
    thread.start()
    return thread


def test_a_killed_worker_leaves_at_once_and_nobody_waits_for_it(server_process, tmp_path, transport):
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "0")
    idle, ready = start_idle_worker(server.address, 1, 2, 4, tmp_path, transport)
    with aps.Worker(server.address, 0, 2, transport=transport) as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        wait_for(ready)
        worker.push({"w": np.ones(4, np.float32)})
        released = threading.Event()
        thread = threading.Thread(target=lambda: (worker.pull(), released.set()), daemon=True)
        thread.start()
        assert not released.wait(0.5), "s=0: rank 0 must wait for rank 1"
        os.kill(idle.pid, signal.SIGKILL)
        assert released.wait(10), "rank 0 still waits for a dead worker"
        thread.join()
        server.wait_for_log("worker 1 disconnected")
        # With rank 1 gone, rank 0 trains alone.
        for _ in range(3):
            worker.push_pull({"w": np.ones(4, np.float32)})
        assert worker.clock == 4
    idle.join(5)


def test_rejoin_under_the_same_rank_resumes_at_the_slowest_clock(server_process, tmp_path, transport):
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "3", "--lr", "1")
    idle, ready = start_idle_worker(server.address, 1, 2, 2, tmp_path, transport)
    with aps.Worker(server.address, 0, 2, transport=transport) as worker:
        worker.init({"w": np.zeros(2, np.float32)})
        wait_for(ready)
        os.kill(idle.pid, signal.SIGKILL)
        server.wait_for_log("worker 1 disconnected")
        for _ in range(5):
            worker.push_pull({"w": np.ones(2, np.float32)})
        # Training has started: a rejoining worker's init returns at once with the newest weights.
        with aps.Worker(server.address, 1, 2, transport=transport) as again:
            weights = again.init({"w": np.zeros(2, np.float32)}, timeout=5)
            assert weights["w"].tolist() == [-5.0, -5.0] and again.version == 5
            assert again.clock == 5  # the slowest live worker's clock
            again.push_pull({"w": np.ones(2, np.float32)})
            assert again.clock == 6
    idle.join(5)


def test_init_times_out_with_a_clear_error(server_process):
    server = server_process("--workers", "2")
    worker = aps.Worker(server.address, 0, 2)
    with pytest.raises(aps.InitTimeout, match="2 workers"):
        worker.init({"w": np.zeros(2, np.float32)}, timeout=0.5)
    worker.close()
    server.wait_for_log("worker 0 disconnected")


def test_close_leaves_gracefully(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    worker = aps.Worker(server.address, 0, 1, reconnect=False)
    worker.init({"w": np.zeros(2, np.float32)})
    worker.close()
    server.wait_for_log("worker 0 left")
    worker.close()  # idempotent
    with pytest.raises(aps.APSConnectionError):
        worker.pull()


def test_reconnect_after_losing_the_connection(server_process, transport):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    worker = aps.Worker(server.address, 0, 1, transport=transport, reconnect=False)
    worker.init({"w": np.zeros(2, np.float32)})
    worker.push_pull({"w": np.ones(2, np.float32)})
    worker.shards[0]._conn.sock.shutdown(2)  # the network drops the connection
    with pytest.raises(aps.APSConnectionError):
        worker.pull()
    server.wait_for_log("worker 0 disconnected")
    grads = worker.grads["w"]
    weights = worker.reconnect()
    assert weights["w"].tolist() == [-1.0, -1.0] and worker.version == 1
    assert worker.grads["w"] is grads and worker.transport == transport  # the same buffers, the same way
    worker.push_pull({"w": np.ones(2, np.float32)})
    assert worker.version == 2
    worker.close()


def test_a_silent_worker_misses_its_heartbeats_and_leaves(server_process, transport):
    from aps.testing import RawClient

    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "0", "--heartbeat-timeout", "1")
    with aps.Worker(server.address, 0, 2, heartbeat=0.2, transport=transport) as worker:
        thread = init_in_thread(worker, {"w": np.zeros(4, np.float32)})
        silent = RawClient.to(server, transport)
        silent.init(1, 2, {"w": np.zeros(4, np.float32)})
        silent.reply()  # joined; then it hangs without closing its socket
        thread.join(10)
        worker.push({"w": np.ones(4, np.float32)})
        start = time.monotonic()
        worker.pull()  # held by rank 1 until the server gives up on it
        assert 0.5 < time.monotonic() - start < 10
        server.wait_for_log("missed heartbeats")
        server.wait_for_log("worker 1 timed out")
        assert silent.closed_by_peer()
        silent.close()


def test_heartbeats_keep_an_idle_worker_seated(server_process, transport):
    server = server_process("--workers", "2", "--sync", "asp", "--heartbeat-timeout", "0.6")
    pinging = aps.Worker(server.address, 0, 2, heartbeat=0.1, transport=transport, reconnect=False)
    mute = aps.Worker(server.address, 1, 2, heartbeat=None, transport=transport, reconnect=False)
    threads = [init_in_thread(w, {"w": np.zeros(2, np.float32)}) for w in (pinging, mute)]
    for t in threads:
        t.join(10)
    time.sleep(2.0)  # a long iteration
    pinging.push_pull({"w": np.ones(2, np.float32)})
    with pytest.raises(aps.APSConnectionError):
        mute.push_pull({"w": np.ones(2, np.float32)})
    assert "rank 0" not in "".join(line for line in server.log().splitlines() if "missed heartbeats" in line)
    pinging.close()
    mute.close()


def test_a_waiting_worker_learns_that_the_server_shuts_down(server_process, transport):
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "0")
    workers = [aps.Worker(server.address, r, 2, transport=transport, reconnect=False) for r in range(2)]
    threads = [init_in_thread(w, {"w": np.zeros(2, np.float32)}) for w in workers]
    for t in threads:
        t.join(10)
    workers[0].push({"w": np.ones(2, np.float32)})
    errors = []
    thread = threading.Thread(target=lambda: _record(errors, workers[0].pull), daemon=True)
    thread.start()
    time.sleep(0.3)
    server.signal(signal.SIGTERM)
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], aps.errors.ShuttingDown)
    assert isinstance(errors[0], ConnectionError)
    assert server.proc.wait(10) == 0
    for w in workers:
        w.close()


def _record(errors, call):
    try:
        call()
    except aps.APSError as exc:
        errors.append(exc)


def test_a_waiting_worker_says_who_is_missing(server_process, transport, monkeypatch, caplog):
    """init() waits in silence no longer: a log line names who has not joined, and so does InitTimeout."""
    monkeypatch.setattr(aps.client.recovery, "_FIRST_WAIT_NOTE", 1.0)
    server = server_process("--workers", "4", "--sync", "asp")
    early = aps.Worker(server.address, 2, 4, transport=transport)
    errors = []
    thread = threading.Thread(target=_record, args=(errors, lambda: early.init({"w": np.zeros(2, np.float32)},
                                                                               timeout=4.0)), daemon=True)
    thread.start()
    worker = aps.Worker(server.address, 0, 4, transport=transport)
    with caplog.at_level("WARNING", logger="aps.worker"):
        with pytest.raises(aps.InitTimeout, match=r"2 of 4 workers joined; missing ranks 1, 3$"):
            worker.init({"w": np.zeros(2, np.float32)}, timeout=2.5)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rank 0: waiting")]
    assert len(notes) == 1, notes  # one line after the first second, not one per notice
    assert notes[0].startswith(f"rank 0: waiting for the other workers at {server.address} for 1 s: ")
    assert notes[0].endswith("2 of 4 workers joined; missing ranks 1, 3")
    thread.join(10)
    assert isinstance(errors[0], aps.InitTimeout) and "1 of 4 workers joined; missing ranks 0-1, 3" in str(errors[0])
    worker.close()
    early.close()


def test_joining_a_running_model_says_the_values_were_not_used(server_process, transport, caplog):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    first = aps.Worker(server.address, 0, 2, transport=transport)
    second = aps.Worker(server.address, 1, 2, transport=transport)
    with caplog.at_level("WARNING", logger="aps.worker"):
        thread = init_in_thread(first, {"w": np.zeros(2, np.float32)})
        second.init({"w": np.zeros(2, np.float32)})  # a fresh model: nothing to say
        thread.join(10)
        assert not [r for r in caplog.records if "running model" in r.getMessage()]
        first.push_pull({"w": np.ones(2, np.float32)})
        second.close()
        again = aps.Worker(server.address, 1, 2, transport=transport)
        weights = again.init({"w": np.full(2, 7.0, np.float32)})
        np.testing.assert_array_equal(weights["w"], [-1.0, -1.0])  # the server's weights, as before
        notes = [r.getMessage() for r in caplog.records if "running model" in r.getMessage()]
        assert notes == [f"rank 1 joined a running model at {server.address} at version 1: the values passed "
                         "to init() were not used; the server's weights were returned"]
        again.reconnect()  # a rejoin passes no values: nothing to say
        assert len([r for r in caplog.records if "running model" in r.getMessage()]) == 1
    again.close()
    first.close()


def test_a_failed_init_leaves_no_spurious_warning(server_process, transport):
    server = server_process("--workers", "2", "--sync", "asp")
    worker = aps.Worker(server.address, 0, 3, transport=transport)
    with pytest.raises(aps.errors.WorkerCountMismatch):
        worker.init({"w": np.zeros(2, np.float32)})
    worker.close()
    with aps.Worker(server.address, 0, 2, transport=transport) as probe:
        probe.ping()  # the server has handled everything the first worker sent
    log = server.log()
    assert "WORKER_COUNT_MISMATCH" in log and "NOT_INITIALIZED" not in log


def test_shutdown_mid_training_is_the_same_error_on_both_transports(server_process, transport):
    """A worker busy pushing when the server stops learns why: ShuttingDown, not a broken pipe."""
    server = server_process("--workers", "1", "--sync", "asp")
    worker = aps.Worker(server.address, 0, 1, transport=transport, heartbeat=0.2, reconnect=False)
    worker.init({"w": np.zeros(1000, np.float32)})
    server.signal(signal.SIGTERM)
    with pytest.raises(aps.APSConnectionError) as raised:
        for _ in range(1_000_000):
            worker.push_pull(worker.grads)
    assert isinstance(raised.value, aps.errors.ShuttingDown), repr(raised.value)
    with pytest.raises(aps.errors.ShuttingDown, match="call reconnect"):  # and so does every later call
        worker.pull()
    assert server.proc.wait(10) == 0
    worker.close()


def _push_after_the_heartbeat_found_it_lost(server, transport: str, caplog, alone: int) -> aps.Worker:
    """Rank 1 of 2 joins, holds clock 0 and version 0 and goes quiet; the server drops it
    and rank 0 runs ``alone`` iterations; rank 1's heartbeat then finds its connection gone,
    and it pushes a gradient computed before (100 in every weight): its push rejoins first,
    which brings a newer clock and version, and only then goes out. Returns rank 1."""
    zeros = {"w": np.zeros(4, np.float32)}
    quiet = aps.Worker(server.address, 1, 2, heartbeat=3.0, transport=transport, reconnect=True)
    with aps.Worker(server.address, 0, 2, heartbeat=0.2, transport=transport) as worker:
        thread = init_in_thread(quiet, zeros)
        worker.init(zeros)
        thread.join(10)
        server.wait_for_log("worker 1 timed out")
        for _ in range(alone):
            worker.push_pull({"w": np.ones(4, np.float32)})
        assert worker.version == alone
        with caplog.at_level("WARNING", logger="aps.worker"):
            deadline = time.monotonic() + 15
            while "heartbeat failed" not in caplog.text:
                assert time.monotonic() < deadline, "rank 1's heartbeat never found its connection lost"
                time.sleep(0.05)
        assert quiet.clock == 0 and quiet.version == 0
        quiet.push({"w": np.full(4, 100.0, np.float32)})  # computed in iteration 0, on version 0
        return quiet


def test_a_push_whose_connection_was_found_lost_before_it_went_out_says_the_weights_it_was_computed_on(
        server_process, transport, caplog):
    """BSP: round 0 closes without rank 1; its push, computed on version 0, must still say
    version 0 once its rejoin brought version 1, and be dropped for the closed round, not be
    taken into round 1."""
    server = server_process("--workers", "2", "--sync", "bsp", "--heartbeat-timeout", "1", "--lr", "1",
                            "--momentum", "0")
    quiet = _push_after_the_heartbeat_found_it_lost(server, transport, caplog, alone=1)
    try:
        assert quiet.last_push_dropped, "a gradient of round 0 was taken into a later round"
        quiet.pull()  # released at once: its push ended its iteration
        assert quiet.version == 1
        np.testing.assert_array_equal(quiet.weights["w"], -np.ones(4, np.float32))
    finally:
        quiet.close()


def test_a_push_whose_connection_was_found_lost_before_it_went_out_says_the_clock_it_was_computed_in(
        server_process, transport, caplog):
    """SSP s=1: rank 0 runs ten iterations alone; rank 1's push, computed in iteration 0,
    must still say clock 0 once its rejoin brought a newer one, and be dropped as stale
    (docs/algorithms.md, "The bound across a reconnect"), not be taken ten iterations late."""
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "1", "--heartbeat-timeout", "1",
                            "--lr", "1", "--momentum", "0")
    quiet = _push_after_the_heartbeat_found_it_lost(server, transport, caplog, alone=10)
    try:
        assert quiet.last_push_dropped, "a gradient of iteration 0 was taken ten iterations late"
        quiet.pull()
        np.testing.assert_array_equal(quiet.weights["w"], np.full(4, -10.0, np.float32))
    finally:
        quiet.close()
