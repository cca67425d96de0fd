"""Nobody stalls on a stuck peer: a frozen worker (SIGSTOP), a reader that never drains its
reply, a worker killed in the middle of a reply. Real server and worker processes."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import aps
from aps.wire.protocol import Op
from aps.testing import workers as _workers
from aps.testing import SPAWN, RawClient, SteadyCluster, wait_for

HEARTBEAT = 2.0


@pytest.mark.parametrize("sync", [["--sync", "bsp"], ["--sync", "ssp", "--staleness", "1"]], ids=["bsp", "ssp"])
@pytest.mark.parametrize("numel, transport", [(1024, "tcp"), (1024, "shm"), (16 << 20, "tcp")],
                         ids=["4KiB-tcp", "4KiB-shm", "64MiB-tcp"])
def test_a_frozen_worker_is_dropped_and_the_others_go_on(server_process, sync, numel, transport):
    cluster = SteadyCluster(server_process("--workers", "3", *sync, "--heartbeat-timeout", str(HEARTBEAT), "--lr", "0"),
                            3, numel, transport)
    try:
        cluster.wait_steps(range(3), 3, timeout=60)
        os.kill(cluster.procs[2].pid, signal.SIGSTOP)
        frozen = time.monotonic()
        # the others stop (BSP, SSP: they wait for the slowest) until the server drops the frozen one
        waited = cluster.wait_steps([0, 1], 10, timeout=HEARTBEAT + 10)
        log = cluster.server.log()
        # dropped by the server's heartbeat watch, or (a 64 MiB reply it stopped reading) by the kernel's
        # user timeout on the shut window: either way at the heartbeat timeout
        assert ("dropping it (it may rejoin)" in log or "Connection timed out" in log) and ("worker 2 timed out" in log or "worker 2 disconnected" in log)
        print(f"the others went on {waited:.2f} s after the freeze (heartbeat timeout {HEARTBEAT} s)")
        os.kill(cluster.procs[2].pid, signal.SIGCONT)  # it wakes up, hears why, and rejoins
        rank, kind, message = cluster.errors.get(timeout=30)
        assert rank == 2 and kind in ("Evicted", "APSConnectionError"), (kind, message)
        cluster.wait_steps([0, 1, 2], 3, timeout=30)
        assert time.monotonic() - frozen > HEARTBEAT  # it was not dropped before its time
    finally:
        cluster.close()


def test_a_reader_that_never_drains_its_reply_is_dropped(server_process):
    """A client asks for 64 MiB of weights and reads none of it (its window stays shut):
    the server drops it after the heartbeat timeout and a real worker goes on."""
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "0",
                            "--heartbeat-timeout", str(HEARTBEAT))
    numel = 16 << 20
    values = np.zeros(numel, np.float32)
    values.fill(0)  # its pages made before the raw client connects: it says nothing between handshake and INIT
    worker = aps.Worker(server.address, 1, 2, transport="tcp")
    joining = threading.Thread(target=worker.init, args=({"w": np.zeros(numel, np.float32)},))
    joining.start()
    raw = RawClient(server.port)  # connected last: idle past the heartbeat timeout, it would be dropped
    try:
        raw.init(0, 2, {"w": values})
        assert raw.reply()[0].op == Op.INIT_REPLY  # it reads this one
        # at once (a worker quiet for the heartbeat timeout after a reply is dropped for that): its reply is
        # held at the gate until rank 1 has pushed too, then leaves, 64 MiB that it never reads
        raw.push(np.zeros(numel, np.float32), op=Op.PUSH_PULL, request_id=2)
        joining.join(30)
        worker.push(worker.grads)
        worker.pull()
        start = time.monotonic()
        worker.push(worker.grads)  # ahead of rank 0 by one: held until rank 0 pushes, which it never will
        worker.pull()  # goes on once the server has dropped the reader that stopped reading
        assert time.monotonic() - start > HEARTBEAT
        # dropped by the server (timed out), or by the kernel (disconnected)
        wait_for(lambda: "worker 0 timed out" in server.log() or "worker 0 disconnected" in server.log(), 10.0,
                 "rank 0 to be dropped")
        log = server.log()
        # the server's drain deadline, or the kernel's user timeout on a window that stayed shut
        assert "read nothing of its reply" in log or "Connection timed out" in log, log
    finally:
        raw.close()
        worker.close()
        joining.join(30)


def test_a_worker_killed_in_the_middle_of_a_reply_leaves_and_nobody_waits(server_process, tmp_path):
    server = server_process("--workers", "2", "--sync", "bsp", "--heartbeat-timeout", str(HEARTBEAT))
    numel = 16 << 20
    victim = SPAWN.Process(target=_workers.idle_worker,
                           args=(server.address, 0, 2, numel, str(tmp_path / "ready"), "tcp"), daemon=True)
    victim.start()
    worker = aps.Worker(server.address, 1, 2, transport="tcp")
    worker.init({"w": np.zeros(numel, np.float32)})  # both joined: the victim's INIT reply (64 MiB) is leaving
    while not (tmp_path / "ready").exists():
        time.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    worker.push(worker.grads)  # BSP: the round closes without the dead one
    worker.pull()
    assert worker.version == 1 and "worker 0 disconnected" in server.log()
    worker.close()
