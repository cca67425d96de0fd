"""What another user of the server's host can and cannot do, tried as that user (``nobody``,
by ``setpriv``; the tests need root and are skipped without it): guessing the token on
loopback slows that user's guesses and nobody else's, a server of theirs on the port of one
that died trains none of the first user's workers, and a loopback server's HTTP side tells
them nothing of the run. Real server and worker processes, loopback only."""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import aps
from aps.cli.checkpoint import request_checkpoint
from aps.cli.status import fetch_stats
from aps.server.admission import AuthThrottle
from aps.testing import TOKEN, ServerProcess, wait_for
from aps.testing.users import as_second_user, second_user_env, second_user_unavailable
from aps.wire.tokens import token_path

pytestmark = pytest.mark.skipif(second_user_unavailable() is not None, reason=str(second_user_unavailable()))


@pytest.fixture
def nobody_home():
    """A home of the second user's (its programs write there), removed afterwards."""
    env = second_user_env()
    yield env
    shutil.rmtree(env["HOME"], ignore_errors=True)


def guesses(server: ServerProcess, env: dict, count: int, parallel: int, sources: list[str]) -> subprocess.Popen:
    """The second user guessing at ``server``'s token: ``count`` wrong AUTHs, from ``sources``."""
    out = Path(env["HOME"]) / "guesses.json"
    proc = subprocess.Popen(as_second_user([
        sys.executable, "-m", "aps.testing.chaos_processes", "guesser", "--address", server.address, "--count",
        str(count), "--parallel", str(parallel), "--sources", ",".join(sources), "--out", str(out)]), env=env)
    proc.out = out
    return proc


def finished(proc: subprocess.Popen, timeout: float = 60) -> dict:
    assert proc.wait(timeout) == 0
    return json.loads(proc.out.read_text())


def trains(address: str, transport: str) -> None:
    with aps.Worker(address, 0, 1, transport=transport, reconnect=False) as worker:
        assert worker.transport == ("shm" if transport == "auto" else transport)
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull({"w": np.ones(4, np.float32)})


