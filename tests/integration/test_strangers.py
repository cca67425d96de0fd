"""What a stranger may cost a server without a token (``--insecure``; on loopback, what any
local user could do before a server made its own token): its requests get a share of the
loop after the members' (docs/design/server.md, "Strangers"), INIT layout blocks in flight have one
budget for all connections, and the memory strangers made the server hold goes back to the
OS when they leave. And a server left to its defaults on loopback is not tokenless at all.

Real ``aps serve`` processes and real worker processes, loopback only."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import aps
from aps.wire.tokens import token_path
from aps.cli.status import fetch_stats
from aps.errors import ErrorCode
from aps.wire.protocol import MAX_LAYOUT_BYTES, DType, Op, pack_header
from aps.testing import RawClient, ServerProcess, wait_for

#: A worker that trains until its stdin closes; each line it reads, it answers with the
#: steps it has made so far and the time.
TRAINER = """
import sys, threading, time, numpy as np, aps
worker = aps.Worker(sys.argv[1], 0, 1, transport=sys.argv[2])
worker.init({"w": np.zeros(1024, np.float32)})
print("ready", flush=True)
stop = threading.Event()
steps = 0
def marks():
    for _ in sys.stdin:
        print(steps, time.monotonic(), flush=True)
    stop.set()
threading.Thread(target=marks, daemon=True).start()
while not stop.is_set():
    worker.push_pull(worker.grads)
    steps += 1
worker.close()
"""


class Flood:
    """``connections`` strangers pipelining PINGs as fast as the server takes them (each
    reads its replies on a thread of its own, so the server never waits on it to write)."""

    BATCH = pack_header(Op.PING) * 20000

    def __init__(self, port: int, connections: int = 4) -> None:
        self.port = port
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._one, daemon=True) for _ in range(connections)]
        for thread in self.threads:
            thread.start()

    def _one(self) -> None:
        while not self.stop.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                time.sleep(0.05)
                continue
            reader = threading.Thread(target=self._drain, args=(sock,), daemon=True)
            reader.start()
            try:
                while not self.stop.is_set():
                    sock.sendall(self.BATCH)
            except OSError:  # evicted at the handshake deadline: come back
                pass
            finally:
                sock.close()
                reader.join(5)

    def _drain(self, sock: socket.socket) -> None:
        buffer = bytearray(1 << 20)
        try:
            while not self.stop.is_set() and sock.recv_into(buffer):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)


class Marks:
    """The trainer's progress: :meth:`rate` since the last call, in steps per second."""

    def __init__(self, trainer: subprocess.Popen) -> None:
        self.trainer = trainer
        self.last = self._mark()

    def _mark(self) -> tuple[int, float]:
        self.trainer.stdin.write("\n")
        self.trainer.stdin.flush()
        steps, when = self.trainer.stdout.readline().split()
        return int(steps), float(when)

    def rate(self) -> float:
        (steps, when), (before, then) = self._mark(), self.last
        self.last = (steps, when)
        return (steps - before) / (when - then)


