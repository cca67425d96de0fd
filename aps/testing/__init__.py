"""The helpers tests and bench/ share: a real ``aps serve`` subprocess, raw frames, worker
processes (as asyncpg._testbase and aiohttp.test_utils do for theirs).

Submodules: ``workers`` (worker-process bodies), ``netns`` (network namespaces),
``chaos`` (the chaos soak), ``fuzzing`` (frame fuzzing)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from aps.wire.tokens import find_token
from aps.layout import Layout
from aps.wire.protocol import (
    HEADER_SIZE,
    NONCE_BYTES,
    DType,
    Flag,
    Op,
    auth_proof,
    decode_error,
    decode_hello_reply,
    encode_init,
    pack_header,
    unpack_header,
)
from aps.wire.rows import ROWS_REF_BYTES, decode_rows_ref, encode_rows_ref
from aps.wire.segments import ANCILLARY_SPACE, Segment, fds_from, map_received, scm_rights

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

#: Worker processes for tests: forked from a server process that has imported what they use
#: once (torch among it), instead of each starting an interpreter and importing it again.
#: Each test process (each pytest-xdist worker) starts its own. torch._dynamo is what torch
#: imports at the first optimizer made (some 900 modules, seconds on a loaded machine): made
#: after aps.torch.Optimizer has connected, it could outlast the server's handshake deadline.
SPAWN = mp.get_context("forkserver")
SPAWN.set_forkserver_preload(["numpy", "torch", "torch._dynamo", "aps", "aps.torch", "aps.testing.workers"])

#: A token strong enough for ``--token`` (aps serve refuses weaker ones): what ``aps token`` prints.
TOKEN = "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"
#: RawClient: find the server's token the way a worker does (its token file), and prove it.
FIND = object()


class ServerProcess:
    """``python -m aps serve --port 0 ...`` on 127.0.0.1, with its log captured to a file.

    ``host`` is the default ``--host`` (a ``--host`` in ``args`` wins); ``popen``
    starts the command (``subprocess.Popen``, or e.g. ``aps.testing.netns.Host.popen``
    to run the server inside a network namespace).
    """

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 30.0,
        host: str = "127.0.0.1",
        popen: Callable[..., subprocess.Popen] = subprocess.Popen,
    ) -> None:
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="aps-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "aps", "serve", "--host", host]
        if "--port" not in args:
            cmd += ["--port", "0"]
        cmd += list(args)
        full_env = dict(os.environ)
        full_env.update(env or {})
        try:
            self.proc = popen(cmd, stdout=subprocess.PIPE, stderr=self.log_file, text=True, env=full_env)
        except BaseException:
            self.log_file.close()
            os.unlink(self.log_file.name)
            raise
        self.first_line = self._read_first_line(timeout)
        prefix = "aps: serving on "
        if not self.first_line.startswith(prefix):
            log = self.log()
            self.stop()
            raise RuntimeError(f"aps serve did not start: {self.first_line!r}\n{log}")
        self.address = self.first_line[len(prefix) :].strip()
        self.port = int(self.address.rsplit(":", 1)[1])
        # the server's token: the one the test gave it, else the one it made itself (its token
        # file), for the helper's own requests; None when it has none (--insecure)
        token = args[args.index("--token") + 1] if "--token" in args else full_env.get("APS_TOKEN")
        self.token = token.encode() if token else find_token(host, self.port)
        #: The server made its token itself (no --token, none in the environment: its token file).
        self.token_made = not token and self.token is not None

    def _read_first_line(self, timeout: float) -> str:
        lines: queue.Queue[str] = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None  # stdout=PIPE
        threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
        try:
            return lines.get(timeout=timeout)
        except queue.Empty:
            return ""

    def log(self) -> str:
        self.log_file.flush()
        with open(self.log_file.name) as fh:
            return fh.read()

    def wait_for_log(self, text: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log()
            if text in log:
                return log
            time.sleep(0.02)
        raise AssertionError(f"{text!r} not in the server log:\n{self.log()}")

    @property
    def unix_path(self) -> str:
        """The server's Unix socket for shared memory, as its HELLO reply says."""
        from aps.client.sockets import handshake
        from aps.client.tcp import BlockingConnection

        conn = BlockingConnection("127.0.0.1", self.port)
        try:
            return handshake(conn, self.token, 10)[1]
        finally:
            conn.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log_file.close()
        try:
            os.unlink(self.log_file.name)
        except OSError:
            pass
        return self.proc.returncode


