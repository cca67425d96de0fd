"""The chaos soak with replica sets (``SoakConfig.replicas`` > 1): every shard a primary
and its backups (``aps serve --replicas``), a real etcd deciding who is primary, the same
seeded faults, and a stricter promise: no acknowledged gradient is lost, ever (the
checkpoint-only soak allows the updates between a crash and the checkpoint it resumed
from).

The faults mean, with replicas:

- ``shard_kill``: kill -9 of a shard's primary (a backup takes over; the killed replica
  comes back after the fault's seconds, as a backup that catches up);
- ``shard_kill_older``: kill -9 of a backup instead (the primary goes on; it comes back);
- ``shard_stop``: SIGSTOP of a primary for the fault's seconds (a backup takes over; the
  stopped one wakes deposed, stops, and comes back as a backup);
- ``cut``: a replica's, a worker's or the coordinator's host cut off;
- ``impostor``, ``guesser``, ``strangers``: at the shard's primary, as without replicas.

``disk_full`` is left out: the checkpoints are the second line here. A replica that
exits by itself (a deposed primary) is started again, as a backup.
"""

from __future__ import annotations

import re
import signal
import socket
import time

from .chaos import PY, LEDGER_OPTIONS, POLICIES, Fault, Soak, SoakConfig, run_soak
from .etcd import Etcd
from .places import Place, ShardProc

__all__ = ["ReplicatedSoak", "run_replicated_soak"]