@pytest.mark.slow  # (strangers pipelining requests beside two transports' training: about 12 s each)
def test_pipelining_strangers_do_not_slow_training(server_process, transport):
    """Four connections pipelining PINGs cut training to 0.39 of its rate and held a stats
    request 3.2 s; now they share a tenth of the loop, after the members.

    The strangers' own threads and the other tests share this machine's cores with the
    trainer, so a window in which another test took the cores reads low: a quiet and a
    flooded window are measured in pairs, up to three, until one pair holds (without the
    share every pair read 0.00)."""
    server = server_process("--workers", "1", "--sync", "asp", "--insecure")
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, server.address, transport], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    ratios, stats_s = [], []
    try:
        assert trainer.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        for _ in range(3):
            marks = Marks(trainer)
            time.sleep(3.0)
            alone = marks.rate()
            flood = Flood(server.port)
            try:
                time.sleep(0.5)
                marks.rate()
                began = time.monotonic()
                stats = fetch_stats(server.address, timeout=30)
                stats_s.append(time.monotonic() - began)
                time.sleep(max(0.0, began + 3.0 - time.monotonic()))
                ratios.append(marks.rate() / alone)
            finally:
                flood.close()
            assert stats["server"]["live"] == 1
            print(f"steps/s alone {alone:.0f}, with 4 pipelining strangers {alone * ratios[-1]:.0f} "
                  f"(ratio {ratios[-1]:.2f}); a stats request took {stats_s[-1]:.3f} s")
            if ratios[-1] > 0.35 and stats_s[-1] < 1.5:
                break
        trainer.communicate("", timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    # Without the strangers' share, training all but stopped (a ratio of 0.00 here, 0.39 where
    # it was found); with it, 0.6 to 1.0 on a loaded 2-core machine. The bound is generous.
    assert max(ratios) > 0.35, f"training ran at {max(ratios):.2f} of its rate while strangers pipelined PINGs"
    assert min(stats_s) < 1.5, f"a stats request took {min(stats_s):.2f} s"


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@pytest.mark.slow
def test_strangers_holding_large_layout_blocks_cost_a_bounded_amount_of_memory_and_give_it_back(server_process):
    """500 strangers each holding an INIT layout block one byte short of 4 MiB raised RSS
    from 46 to 2,080 MB, and 2,060 MB stayed after they closed."""
    server = server_process("--workers", "1", "--sync", "asp", "--insecure")
    assert trained(server)  # the model exists: the baseline holds it
    baseline = rss(server.proc.pid)
    block = MAX_LAYOUT_BYTES
    part = b"\0" * (block - 1)
    strangers = []
    read_before = fetch_stats(server.address)["server"]["bytes_in"]
    for _ in range(500):
        raw = RawClient(server.port, token=None)
        raw.send(pack_header(Op.INIT, 0, DType.FLOAT32, 1, 0, block, block + 16), part)
        strangers.append(raw)
    read_by_server(server, read_before + 500 * len(part))
    peak = rss(server.proc.pid)
    assert trained(server)  # a worker still joins meanwhile (its layout block is small)
    for raw in strangers:
        raw.close()
    settled = wait_for(lambda: (lambda now: now if now - baseline < 48 << 20 else None)(rss(server.proc.pid)),
                       timeout=15, what="the server's memory to come back")
    print(f"RSS {baseline >> 20} MiB, {peak >> 20} MiB with 500 strangers holding layout blocks, "
          f"{settled >> 20} MiB after they closed")
    assert peak - baseline < 192 << 20, f"{(peak - baseline) >> 20} MiB for 500 strangers"
    stats = fetch_stats(server.address)
    assert stats["server"]["strangers"]["layout_refused"] > 0


def test_the_layout_budget_refuses_an_init_cleanly_and_gives_back_what_it_took(server_process):
    """A layout block that would overdraw the budget is refused with OVERLOADED; its bytes are
    read and dropped, and once the connections that held the budget go, a large block is read."""
    server = server_process("--workers", "1", "--sync", "asp", "--insecure")
    block = MAX_LAYOUT_BYTES
    holders = []
    for _ in range(8):  # 8 x 4 MiB: the whole budget, a byte short each
        raw = RawClient(server.port, token=None)
        raw.send(pack_header(Op.INIT, 0, DType.FLOAT32, 1, 0, block, block + 16), b"\0" * (block - 1))
        holders.append(raw)
    read_by_server(server, 8 * (block - 1))
    late = RawClient(server.port, token=None)
    late.send(pack_header(Op.INIT, 0, DType.FLOAT32, 1, 0, block, block), b"\0" * block)
    code, message = late.error()
    assert code == ErrorCode.OVERLOADED and "layout blocks" in message, message
    late.close()
    for raw in holders:
        raw.close()
    time.sleep(0.5)
    again = RawClient(server.port, token=None)
    again.send(pack_header(Op.INIT, 0, DType.FLOAT32, 1, 0, block, block), b"\0" * block)
    code, message = again.error()  # read whole, then found wanting: the budget was given back
    assert code != ErrorCode.OVERLOADED, message
    again.close()
    assert trained(server)


def trained(server) -> bool:
    with aps.Worker(server.address, 0, 1, transport="tcp") as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull(worker.grads)
        return True


def read_by_server(server, nbytes: int) -> None:
    """Wait until the server has read ``nbytes`` from its sockets in all (sent is not read)."""
    wait_for(lambda: fetch_stats(server.address)["server"]["bytes_in"] >= nbytes, timeout=60,
             what=f"the server to read {nbytes} bytes")


# A loopback server left to its defaults --------------------------------------------------
def test_a_default_loopback_server_makes_a_token_that_only_its_user_reads(server_process, transport, monkeypatch):
    """No flags: a token of its own in a 0600 file, found by workers and aps status; a stranger
    without it is served nothing; the file is gone after a clean shutdown."""
    monkeypatch.delenv("APS_TOKEN", raising=False)
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    path = token_path("127.0.0.1", server.port)
    info = os.stat(path)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert f"token in {path}" in server.proc.stdout.readline()
    assert "a token is required: made for this run" in server.log()
    with aps.Worker(server.address, 0, 1, transport=transport) as worker:  # no token given: found
        assert worker.transport == transport
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull({"w": np.ones(4, np.float32)})
    done = subprocess.run([sys.executable, "-m", "aps", "status", server.address], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "sync asp" in done.stdout, done.stderr
    stranger = RawClient.to(server, transport, token=None)
    stranger.init(0, 1, {"w": np.full(4, 666.0, np.float32)})
    assert stranger.error()[0] == ErrorCode.AUTHENTICATION and stranger.closed_by_peer()
    stranger.close()
    assert server.stop() == 0
    assert not os.path.exists(path)


def test_an_embedded_server_and_its_workers_need_no_configuration(monkeypatch):
    monkeypatch.delenv("APS_TOKEN", raising=False)
    with aps.Server(workers=1, sync="asp", port=0).run_in_background() as background:
        path = background.server.token_file
        assert path is not None and os.path.exists(path)
        with aps.Worker(background.address, 0, 1) as worker:
            worker.init({"w": np.zeros(4, np.float32)})
            worker.push_pull(worker.grads)
    assert not os.path.exists(path)


def test_insecure_serves_loopback_without_a_token_and_a_dead_servers_file_is_no_obstacle(monkeypatch):
    """--insecure keeps the tokenless server; a token file a killed server left at the same
    address is removed (the port is this server's now) and a worker is not put off by one."""
    monkeypatch.delenv("APS_TOKEN", raising=False)
    first = ServerProcess("--workers", "1", "--sync", "asp")
    port, path = first.port, token_path("127.0.0.1", first.port)
    first.proc.kill()  # no clean shutdown: its file stays
    first.stop()
    assert os.path.exists(path)
    plain = ServerProcess("--workers", "1", "--sync", "asp", "--insecure", "--port", str(port))
    try:
        assert plain.token is None and not os.path.exists(path)
        assert "no token" in plain.log()
        with aps.Worker(plain.address, 0, 1, transport="tcp") as worker:
            worker.init({"w": np.zeros(4, np.float32)})
    finally:
        plain.stop()