#: A raw client's frame of at most this many bytes is joined and sent in one write.
_JOIN_BELOW = 1 << 20


class RawClient:
    """Hand-made frames over a plain TCP socket, for bad-input tests.

    ``token``: FIND (the default) proves the token the server at ``port`` wrote to its
    token file, when there is one, as a worker would (HELLO, AUTH); a token proves that
    one; None sends nothing first (a stranger).
    """

    transport = "tcp"

    def __init__(self, port: int, timeout: float = 10.0, token=FIND) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._authenticate(find_token("127.0.0.1", port) if token is FIND else token)

    @classmethod
    def to(cls, server: ServerProcess, transport: str, token=FIND) -> RawClient:
        """A raw client of ``server`` over ``transport`` ("tcp" or "shm")."""
        token = server.token if token is FIND else token
        return (
            RawClient(server.port, token=token) if transport == "tcp" else RawShmClient(server.unix_path, token=token)
        )

    def _authenticate(self, token: bytes | str | None) -> None:
        if token is None:
            return
        token = token.encode() if isinstance(token, str) else token
        nonce = os.urandom(NONCE_BYTES)
        self.frame(Op.HELLO, nonce)
        header, payload = self.reply()
        assert header.op == Op.HELLO_REPLY, f"expected a HELLO reply, got op {header.op}"
        required, server_nonce, _ = decode_hello_reply(payload)
        if required:
            self.frame(Op.AUTH, auth_proof(token, "client", server_nonce, nonce))
            header, _ = self.reply()
            assert header.op == Op.AUTH_REPLY, f"expected an AUTH reply, got op {header.op}"

    def send(self, *parts: Buffer) -> None:
        if sum(len(memoryview(part).cast("B")) for part in parts) <= _JOIN_BELOW:
            # one write: a peer that answers the header and closes still finds the whole frame sent
            self.sock.sendall(b"".join(memoryview(part).cast("B") for part in parts))
            return
        for part in parts:  # no joined copy: a large payload starts leaving at once
            self.sock.sendall(part)

    def push(
        self, grad: np.ndarray, *, op: int = Op.PUSH, dtype: int = DType.FLOAT32, version: int = 0, request_id: int = 0
    ) -> None:
        """Send a gradient the way this transport does."""
        payload = np.ascontiguousarray(grad).tobytes()
        self.send(pack_header(op, 0, dtype, request_id, 0, version, len(payload)), payload)

    def frame(self, op: int, *payload: Buffer, **fields) -> None:
        """A frame whose payload is ``payload``'s parts, sent as they are (not joined)."""
        fields.setdefault("length", sum(len(memoryview(part).cast("B")) for part in payload))
        self.send(pack_header(op, **fields), *payload)

    def send_rows(self, header: bytes, rows: bytes) -> None:
        """A request with rows (Flag.ROWS; ``header`` says ``rows``'s length, after any dense
        part, which over TCP starts ``rows``), as this transport carries them."""
        self.send(header, rows)

    def rows_of(self, header, payload: bytes) -> bytes:
        """A reply's rows (``payload`` without its dense part, over TCP)."""
        return payload

    def init(self, rank: int, num_workers: int, params: dict[str, np.ndarray], tables=None, **fields) -> None:
        layout = Layout.from_arrays(params, tables)
        values = [np.ascontiguousarray(v, np.float32).data for v in params.values()]
        block = encode_init(rank, num_workers, layout)
        fields.setdefault("dtype", DType.FLOAT32)
        fields.setdefault("version", len(block))  # the layout block's length
        self.frame(Op.INIT, block, *values, **fields)

    def recv_exact(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise EOFError(f"connection closed after {len(data)} of {n} bytes")
            data += chunk
        return bytes(data)

    def reply(self):
        """The next reply or error frame (JOIN_PROGRESS notices, which are neither, are skipped)."""
        while True:
            header = unpack_header(self.recv_exact(HEADER_SIZE))
            payload = self.recv_exact(header.length) if header.length else b""
            if header.op != Op.JOIN_PROGRESS:
                return header, payload

    def error(self) -> tuple[int, str]:
        header, payload = self.reply()
        assert header.op == Op.ERROR, f"expected an error frame, got op {header.op}"
        return decode_error(payload)

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True when the server closed this connection (EOF or reset) within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


class RawShmClient(RawClient):
    """Hand-made frames over the server's Unix socket, with a shared gradient segment."""

    transport = "shm"

    def __init__(self, path: str, timeout: float = 10.0, token=FIND) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.segment: Segment | None = None
        self.rows_segment: Segment | None = None
        self.reply_rows: np.ndarray | None = None
        self.fds: list[int] = []  # descriptors received and not yet claimed
        if token is FIND:  # the socket of a server on TCP port N is .../N.sock
            stem = os.path.basename(path).split(".", 1)[0]
            token = find_token("127.0.0.1", int(stem)) if stem.isdigit() else None
        self._authenticate(token)

    def init(
        self,
        rank: int,
        num_workers: int,
        params: dict[str, np.ndarray],
        tables=None,
        *,
        segment_numel: int | None = None,
        with_segment: bool = True,
        **fields,
    ) -> None:
        layout = Layout.from_arrays(params, tables)
        values = b"".join(np.ascontiguousarray(v, np.float32).tobytes() for v in params.values())
        block = encode_init(rank, num_workers, layout)
        fields.setdefault("dtype", DType.FLOAT32)
        fields.setdefault("version", len(block))  # the layout block's length
        payload = block + values
        if self.segment is None or segment_numel is not None:
            self.segment = Segment.create(layout.numel if segment_numel is None else segment_numel, "test-grad")
        fds = [self.segment.fd] if with_segment else []
        self.sock.sendmsg([pack_header(Op.INIT, length=len(payload), **fields) + payload], scm_rights(fds))

    def push(
        self, grad: np.ndarray, *, op: int = Op.PUSH, dtype: int = DType.FLOAT32, version: int = 0, request_id: int = 0
    ) -> None:
        assert self.segment is not None, "init first: it sends the gradient segment"
        self.segment.array[: grad.size] = np.asarray(grad, np.float32).ravel()
        self.send(pack_header(op, int(Flag.SHM), dtype, request_id, 0, version, 0))

    def send_rows(self, header: bytes, rows: bytes, *, ref: bytes | None = None, fds: list | None = None) -> None:
        """``rows`` in this client's rows segment (a new one, with its descriptor, when they
        do not fit the last), the frame carrying their rows reference (or ``ref`` and
        ``fds``, as given: a lie)."""
        segment = self.rows_segment
        fresh = segment is None or segment.nbytes < len(rows)
        if segment is None or fresh:
            segment = self.rows_segment = Segment.create(
                -(-max(len(rows), 1 << 16) // 8) * 2, "test-rows"
            )  # (8-aligned)
        segment.array.view(np.uint8)[: len(rows)] = np.frombuffer(bytes(rows), np.uint8)
        if ref is None:
            ref = encode_rows_ref(len(rows), segment.nbytes, fresh)
            fds = [segment.fd] if fresh else []
        h = unpack_header(bytes(header))
        self.sock.sendmsg(
            [pack_header(h.op, h.flags, h.dtype, h.request_id, h.clock, h.version, len(ref)) + ref],
            scm_rights(fds or []),
        )

    def rows_of(self, header, payload: bytes) -> bytes:
        """A reply's rows, out of the server's reply segment its rows reference names."""
        length, size, has_fd = decode_rows_ref(payload[-ROWS_REF_BYTES:])
        if has_fd:
            self.reply_rows = map_received(self.fds.pop(), size, writable=False).view(np.uint8)  # (its own: the last)
        if not length:
            return b""
        assert self.reply_rows is not None, "a reply with rows before the one that brought their segment"
        return self.reply_rows[:length].tobytes()

    def recv_exact(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk, ancdata, _, _ = self.sock.recvmsg(n - len(data), ANCILLARY_SPACE)
            self.fds += fds_from(ancdata)
            if not chunk:
                raise EOFError(f"connection closed after {len(data)} of {n} bytes")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        super().close()
        for segment in (self.segment, self.rows_segment):
            if segment is not None:
                segment.close()
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def wait_for(condition, timeout: float = 20.0, what: str = "condition", every: float = 0.02):
    """Poll ``condition()`` every ``every`` seconds until it returns something true (returned),
    or raise AssertionError after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def memfd_inodes(pid: int, name: str) -> set[str]:
    """The inodes of the memfd segments named like ``name`` that process ``pid`` maps."""
    return {line.split()[4] for line in mapped_memfds(pid, name)}


def mapped_memfds(pid: int, name: str) -> list[str]:
    """Lines of /proc/PID/maps for memfd segments whose name contains ``name``."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return [line for line in fh if "memfd:" in line and name in line]
    except FileNotFoundError:
        return []


def run_processes(target, args_list, timeout: float = 60.0) -> list:
    """Run ``target(*args, results)`` in one spawned process per args; return their results.

    Each process puts exactly one item on ``results``; an exception instance
    counts as a failure and is raised here. Processes still alive at the
    deadline are killed (by their pid) and reported.
    """
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=_guarded, args=(target, args, results), daemon=True) for args in args_list]
    for proc in procs:
        proc.start()
    out = []
    deadline = time.monotonic() + timeout
    try:
        for _ in procs:
            remaining = max(0.1, deadline - time.monotonic())
            item = results.get(timeout=remaining)
            if isinstance(item, BaseException):
                raise item
            out.append(item)
    finally:
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()  # SIGKILL to its pid
                proc.join(5)
    return out


def _guarded(target, args, results) -> None:
    try:
        results.put(target(*args))
    except BaseException as exc:  # reported to the test
        results.put(RuntimeError(f"{type(exc).__name__}: {exc}"))


class SteadyCluster:
    """``server`` (a ServerProcess for ``workers`` workers) and that many steady worker
    processes (``aps.testing.workers.steady_worker``), their steps counted in ``steps``."""

    def __init__(self, server: ServerProcess, workers: int, numel: int, transport: str) -> None:
        from . import workers as _workers

        self.server = server
        self.steps = SPAWN.Array("q", workers, lock=False)
        self.errors = SPAWN.Queue()
        self.stop = SPAWN.Event()
        self.procs = [
            SPAWN.Process(
                target=_workers.steady_worker,
                daemon=True,
                args=(self.server.address, r, workers, numel, transport, self.steps, self.errors, self.stop),
            )
            for r in range(workers)
        ]
        for p in self.procs:
            p.start()

    def wait_steps(self, ranks, more: int, timeout: float) -> float:
        """Seconds until every rank in ``ranks`` has taken ``more`` further steps (AssertionError after ``timeout``)."""
        start = time.monotonic()
        goal = {r: self.steps[r] + more for r in ranks}
        while not all(self.steps[r] >= goal[r] for r in ranks):
            assert time.monotonic() - start < timeout, f"steps {list(self.steps)}, goal {goal}"
            time.sleep(0.01)
        return time.monotonic() - start

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            if p.is_alive() and p.pid is not None:  # (alive: started, with a pid)
                # it may have ended since, and been reaped by a handler another test's library left behind
                # (multiprocessing then still calls it alive): nothing to wake
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
