"""``aps launch --replica-count R``: each shard a replica set of R local server processes.

Each replica is an ``aps serve --replicas ...`` of its own, a process the
launcher starts (and a session of its own, so that Ctrl-C reaches the
launcher, which stops them in order). Who is primary is decided in etcd:
``--coordinator URL``, or, when none is given, a private etcd the launcher
starts (its data in the log directory, its Unix socket in a directory only this
user may enter: see :mod:`aps.lab.etcd`). A replica that dies while the workers train
(``kill -9`` it to watch a failover) is started again: it catches up from the
live replica and joins its set as a backup. When the run ends the backups are
stopped first, then the primaries, so that nothing fails over on the way out.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..client.tcp import control_request
from ..config import ServerConfig
from ..errors import APSError, ConfigurationError
from ..lab.processes import die_with_parent
from ..wire.protocol import Op

__all__ = ["LocalReplicaSets"]

#: A replica that dies this many times within RESTART_WINDOW_S is left down (the alarm says so).
RESTART_LIMIT = 3
RESTART_WINDOW_S = 60.0
_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(config: ServerConfig, log_path: str, parent: int) -> None:
    """A replica's process: the server, its output in ``log_path``."""
    import json

    from ..server.replicas import SetRetired
    from ..server.server import Server
    from .serve import setup_logging

    os.setsid()  # (Ctrl-C reaches the launcher only: it stops the replicas in order)
    die_with_parent(parent)  # (a launcher killed with SIGKILL leaves no replica behind)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    setup_logging(config.log_level)
    print(f"aps: replica {config.advertise} of {json.dumps(config.replicas)}", flush=True)
    server = Server(config)

    def retire(signum: int, frame: object) -> None:  # (the launcher's run is over: the backups stop too)
        server.retire_replicas = True
        server.stop()

    signal.signal(signal.SIGUSR1, retire)
    try:
        code = server.run()
    except SetRetired as exc:
        print(f"aps: {exc}", flush=True)
        code = 0
    sys.exit(code)


@dataclass
class Replica:
    shard: int
    index: int
    sharded: bool
    config: ServerConfig
    log_path: str
    process: Any = None  # multiprocessing.Process
    deaths: list[float] = field(default_factory=list)
    given_up: bool = False

    @property
    def address(self) -> str:
        assert self.config.advertise is not None
        return self.config.advertise

    @property
    def name(self) -> str:
        return f"{f'shard {self.shard} ' if self.sharded else ''}replica {self.index} ({self.address})"


