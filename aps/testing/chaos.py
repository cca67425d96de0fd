"""The chaos soak's parts: a ledger model, worker and stranger processes, a seeded fault
schedule, and the cluster that injects the faults and checks what survived.

The model is a **ledger**: SGD with lr=1 (no momentum, no weight decay, no
staleness scaling), one float32 weight per (shard, rank, slot), where a slot
names one gradient of the rank: each gradient is -1 at its slot of every shard
``s``'s block and 0 elsewhere (-P under BSP, where the server applies the mean
of the round's gradients), so each weight counts the times its gradient was
applied, on each shard separately: a weight above one application is a
gradient applied twice; a zero where the worker logged an acknowledged push is
a gradient lost.

A slot is the rank's own count of the gradients it made, carried on from one
process of the rank to the next (read back from the rank's log), not its
``clock``: a new process for a rank starts at the slowest live clock
(docs/algorithms.md, Membership), so under ASP and SSP it takes iteration
numbers its predecessor had taken already; its gradients are new ones. Under
BSP the slot on shard ``s`` is the round the gradient is for (the shard's
version it was computed on), so a round of ``n`` gradients adds ``P / n`` to
the ``n`` weights of its slot and one application at slot ``v`` is at most
``P / (gradients seen at slot v)``: any second application exceeds it.

Run by ``bench/chaos.py`` (a long soak, a table and JSON) and by
``tests/integration/test_chaos.py`` (a short one in CI). Processes started
here are tracked by pid and stopped at the end (SIGCONT first: a stopped
process cannot act on SIGTERM), namespaces are deleted, tmpfs mounts
unmounted, whatever ended the run (an exception, Ctrl-C, SIGTERM).

The ledger is in :mod:`aps.testing.ledger`, the programs of the worker, stranger and
puller processes in :mod:`aps.testing.chaos_processes`, where they run and how they are
started, logged and stopped in :mod:`aps.testing.places`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .ledger import LedgerLayout, analyse_ledger
from .places import (
    LogTail,
    Place,
    SecondUser,
    ShardProc,
    Tmpfs,
    WorkerProc,
    run_checked,
    stop_process,
    tmpfs_unavailable_reason,
)
from .users import as_second_user, second_user_env, second_user_unavailable

if TYPE_CHECKING:
    from .netns import Network

PY = sys.executable

#: Every fault kind, in the order the report lists them.
FAULT_KINDS = (
    "worker_kill",
    "worker_stop",
    "shard_kill",
    "shard_kill_older",
    "shard_stop",
    "cut",
    "disk_full",
    "strangers",
    "guesser",
    "impostor",
)
#: The kinds that need a second user of the host (root, to run them as ``nobody``).
SECOND_USER_KINDS = ("guesser", "impostor")
#: The sync policies a soak runs (``--sync``).
POLICIES = {"bsp": ("--sync", "bsp"), "ssp": ("--sync", "ssp", "--staleness", "2"), "asp": ("--sync", "asp")}
#: The ledger's SGD: every weight counts its applications.
LEDGER_OPTIONS = (
    "--optimizer",
    "sgd",
    "--lr",
    "1",
    "--momentum",
    "0",
    "--weight-decay",
    "0",
    "--lr-staleness",
    "none",
    "--async-scale",
    "sum",
)


# The fault schedule ------------------------------------------------------------------------------
@dataclass
class Fault:
    """One fault drawn from the schedule."""

    kind: str
    target: int  # a rank, a shard index, or a host index (cuts)
    seconds: float  # how long it lasts (a stop, a cut, a full disk, a flood) or the downtime of a kill
    at: float = 0.0  # seconds into the run when it began
    survived: bool | None = None
    recovered_s: float | None = None  # from its end until every worker pushed again
    detail: dict = field(default_factory=dict)


class FaultSchedule:
    """Faults drawn from ``seed``: kinds dealt from shuffled decks (each available kind
    once per deck, so a short run sees every kind), targets and durations at random,
    with a pause of ``gap`` seconds (uniform in the range) between one fault's recovery
    and the next."""

    def __init__(
        self,
        seed: int,
        kinds: list[str],
        workers: int,
        shards: int,
        cut_hosts: int,
        gap: tuple[float, float] = (1.0, 4.0),
        max_fault_s: float = 6.0,
    ) -> None:
        self.rng = random.Random(seed)
        self.kinds = list(kinds)
        self.workers, self.shards, self.cut_hosts = workers, shards, cut_hosts
        self.gap = gap
        self.max_fault_s = max_fault_s
        self._deck: list[str] = []

    def next_gap(self) -> float:
        return self.rng.uniform(*self.gap)

    def next(self) -> Fault:
        if not self._deck:
            self._deck = self.kinds[:]
            self.rng.shuffle(self._deck)
        kind = self._deck.pop()
        rng, top = self.rng, self.max_fault_s
        if kind.startswith("worker"):
            target = rng.randrange(self.workers)
        elif kind == "cut":
            target = rng.randrange(self.cut_hosts)
        else:
            target = rng.randrange(self.shards)
        seconds = {
            "worker_kill": rng.uniform(0.1, 2.0),
            "shard_kill": rng.uniform(0.1, 2.0),
            "shard_kill_older": rng.uniform(0.1, 2.0),
        }.get(kind) or rng.uniform(0.5, top)
        return Fault(kind, target, round(seconds, 2))


# The cluster -------------------------------------------------------------------------------------
@dataclass
class SoakConfig:
    """One soak's settings (see bench/chaos.py --help)."""

    sync: str = "bsp"
    seconds: float = 60.0
    seed: int = 0
    shards: int = 2
    workers: int = 4
    transport: str = "tcp"
    network: str = "auto"  # netns, loopback or auto (netns when usable)
    step_time: float = 0.02
    checkpoint_every_updates: int = 40
    checkpoint_keep: int = 3
    heartbeat_timeout: float = 5.0
    server_timeout: float = 10.0
    max_fault_s: float = 6.0
    gap: tuple[float, float] = (1.0, 4.0)
    recovery_s: float = 60.0  # how long every worker has to push again after a fault ends
    kinds: tuple[str, ...] = FAULT_KINDS
    run_dir: str | None = None
    keep_run_dir: bool = False
    rss_every_s: float = 2.0
    rss_warmup_s: float = 15.0
    quiet: bool = False
    #: Replicas a shard (aps serve --replicas; more than 1: aps.testing.chaos_replicas, with a real etcd).
    replicas: int = 1

    @property
    def call_bound(self) -> float:
        """The documented deadline of any worker call: the longest fault, the TCP retransmission
        that follows a cut of that length (about as long again), the worker's server timeout and
        reconnection backoff cap (5 s), the server's heartbeat timeout and a restart (20 s)."""
        return 2 * self.max_fault_s + self.server_timeout + 5.0 + self.heartbeat_timeout + 20.0


