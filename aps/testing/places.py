"""Where a chaos soak's processes run and how they live: a place (this host's loopback, a
network namespace, a second user of the host), an ``aps serve`` shard and a worker process
with their logs, a stop by pid that reaches a stopped process too, and a tmpfs to fill.

The soak itself is :mod:`aps.testing.chaos`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .users import as_second_user

__all__ = [
    "stop_process",
    "Place",
    "SecondUser",
    "LogTail",
    "ShardProc",
    "WorkerProc",
    "run_checked",
    "tmpfs_unavailable_reason",
    "Tmpfs",
]


def stop_process(proc: subprocess.Popen, grace: float = 5.0, signum: int = signal.SIGTERM) -> None:
    """End ``proc`` by its pid: SIGCONT (a stopped process cannot act on SIGTERM), ``signum``,
    SIGKILL after ``grace`` seconds; then reap it."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGCONT, signum):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(10)


class Place:
    """Where processes run: this host's loopback, or a network namespace (aps.testing.netns.Host)."""

    def __init__(self, host=None) -> None:
        self.host = host

    @property
    def address(self) -> str:
        return self.host.address if self.host is not None else "127.0.0.1"

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        if self.host is not None:
            return self.host.popen(argv, **kwargs)
        return subprocess.Popen(argv, **kwargs)


class SecondUser(Place):
    """Where the second user's processes run: ``place``, as ``nobody``."""

    def __init__(self, place: Place) -> None:
        super().__init__(place.host)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return super().popen(as_second_user(argv), **kwargs)


class LogTail:
    """New lines of a file that another process appends to, read from where the last call stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._partial = b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        return [line.decode("utf-8", "replace") for line in complete]


class ShardProc:
    """One ``aps serve --shard I`` process; its output (both streams) in its own log file,
    which is cut back to its last MiB when it passes ``LOG_CAP`` bytes."""

    LOG_CAP = 8 << 20

    def __init__(
        self, index: int, place: Place, argv: list[str], env: dict, log_path: Path, timeout: float = 60.0
    ) -> None:
        self.index = index
        self.log_path = log_path
        self.started = time.monotonic()
        self._log_start = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            self.proc = place.popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.address = self._wait_address(timeout)
        self.port = int(self.address.rsplit(":", 1)[1])

    def _wait_address(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_since_start()
            match = re.search(r"^aps: serving on (\S+)", text, re.M)
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"shard {self.index} exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.05)
        stop_process(self.proc)
        raise RuntimeError(f"shard {self.index} did not start within {timeout} s:\n{self.log_since_start()[-3000:]}")

    def log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._log_start)
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def cap_log(self) -> None:
        with contextlib.suppress(OSError):
            size = self.log_path.stat().st_size
            if size > self.LOG_CAP:
                with open(self.log_path, "rb") as fh:
                    fh.seek(size - (1 << 20))
                    tail = fh.read()
                with open(self.log_path.with_suffix(".old.log"), "wb") as fh:
                    fh.write(tail)
                os.truncate(self.log_path, 0)  # the server appends (O_APPEND): it goes on at the new end
                self._log_start = 0

    def alive(self) -> bool:
        return self.proc.poll() is None


class WorkerProc:
    """One worker process of rank ``rank`` (a new one after each kill); its log is shared by all."""

    def __init__(self, rank: int, place: Place, argv: list[str], env: dict, log_path: Path) -> None:
        self.rank = rank
        with open(log_path.with_suffix(".err"), "ab") as err:  # the child has its own descriptor
            self.proc = place.popen(argv, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, env=env)


def run_checked(argv: list[str], timeout: float = 15.0) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")


def tmpfs_unavailable_reason() -> str | None:
    """Why a tmpfs cannot be mounted here (None when it can)."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount/umount not found"
    return None


class Tmpfs:
    """A small tmpfs mounted at ``path`` (a shard's checkpoint directory), to fill on demand."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        path.mkdir(parents=True, exist_ok=True)
        run_checked(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)])
        self.mounted = True
        self.ballast = path / ".ballast"

    def fill(self) -> int:
        """Take every free byte (a ballast file); returns how many were taken."""
        taken = 0
        with contextlib.suppress(OSError), open(self.ballast, "ab", buffering=0) as fh:  # unbuffered: ENOSPC here
            for size in (1 << 16, 512):  # then the last partial chunk
                with contextlib.suppress(OSError):  # ENOSPC: full
                    while True:
                        taken += fh.write(b"\0" * size)
        return taken

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.ballast.unlink()

    def unmount(self) -> None:
        if not self.mounted:
            return
        try:
            run_checked(["umount", str(self.path)])
        except RuntimeError:  # a process still holds a file there: detach it now, freed when released
            run_checked(["umount", "-l", str(self.path)])
        self.mounted = False