_PORT = 7450  # every replica's port in a namespace of its own


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ReplicaProc(ShardProc):
    """One replica of shard ``index``: started as primary or backup, its address known."""

    def __init__(self, index: int, replica: int, address: str, *args, **kwargs) -> None:
        self.replica = replica
        self.known_address = address
        super().__init__(index, *args, **kwargs)
        self.serving_at: float | None = None

    def _wait_address(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_since_start()
            if re.search(r"^aps: (serving on|backup of replica set) ", text, re.M):
                return f"tcp://{self.known_address}"
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.index}/{self.replica} exited:\n{text[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"replica {self.index}/{self.replica} did not start:\n{self.log_since_start()[-3000:]}")

    def serving(self) -> bool:
        """Whether it serves the workers (it is, or was until it stopped, the primary)."""
        if self.serving_at is None and "aps: serving on" in self.log_since_start():
            self.serving_at = time.monotonic()
        return self.serving_at is not None and self.alive()


class ReplicatedSoak(Soak):
    """:class:`aps.testing.chaos.Soak` with ``config.replicas`` replicas a shard."""

    def __init__(self, config: SoakConfig) -> None:
        super().__init__(config)
        self.R = config.replicas
        self.replica_places: list[list[Place]] = []
        self.replica_procs: list[list[ReplicaProc | None]] = []
        self.replica_addresses: list[list[str]] = []
        self.down: set[tuple[int, int]] = set()  # replicas down on purpose (poll() does not restart them)
        self.etcd: Etcd | None = None
        self.etcd_place = Place()
        self.failovers: list[dict] = []

    # Setting up ------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        from aps.testing import netns

        use_netns = cfg.network == "netns" or (cfg.network == "auto" and netns.netns_unavailable_reason() is None)
        if use_netns:
            self.network = netns.Network("198.18.7.0/24", max_hosts=cfg.shards * self.R + cfg.workers + 2)
            self.network.open()
            self.replica_places = [
                [Place(self.network.add_host(f"ps{i}r{j}")) for j in range(self.R)] for i in range(cfg.shards)
            ]
            self.worker_places = [Place(self.network.add_host(f"w{r}")) for r in range(cfg.workers)]
            self.stranger_place = Place(self.network.add_host("stranger"))
            self.etcd_place = Place(self.network.add_host("etcd"))
            self.replica_addresses = [[f"{p.address}:{_PORT}" for p in places] for places in self.replica_places]
        else:
            self.notes.append("network cuts off: no network namespaces here")
            self.replica_places = [[Place() for _ in range(self.R)] for _ in range(cfg.shards)]
            self.worker_places = [Place() for _ in range(cfg.workers)]
            self.replica_addresses = [[f"127.0.0.1:{_free_port()}" for _ in range(self.R)] for _ in range(cfg.shards)]
        self.etcd = Etcd(self.dir / "etcd", host=self.etcd_place.host).start()
        self.shard_places = [places[0] for places in self.replica_places]
        self.replica_procs = [[None] * self.R for _ in range(cfg.shards)]
        for i in range(cfg.shards):
            self.start_replica(i, 0)
        for i in range(cfg.shards):
            _wait(lambda i=i: "primary at term" in self._log(i, 0), 30, f"shard {i}'s first primary")
            for j in range(1, self.R):
                self.start_replica(i, j)
        for i in range(cfg.shards):
            _wait(lambda i=i: self._log(i, 0).count("holds the whole state") >= self.R - 1, 60, f"shard {i}'s backups")
        self.shards = [self.replica_procs[i][0] for i in range(cfg.shards)]
        self.addresses = [f"tcp://{self.replica_addresses[i][0]}" for i in range(cfg.shards)]
        for r in range(cfg.workers):
            self.start_worker(r)

    def kinds(self) -> list[str]:
        return [k for k in super().kinds() if k != "disk_full"]

    def start_replica(self, index: int, replica: int) -> ReplicaProc:
        cfg, place = self.cfg, self.replica_places[index][replica]
        address = self.replica_addresses[index][replica]
        assert self.etcd is not None
        argv = [PY, "-m", "aps", "serve", "--host", place.address, "--port", address.rsplit(":", 1)[1]]
        argv += ["--replicas", ",".join(self.replica_addresses[index]), "--advertise", address]
        argv += ["--coordinator", self.etcd.url, "--replica-set", f"{self.dir.name}-shard-{index}"]
        argv += ["--shard", str(index), "--shards", str(cfg.shards), "--workers", str(cfg.workers)]
        argv += [*POLICIES[cfg.sync], *LEDGER_OPTIONS, "--heartbeat-timeout", str(cfg.heartbeat_timeout)]
        argv += ["--checkpoint-dir", str(self.dir / f"ckpt-{index}-{replica}"), "--checkpoint-every", "0"]
        argv += ["--checkpoint-every-updates", str(cfg.checkpoint_every_updates)]
        # (a replica that finds itself primary with no backup to take over resumes its own newest)
        argv += ["--checkpoint-keep", str(cfg.checkpoint_keep), "--resume"]
        env = dict(self.env)
        if place.host is not None:
            env["XDG_RUNTIME_DIR"] = place.host.runtime_dir
        proc = ReplicaProc(
            index, replica, address, place, argv, env, self.dir / f"shard-{index}-{replica}.log", timeout=90.0
        )
        self.replica_procs[index][replica] = proc
        self.all_shards.append(proc.proc)
        self.down.discard((index, replica))
        return proc

    def _log(self, index: int, replica: int) -> str:
        path = self.dir / f"shard-{index}-{replica}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # Watching ------------------------------------------------------------------------------
    def poll(self) -> None:
        super().poll()
        for i, procs in enumerate(self.replica_procs):
            for j, proc in enumerate(procs):
                if proc is not None and not proc.alive() and (i, j) not in self.down and not self.stop_path.exists():
                    self.say(f"replica {j} of shard {i} exited ({proc.proc.returncode}): starting it again")
                    self.start_replica(i, j)
            serving = [p for p in procs if p is not None and p.serving()]
            if serving:  # the newest to serve is the primary (a deposed one stops soon)
                primary = max(serving, key=lambda p: p.serving_at or 0.0)
                self.shards[i], self.shard_places[i] = primary, self.replica_places[i][primary.replica]
                if i < len(getattr(self, "addresses", ())):  # (a worker started now, and the final pull, go there)
                    self.addresses[i] = f"tcp://{self.replica_addresses[i][primary.replica]}"

    def _primary(self, index: int) -> ReplicaProc:
        self.poll()
        shard = self.shards[index]
        assert isinstance(shard, ReplicaProc)
        return shard

    def _wait_primary_other_than(self, index: int, old: ReplicaProc, fault: Fault, timeout: float = 30.0) -> None:
        """Until another replica of shard ``index`` serves (a takeover); its time in the fault's detail."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            self.poll()
            new = self.shards[index]
            if new is not old and isinstance(new, ReplicaProc) and new.serving():
                fault.detail["took_over_s"] = round(time.monotonic() - start, 3)
                self.failovers.append({"shard": index, "at": round(self.elapsed(), 1), **fault.detail})
                return
            time.sleep(0.02)
        fault.detail["no_takeover"] = True

    # Faults ----------------------------------------------------------------------------------
    def _fault_shard_kill(self, fault: Fault, older: bool = False, meanwhile=None) -> None:
        index = fault.target
        primary = self._primary(index)
        fault.detail["killed"] = f"replica {primary.replica} (primary)"
        self.down.add((index, primary.replica))
        self._signal(primary.proc, signal.SIGKILL)
        primary.proc.wait(10)
        self._wait_primary_other_than(index, primary, fault)
        if meanwhile is None:
            self.wait(fault.seconds)
        else:
            meanwhile()
        self.start_replica(index, primary.replica)

    def _fault_shard_kill_older(self, fault: Fault) -> None:
        """A backup killed (kill -9) and started again after the fault's seconds."""
        index = fault.target
        primary = self._primary(index)
        backups = [p for p in self.replica_procs[index] if p is not None and p is not primary and p.alive()]
        if not backups:
            fault.detail["no_backup"] = True
            return
        backup = backups[self.rng_pick(0, len(backups) - 1)]
        fault.detail["killed"] = f"replica {backup.replica} (backup)"
        self.down.add((index, backup.replica))
        self._signal(backup.proc, signal.SIGKILL)
        backup.proc.wait(10)
        self.wait(fault.seconds)
        self.start_replica(index, backup.replica)

    def _fault_shard_stop(self, fault: Fault) -> None:
        index = fault.target
        primary = self._primary(index)
        fault.detail["stopped"] = f"replica {primary.replica} (primary)"
        self._signal(primary.proc, signal.SIGSTOP)
        try:
            self._wait_primary_other_than(index, primary, fault)
            self.wait(max(0.0, fault.seconds - fault.detail.get("took_over_s", 0.0)))
        finally:
            self._signal(primary.proc, signal.SIGCONT)  # it wakes deposed, stops, and poll() starts it again

    def _cut_host(self, fault: Fault):
        places = [p for places in self.replica_places for p in places] + self.worker_places + [self.etcd_place]
        return places[fault.target % len(places)].host

    def cut_host_count(self) -> int:
        return self.cfg.shards * self.R + self.cfg.workers + 1

    def inject(self, fault: Fault) -> None:
        """The fault, then (before the next one) every shard whole again: all its replicas
        up and listed, so that one fault at a time never leaves a shard without a copy."""
        super().inject(fault)
        start = time.monotonic()
        while time.monotonic() - start < self.cfg.recovery_s:
            self.poll()
            if all(self._whole(i) for i in range(self.cfg.shards)):
                fault.detail["whole_after_s"] = round(time.monotonic() - start, 2)
                return
            time.sleep(0.1)
        fault.detail["not_whole"] = True

    def _whole(self, index: int) -> bool:
        shard = self.shards[index]
        if not isinstance(shard, ReplicaProc) or not shard.serving():
            return False
        listed = re.findall(r"\(term \d+; backups ([^)]*)\)", shard.log_since_start())
        return bool(listed) and len(listed[-1].split(", ")) == self.R - 1 and listed[-1] != "none"

    def _fault_impostor(self, fault: Fault) -> None:
        """The primary dies and another user squats its port (see the base class): the workers
        refuse the squatter and follow the backup that took over."""
        index = fault.target
        primary = self._primary(index)
        place = self.replica_places[index][primary.replica]
        self._fault_shard_kill(fault, meanwhile=lambda: self._squat(fault, primary, place))

    # The report ---------------------------------------------------------------------------
    def loss_bound(self) -> dict:
        """None may be lost: every acknowledged update is held by every listed backup."""
        return {
            "bound": 0,
            "newest_checkpoint_lag_max": 0,
            "checkpoint_every_updates": self.cfg.checkpoint_every_updates,
        }

    def report(self, ledger: dict, progressed: float | None) -> dict:
        out = super().report(ledger, progressed)
        took = sorted(f["took_over_s"] for f in self.failovers if "took_over_s" in f)
        out["replicas"] = self.R
        out["failovers"] = len(took)
        out["failover_s"] = {"median": took[len(took) // 2], "max": took[-1], "all": took} if took else None
        out["no_takeover"] = sum(1 for f in self.faults if f.detail.get("no_takeover"))
        return out

    def cleanup(self) -> list[str]:
        errors = super().cleanup()
        if self.etcd is not None:
            try:
                self.etcd.stop()
            except Exception as exc:
                errors.append(f"etcd: {exc!r}")
        return errors


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout} s for {what}")
        time.sleep(0.05)


def run_replicated_soak(config: SoakConfig) -> dict:
    """:func:`aps.testing.chaos.run_soak` with every shard a replica set (``config.replicas``)."""
    if config.replicas < 2:
        raise ValueError("a replicated soak has 2 or more replicas a shard")
    return run_soak(config, ReplicatedSoak)
