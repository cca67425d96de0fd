"""A shared-memory worker's ``spin``: it polls for a reply before sleeping, and only then."""

import socket
import threading
import time

import pytest

import aps
from aps.client.shm import ShmConnection


@pytest.fixture
def connection(tmp_path):
    """A ShmConnection to a Unix listener of the test's; yields (connection, server end)."""
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    conn = ShmConnection(path)
    peer, _ = listener.accept()
    yield conn, peer
    conn.close()
    peer.close()
    listener.close()


def test_spinning_waits_its_time_when_nothing_comes(connection):
    conn, _ = connection
    conn.spin = 0.05
    start = time.perf_counter()
    conn._spin()
    assert time.perf_counter() - start >= 0.05


def test_spinning_ends_when_the_reply_is_there(connection):
    conn, peer = connection
    conn.spin = 30.0  # (set here directly: a worker may ask for 0.01 at most)
    threading.Timer(0.05, peer.sendall, (b"x",)).start()
    start = time.perf_counter()
    conn._spin()
    assert time.perf_counter() - start < 20.0, "it saw the byte, not the end of its time"
    assert conn.sock.recv(1) == b"x", "the byte is left for the receive"


@pytest.mark.parametrize("spin", [-1e-6, 0.02, "fast", None])
def test_a_bad_spin_is_refused(spin):
    with pytest.raises(aps.ConfigurationError, match="spin"):
        aps.Worker("tcp://127.0.0.1:1", 0, 1, spin=spin)
