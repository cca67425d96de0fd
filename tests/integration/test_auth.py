"""Authentication: with --token, nothing but the handshake is served until a peer proves it
knows the token (HMAC over fresh nonces; the token never crosses the wire), and a worker
checks that the server knows it too. Real server processes, loopback only."""

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

import aps
from aps.config import ServerConfig
from aps.errors import ErrorCode, ServerOverloaded
from aps.wire.protocol import (
    NONCE_BYTES,
    Op,
    auth_proof,
    decode_error,
    decode_hello_reply,
    encode_hello,
    encode_hello_reply,
    pack_header,
)
from aps.server.admission import AuthThrottle
from prometheus_client.parser import text_string_to_metric_families
from aps.testing import HEADER_SIZE, RawClient, RawShmClient, unpack_header

from aps.testing import TOKEN
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts")


@pytest.fixture
def secured(server_process):
    return server_process("--workers", "1", "--sync", "asp", "--lr", "1", "--token", TOKEN)


def test_the_right_token_trains(secured, transport, monkeypatch):
    with aps.Worker(secured.address, 0, 1, transport=transport, token=TOKEN) as worker:
        assert worker.transport == transport
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull({"w": np.ones(4, np.float32)})
        assert worker.weights["w"].tolist() == [-1.0] * 4
    monkeypatch.setenv("APS_TOKEN", TOKEN)  # or from the environment, as aps launch and torchrun pass it
    with aps.Worker(secured.address, 0, 1, transport=transport) as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        assert worker.pull()["w"].tolist() == [-1.0] * 4
    assert "a token is required" in secured.log()


@pytest.mark.parametrize("token", [None, "wrong horse"], ids=["missing", "wrong"])
def test_a_missing_or_wrong_token_is_refused_with_a_clear_error(secured, transport, token, monkeypatch):
    monkeypatch.delenv("APS_TOKEN", raising=False)
    with pytest.raises(aps.AuthenticationError, match="token") as raised:
        aps.Worker(secured.address, 0, 1, transport=transport, token=token)
    assert isinstance(raised.value, ConnectionError)
    if token is not None:  # the server saw it, and says who it was
        assert "authentication failed: a wrong token" in secured.wait_for_log("authentication failed")
    assert trains(secured)


def trains(server) -> bool:
    with aps.Worker(server.address, 0, 1, token=TOKEN) as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull(worker.grads)
        return True


def hello(raw: RawClient, nonce: bytes) -> bytes:
    raw.frame(Op.HELLO, nonce)
    header, payload = raw.reply()
    assert header.op == Op.HELLO_REPLY
    required, server_nonce, info = decode_hello_reply(payload)
    assert required and info is None  # nothing about the server before the handshake
    return server_nonce


def test_a_replayed_proof_is_refused(secured, transport):
    """A proof seen on one connection is worthless on another: the server's nonce is fresh."""
    first = RawClient.to(secured, transport, token=None)
    client_nonce = os.urandom(NONCE_BYTES)
    server_nonce = hello(first, client_nonce)
    proof = auth_proof(TOKEN.encode(), "client", server_nonce, client_nonce)
    first.frame(Op.AUTH, proof)
    assert first.reply()[0].op == Op.AUTH_REPLY  # the genuine exchange
    first.close()
    replay = RawClient.to(secured, transport, token=None)
    assert hello(replay, client_nonce) != server_nonce
    replay.frame(Op.AUTH, proof)  # an eavesdropper sends what it saw
    code, message = replay.error()
    assert code == ErrorCode.AUTHENTICATION and "wrong token" in message
    assert replay.closed_by_peer()
    replay.close()


