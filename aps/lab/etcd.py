"""A private etcd, one member alone in its cluster: ``with Etcd(directory) as etcd: etcd.url``
(Debian's ``etcd-server``). ``aps launch --replica-count`` starts one when given no
``--coordinator``, and the tests start theirs (:mod:`aps.testing.etcd`).

On loopback, on ports the kernel picks free, or (``unix=True``, the launcher's) on Unix
sockets in a directory of its own that only this user may enter: etcd 3.4 has no
authentication a launcher could set up in passing, and on loopback any user of the host
could rewrite who is primary. Its data in the directory given; stopped (by its process id)
and its data left for the caller to remove.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from .processes import die_with_parent

__all__ = ["Etcd", "etcd_available"]


class Host(Protocol):
    """A host of a test's network (:class:`aps.testing.netns.Host`): etcd runs inside it."""

    address: str

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen: ...


def etcd_available() -> bool:
    return shutil.which("etcd") is not None


#: Its sockets' names in :attr:`Etcd.socket_dir` (etcd 3.4 takes a Unix socket as "host:port"),
#: short: the whole path must fit a socket's 108 bytes.
_CLIENT_SOCKET, _PEER_SOCKET = "etcd:1", "peer:2"
_SOCKET_PATH_MAX = 108  # (sun_path, with its terminating NUL)


def _unix_health(path: Path) -> bool:
    """Whether the etcd on Unix socket ``path`` says it is healthy (GET /health)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1)
            sock.connect(str(path))
            sock.sendall(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        return b'"true"' in answer or b"true" in answer.split(b"\r\n\r\n", 1)[-1]
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Etcd:
    """One etcd member, alone in its cluster."""

    def __init__(
        self, directory: str | os.PathLike, timeout: float = 20.0, host: Host | None = None, unix: bool = False
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self.host = host  # (a host of an aps.testing.netns.Network: etcd runs inside it)
        self.address = host.address if host is not None else "127.0.0.1"
        self.proc: subprocess.Popen | None = None
        self.client_port = self.peer_port = 0
        self.unix = unix
        #: The directory of its Unix sockets (``unix=True``), made by :meth:`start`: 0700, in
        #: ``directory``, or in the temporary directory or /tmp when that path is too long for a
        #: socket's (108 bytes); removed by :meth:`remove_sockets`.
        self.socket_dir: Path | None = None

    def _make_socket_dir(self) -> Path:
        # In its own directory (the launcher's log directory: nothing is left elsewhere by a
        # launcher killed with SIGKILL), else in the temporary directory, else in /tmp, the
        # first whose path is short enough for a socket's.
        for where in (str(self.directory), None, "/tmp"):
            path = Path(tempfile.mkdtemp(prefix="aps-etcd-", dir=where))
            if len(str(path / _CLIENT_SOCKET).encode()) < _SOCKET_PATH_MAX:
                return path
            path.rmdir()
        raise RuntimeError("no directory for etcd's Unix socket has a path short enough (108 bytes)")

    @property
    def url(self) -> str:
        """Its client URL, as ``--coordinator`` takes it."""
        if self.socket_dir is not None:
            return f"unix://{self.socket_dir / _CLIENT_SOCKET}"
        return f"etcd://{self.address}:{self.client_port}"

    def _ready(self, client: str) -> bool:
        if self.host is not None:  # (unreachable from here: its log says when it serves)
            return b"ready to serve client requests" in (self.directory / "etcd.log").read_bytes()
        if self.socket_dir is not None:
            return _unix_health(self.socket_dir / _CLIENT_SOCKET)
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1) as response:
                return b"true" in response.read()
        except OSError:
            return False

    def start(self) -> Etcd:
        popen = self.host.popen if self.host is not None else subprocess.Popen
        if self.unix and self.socket_dir is None:
            self.socket_dir = self._make_socket_dir()
        for _ in range(1 if self.unix else 5):  # (a port picked free may be taken before etcd binds it)
            if self.socket_dir is not None:  # (sockets in its directory: etcd names them by a "host:port")
                client, peer = f"unix://{_CLIENT_SOCKET}", f"unix://{_PEER_SOCKET}"
            else:
                if self.host is None:
                    self.client_port, self.peer_port = _free_port(), _free_port()
                else:  # (a namespace of its own: every port is free)
                    self.client_port, self.peer_port = 2379, 2380
                client, peer = f"http://{self.address}:{self.client_port}", f"http://{self.address}:{self.peer_port}"
            log = open(self.directory / "etcd.log", "ab")
            self.proc = popen(
                [
                    "etcd",
                    "--name",
                    "aps-test",
                    "--data-dir",
                    str((self.directory / "data").absolute()),
                    "--listen-client-urls",
                    client,
                    "--advertise-client-urls",
                    client,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"aps-test={peer}",
                    "--log-level",
                    "info",
                ],
                stdout=log,
                stderr=log,
                cwd=self.socket_dir,  # (None: this one's; its Unix sockets are made where it runs)
                # (it ends with whoever started it, even one killed with SIGKILL)
                preexec_fn=functools.partial(die_with_parent, os.getpid()) if self.host is None else None,
            )
            log.close()
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._ready(client):
                    return self
                time.sleep(0.05)
            self.stop()
        self.remove_sockets()
        raise RuntimeError(f"etcd did not start: {(self.directory / 'etcd.log').read_text()[-2000:]}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.socket_dir is not None and proc is not None:
            for name in (_CLIENT_SOCKET, _PEER_SOCKET):  # (the directory stays for a start again)
                (self.socket_dir / name).unlink(missing_ok=True)

    def remove_sockets(self) -> None:
        """Remove the sockets' directory (stopped: the caller is done with this etcd)."""
        if self.socket_dir is not None and self.proc is None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None

    def __enter__(self) -> Etcd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