class Soak:
    """A sharded cluster under a seeded fault schedule, with the ledger checked at the end.

    Use :func:`run_soak`; the object is a context manager that cleans up everything
    it started, whatever happens.
    """

    def __init__(self, config: SoakConfig) -> None:
        self.cfg = config
        self.bsp = config.sync == "bsp"
        self.t0 = time.monotonic()
        self.token = secrets.token_hex(32)
        self.env = {
            **os.environ,
            "APS_TOKEN": self.token,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
        self._own_dir = config.run_dir is None
        self.dir = Path(config.run_dir) if config.run_dir else Path(__import__("tempfile").mkdtemp(prefix="aps-chaos-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stop_path = self.dir / "stop"
        self.network: Network | None = None
        self.tmpfs: list[Tmpfs] = []
        self.shards: list[ShardProc | None] = [None] * config.shards
        self.shard_places: list[Place] = []
        self.worker_places: list[Place] = []
        self.stranger_place = Place()
        self.workers: list[WorkerProc | None] = [None] * config.workers
        self.other_procs: list[subprocess.Popen] = []
        self.second_user_homes: list[str] = []
        self.all_workers: list[subprocess.Popen] = []  # every worker process ever started, to stop by pid
        self.all_shards: list[subprocess.Popen] = []
        self.tails = [LogTail(self.dir / f"worker-{r}.log") for r in range(config.workers)]
        self.notes: list[str] = []
        self.faults: list[Fault] = []
        self.crashes: list[dict] = []
        self.rss: dict[int, dict] = {}
        self.unexpected_exits: list[dict] = []
        seconds = config.seconds + 120.0
        self.layout = LedgerLayout(
            config.shards, config.workers, math.ceil(seconds / max(config.step_time, 0.005) * 1.2) + 256
        )
        self.layout.check()
        P, MC = config.workers, self.layout.slots
        self.acked = np.zeros((config.shards, P, MC), bool)
        self.acks = [0] * P
        self.last_ack = [0.0] * P
        self.seen_versions = [[0] * config.shards for _ in range(P)]
        self.dropped = 0
        self.worker_slowest = [0.0] * P
        self.worker_over: list[dict] = []
        self.worker_errors: Counter = Counter()
        self.worker_error_samples: list[str] = []

    # Life cycle ------------------------------------------------------------
    def __enter__(self) -> Soak:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def say(self, text: str) -> None:
        if not self.cfg.quiet:
            print(f"[{self.elapsed():7.1f}s {self.cfg.sync}] {text}", flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def setup(self) -> None:
        cfg = self.cfg
        from aps.testing import netns

        use_netns = cfg.network == "netns"
        if cfg.network == "auto":
            reason = netns.netns_unavailable_reason()
            use_netns = reason is None
            if reason:
                self.notes.append(f"network cuts off: {reason}")
        if use_netns:
            self.network = netns.Network("198.18.7.0/24", max_hosts=cfg.shards + cfg.workers + 1)
            self.network.open()
            self.shard_places = [Place(self.network.add_host(f"ps{i}")) for i in range(cfg.shards)]
            self.worker_places = [Place(self.network.add_host(f"w{r}")) for r in range(cfg.workers)]
            self.stranger_place = Place(self.network.add_host("stranger"))
        else:
            self.shard_places = [Place() for _ in range(cfg.shards)]
            self.worker_places = [Place() for _ in range(cfg.workers)]
        reason = second_user_unavailable()
        if reason is not None:
            self.notes.append(f"second-user attackers (guesser, impostor) off: {reason}")
        reason = tmpfs_unavailable_reason()
        if reason is None:
            # room for the kept checkpoints, one being written and one left over, and slack
            size = (cfg.checkpoint_keep + 3) * (self.layout.block * 4 + (64 << 10)) + (1 << 20)
            for i in range(cfg.shards):
                self.tmpfs.append(Tmpfs(self.dir / f"ckpt-{i}", size))
        else:
            self.notes.append(f"disk-full off: {reason}")
            for i in range(cfg.shards):
                (self.dir / f"ckpt-{i}").mkdir(exist_ok=True)
        self.addresses = [self.start_shard(i).address for i in range(cfg.shards)]
        for r in range(cfg.workers):
            self.start_worker(r)

    def kinds(self) -> list[str]:
        kinds = list(self.cfg.kinds)
        if self.network is None:
            kinds = [k for k in kinds if k != "cut"]
        if not self.tmpfs:
            kinds = [k for k in kinds if k != "disk_full"]
        if second_user_unavailable() is not None:
            kinds = [k for k in kinds if k not in SECOND_USER_KINDS]
        return kinds

    def shard_argv(self, index: int, port: int, resume: str | None) -> list[str]:
        cfg = self.cfg
        argv = [PY, "-m", "aps", "serve", "--host", self.shard_places[index].address, "--port", str(port)]
        argv += ["--shard", str(index), "--shards", str(cfg.shards), "--workers", str(cfg.workers)]
        argv += [*POLICIES[cfg.sync], *LEDGER_OPTIONS, "--heartbeat-timeout", str(cfg.heartbeat_timeout)]
        argv += ["--checkpoint-dir", str(self.dir / f"ckpt-{index}"), "--checkpoint-every", "0"]
        argv += ["--checkpoint-every-updates", str(cfg.checkpoint_every_updates)]
        argv += ["--checkpoint-keep", str(cfg.checkpoint_keep)]
        if resume is not None:
            argv += ["--resume"] if resume == "" else ["--resume", resume]
        return argv

    def start_shard(self, index: int, resume: str | None = None) -> ShardProc:
        place = self.shard_places[index]
        running = self.shards[index]
        port = running.port if running is not None else 0
        env = dict(self.env)
        if place.host is not None:
            env["XDG_RUNTIME_DIR"] = place.host.runtime_dir
        shard = ShardProc(index, place, self.shard_argv(index, port, resume), env, self.dir / f"shard-{index}.log")
        self.shards[index] = shard
        self.all_shards.append(shard.proc)
        return shard

    def start_worker(self, rank: int) -> None:
        cfg = self.cfg
        argv = [PY, "-m", "aps.testing.chaos_processes", "worker", "--addresses", ",".join(self.addresses)]
        argv += ["--rank", str(rank), "--workers", str(cfg.workers), "--shards", str(cfg.shards)]
        argv += ["--slots", str(self.layout.slots), "--transport", cfg.transport]
        argv += ["--log", str(self.dir / f"worker-{rank}.log"), "--stop", str(self.stop_path)]
        argv += ["--step-time", str(cfg.step_time), "--server-timeout", str(cfg.server_timeout)]
        argv += ["--call-bound", str(cfg.call_bound)]
        if self.bsp:
            argv.append("--bsp")
        worker = WorkerProc(rank, self.worker_places[rank], argv, self.env, self.dir / f"worker-{rank}.log")
        self.workers[rank] = worker
        self.all_workers.append(worker.proc)

    def cleanup(self) -> list[str]:
        """Stop every process by pid, delete the namespaces, unmount the tmpfs mounts."""
        errors = []
        with contextlib.suppress(OSError):
            self.stop_path.touch()
        procs = self.all_workers + list(self.other_procs)
        for proc in procs:
            try:
                stop_process(proc, grace=2.0, signum=signal.SIGKILL)
            except Exception as exc:  # go on: the rest must still be stopped
                errors.append(f"worker {proc.pid}: {exc!r}")
        for proc in self.all_shards:
            try:
                stop_process(proc, grace=10.0)
            except Exception as exc:
                errors.append(f"shard {proc.pid}: {exc!r}")
        if self.network is not None:
            try:
                self.network.close()
            except Exception as exc:
                errors.append(f"network: {exc!r}")
            self.network = None
        for fs in self.tmpfs:
            try:
                fs.unmount()
            except Exception as exc:
                errors.append(f"umount {fs.path}: {exc!r}")
        left = [p.pid for p in procs + self.all_shards if p.poll() is None]
        if left:
            errors.append(f"processes left: {left}")
        for home in self.second_user_homes:
            shutil.rmtree(home, ignore_errors=True)
        if self._own_dir and not self.cfg.keep_run_dir and not errors:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.cleanup_errors = errors
        return errors

    # Watching ----------------------------------------------------------------
    def poll(self) -> None:
        """Read the workers' new log lines; restart workers that exited by themselves;
        sample the shards' RSS; keep the shard logs bounded."""
        now = time.monotonic()
        for r, tail in enumerate(self.tails):
            for line in tail.lines():
                kind, _, rest = line.partition(" ")
                if kind == "a":
                    parts = rest.split()
                    dropped = parts[0] == "1"
                    if not dropped:
                        for s, slot in enumerate(int(x) for x in parts[2].split(",")):
                            if 0 <= slot < self.layout.slots:
                                self.acked[s, r, slot] = True
                    self.dropped += dropped
                    self.acks[r] += 1
                    self.last_ack[r] = now
                    self.seen_versions[r] = [int(v) for v in parts[3:]]
                elif kind in ("slow", "over"):
                    took = float(rest.split()[0])
                    self.worker_slowest[r] = max(self.worker_slowest[r], took)
                    if kind == "over" and len(self.worker_over) < 200:
                        self.worker_over.append({"rank": r, "seconds": took, "at": round(self.elapsed(), 1)})
                elif kind == "err":
                    self.worker_errors[rest.split(":")[0]] += 1
                    if len(self.worker_error_samples) < 20:
                        self.worker_error_samples.append(f"rank {r}: {rest[:300]}")
        for r, w in enumerate(self.workers):
            if w is not None and w.proc.poll() is not None and not self.stop_path.exists():
                self.unexpected_exits.append({"rank": r, "code": w.proc.returncode, "at": round(self.elapsed(), 1)})
                self.say(f"worker {r} exited by itself with {w.proc.returncode}: restarting it")
                self.start_worker(r)
        for shard in self.shards:
            if shard is None or not shard.alive():
                continue
            shard.cap_log()
            entry = self.rss.setdefault(
                shard.proc.pid, {"shard": shard.index, "started": shard.started, "samples": [], "next": 0.0}
            )
            if now >= entry["next"]:
                entry["next"] = now + self.cfg.rss_every_s
                rss = _rss(shard.proc.pid)
                if rss is not None:
                    age = now - shard.started
                    if age >= self.cfg.rss_warmup_s:  # after the start-up allocations
                        entry.setdefault("baseline", rss)
                        entry["max"] = max(entry.get("max", 0), rss)
                    entry["last"], entry["age"] = rss, age
                    if not entry["samples"] or age - entry["samples"][-1][0] >= 30:
                        entry["samples"].append((round(age, 1), rss))

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            self.poll()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.2, left))

    def wait_progress(self, since: float, timeout: float, ranks=None) -> float | None:
        """Seconds from ``since`` until every worker (in ``ranks``) acknowledged a push after
        ``since``; None if one did not within ``timeout``."""
        ranks = range(self.cfg.workers) if ranks is None else ranks
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if all(self.last_ack[r] > since for r in ranks):
                return max(self.last_ack[r] for r in ranks) - since
            time.sleep(0.1)
        return None

    # Faults -------------------------------------------------------------------
    def _shard(self, index: int) -> ShardProc:
        """Shard ``index``'s process (every shard has one once :meth:`setup` has run)."""
        shard = self.shards[index]
        assert shard is not None, f"shard {index} was never started"
        return shard

    def _worker(self, rank: int) -> WorkerProc:
        """Worker ``rank``'s process (it has none only inside its own worker_kill fault)."""
        worker = self.workers[rank]
        assert worker is not None, f"worker {rank} is down"
        return worker

    def inject(self, fault: Fault) -> None:
        getattr(self, f"_fault_{fault.kind}")(fault)

    def _signal(self, proc: subprocess.Popen, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    def _fault_worker_kill(self, fault: Fault) -> None:
        worker = self._worker(fault.target)
        self.workers[fault.target] = None  # down on purpose: poll() does not restart it
        self._signal(worker.proc, signal.SIGKILL)
        worker.proc.wait(10)
        self.wait(fault.seconds)
        self.start_worker(fault.target)

    def _fault_worker_stop(self, fault: Fault) -> None:
        worker = self._worker(fault.target)
        self._signal(worker.proc, signal.SIGSTOP)
        self.wait(fault.seconds)
        self._signal(worker.proc, signal.SIGCONT)

    def _fault_shard_stop(self, fault: Fault) -> None:
        shard = self._shard(fault.target)
        self._signal(shard.proc, signal.SIGSTOP)
        self.wait(fault.seconds)
        self._signal(shard.proc, signal.SIGCONT)

    def _fault_shard_kill(self, fault: Fault, older: bool = False, meanwhile=None) -> None:
        """Kill a shard (kill -9), and resume it after ``fault.seconds`` (``meanwhile()`` runs
        while it is down instead of a plain wait, when given)."""
        from aps.checkpoint import list_checkpoints, read_checkpoint

        index = fault.target
        shard = self._shard(index)
        # Freeze it first: no reply leaves it from now on, so the versions the workers logged
        # until now are within P updates of the version it dies at.
        self._signal(shard.proc, signal.SIGSTOP)
        self.wait(0.5)
        seen = max(v[index] for v in self.seen_versions)
        self._signal(shard.proc, signal.SIGKILL)
        shard.proc.wait(10)
        directory = self.dir / f"ckpt-{index}"
        found = []
        for kept in list_checkpoints(directory):  # newest first
            with contextlib.suppress(Exception):
                checkpoint = read_checkpoint(kept)
                found.append((kept, checkpoint.version, list(checkpoint.manifest["policy"]["clocks"])))
        crash: dict[str, Any] = {
            "shard": index,
            "at": round(self.elapsed(), 1),
            "version_seen": seen,
            "newest": found[0][1] if found else None,
            "older": older and len(found) > 1,
        }
        path: Path | None  # the checkpoint it resumes from
        if older and len(found) > 1:
            path, version, clocks = found[self.rng_pick(1, len(found) - 1)]
            resume = str(path)
        else:
            path, version, clocks = found[0] if found else (None, 0, [0] * self.cfg.workers)
            resume = ""
        newest_clocks = found[0][2] if found else [0] * self.cfg.workers
        crash.update(
            resumed_version=version,
            resumed_clocks=clocks,
            newest_clocks=newest_clocks,
            resumed_from=path.name if path else None,
        )
        fault.detail.update(crash)
        self.crashes.append(crash)
        if meanwhile is None:
            self.wait(fault.seconds)
        else:
            meanwhile()
        try:
            restarted = self.start_shard(index, resume)
        except RuntimeError as exc:  # the resume was refused: say so, start from the newest instead
            fault.detail["refused"] = str(exc)[-500:]
            self.say(f"shard {index}: resume from {resume or 'newest'} refused; resuming the newest")
            restarted = self.start_shard(index, "")
        match = re.search(r"resumed from (\S+): version (\d+)", _wait_text(restarted, "resumed from", 10.0))
        if match:
            crash["resumed_version"] = int(match.group(2))
            crash["resumed_from"] = Path(match.group(1)).name

    def _fault_shard_kill_older(self, fault: Fault) -> None:
        self._fault_shard_kill(fault, older=True)

    def cut_host_count(self) -> int:
        """The hosts a cut may take: the shards' and the workers'."""
        return self.cfg.shards + self.cfg.workers

    def rng_pick(self, low: int, high: int) -> int:
        return self._rng.randint(low, high)

    def _cut_host(self, fault: Fault):
        hosts = [p.host for p in self.shard_places + self.worker_places]
        return hosts[fault.target % len(hosts)]

    def _fault_cut(self, fault: Fault) -> None:
        host = self._cut_host(fault)
        fault.detail["host"] = host.name
        assert self.network is not None  # kinds(): cuts only in namespaces
        link = ["ip", "-n", self.network.bridge_netns, "link", "set", host.bridge_port]
        run_checked([*link, "down"])
        try:
            self.wait(fault.seconds)
        finally:
            run_checked([*link, "up"])

    def _fault_disk_full(self, fault: Fault) -> None:
        from aps.checkpoint import list_checkpoints

        fs = self.tmpfs[fault.target]
        before = list_checkpoints(fs.path)
        fault.detail["taken_bytes"] = fs.fill()
        try:
            self.wait(fault.seconds)
        finally:
            fs.free()
        newest = before[0].name if before else None
        # survived only when the shard writes a checkpoint again once there is room
        deadline = time.monotonic() + self.cfg.recovery_s
        while time.monotonic() < deadline:
            self.poll()
            now = list_checkpoints(fs.path)
            if now and now[0].name != newest:
                fault.detail["checkpoint_after"] = now[0].name
                break
            time.sleep(0.2)
        else:
            fault.detail["no_checkpoint_after"] = True

    def _fault_strangers(self, fault: Fault) -> None:
        shard = self._shard(fault.target)
        out = self.dir / f"stranger-{len(self.faults)}.json"
        argv = [PY, "-m", "aps.testing.chaos_processes", "stranger", "--address", shard.address]
        argv += ["--seconds", str(fault.seconds), "--out", str(out)]
        proc = self.stranger_place.popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            env=self.env,
        )
        self._attack(fault, proc, out, fault.seconds + 15.0)

    def _attack(self, fault: Fault, proc: subprocess.Popen, out: Path, seconds: float) -> None:
        """Wait (training goes on) while the attacker ``proc`` runs, for ``seconds`` at most;
        then its JSON summary (``out``) and the pushes made meanwhile go into the fault's detail."""
        self.other_procs.append(proc)
        before = list(self.acks)
        end = time.monotonic() + seconds
        while proc.poll() is None and time.monotonic() < end:
            self.wait(0.2)
        stop_process(proc, grace=1.0, signum=signal.SIGKILL)
        self.other_procs.remove(proc)
        fault.detail["pushes_during"] = sum(self.acks) - sum(before)
        with contextlib.suppress(OSError, ValueError):
            summary = json.loads(out.read_text())
            summary.pop("took", None)
            fault.detail.update(summary)
            out.unlink()

    def _second_user_env(self) -> dict:
        """The second user's environment: a home of its own (removed at cleanup), no token."""
        env = second_user_env()
        self.second_user_homes.append(env["HOME"])
        return env

    def _fault_guesser(self, fault: Fault) -> None:
        """Another user of a shard's host guesses at its token, from several loopback addresses
        where the shard listens on loopback: the workers train on, and no guess is let in."""
        shard, place = self._shard(fault.target), self.shard_places[fault.target]
        env = self._second_user_env()
        out = Path(env["HOME"]) / "guesses.json"
        sources = ",".join(f"127.0.0.{n}" for n in range(1, 7)) if place.host is None else place.address
        argv = [PY, "-m", "aps.testing.chaos_processes", "guesser", "--address", shard.address]
        argv += ["--count", str(max(8, int(fault.seconds * 4))), "--parallel", "4", "--sources", sources]
        argv += ["--timeout", "15", "--out", str(out)]
        proc = place.popen(
            as_second_user(argv),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        self._attack(fault, proc, out, fault.seconds + 30.0)

    def _worker_refusals(self) -> int:
        """How many times the workers have said they refused a server on a shard's address."""
        total = 0
        for rank in range(self.cfg.workers):
            with contextlib.suppress(OSError):
                total += (self.dir / f"worker-{rank}.err").read_bytes().count(b"refused the server now at")
        return total

    def _fault_impostor(self, fault: Fault) -> None:
        """A shard dies (kill -9) and another user of its host starts a server of its own on the
        shard's port, asking for no token and at lr 1000, for ``seconds``; then the real shard
        is resumed there. The workers refuse the impostor (it cannot prove it knows the
        token) and wait for the real one: the impostor is sent nothing, the ledger holds."""
        self._fault_shard_kill(fault, meanwhile=lambda: self._squat(fault))

    def _squat(self, fault: Fault, shard: ShardProc | None = None, place: Place | None = None) -> None:
        """Another user starts a server on ``shard``'s port (default: the fault's shard), in its ``place``."""
        index = fault.target
        shard = self._shard(index) if shard is None else shard
        place = self.shard_places[index] if place is None else place
        argv = [PY, "-m", "aps", "serve", "--host", place.address, "--port", str(shard.port), "--insecure"]
        argv += ["--workers", str(self.cfg.workers), "--sync", "asp", "--lr", "1000"]
        try:
            impostor = ShardProc(
                index, SecondUser(place), argv, self._second_user_env(), self.dir / f"impostor-{len(self.faults)}.log"
            )
        except RuntimeError as exc:  # (the port not free yet: the real shard's socket lingers)
            fault.detail["impostor_not_started"] = str(exc)[-300:]
            self.wait(fault.seconds)
            return
        self.other_procs.append(impostor.proc)
        refusals = self._worker_refusals()
        self.wait(fault.seconds)
        said = impostor.log_since_start()
        fault.detail["impostor_joins"] = len(re.findall(r"joined|worker \d+ ", said))
        fault.detail["workers_refused_it"] = self._worker_refusals() - refusals
        stop_process(impostor.proc, grace=2.0)
        self.other_procs.remove(impostor.proc)

    # The run --------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        self._rng = random.Random(cfg.seed * 7919 + 1)
        self.setup()
        kinds = self.kinds()
        schedule = FaultSchedule(
            cfg.seed,
            kinds,
            cfg.workers,
            cfg.shards,
            cut_hosts=self.cut_host_count(),
            gap=cfg.gap,
            max_fault_s=cfg.max_fault_s,
        )
        self.say(
            f"{cfg.shards} shards, {cfg.workers} workers over {cfg.transport}, "
            f"{'namespaces' if self.network else 'loopback'}; faults: {', '.join(kinds)}"
        )
        started = self.wait_progress(self.t0, 120.0)
        if started is None:
            raise RuntimeError(f"the workers did not start training: acks {self.acks}\n{self._shard_tails()}")
        self.t_train = time.monotonic()
        end = self.t_train + cfg.seconds
        while time.monotonic() < end - cfg.max_fault_s:
            self.wait(schedule.next_gap())
            if time.monotonic() >= end - cfg.max_fault_s:
                break
            fault = schedule.next()
            fault.at = round(self.elapsed(), 1)
            self.faults.append(fault)
            self.say(f"fault {len(self.faults)}: {fault.kind} of {fault.target} for {fault.seconds} s")
            self.inject(fault)
            ended = time.monotonic()
            took = self.wait_progress(ended, cfg.recovery_s)
            alive = all(self._shard(i).alive() for i in range(len(self.shards)))
            fault.recovered_s = None if took is None else round(took, 2)
            fault.survived = (
                took is not None
                and alive
                and not fault.detail.get("no_checkpoint_after")
                and not fault.detail.get("accepted")
                and not fault.detail.get("impostor_joins")
            )
            if not fault.survived:
                self.say(
                    f"fault {len(self.faults)} NOT survived: {fault.detail} acks {self.acks}\n{self._shard_tails()}"
                )
                if took is None:
                    break  # the cluster is stuck: the report says so
        self.wait(max(0.0, end - time.monotonic()))
        return self.finish()

    def finish(self) -> dict:
        cfg = self.cfg
        progressed = self.wait_progress(time.monotonic(), cfg.recovery_s)
        self.stop_path.touch()
        # stuck workers (no progress) cannot see the stop file: they get 5 s, not the recovery time
        deadline = time.monotonic() + (cfg.recovery_s if progressed is not None else 5.0)
        for w in self.workers:
            if w is None:
                continue
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.notes.append(f"worker {w.rank} did not stop by itself: killed")
                stop_process(w.proc, grace=1.0, signum=signal.SIGKILL)
        self.poll()
        out = self.dir / "final.npy"
        argv = [PY, "-m", "aps.testing.chaos_processes", "pull", "--addresses", ",".join(self.addresses)]
        argv += ["--workers", str(cfg.workers), "--shards", str(cfg.shards), "--slots", str(self.layout.slots)]
        argv += ["--out", str(out)]
        with open(self.dir / "pull.err", "wb") as err:
            pull = self.worker_places[0].popen(
                argv,
                stdout=subprocess.DEVNULL,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        self.other_procs.append(pull)
        try:
            code = pull.wait(120)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            raise RuntimeError(
                f"pulling the final weights failed ({code}): {(self.dir / 'pull.err').read_text()[-2000:]}"
            )
        weights = np.load(out)
        ledger = analyse_ledger(weights, self.layout, self.acked, self.bsp)
        return self.report(ledger, progressed)

    # The report --------------------------------------------------------------------
    def loss_bound(self) -> dict:
        """Lost gradients a crash may cost: the updates between the version the shard
        died at (at most ``version_seen + P``) and the one it resumed from, one gradient
        per update (P per BSP round); per crash too, the lag of the newest checkpoint
        behind the death, against the checkpoint interval."""
        P = self.cfg.workers
        total, lags = 0, []
        for crash in self.crashes:
            died = crash["version_seen"] + P
            crash["bound"] = max(0, died - crash["resumed_version"]) * (P if self.bsp else 1)
            total += crash["bound"]
            if crash["newest"] is not None:
                lags.append(crash["version_seen"] - crash["newest"])
        return {
            "bound": total,
            "newest_checkpoint_lag_max": max(lags, default=0),
            "checkpoint_every_updates": self.cfg.checkpoint_every_updates,
        }

    def report(self, ledger: dict, progressed: float | None) -> dict:
        cfg = self.cfg
        by_kind: dict[str, dict] = {}
        for fault in self.faults:
            row = by_kind.setdefault(fault.kind, {"injected": 0, "survived": 0, "recovered_s_max": 0.0})
            row["injected"] += 1
            row["survived"] += bool(fault.survived)
            if fault.recovered_s is not None:
                row["recovered_s_max"] = max(row["recovered_s_max"], fault.recovered_s)
        rss_rows = []
        for pid, entry in self.rss.items():
            if "baseline" in entry:
                rss_rows.append(
                    {
                        "pid": pid,
                        "shard": entry["shard"],
                        "lived_s": round(entry["age"], 1),
                        "baseline_mib": round(entry["baseline"] / 2**20, 1),
                        "max_mib": round(entry["max"] / 2**20, 1),
                        "growth_mib": round((entry["max"] - entry["baseline"]) / 2**20, 1),
                        "samples": [(t, round(v / 2**20, 1)) for t, v in entry["samples"]],
                    }
                )
        longest = max(rss_rows, key=lambda row: row["lived_s"], default=None)
        bound = self.loss_bound()
        older = [c for c in self.crashes if c["older"]]
        return {
            "sync": cfg.sync,
            "seed": cfg.seed,
            "shards": cfg.shards,
            "workers": cfg.workers,
            "transport": cfg.transport,
            "network": "netns" if self.shard_places[0].host is not None else "loopback",
            "seconds": round(time.monotonic() - self.t_train, 1),
            "ledger_size": self.layout.numel,
            "checkpoint_every_updates": cfg.checkpoint_every_updates,
            "faults_injected": len(self.faults),
            "faults_survived": sum(bool(f.survived) for f in self.faults),
            "faults_by_kind": by_kind,
            "pushes_acknowledged": int(sum(self.acks)),
            "pushes_dropped": self.dropped,
            "applied_twice": ledger["applied_twice"],
            "lost": ledger["lost"],
            "lost_bound": bound["bound"],
            "newest_checkpoint_lag_max": bound["newest_checkpoint_lag_max"],
            "older_resumes": len(older),
            "ledger": ledger,
            "call_bound_s": round(cfg.call_bound, 1),
            "stalls": len(self.worker_over),
            "slowest_call_s": round(max(self.worker_slowest), 3),
            "slowest_call_by_rank": self.worker_slowest,
            "stalls_at": self.worker_over[:50],
            "rss_growth_mib_max": max((row["growth_mib"] for row in rss_rows), default=None),
            "rss_growth_mib_longest": longest["growth_mib"] if longest else None,
            "rss_longest_lived_s": longest["lived_s"] if longest else None,
            "rss": rss_rows,
            "worker_errors": dict(self.worker_errors),
            "worker_error_samples": self.worker_error_samples,
            "unexpected_exits": self.unexpected_exits,
            "recovered_at_end": progressed is not None,
            "crashes": self.crashes,
            "faults": [vars(f) for f in self.faults],
            "notes": self.notes,
        }

    def _shard_tails(self) -> str:
        return "\n".join(f"--- shard {s.index}\n{s.log_since_start()[-1500:]}" for s in self.shards if s)


def _wait_text(shard: ShardProc, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = shard.log_since_start()
        if text in log:
            return log
        time.sleep(0.05)
    return shard.log_since_start()


def _rss(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def run_soak(config: SoakConfig, kind: type[Soak] = Soak) -> dict:
    """Run one soak (``kind``: :class:`Soak`, or ``aps.testing.chaos_replicas.ReplicatedSoak``
    for ``config.replicas`` > 1); returns its report (``cleanup_errors`` included). Everything
    started is stopped and removed before this returns or raises."""
    soak = kind(config)
    try:
        report = soak.run()
    finally:
        errors = soak.cleanup()
    report["cleanup_errors"] = errors
    report["run_dir"] = str(soak.dir) if soak.dir.exists() else None
    return report