@pytest.mark.parametrize("op", [Op.INIT, Op.STATS, Op.PULL, Op.PUSH, Op.PING, Op.AUTH])
def test_a_stranger_is_served_nothing(secured, transport, op):
    """Without the handshake: no INIT (choosing the weights), no rank, no push, pull or stats."""
    raw = RawClient.to(secured, transport, token=None)
    if op == Op.INIT:
        raw.init(0, 1, {"w": np.full(4, 666.0, np.float32)})
    elif op == Op.PUSH:
        payload = np.full(4, 1e6, np.float32).tobytes()
        raw.send(pack_header(Op.PUSH, dtype=1, length=len(payload)), payload)
    elif op == Op.AUTH:
        raw.frame(Op.AUTH, b"\0" * NONCE_BYTES)  # a proof with no challenge behind it
    else:
        raw.frame(op)
    code, message = raw.error()
    assert code == ErrorCode.AUTHENTICATION, message
    assert raw.closed_by_peer()
    raw.close()
    with aps.Worker(secured.address, 0, 1, token=TOKEN) as worker:  # the stranger chose nothing
        weights = worker.init({"w": np.zeros(4, np.float32)})
        assert weights["w"].tolist() == [0.0] * 4


def test_the_worker_checks_the_server_too(server_process, monkeypatch):
    """A server without the token cannot pass for the real one: the worker refuses to train with it."""
    monkeypatch.delenv("APS_TOKEN", raising=False)
    plain = server_process("--workers", "1", "--sync", "asp", "--insecure")
    with pytest.raises(aps.AuthenticationError, match="asks for no token"):
        aps.Worker(plain.address, 0, 1, token=TOKEN)
    impostor = socket.create_server(("127.0.0.1", 0))  # asks for a token, then cannot prove it knows it
    port = impostor.getsockname()[1]

    def serve_one():
        conn, _ = impostor.accept()
        with conn:
            for op, payload in [(Op.HELLO_REPLY, encode_hello_reply(True, os.urandom(NONCE_BYTES), "", "")),
                                (Op.AUTH_REPLY, b"\0" * 32 + encode_hello("h", ""))]:
                header = unpack_header(conn.recv(HEADER_SIZE, socket.MSG_WAITALL))
                if header.length:
                    conn.recv(header.length, socket.MSG_WAITALL)
                conn.sendall(pack_header(op, request_id=header.request_id, length=len(payload)) + payload)

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    with pytest.raises(aps.AuthenticationError, match="could not prove it knows the token"):
        aps.Worker(f"tcp://127.0.0.1:{port}", 0, 1, transport="tcp", token=TOKEN)
    thread.join(10)
    impostor.close()


