"""Replica sets for tests and benchmarks: real ``aps serve --replicas`` processes on
loopback, a real etcd (:mod:`aps.testing.etcd`), and ledger workers
(:mod:`aps.testing.chaos_processes`) whose acknowledged pushes are read off their logs.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .ledger import LedgerLayout, analyse_ledger

if TYPE_CHECKING:
    from .netns import Host

__all__ = ["ReplicaCluster"]

PY = sys.executable


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ReplicaCluster:
    """``replicas`` replicas of one unsharded set, and ``workers`` ledger workers. With no
    ``coordinator`` it is one plain server (``replicas`` 1), the checkpoint-only baseline
    the benchmarks set beside a replica set (its checkpoint options in ``extra``)."""

    def __init__(
        self,
        directory: Path,
        coordinator: str | None,
        *,
        replicas: int = 2,
        workers: int = 2,
        slots: int = 20000,
        sync: str = "asp",
        extra: tuple[str, ...] = (),
        hosts: list[Host] | None = None,
        worker_host: Host | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.coordinator = coordinator
        # Each replica on loopback, or in a host of its own (aps.testing.netns), as the workers are.
        self.hosts, self.worker_host = hosts, worker_host
        if hosts is not None:
            self.ports = [7450] * replicas
            self.addresses = [f"{host.address}:7450" for host in hosts]
        else:
            self.ports = [_free_port() for _ in range(replicas)]
            self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.token = secrets.token_hex(16)
        self.env = dict(os.environ, APS_TOKEN=self.token)
        self.workers, self.sync, self.extra = workers, sync, extra
        self.layout = LedgerLayout(1, workers, slots)
        self.procs: dict[int, subprocess.Popen] = {}
        self.starts: dict[int, int] = {}
        self.worker_procs: list[subprocess.Popen] = []
        self.name = "set-" + secrets.token_hex(4)

    def log(self, index: int) -> str:
        return "".join((self.dir / f"replica{index}.{n}.err").read_text() for n in range(self.starts.get(index, 0)))

    def out(self, index: int) -> str:
        """What replica ``index`` printed in its newest start (``aps: serving on ...`` once primary)."""
        n = self.starts.get(index, 0) - 1
        return (self.dir / f"replica{index}.{n}.out").read_text() if n >= 0 else ""

    def start_replica(self, index: int, *more: str) -> subprocess.Popen:
        n = self.starts.get(index, 0)
        self.starts[index] = n + 1
        argv = [
            PY,
            "-m",
            "aps",
            "serve",
            "--host",
            self.addresses[index].rsplit(":", 1)[0],
            "--port",
            str(self.ports[index]),
            *self._replica_flags(),
            "--workers",
            str(self.workers),
            "--sync",
            self.sync,
            "--lr",
            "1",
            "--heartbeat-timeout",
            "5",
            *self.extra,
            *more,
        ]
        out_path, err_path = self.dir / f"replica{index}.{n}.out", self.dir / f"replica{index}.{n}.err"
        with open(out_path, "w") as out, open(err_path, "w") as err:
            popen = self.hosts[index].popen if self.hosts is not None else subprocess.Popen
            env = self.env if self.hosts is None else {**self.env, "XDG_RUNTIME_DIR": self.hosts[index].runtime_dir}
            proc = popen(argv, stdout=out, stderr=err, env=env, stdin=subprocess.DEVNULL)
        self.procs[index] = proc
        return proc

    def _replica_flags(self) -> list[str]:
        if self.coordinator is None:
            if len(self.addresses) != 1:
                raise ValueError("a cluster without a coordinator is one server")
            return []
        return ["--replicas", ",".join(self.addresses), "--coordinator", self.coordinator, "--replica-set", self.name]

    def wait_log(self, index: int, text: str, timeout: float = 30.0) -> float:
        """Seconds until replica ``index``'s log says ``text`` (AssertionError after ``timeout``)."""
        start = time.monotonic()
        while text not in self.log(index):
            proc = self.procs[index]
            tail = self.log(index)[-3000:]
            assert proc.poll() is None or text in self.log(index), f"replica {index} exited:\n{tail}"
            assert time.monotonic() - start < timeout, f"replica {index} never said {text!r}:\n{tail}"
            time.sleep(0.02)
        return time.monotonic() - start

    def start_set(self) -> None:
        """Replica 0 as primary, then the others, until the primary has listed every backup."""
        self.start_replica(0)
        self.wait_log(0, "primary at term")
        for index in range(1, len(self.addresses)):
            self.start_replica(index)
        self.wait_count(0, "holds the whole state", len(self.addresses) - 1)

    def wait_count(self, index: int, text: str, count: int, timeout: float = 30.0) -> float:
        """Seconds until replica ``index``'s logs (every start) say ``text`` ``count`` times."""
        start = time.monotonic()
        while self.log(index).count(text) < count:
            assert time.monotonic() - start < timeout, f"replica {index} said {text!r} fewer than {count} times"
            time.sleep(0.02)
        return time.monotonic() - start

    def start_workers(self, first: int = 0, transport: str = "tcp") -> None:
        for rank in range(self.workers):
            argv = [
                PY,
                "-m",
                "aps.testing.chaos_processes",
                "worker",
                "--addresses",
                f"tcp://{self.addresses[first]}",
                "--rank",
                str(rank),
                "--workers",
                str(self.workers),
                "--shards",
                "1",
                "--slots",
                str(self.layout.slots),
                "--log",
                str(self.dir / f"w{rank}.log"),
                "--stop",
                str(self.dir / "stop"),
                "--reconnect-timeout",
                "60",
                "--heartbeat",
                "0.5",
                "--server-timeout",
                "5",
                "--transport",
                transport,
            ]
            if self.sync == "bsp":
                argv.append("--bsp")
            with open(self.dir / f"w{rank}.err", "a") as err:
                self.worker_procs.append(self._popen(argv, env=self.env, stderr=err, stdin=subprocess.DEVNULL))

    def acked(self) -> np.ndarray:
        acked = np.zeros((1, self.workers, self.layout.slots), bool)
        for rank in range(self.workers):
            path = self.dir / f"w{rank}.log"
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                kind, _, rest = line.partition(" ")
                if kind == "a":
                    parts = rest.split()
                    slot = int(parts[2])
                    if parts[0] == "0" and 0 <= slot < self.layout.slots:
                        acked[0, rank, slot] = True
        return acked

    def wait_acks(self, more: int, timeout: float = 60.0) -> float:
        """Seconds until the workers have ``more`` acknowledged pushes beyond now, between them."""
        start = time.monotonic()
        goal = int(self.acked().sum()) + more
        while int(self.acked().sum()) < goal:
            assert time.monotonic() - start < timeout, f"{self.acked().sum()} acknowledged, waiting for {goal}"
            for proc in self.worker_procs:
                assert proc.poll() is None, f"a worker exited: {(self.dir / 'w0.err').read_text()[-2000:]}"
            time.sleep(0.05)
        return time.monotonic() - start

    def _popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """A worker-side process: on loopback, or in the workers' host."""
        return (self.worker_host.popen if self.worker_host is not None else subprocess.Popen)(argv, **kwargs)

    def kill(self, index: int, signum: int = signal.SIGKILL) -> None:
        os.kill(self.procs[index].pid, signum)
        if signum == signal.SIGKILL:
            self.procs[index].wait(10)

    def finish(self, primary: int) -> dict:
        """Stop the workers, read the weights from replica ``primary``: the ledger's verdict."""
        (self.dir / "stop").touch()
        for proc in self.worker_procs:
            proc.wait(60)
        out = self.dir / "final.npy"
        pull = self._popen(
            [
                PY,
                "-m",
                "aps.testing.chaos_processes",
                "pull",
                "--addresses",
                f"tcp://{self.addresses[primary]}",
                "--workers",
                str(self.workers),
                "--shards",
                "1",
                "--slots",
                str(self.layout.slots),
                "--out",
                str(out),
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _, err = pull.communicate(timeout=120)
        if pull.returncode != 0:
            raise RuntimeError(f"pulling the final ledger failed: {err.decode()[-2000:]}")
        return analyse_ledger(np.load(out), self.layout, self.acked(), self.sync == "bsp")

    def close(self) -> None:
        for proc in [*self.worker_procs, *self.procs.values()]:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.terminate()
                    proc.wait(10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()