def test_another_user_guessing_on_loopback_locks_out_none_of_the_workers(server_process, nobody_home, monkeypatch):
    """``nobody`` guesses from 127.0.0.1 and five more loopback addresses (any local process
    may send from any of 127/8): its guesses are counted as one user's, whatever address they
    come from, and slowed; meanwhile this user's workers over TCP, shared memory and auto,
    one that reconnects, and ``aps status`` are all let in at once."""
    monkeypatch.delenv("APS_TOKEN", raising=False)
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    count = AuthThrottle.FREE + 8  # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 + 2 + 2 + 2 s of turns
    guesser = guesses(server, nobody_home, count, 3, [f"127.0.0.{n}" for n in range(1, 7)])
    began = time.monotonic()
    throttled = lambda: fetch_stats(server.address)["server"]["auth"]["throttled"]  # noqa: E731
    deadline = time.monotonic() + 30
    while throttled() == 0:  # the second user is being held back now
        assert time.monotonic() < deadline and guesser.poll() is None, "the guesses were never throttled"
        time.sleep(0.05)
    for transport in ("tcp", "shm", "auto"):
        trains(server.address, transport)
    with aps.Worker(server.address, 0, 1, transport="tcp") as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        worker.reconnect(timeout=10)
        worker.push_pull({"w": np.ones(4, np.float32)})
    status = subprocess.run([sys.executable, "-m", "aps", "status", server.address], capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    assert guesser.poll() is None, "the workers were let in while the second user was still held back"
    summary = finished(guesser)
    spent = time.monotonic() - began
    # (an attempt whose turn would come too late is refused unchecked: the second user's own)
    assert "accepted" not in summary and "lost" not in summary, summary
    assert summary.get("wrong", 0) + summary.get("refused", 0) == count and summary["wrong"] >= count - 3, summary
    delays = [min(AuthThrottle.BASE_S * 2 ** k, AuthThrottle.MAX_DELAY_S) for k in range(count - AuthThrottle.FREE)]
    # (the first few sent together take their turns before the failures of those before them are known)
    assert spent >= sum(delays) / 2, f"{count} guesses in {spent:.1f} s: they were not throttled as one user's"
    auth = fetch_stats(server.address)["server"]["auth"]
    assert auth["failures"] == summary["wrong"] and auth["throttled"] >= summary["wrong"] - AuthThrottle.FREE, auth
    assert "uid 65534" in server.log()


#: An impostor that answers every HELLO with an error frame (a layout mismatch, a shutdown
#: for good ...), as the second user: it must end no worker that holds a token.
ERROR_FRAMES = """
import socket, struct, sys
from aps.errors import ErrorCode
from aps.wire.protocol import HEADER_SIZE, Op, encode_error, pack_header, unpack_header
code = ErrorCode[sys.argv[2]]
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("listening", flush=True)
while True:
    conn, _ = listener.accept()
    try:
        conn.settimeout(2)
        header = unpack_header(conn.recv(HEADER_SIZE, socket.MSG_WAITALL))
        payload = encode_error(code, "the impostor says no")
        conn.sendall(pack_header(Op.ERROR, header.request_id, 0, 0, 0, 0, len(payload)) + payload)
    except Exception:  # (a peer that closed at once: the next one)
        pass
    conn.close()
"""


def push_meanwhile(worker: aps.Worker, size: int) -> tuple[threading.Thread, list]:
    """``worker.push_pull`` of ones on a thread of its own: the thread, and a list that gets
    what it returned or raised."""
    answers: list = []

    def go_on() -> None:
        try:
            answers.append(worker.push_pull({"w": np.ones(size, np.float32)}))
        except BaseException as exc:  # noqa: BLE001 (what it raised is the test's)
            answers.append(exc)

    pushing = threading.Thread(target=go_on)
    pushing.start()
    return pushing, answers


def start_impostor(kind: str, port: int, env: dict):
    """``nobody``'s impostor on ``port``: a real ``aps serve --insecure`` at lr 1000, or a
    process that answers every HELLO with an error frame of code ``kind``."""
    if kind == "server":
        impostor = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "1000", "--insecure", "--port", str(port),
                                 env=env, popen=lambda argv, **kwargs: subprocess.Popen(as_second_user(argv), **kwargs))
        assert "no token" in impostor.log()
        return impostor.stop
    proc = subprocess.Popen(as_second_user([sys.executable, "-c", ERROR_FRAMES, str(port), kind]), env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"

    def stop() -> None:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()

    return stop


@pytest.mark.parametrize("kind", ["server", "LAYOUT_MISMATCH", "SHUTTING_DOWN"])
@pytest.mark.parametrize("how", ["kill", "sigint"])
def test_an_impostor_on_a_dead_servers_port_trains_none_of_its_workers(server_process, nobody_home, tmp_path,
                                                                       monkeypatch, kind, how):
    """The first user's server stops: killed (kill -9: its token file stays) or stopped with
    Ctrl-C (it checkpoints and tells its workers to wait for it; its token file goes). ``nobody``
    serves on the same port: a server of its own, asking for no token and at lr 1000, or one
    that answers every handshake with an error frame. A new worker refuses it at once
    (ServerUnproven); a running worker reconnecting refuses it too, whatever it answers, and
    waits for the real server, which it goes on with once that is resumed there. Neither
    sends the impostor anything of its model."""
    monkeypatch.delenv("APS_TOKEN", raising=False)
    options = ("--workers", "1", "--sync", "asp", "--lr", "1", "--checkpoint-dir", str(tmp_path / "ckpt"))
    real = server_process(*options)
    port, path = real.port, token_path("127.0.0.1", real.port)
    running = aps.Worker(real.address, 0, 1, transport="tcp", reconnect_timeout=60)
    running.init({"w": np.zeros(4, np.float32)})
    running.push_pull({"w": np.ones(4, np.float32)})
    request_checkpoint(real.address)
    if how == "kill":
        real.proc.kill()
    else:
        real.signal(signal.SIGINT)
    real.proc.wait(30)
    assert os.path.exists(path) == (how == "kill")
    pushing, answers = push_meanwhile(running, 4)  # reconnecting: nothing listens yet
    stop = start_impostor(kind, port, nobody_home)
    try:
        if how == "kill":
            with pytest.raises(aps.ServerUnproven) as raised:
                aps.Worker(real.address, 0, 1, transport="tcp", reconnect=False)
            assert path in str(raised.value) or "before it proved" in str(raised.value)
        time.sleep(2.0)  # the running worker meets the impostor a few times meanwhile
        assert pushing.is_alive() and not answers, answers
    finally:
        stop()
    resumed = server_process(*options, "--resume", "--port", str(port))
    pushing.join(60)
    running.close()
    assert not pushing.is_alive() and len(answers) == 1 and not isinstance(answers[0], BaseException), answers
    assert answers[0]["w"].tolist() == [-2.0] * 4, "trained by the real server at lr 1, from its checkpoint"
    assert resumed.alive()


def test_another_user_reads_nothing_of_a_loopback_run_over_http(server_process, nobody_home, monkeypatch):
    """A loopback server that made its own token guards its HTTP side with it too: the
    second user gets the liveness probe and the page (which holds no data), not the run's
    statistics, configuration, curves or metrics; this user, with the token, gets them."""
    monkeypatch.delenv("APS_TOKEN", raising=False)
    server = server_process("--workers", "1", "--sync", "asp", "--http-port", "0")
    base = server.proc.stdout.readline().split(" on ", 1)[1].strip()
    hint = server.proc.stdout.readline()
    assert "asks for the server's token" in hint and token_path("127.0.0.1", server.port) in hint, hint
    script = ("import sys, urllib.request, urllib.error\n"
              "for path in sys.argv[2:]:\n"
              "    try:\n"
              "        code = urllib.request.urlopen(sys.argv[1] + path, timeout=10).status\n"
              "    except urllib.error.HTTPError as exc:\n"
              "        code = exc.code\n"
              "    print(path, code)\n")
    paths = ["healthz", "", "api/stats", "api/config", "api/history", "api/scalars", "metrics"]
    done = subprocess.run(as_second_user([sys.executable, "-c", script, base, *paths]), env=nobody_home,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    codes = dict(line.split() if " " in line.strip() else ("", line.strip()) for line in done.stdout.splitlines())
    assert codes.pop("healthz") == "200" and codes.pop("") == "200", done.stdout
    assert set(codes.values()) == {"401"}, done.stdout
    # Guessing the token over HTTP is throttled as over the worker port: by the guesser's user.
    guess = ("import sys, time, urllib.request, urllib.error\n"
             "began = time.monotonic()\n"
             "for n in range(8):\n"
             "    request = urllib.request.Request(sys.argv[1] + 'metrics', headers={'Authorization': f'Bearer {n}'})\n"
             "    try:\n"
             "        urllib.request.urlopen(request, timeout=30)\n"
             "    except urllib.error.HTTPError as exc:\n"
             "        assert exc.code == 401, exc.code\n"
             "        exc.close()\n"
             "print(time.monotonic() - began)\n")
    done = subprocess.run(as_second_user([sys.executable, "-c", guess, base]), env=nobody_home, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    turns = [AuthThrottle.BASE_S * 2 ** k for k in range(8 - AuthThrottle.FREE - 1)]
    assert float(done.stdout) >= sum(turns) * 0.9, (done.stdout, turns)
    began = time.monotonic()
    request = urllib.request.Request(base + "api/stats", headers={"Authorization": f"Bearer {server.token.decode()}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200 and json.load(answer)["server"]["auth"]["failures"] == 8
    assert time.monotonic() - began < 1.0, "this user's token is checked at once"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(base + "api/stats", timeout=10)
    refused.value.close()  # (the error holds the response: its socket)
    assert refused.value.code == 401


#: A relay on a dead shard's port, as the second user: it passes a reconnecting worker's
#: handshake on to the live shard, then tries the authenticated connection for itself (STATS).
RELAY = """
import json, socket, sys
from aps.wire.protocol import HEADER_SIZE, Op, pack_header, unpack_header
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("listening", flush=True)
out = open(sys.argv[3], "a")

def frame(sock):
    head = sock.recv(HEADER_SIZE, socket.MSG_WAITALL)
    header = unpack_header(head)
    return header, head + (sock.recv(header.length, socket.MSG_WAITALL) if header.length else b"")

while True:
    worker, _ = listener.accept()
    said = {}
    try:
        upstream = socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=5)
        worker.settimeout(5)
        for _ in range(2):  # HELLO, AUTH: passed on, and their replies back
            _, request = frame(worker)
            upstream.sendall(request)
            header, reply = frame(upstream)
            worker.sendall(reply)
            said[Op(header.op).name] = True
        upstream.sendall(pack_header(Op.STATS, request_id=9))
        header, _ = frame(upstream)
        said["stats"] = Op(header.op).name
    except Exception as exc:  # (a closed connection reads as a short frame, too)
        said["stats"] = said.get("stats") or f"closed ({type(exc).__name__})"
    out.write(json.dumps(said) + "\\n")
    out.flush()
    worker.close()
"""


def test_a_relay_on_a_dead_shards_port_opens_nothing_on_the_live_shard(server_process, nobody_home, tmp_path,
                                                                    monkeypatch):
    """Two shards share a token. Shard 1 dies; ``nobody`` listens on its port and relays a
    reconnecting worker's handshake to shard 0, then tries the connection for itself. The
    worker's proof names the run and shard it means: shard 0 answers it (proved, so the worker
    learns it reached another shard) and closes, authenticated for no one; the worker waits
    for its shard, and goes on with it once it is resumed."""
    monkeypatch.setenv("APS_TOKEN", TOKEN)
    dirs = [tmp_path / f"shard{i}" for i in range(2)]
    options = ("--workers", "1", "--sync", "asp", "--lr", "1", "--shards", "2", "--token", TOKEN)
    shards = [server_process(*options, "--shard", str(i), "--checkpoint-dir", str(dirs[i])) for i in range(2)]
    worker = aps.Worker([s.address for s in shards], 0, 1, transport="tcp", reconnect_timeout=60)
    worker.init({"w": np.zeros(64, np.float32)})
    worker.push_pull({"w": np.ones(64, np.float32)})
    request_checkpoint(shards[1].address, token=TOKEN)
    port = shards[1].port
    shards[1].proc.kill()
    shards[1].proc.wait(10)
    record = Path(nobody_home["HOME"]) / "relayed.jsonl"
    relay = subprocess.Popen(as_second_user([sys.executable, "-c", RELAY, str(port), str(shards[0].port),
                                             str(record)]), env=nobody_home, stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout.readline().strip() == "listening"
        pushing, answers = push_meanwhile(worker, 64)
        wait_for(lambda: record.exists() and record.read_text().count("\n") >= 1, timeout=60,
                 what="the worker's handshakes relayed")
        assert pushing.is_alive() and not answers, answers
    finally:
        relay.kill()
        relay.wait(10)
        relay.stdout.close()
    relayed = [json.loads(line) for line in record.read_text().splitlines()]
    assert all(said.get("AUTH_REPLY") and said["stats"] != "STATS_REPLY" for said in relayed), relayed
    server_process(*options, "--shard", "1", "--checkpoint-dir", str(dirs[1]), "--resume", "--port", str(port))
    pushing.join(60)
    worker.close()
    assert len(answers) == 1 and not isinstance(answers[0], BaseException), answers
    assert re.search(r"a proof meant for (run|shard) \S+: not opened", shards[0].log())


@pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd (Debian's etcd-server)")
def test_another_user_cannot_reach_the_private_etcd_of_aps_launch(tmp_path, nobody_home):
    """``aps launch --replica-count``'s own etcd (who is primary of each replica set) listens on
    a Unix socket in a directory only its user may enter: this user's replicas reach it,
    ``nobody`` cannot connect, so cannot rewrite the record (on loopback it could, and stop a
    primary or stall a failover)."""
    import asyncio
    import socket
    import stat

    from aps.lab.etcd import Etcd
    from aps.server.coordinator import Coordinator, Record

    etcd = Etcd(tmp_path / "etcd", unix=True).start()
    try:
        assert etcd.url.startswith("unix:///") and etcd.socket_dir is not None
        assert stat.S_IMODE(os.stat(etcd.socket_dir).st_mode) == 0o700
        socket_dir = etcd.socket_dir
        path = etcd.url[len("unix://"):]

        async def write_and_read() -> Record | None:
            coordinator = Coordinator(etcd.url, "shard-0")
            try:
                assert await coordinator.swap(0, Record("127.0.0.1:7000")) is not None
                return await coordinator.read()
            finally:
                await coordinator.close()

        assert asyncio.run(write_and_read()).primary == "127.0.0.1:7000"  # this user's replicas reach it
        probe = subprocess.run(
            as_second_user([sys.executable, "-c",
                            "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])", path]),
            env=nobody_home, capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr
        with socket.socket(socket.AF_UNIX) as mine:  # (and the socket is there: refused, not missing)
            mine.connect(path)
    finally:
        etcd.stop()
        etcd.remove_sockets()
    assert not os.path.exists(socket_dir)
