"""The network-namespace harness (aps/testing/netns.py): reachability, isolation, cleanup,
rate limits, and a real server and worker on two hosts."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from aps.testing.netns import (PREFIX, Network, NetnsError, cleanup_stale, list_netns, pid_alive, require_netns,
                               tbf_params)

PY = sys.executable

ECHO_SERVER = """
import socket
srv = socket.create_server(("0.0.0.0", 0))
srv.settimeout(20)
print(srv.getsockname()[1], flush=True)
conn, peer = srv.accept()
conn.settimeout(20)
with conn:
    while data := conn.recv(65536):
        conn.sendall(data)
print(peer[0], flush=True)
"""

ECHO_CLIENT = """
import socket, sys
message = b"ping from another host " * 2000
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
    s.sendall(message)
    s.shutdown(socket.SHUT_WR)
    echoed = b""
    while chunk := s.recv(65536):
        echoed += chunk
    source = s.getsockname()[0]
print(len(echoed), echoed == message, source)
"""

CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""

RECEIVER = """
import socket, time
srv = socket.create_server(("0.0.0.0", 0))
srv.settimeout(20)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(20)
buf = bytearray(1 << 20)
total, first = 0, None
while n := conn.recv_into(buf):
    if first is None:
        first = time.monotonic()
    total += n
print(total, time.monotonic() - first, flush=True)
"""

SENDER = """
import socket, sys, time
chunk = b"\\0" * (1 << 20)
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20) as s:
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        s.sendall(chunk)
"""

WORKER = """
import json, sys
import numpy as np
import aps
params = {"w": np.arange(1, 9, dtype=np.float32), "b": np.zeros(3, np.float32)}
grads = {"w": np.full(8, 0.5, np.float32), "b": np.array([1, -2, 4], np.float32)}
with aps.Worker(sys.argv[1], 0, 1, transport="tcp") as worker:
    worker.init(params)
    for _ in range(int(sys.argv[2])):
        weights = worker.push_pull(grads)
    print(json.dumps({name: value.tolist() for name, value in weights.items()}))
