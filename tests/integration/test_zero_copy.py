"""Zero-copy pulls over shared memory (``aps.Worker(zero_copy=True)``): the weights are
read-only views into the server's leased snapshot slot, one version until the next
weights reply."""

import contextlib
import os
import socket
import threading

import numpy as np
import pytest

import aps
from aps.testing import mapped_memfds

N = 1000


@contextlib.contextmanager
def _pair(server, zero_copy=True, transport="shm"):
    """Worker 0 (``zero_copy``) and worker 1 (copies), both joined; both closed after."""
    with aps.Worker(server.address, 0, 2, transport=transport, zero_copy=zero_copy) as a, \
            aps.Worker(server.address, 1, 2, transport="shm") as b:
        joining = threading.Thread(target=b.init, args=({"w": np.zeros(N, np.float32)},))
        joining.start()
        a.init({"w": np.zeros(N, np.float32)})
        joining.join()
        yield a, b


def _in_a_slot(array: np.ndarray) -> bool:
    """``array``'s memory lies in one of the server's snapshot slots mapped here."""
    address = array.__array_interface__["data"][0]
    for line in mapped_memfds(os.getpid(), "aps-slot"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


def test_weights_are_read_only_views_into_the_slot(server_process):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    with _pair(server) as (a, b):
        assert a.zero_copy and not b.zero_copy
        weights = a.push_pull({"w": np.ones(N, np.float32)})
        assert weights["w"].tolist() == [-1.0] * N and a.version == 1
        assert weights is a.weights and weights["w"].base is not None
        assert _in_a_slot(a.flat_weights) and _in_a_slot(weights["w"]), "no copy: the slot itself"
        assert not _in_a_slot(b.flat_weights), "a worker without zero_copy reads its own buffer"
        with pytest.raises(ValueError, match="read-only"):
            weights["w"][0] = 5.0
        with pytest.raises(ValueError, match="read-only"):
            a.flat_weights[:] = 0.0
        assert a.pull()["w"].tolist() == [-1.0] * N, "the failed writes changed nothing"


def test_a_view_holds_one_version_until_the_next_weights_reply(server_process):
    """Pushes, heartbeats and refused requests in between leave the slot leased: updates
    by another worker (which reuse every free slot) never write into it."""
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    with _pair(server) as (a, b):
        held = a.pull()["w"]
        before = held.copy()
        version = a.version
        a.push({"w": np.ones(N, np.float32)})  # a push with no pull: the weights stay these
        a.ping()
        bad = np.ones(N, np.float32)
        bad[3] = np.nan
        with pytest.raises(aps.NonFiniteGradient):
            a.push({"w": bad})
        for _ in range(30):  # many versions: free slots are taken again and again
            b.push_pull({"w": np.ones(N, np.float32)})
        assert a.weights["w"] is held and np.array_equal(held, before), "the view still holds its version"
        assert a.version == version
        fresh = a.pull()["w"]
        assert fresh is not held and fresh[0] == -(1.0 + 30) and a.version == 31


def test_over_tcp_the_views_are_of_the_workers_own_buffer(server_process):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    with _pair(server, transport="tcp") as (a, b):
        assert a.transport == "tcp"
        weights = a.push_pull({"w": np.full(N, 2.0, np.float32)})
        assert weights["w"].tolist() == [-2.0] * N and not _in_a_slot(weights["w"])
        with pytest.raises(ValueError, match="read-only"):
            weights["w"][:] = 0.0
        with pytest.raises(ValueError, match="WRITEABLE"):  # (their buffer is read-only too)
            weights["w"].flags.writeable = True


def test_a_worker_that_left_keeps_its_last_weights(server_process):
    """Its lease ends with its LEAVE: it copies the slot first, so that the weights it reads
    afterwards stay those of its last reply while other workers go on."""
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    with _pair(server) as (a, b):
        for _ in range(3):
            a.push_pull({"w": np.ones(N, np.float32)})
        a.close()
        for _ in range(20):  # (free slots, the one a read included, are written again)
            b.push_pull({"w": np.ones(N, np.float32)})
        assert a.weights["w"].tolist() == [-3.0] * N and a.flat_weights.tolist() == [-3.0] * N
        assert not _in_a_slot(a.flat_weights) and not a.flat_weights.flags.writeable


def test_a_lost_connection_leaves_the_worker_its_last_weights(server_process):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    with aps.Worker(server.address, 0, 2, transport="shm", zero_copy=True, reconnect=False) as a, \
            aps.Worker(server.address, 1, 2, transport="shm") as b:
        joining = threading.Thread(target=b.init, args=({"w": np.zeros(N, np.float32)},))
        joining.start()
        a.init({"w": np.zeros(N, np.float32)})
        joining.join()
        a.push_pull({"w": np.ones(N, np.float32)})
        a._channels[0]._conn.sock.shutdown(socket.SHUT_RDWR)  # (the connection fails under it)
        with pytest.raises(aps.APSConnectionError):
            a.ping()
        for _ in range(20):
            b.push_pull({"w": np.ones(N, np.float32)})
        assert a.weights["w"].tolist() == [-1.0] * N and not _in_a_slot(a.flat_weights)


def test_the_views_of_slots_the_server_dropped_go(server_process):
    """Six workers holding six versions make the server add slots; once they are gone it
    drops them, and the zero_copy worker, which read every one, lets go of them too."""
    holders = 6
    server = server_process("--workers", str(holders + 2), "--sync", "asp", "--lr", "1")
    workers = [aps.Worker(server.address, rank, holders + 2, transport="shm", zero_copy=rank == 0)
               for rank in range(holders + 2)]
    try:
        joining = [threading.Thread(target=w.init, args=({"w": np.zeros(N, np.float32)},)) for w in workers]
        for thread in joining:
            thread.start()
        for thread in joining:
            thread.join()
        a, b, core = workers[0], workers[1], workers[0]._channels[0]._core
        for holder in workers[2:]:
            b.push_pull({"w": np.ones(N, np.float32)})
            holder.pull()
            a.pull()
        peak = len(core._slot_views)
        for holder in workers[2:]:
            holder.close()
        for step in range(600):  # (the server keeps the last 256 updates' peak of slots in use)
            b.push_pull({"w": np.ones(N, np.float32)})
            if step % 50 == 0:
                a.pull()
        a.pull()
        assert peak >= holders and len(core.shm.slots) < peak, "the server dropped slots"
        assert set(core._slot_views) <= set(core.shm.slots), "no views of a dropped slot are kept"
        assert a.weights["w"][0] == -(holders + 600.0)
    finally:
        for worker in workers:
            worker.close()


def test_loaded_weights_are_held_read_only(server_process):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    with _pair(server) as (a, b):
        values = np.arange(N, dtype=np.float32)
        assert a.load_weights({"w": values})
        assert a.weights["w"].tolist() == values.tolist() and not a.flat_weights.flags.writeable
        assert b.pull()["w"].tolist() == values.tolist()
        assert a.pull()["w"].tolist() == values.tolist() and _in_a_slot(a.flat_weights)


def test_a_reconnected_worker_reads_the_new_connections_slot(server_process):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1")
    with _pair(server) as (a, b):
        a.push_pull({"w": np.ones(N, np.float32)})
        weights = a.reconnect()
        assert weights["w"].tolist() == [-1.0] * N and _in_a_slot(weights["w"])
        assert a.push_pull({"w": np.ones(N, np.float32)})["w"].tolist() == [-2.0] * N


def test_zero_copy_needs_one_server_and_a_numpy_model(server_process):
    with pytest.raises(aps.ConfigurationError, match="one server"):
        aps.Worker(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], 0, 1, zero_copy=True)
    torch = pytest.importorskip("torch")
    import aps.torch as aps_torch

    server = server_process("--workers", "1", "--sync", "asp")
    with aps.Worker(server.address, 0, 1, zero_copy=True) as worker:
        with pytest.raises(aps.ConfigurationError, match="without zero_copy"):
            aps_torch.Optimizer(torch.nn.Linear(2, 2).parameters(), worker=worker)