class LocalReplicaSets:
    """The replica sets of a launch: ``shards`` sets of ``count`` replicas on this host."""

    def __init__(self, config: ServerConfig, count: int, log_dir: str, token: str, say) -> None:
        self.config, self.count, self.log_dir, self.token, self.say = config, count, log_dir, token, say
        self.etcd: Any = None
        self._context = multiprocessing.get_context("spawn")
        self.replicas: list[Replica] = []
        self.primary: dict[int, Replica] = {}
        self._stopping = False

    # Starting -------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> LocalReplicaSets:
        """Start the coordinator (unless given) and every replica; return once each shard has a
        primary that lists all its backups (each holds the whole state)."""
        config, count, shards = self.config, self.count, self.config.shards
        coordinator = config.coordinator or self._start_etcd()
        run = secrets.token_hex(4)
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
        for shard in range(shards):
            # Replica r of shard s listens on port + s * R + r (and its dashboard likewise), or free ports.
            ports = [config.port + shard * count + r if config.port else _free_port() for r in range(count)]
            addresses = [f"{host}:{port}" for port in ports]
            for index, port in enumerate(ports):
                http = config.http_port
                if http is not None:
                    http = http + shard * count + index if http else _free_port()
                where = f"shard-{shard}-replica-{index}" if shards > 1 else f"replica-{index}"
                replica_config = config.replace(
                    shard=shard,
                    port=port,
                    http_port=http,
                    replicas=",".join(addresses),
                    advertise=addresses[index],
                    coordinator=coordinator,
                    replica_set=f"launch-{run}-shard-{shard}",
                    token=self.token,
                    token_file=None,
                    checkpoint_dir=(
                        os.path.join(config.checkpoint_dir, where) if config.checkpoint_dir is not None else None
                    ),
                )
                log_path = os.path.join(self.log_dir, where + ".log")
                self.replicas.append(Replica(shard, index, shards > 1, replica_config, log_path))
        for replica in self.replicas:
            self._spawn(replica)
        self._wait_replicated(timeout)
        return self

    def _start_etcd(self) -> str:
        from ..lab.etcd import Etcd, etcd_available

        if not etcd_available():
            raise ConfigurationError(
                "--replica-count needs a coordinator: --coordinator etcd://HOST:PORT, or etcd installed "
                "(Debian's etcd-server) for the private one aps launch starts (docs/guide/replicas.md)"
            )
        # On Unix sockets in a directory only this user may enter: on loopback, any user of the
        # host could rewrite who is primary (etcd 3.4 has no authentication to set up in passing).
        self.etcd = Etcd(os.path.join(self.log_dir, "etcd"), unix=True).start()
        self.say(f"aps: coordinator: a private etcd on {self.etcd.url} (its log in {self.log_dir}/etcd)")
        return str(self.etcd.url)

    def _spawn(self, replica: Replica) -> None:
        replica.process = self._context.Process(
            target=_serve, args=(replica.config, replica.log_path, os.getpid()), name=f"aps-{replica.name}"
        )
        replica.process.start()

    def _wait_replicated(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = sorted({r.shard for r in self.replicas})
        while waiting:
            for replica in self.replicas:
                if not replica.process.is_alive():
                    raise ConfigurationError(
                        f"{replica.name} exited with status {replica.process.exitcode} while starting:\n"
                        + _tail(replica.log_path)
                    )
            waiting = [shard for shard in waiting if not self._replicated(shard)]
            if waiting and time.monotonic() > deadline:
                shard = waiting[0]
                logs = "\n".join(f"--- {r.log_path}\n{_tail(r.log_path, 8)}" for r in self.replicas if r.shard == shard)
                raise ConfigurationError(
                    f"shard {shard}'s replica set did not list all {self.count - 1} backups in {timeout:g} s:\n{logs}"
                )
            time.sleep(0.1)

    def _replicated(self, shard: int) -> bool:
        stats = self.stats(shard, timeout=1.0)
        status = (stats or {}).get("server", {}).get("replicas") or {}
        return len(status.get("listed") or []) >= self.count - 1

    # Running --------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        """What the workers are given: one replica of each shard (they learn the rest at the handshake)."""
        return [f"tcp://{r.address}" for r in self.replicas if r.index == 0]

    def stats(self, shard: int = 0, timeout: float = 2.0) -> dict | None:
        """Shard ``shard``'s statistics, from its primary (None while none answers)."""
        import json

        known = self.primary.get(shard)
        order = [known] if known is not None else []
        order += [r for r in self.replicas if r.shard == shard and r is not known]
        for replica in order:
            try:
                stats = json.loads(control_request(f"tcp://{replica.address}", Op.STATS, self.token, timeout))
            except (APSError, OSError, ValueError):
                continue
            if ((stats.get("server") or {}).get("replicas") or {}).get("role") == "primary":
                self.primary[shard] = replica
                return stats
        return None

    def supervise(self) -> None:
        """Start again each replica that died (it rejoins its set as a backup); one that keeps
        dying is left down, and said so."""
        if self._stopping:
            return
        now = time.monotonic()
        for replica in self.replicas:
            if replica.given_up or replica.process.is_alive():
                continue
            code = replica.process.exitcode
            replica.deaths = [t for t in replica.deaths if now - t < RESTART_WINDOW_S] + [now]
            if self.primary.get(replica.shard) is replica:
                del self.primary[replica.shard]
            if len(replica.deaths) > RESTART_LIMIT:
                replica.given_up = True
                self.say(
                    f"aps: ALARM: {replica.name} exited {len(replica.deaths)} times in {RESTART_WINDOW_S:g} s "
                    f"(last status {code}): left down; its shard runs on without it (see {replica.log_path})"
                )
                continue
            self.say(f"aps: {replica.name} exited with status {code}: starting it again; it rejoins as a backup")
            self._spawn(replica)

    def describe(self) -> list[str]:
        lines = []
        for shard in sorted({r.shard for r in self.replicas}):
            members = [r for r in self.replicas if r.shard == shard]
            primary = self.primary.get(shard)
            text = ", ".join(f"{r.address} pid {r.process.pid}{' (primary)' if r is primary else ''}" for r in members)
            which = f"shard {shard} " if self.config.shards > 1 else ""
            logs = os.path.join(self.log_dir, f"{f'shard-{shard}-' if self.config.shards > 1 else ''}replica-*.log")
            lines.append(f"aps: {which}replica set: {text}; logs in {logs}")
            for r in members:
                if r.config.http_port:
                    host = r.address.rsplit(":", 1)[0]
                    which = f"shard {shard}, " if self.config.shards > 1 else ""
                    lines.append(f"aps: dashboard on http://{host}:{r.config.http_port}/ ({which}replica {r.index})")
        return lines

    # Stopping -------------------------------------------------------------------
    def stop(self) -> None:
        """Retire each set through its primary (SIGUSR1: its backups stop too, nothing fails
        over), then SIGTERM what is left, SIGKILL after a grace period; then etcd."""
        self._stopping = True
        for shard in range(self.config.shards):  # (who is primary now: failovers may have moved it)
            self.primary.pop(shard, None)
            self.stats(shard, timeout=1.0)
        for replica in self.primary.values():
            if replica.process.is_alive():
                _signal(replica.process.pid, signal.SIGUSR1)
        for signum in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + _GRACE_S
            for replica in self.replicas:
                replica.process.join(max(0.0, deadline - time.monotonic()))
            live = [r for r in self.replicas if r.process.is_alive()]
            for replica in live:
                _signal(replica.process.pid, signum)
        for replica in self.replicas:
            replica.process.join()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd.remove_sockets()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""