"""


def python(host, code: str, *args: str, **kwargs) -> subprocess.Popen:
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    return host.popen([PY, "-c", code, *args], text=True, **kwargs)


def first_line(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise AssertionError(f"no output in {timeout} s from {proc.args}")
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"no output (exit {proc.returncode}): {err}")
    return line.strip()


def finish(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}: {err}"
    return out


def ours(net: Network) -> list[str]:
    return [name for name in list_netns() if name.startswith(net.name + "-")]


def test_two_hosts_echo(network):
    a, b = network.add_host("a"), network.add_host("b")
    assert (a.address, b.address) == ("198.18.0.1", "198.18.0.2")
    assert set(ours(network)) == {network.bridge_netns, a.netns, b.netns}
    server = python(a, ECHO_SERVER)
    port = first_line(server)
    length, same, source = finish(python(b, ECHO_CLIENT, a.address, port)).split()
    assert (int(length), same, source) == (len(b"ping from another host ") * 2000, "True", b.address)
    assert finish(server).strip() == b.address  # the server saw the other host's address


def test_hosts_are_isolated(network):
    a = network.add_host("a")
    # a service on 127.0.0.1 of the test's own namespace is not there from a host
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        port = str(listener.getsockname()[1])
        assert finish(python(a, CONNECT, "127.0.0.1", port)).strip() == "ConnectionRefusedError"
        with pytest.raises(TimeoutError):
            listener.accept()
    # a host's only route is its subnet; its address exists only inside the namespaces
    assert a.ip("route").split()[:3] == ["198.18.0.0/24", "dev", "eth0"]
    assert "default" not in a.ip("route")
    root = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10, check=True).stdout
    assert "198.18." not in root
    assert "198.18.0.1/24" in a.ip("-o", "addr")


def test_mtu_and_environment(network, tmp_path):
    a = network.add_host("a")
    assert a.mtu() == 1500 and a.mtu(bridge_side=True) == 1500
    # ip netns exec passes the environment through (PYTHONPATH included), and the
    # pid of the Popen is the command's own
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "APS_NETNS_PROBE": "carried"}
    code = ("import os, sys, aps.testing.netns; print(os.environ['APS_NETNS_PROBE'], os.getpid(), "
            "os.readlink('/proc/self/ns/net') != os.readlink(f'/proc/{sys.argv[1]}/ns/net'), sys.argv[2] in sys.path)")
    proc = python(a, code, str(os.getpid()), str(tmp_path), env=env, cwd="/")
    probe, pid, other_ns, on_path = finish(proc).split()
    assert (probe, int(pid), other_ns, on_path) == ("carried", proc.pid, "True", "True")


def test_jumbo_mtu():
    require_netns()
    with Network(mtu=9000) as net:
        a, b = net.add_host("a"), net.add_host("b")
        assert a.mtu() == a.mtu(bridge_side=True) == b.mtu() == 9000
        server = python(a, ECHO_SERVER)
        port = first_line(server)
        assert finish(python(b, ECHO_CLIENT, a.address, port)).split()[1] == "True"
        finish(server)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_cleanup_after_the_body_raised(error):
    require_netns()
    with pytest.raises(error):
        with Network() as net:
            a = net.add_host("a")
            stubborn = a.popen([PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                          "print('ready', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
            sleeper = a.popen(["sleep", "60"])
            assert first_line(stubborn) == "ready"
            created = ours(net)
            assert len(created) == 2
            net.grace = 0.5
            raise error("boom")
    assert ours(net) == []
    assert sleeper.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL  # ignored SIGTERM: killed after the grace period
    assert not os.path.exists(a.runtime_dir)
    with pytest.raises(NetnsError):
        a.popen(["true"])


def test_cleanup_after_normal_exit_and_descendants():
    require_netns()
    with Network() as net:
        a = net.add_host("a")
        # a child that forks a grandchild: the grandchild is not tracked, but it is
        # inside the network's namespace, so it goes with it
        parent = a.popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        grandchild = int(first_line(parent))
        net.grace = 1.0
    assert ours(net) == [] and parent.poll() is not None
    assert not pid_alive(grandchild)


def test_ctrl_c_during_cleanup_is_held_until_it_ends():
    require_netns()
    with pytest.raises(KeyboardInterrupt) as raised:
        with Network(grace=1.5) as net:
            stubborn = net.add_host("a").popen(
                [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                           "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
            assert first_line(stubborn) == "ready"
            # arrives while the exit waits out the grace period
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    assert raised.traceback[-1].path.name == "netns.py"  # raised by the exit, once the cleanup was done
    assert ours(net) == [] and stubborn.returncode == -signal.SIGKILL


def test_stale_namespaces_of_dead_runs_are_removed():
    require_netns()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}-{dead.pid}-1-br"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    inside = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])
    alive = f"{PREFIX}-{os.getpid()}-999-br"  # this process is alive: kept
    subprocess.run(["ip", "netns", "add", alive], check=True, timeout=10)
    try:
        time.sleep(0.1)  # let ip exec sleep inside the namespace
        cleanup_stale(grace=1.0)
        assert stale not in list_netns() and alive in list_netns()
        assert inside.wait(5) == -signal.SIGTERM
    finally:
        for name in (stale, alive):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)
        if inside.poll() is None:
            inside.kill()
            inside.wait()


def transfer_mbit(sender, receiver, seconds: float) -> float:
    rx = python(receiver, RECEIVER)
    port = first_line(rx)
    tx = python(sender, SENDER, receiver.address, port, str(seconds))
    finish(tx, timeout=seconds + 20)
    total, elapsed = finish(rx, timeout=20).split()
    return int(total) * 8 / float(elapsed) / 1e6


def test_rate_limit_both_directions(network):
    require_netns(shaping=True)
    limited, free = network.add_host("limited", rate_mbit=100), network.add_host("free")
    for side, qdisc in limited.qdiscs().items():
        assert "tbf" in qdisc and "rate 100Mbit" in qdisc, side
    assert "tbf" not in free.qdiscs()["host"]
    up = transfer_mbit(limited, free, 1.5)  # the limited host's veth egress
    down = transfer_mbit(free, limited, 1.5)  # the bridge's egress towards the limited host
    print(f"\nshaped at 100 Mbit/s: up {up:.1f} Mbit/s, down {down:.1f} Mbit/s")
    assert 50 <= up <= 130, up
    assert 50 <= down <= 130, down


def test_a_small_bucket_holds_the_rate_for_messages_with_pauses(network):
    """tbf_params(burst=): a 128 KiB bucket, not a timer tick's worth; a bucket under two GSO
    packets is refused."""
    with pytest.raises(ValueError, match="two 64 KiB GSO packets"):
        tbf_params(100, burst=65536)
    assert tbf_params(1000, burst=131072)[4] == "131072"
    require_netns(shaping=True)
    limited, free = network.add_host("limited", rate_mbit=100, burst=131072), network.add_host("free")
    for side, qdisc in limited.qdiscs().items():
        assert "rate 100Mbit burst 128Kb" in qdisc, (side, qdisc)
    up = transfer_mbit(limited, free, 1.5)
    assert 50 <= up <= 130, up


def test_serve_and_worker_on_two_hosts(network):
    server_host, worker_host = network.add_host("server"), network.add_host("worker")
    token = {"APS_TOKEN": "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"}
    server = server_host.serve("--workers", "1", "--sync", "asp", "--lr", "0.25", env=token)
    assert server.address.startswith(f"tcp://{server_host.address}:")
    assert server.proc.args[:4] == server_host.exec_prefix
    steps = 4
    worker = python(worker_host, WORKER, server.address, str(steps), env={**os.environ, **token})
    weights = json.loads(finish(worker, timeout=60))
    w, b = np.arange(1, 9, dtype=np.float32), np.zeros(3, np.float32)
    for _ in range(steps):
        w = w - np.float32(0.25) * np.full(8, 0.5, np.float32)
        b = b - np.float32(0.25) * np.array([1, -2, 4], np.float32)
    assert np.array_equal(np.asarray(weights["w"], np.float32), w), weights
    assert np.array_equal(np.asarray(weights["b"], np.float32), b), weights
    log = server.log()
    assert "a token is required" in log and "worker 0 joined" in log, log
    assert server.alive()
    assert server.stop() == 0