def test_aps_status_and_launch_pass_the_token(secured, tmp_path, monkeypatch):
    monkeypatch.delenv("APS_TOKEN", raising=False)
    run = [sys.executable, "-m", "aps"]
    done = subprocess.run(run + ["status", secured.address, "--token", TOKEN], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "sync asp" in done.stdout, done.stderr
    refused = subprocess.run(run + ["status", secured.address], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "needs a token" in refused.stderr
    launched = subprocess.run(run + ["launch", "--host", "127.0.0.1", "--no-progress", "--workers", "2", "--sync",
                                     "asp", "--token", TOKEN, "--log-dir", str(tmp_path),
                                     os.path.join(SCRIPTS, "late.py")],
                              capture_output=True, text=True, timeout=120, env=dict(os.environ, LATE_S="0"))
    assert launched.returncode == 0, launched.stderr
    assert all("done" in (tmp_path / f"worker-{r}.log").read_text() for r in range(2))


def test_listening_beyond_loopback_needs_a_token_or_insecure():
    with pytest.raises(aps.ConfigurationError, match="refusing to listen on 0.0.0.0 without a token"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", token=TOKEN).token == TOKEN  # a token: fine
    assert ServerConfig(host="0.0.0.0", insecure=True).insecure  # said aloud: fine
    assert ServerConfig(host="::1").host == "::1" and ServerConfig(host="localhost").host == "localhost"
    assert TOKEN not in repr(ServerConfig(token=TOKEN))  # never printed
    done = subprocess.run([sys.executable, "-m", "aps", "serve", "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--insecure" in done.stderr and "anyone who reaches the port" in done.stderr


def test_a_token_file(server_process, tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    server = server_process("--workers", "1", "--sync", "asp", "--token-file", str(path))
    assert trains(server)
    with pytest.raises(aps.AuthenticationError):
        aps.Worker(server.address, 0, 1, token="nope")


def test_the_shared_memory_socket_asks_for_the_token_too(secured):
    raw = RawShmClient(secured.unix_path, token=None)
    raw.init(0, 1, {"w": np.zeros(4, np.float32)})
    assert raw.error()[0] == ErrorCode.AUTHENTICATION
    assert raw.closed_by_peer()
    raw.close()


def test_hello_after_hello_and_descriptors_before_the_handshake_are_refused(secured):
    raw = RawClient(secured.port, token=None)
    for _ in range(2):
        hello(raw, os.urandom(NONCE_BYTES))
    raw.frame(Op.HELLO, os.urandom(NONCE_BYTES))  # a third, still without AUTH: a connection kept for nothing
    assert raw.error()[0] == ErrorCode.AUTHENTICATION and raw.closed_by_peer()
    raw.close()
    from aps.wire.segments import Segment, scm_rights

    shm = RawShmClient(secured.unix_path, token=None)
    segments = [Segment.create(4, "stranger") for _ in range(3)]
    shm.sock.sendmsg([pack_header(Op.HELLO)], scm_rights([s.fd for s in segments]))
    assert shm.error()[0] == ErrorCode.AUTHENTICATION and shm.closed_by_peer()
    for s in segments:
        s.close()
    shm.close()


# Weak tokens and guessing -------------------------------------------------------------------
@pytest.mark.parametrize("weak", [
    "4821", "secret", "a" * 64, "0123456789" * 8, "ab" * 40,
    # long, varied, and guessable: words, a sequence, keyboard walks (zxcvbn finds each)
    "correct-horse-battery-staple-42", "abcdefghijklmnopqrstuvwxyz0123456789",
    "qwertyuiopasdfghjklzxcvbnm1234567890!@#$%^&*()", "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik,9ol.0p;/",
])
def test_a_weak_token_is_refused_with_how_to_make_one(weak, tmp_path):
    """`--token 4821` was found by brute force in 1.2 s, `correct-horse-battery-staple-42` in
    3,000 guesses: under 128 bits (estimated conservatively, repetitions counted once), or
    guessable in under 2^100 tries by zxcvbn's estimate, aps serve refuses to start."""
    serve = [sys.executable, "-m", "aps", "serve", "--port", "0"]
    done = subprocess.run(serve + ["--token", weak], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "aps token" in done.stderr, done.stderr
    assert "too weak" in done.stderr or "too repetitive" in done.stderr or "guessable" in done.stderr
    assert repr(weak) not in done.stderr and f" {weak} " not in done.stderr  # nor prints the secret
    path = tmp_path / "token"
    path.write_text(weak + "\n")
    done = subprocess.run(serve + ["--token-file", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "aps token" in done.stderr, done.stderr


def test_aps_token_makes_a_token_the_server_takes(server_process, tmp_path):
    made = subprocess.run([sys.executable, "-m", "aps", "token"], capture_output=True, text=True, timeout=60)
    token = made.stdout.strip()
    assert made.returncode == 0 and len(token) >= 43 and token.isascii() and " " not in token
    again = subprocess.run([sys.executable, "-m", "aps", "token"], capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() != token
    server = server_process("--workers", "1", "--sync", "asp", "--token", token)
    with aps.Worker(server.address, 0, 1, token=token) as worker:
        worker.init({"w": np.zeros(4, np.float32)})
    path = tmp_path / "token"
    written = subprocess.run([sys.executable, "-m", "aps", "token", "--file", str(path)], capture_output=True,
                             text=True, timeout=60)
    assert written.returncode == 0 and written.stdout == ""
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    from_file = server_process("--workers", "1", "--sync", "asp", "--token-file", str(path))
    with aps.Worker(from_file.address, 0, 1, token=path.read_text().strip()) as worker:
        worker.init({"w": np.zeros(4, np.float32)})


def guess(server, token: str) -> tuple[float, int, str]:
    """One AUTH attempt on a connection of its own: seconds until the answer, and the answer."""
    raw = RawClient(server.port, token=None)
    try:
        client_nonce = os.urandom(NONCE_BYTES)
        server_nonce = hello(raw, client_nonce)
        start = time.monotonic()
        raw.frame(Op.AUTH, auth_proof(token.encode(), "client", server_nonce, client_nonce))
        header, payload = raw.reply()
        took = time.monotonic() - start
        if header.op == Op.ERROR:
            code, message = decode_error(payload)
            return took, code, message
        return took, 0, "ok"
    finally:
        raw.close()


def metrics(server) -> dict[str, float]:
    port = int(server.proc.stdout.readline().rsplit(":", 1)[1].strip(" /\n"))
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {family.name: family.samples[0].value for family in text_string_to_metric_families(text)
            if family.name.startswith(("aps_auth", "aps_layout"))}


def test_guessing_the_token_is_slowed_and_counted_and_the_right_token_still_gets_in(server_process):
    """3,770 guesses/s against a server without a throttle: now a few failures are free, each
    one after waits twice as long (at most 2 s), and the right token, from the same user,
    waits one turn at most, gets in, and clears the failures."""
    server = server_process("--workers", "1", "--sync", "asp", "--token", TOKEN, "--http-port", "0")
    throttle = AuthThrottle
    start = time.monotonic()
    answers = [guess(server, "wrong-" + TOKEN) for _ in range(8)]
    spent = time.monotonic() - start
    assert all(code == ErrorCode.AUTHENTICATION for _, code, _ in answers), answers
    assert all(took < 0.5 for took, _, _ in answers[: throttle.FREE]), answers  # typos cost nothing
    waits = [throttle.BASE_S * 2 ** k for k in range(8 - throttle.FREE)]
    for (took, _, _), wait in zip(answers[throttle.FREE :], waits):
        assert took >= min(wait, throttle.MAX_DELAY_S) * 0.9, answers
    print(f"{len(answers)} wrong guesses took {spent:.2f} s ({len(answers) / spent:.1f} guesses/s)")
    took, code, message = guess(server, TOKEN)
    assert code == 0 and took <= throttle.MAX_DELAY_S + 0.5, (took, code, message)
    took, code, _ = guess(server, TOKEN)  # the failures are forgotten
    assert code == 0 and took < 0.5
    assert trains(server)
    counted = metrics(server)
    assert counted["aps_auth_failures"] == 8, counted
    assert counted["aps_auth_throttled"] == 8 - throttle.FREE + 1, counted
    assert counted["aps_auth_refused"] == 0, counted
    assert "authentication failed: a wrong token" in server.log()  # (rate-limited: a flood logs a few lines)


def test_parallel_guesses_take_their_turns(server_process):
    """Many connections guessing at once do not get around the throttle: their turns are
    taken one after the other, each as if those before it failed, and attempts whose turn
    would come more than MAX_WAIT_S later are refused unchecked."""
    server = server_process("--workers", "1", "--sync", "asp", "--token", TOKEN)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(guess(server, "wrong-" + TOKEN)))
               for _ in range(24)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    spent = time.monotonic() - start
    wrong = sum(code == ErrorCode.AUTHENTICATION for _, code, _ in results)
    refused = [message for _, code, message in results if code == ErrorCode.OVERLOADED]
    assert len(results) == 24 and wrong + len(refused) == 24 and len(refused) >= 12, results
    assert all("too many authentication attempts from uid" in message for message in refused), refused
    turns = [min(AuthThrottle.BASE_S * 2 ** k, AuthThrottle.MAX_DELAY_S) for k in range(wrong - AuthThrottle.FREE)]
    assert spent >= sum(turns[:-1]) * 0.9, (spent, results)
    assert trains(server)
