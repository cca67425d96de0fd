"""``aps launch``: an embedded server and N local worker processes of a training script.

::

    aps launch --workers 4 --sync dssp --step-time 0.05 --slowdown 1,1,1,3 train.py --epochs 5
    aps launch --workers 4 --sync ssp --example mnist --epochs 3   (--example comes last)
    aps launch --workers 4 --shards 2 --sync bsp --example digits   (two servers, half the model each)
    aps launch --workers 2 --replica-count 2 --sync bsp --example digits   (a primary and a backup)

Each worker runs the script with ``APS_ADDRESS``, ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` set (as ``torchrun`` would), one torch thread
(``OMP_NUM_THREADS=1``), and its output in ``LOG_DIR/worker-RANK.log``; as
each worker finishes, the launcher prints its last line of output (its
result, as a training script prints it). With
``--step-time T --slowdown ...`` each worker's iterations are padded to its
multiple of ``T`` by ``aps.torch.Optimizer`` (``APS_STEP_TIME``,
``APS_SLOWDOWN``, ``APS_JITTER``): emulated devices of different speeds, by
sleeping rather than by burning CPU. With ``--replica-count R`` each shard is a replica set of R server processes
(:mod:`aps.cli.replica_sets`): kill one and training goes on. Ctrl-C, SIGTERM, SIGHUP or any worker
exiting with an error stops every worker (each in its own process group,
children included: SIGTERM, then SIGKILL after a grace period or a second
signal) and the server, and exits with 128 + the signal's number (130 for
Ctrl-C) or the failing worker's status; no process is left behind.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import CancelledError

from ..errors import APSError, ConfigurationError
from ..wire.protocol import describe_join_progress
from ..server.server import Server
from ..config import RESUME_LATEST, ServerConfig, resolve_token
from ..lab.processes import die_with_parent
from .replica_sets import LocalReplicaSets
from ._args import add_server_arguments, config_from_args, number, parse_speeds, require

__all__ = ["register", "run"]

EXAMPLES = ("mnist", "digits")
_GRACE = 5.0  # seconds between SIGTERM and SIGKILL


def register(commands) -> None:
    parser = commands.add_parser(
        "launch",
        help="run an embedded server and N local workers of a training script",
        description="Run an embedded server (any aps serve flag) and --workers local processes of SCRIPT, "
        "with APS_ADDRESS, RANK and WORLD_SIZE set; --step-time and --slowdown emulate devices of different speeds.",
    )
    add_server_arguments(parser)
    parser.add_argument(
        "--step-time",
        type=number,
        default=0.0,
        help="emulated iteration time T of a speed-1 worker, in seconds (0: no emulation)",
    )
    parser.add_argument("--slowdown", default="", help="per-worker multiples of T, e.g. 1,1,1,3 (default all 1)")
    parser.add_argument("--jitter", type=number, default=0.0, help="random variation of emulated iteration times")
    parser.add_argument(
        "--replica-count",
        type=int,
        default=1,
        metavar="R",
        help="replicas a shard (default 1): more runs each shard as a replica set of R server processes, a "
        "primary and its backups; one that dies is started again and rejoins as a backup. Who is primary is "
        "decided in --coordinator etcd://HOST:PORT, or in a private etcd started for the run (docs/guide/replicas.md)",
    )
    parser.add_argument("--log-dir", help="where worker-RANK.log go (default: a new temporary directory, printed)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-dashboard",
        action="store_true",
        help="no HTTP side (by default the dashboard and /metrics are on a free port, printed)",
    )
    parser.add_argument(
        "--example",
        nargs=argparse.REMAINDER,
        metavar="NAME [ARGS]",
        help=(
            f"last: run the built-in example ({' or '.join(EXAMPLES)}: python -m aps.workloads)"
            " with ARGS instead of a script"
        ),
    )
    parser.add_argument("script", nargs="?", help="the training script each worker runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if (args.script is None) == (args.example is None):
        raise ConfigurationError("give a training script, or --example NAME")
    if args.example is not None and (not args.example or args.example[0] not in EXAMPLES):
        raise ConfigurationError(f"--example takes one of {', '.join(EXAMPLES)}, then the example's arguments")
    if args.port is None:
        args.port = 0
    if args.http_port is None and not args.no_dashboard:
        args.http_port = 0
    if args.replicas is not None or args.advertise is not None:
        raise ConfigurationError(
            "aps launch starts every replica itself: give --replica-count R, not --replicas or --advertise"
        )
    config = config_from_args(args)
    token = resolve_token(config)
    workers = config.workers
    slowdown = parse_speeds(args.slowdown, workers, "--slowdown") if args.slowdown else [1.0] * workers
    require(args.step_time >= 0, f"--step-time must be >= 0, got {args.step_time:g}")
    require(args.jitter >= 0, f"--jitter must be >= 0, got {args.jitter:g}")
    if args.step_time == 0 and (args.slowdown or args.jitter):
        raise ConfigurationError("--slowdown and --jitter pad iterations to multiples of --step-time: give it too")
    if args.example:
        command = [sys.executable, "-m", "aps.workloads", "--dataset", args.example[0], *args.example[1:]]
    else:
        if not os.path.exists(args.script):
            raise ConfigurationError(f"no such script: {args.script}")
        command = [sys.executable, args.script, *args.script_args]
    if args.log_dir is None:
        args.log_dir = tempfile.mkdtemp(prefix="aps-logs-")
    os.makedirs(args.log_dir, exist_ok=True)

    if config.shard != 0:
        raise ConfigurationError("aps launch starts every shard itself: give --shards K, not --shard")
    require(args.replica_count >= 1, f"--replica-count must be at least 1, got {args.replica_count}")
    if args.replica_count == 1 and config.coordinator is not None:
        raise ConfigurationError("--coordinator decides who is primary of a replica set: give --replica-count too")
    if args.replica_count > 1 and token is None:  # (the replicas prove it to each other, the workers to them)
        token = secrets.token_hex(16).encode()
    if config.shards > 1 and config.port and config.http_port and abs(config.port - config.http_port) < config.shards:
        raise ConfigurationError(
            f"with --shards {config.shards}, the shards listen on --port {config.port} and up, "
            f"and serve HTTP on --http-port {config.http_port} and up: keep them at least "
            f"{config.shards} apart"
        )
    if config.shards > 1 and config.resume not in (None, RESUME_LATEST):
        raise ConfigurationError(
            "with --shards, give --resume without a PATH: each shard resumes from the newest "
            "checkpoint in its own directory (--checkpoint-dir DIR/shard-I)"
        )
    stop = _Signals()
    backgrounds: list = []
    sets: LocalReplicaSets | None = None
    procs: list[subprocess.Popen] = []
    try:
        shards = f" ({config.shards} shards)" if config.shards > 1 else ""
        if args.replica_count > 1:
            assert token is not None
            sets = LocalReplicaSets(config, args.replica_count, args.log_dir, token.decode(), _say)
            address = ",".join(sets.start().addresses)
            print(f"aps: serving on {address}{shards}; {workers} workers; logs in {args.log_dir}", flush=True)
            for line in sets.describe():
                print(line, flush=True)
            stats = sets.stats
        else:
            for index in range(config.shards):
                backgrounds.append(Server(_shard_config(config, index)).run_in_background().start())
            address = ",".join(background.address for background in backgrounds)
            print(f"aps: serving on {address}{shards}; {workers} workers; logs in {args.log_dir}", flush=True)
            for index, background in enumerate(backgrounds):
                if background.server.http_address is not None:
                    which = f" (shard {index})" if config.shards > 1 else ""
                    print(f"aps: dashboard on {background.server.http_address}{which}", flush=True)
            stats = _embedded_stats(backgrounds[0].server)
        for rank in range(workers):
            if stop.received:
                break
            env = dict(
                os.environ,
                APS_ADDRESS=address,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(workers),
                OMP_NUM_THREADS="1",
                MKL_NUM_THREADS="1",
                APS_TORCH_THREADS="1",
                PYTHONUNBUFFERED="1",
                APS_STEP_TIME=str(args.step_time),
                APS_SLOWDOWN=str(slowdown[rank]),
                APS_JITTER=str(args.jitter),
            )
            if token is not None:  # the workers prove they know the embedded server's token
                env["APS_TOKEN"] = token.decode("utf-8")
            with open(os.path.join(args.log_dir, f"worker-{rank}.log"), "w") as log:
                procs.append(
                    subprocess.Popen(
                        command,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        # (a launcher killed with SIGKILL leaves no worker behind: SIGTERM reaches it)
                        preexec_fn=functools.partial(die_with_parent, os.getpid()),
                    )
                )
        status = _watch(procs, stats, args, stop, sets)
        if stop.received:
            name = signal.Signals(stop.received).name
            print(f"\naps: {name}: stopping the workers and the server", file=sys.stderr, flush=True)
            return 128 + stop.received
        return status
    finally:
        _stop_all(procs, stop)
        for background in backgrounds:
            background.stop()
        if sets is not None:
            sets.stop()
        stop.restore()


def _say(line: str) -> None:
    print(line, flush=True)


def _embedded_stats(server: Server) -> Callable[..., dict | None]:
    def stats(shard: int = 0, timeout: float = 2.0) -> dict | None:
        try:
            return server.stats(timeout=timeout)
        except (APSError, RuntimeError, TimeoutError, CancelledError):  # the server is stopping
            return None

    return stats


def _shard_config(config: ServerConfig, index: int) -> ServerConfig:
    """Shard ``index``'s options: its own ports (a given HTTP port counts up from the
    first shard's) and checkpoint directory (``DIR/shard-I``)."""
    if config.shards == 1:
        return config
    changes: dict = {"shard": index}
    if config.http_port:
        changes["http_port"] = config.http_port + index
    if config.port:
        changes["port"] = config.port + index
    if config.checkpoint_dir is not None:
        changes["checkpoint_dir"] = os.path.join(config.checkpoint_dir, f"shard-{index}")
    return config.replace(**changes)


class _Signals:
    """SIGINT, SIGTERM and SIGHUP, recorded rather than raised.

    A handler that raises can interrupt the launcher anywhere: between a fork
    and the bookkeeping of the child, or halfway through the teardown. This
    one only notes the first signal; the launcher looks at it between steps,
    and a second signal during the teardown cuts the grace period short.
    SIGINT is caught even when the launcher was started with it ignored (a
    background job of a shell script).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received = 0
        self.count = 0
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum
        self.count += 1

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _watch(procs: list[subprocess.Popen], stats: Callable[..., dict | None], args, stop: _Signals, sets=None) -> int:
    """Wait for every worker, and keep the replica sets (if any) whole; stop at the first
    failure or signal. Returns the exit status."""
    monitor = _Monitor(stats, len(procs), args.log_dir, bar=not args.no_progress)
    if sets is not None:
        sets.say = monitor.say
    finished: set[int] = set()
    try:
        while not stop.received:
            codes = [p.poll() for p in procs]
            for rank, code in enumerate(codes):
                if code == 0 and rank not in finished:  # what it printed last: its result, as a rule
                    finished.add(rank)
                    last = _last_line(os.path.join(args.log_dir, f"worker-{rank}.log"))
                    monitor.say(f"aps: worker {rank} finished" + (f": {last}" if last else " (it printed nothing)"))
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"\naps: worker {rank} exited with status {code}; stopping the others", file=sys.stderr)
                _show_tail(os.path.join(args.log_dir, f"worker-{rank}.log"))
                return code if 0 < code < 128 else 1
            if all(code == 0 for code in codes):
                monitor.tick()
                print(f"\naps: all {len(procs)} workers finished; logs in {args.log_dir}", flush=True)
                return 0
            monitor.tick()
            if sets is not None:
                sets.supervise()
            time.sleep(0.1)
        return 128 + stop.received
    finally:
        monitor.close()


class _Monitor:
    """What the launcher shows while the workers run: a progress bar of the
    server's updates (unless --no-progress), and, while workers are still
    joining, a line now and then saying which have not (a worker that fails
    to start would otherwise leave the others waiting in silence)."""

    FIRST_NOTE_S = 5.0
    NOTE_EVERY_S = 30.0

    def __init__(self, stats: Callable[..., dict | None], workers: int, log_dir: str, *, bar: bool) -> None:
        self.stats = stats
        self.log_dir = log_dir
        self.bar = _progress(workers) if bar else None
        self.started = False
        self._note_at = time.monotonic() + self.FIRST_NOTE_S
        self._check_at = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if self.bar is None and (self.started or now < self._check_at):
            return
        self._check_at = now + 1.0
        stats = self.stats(timeout=2.0)
        if stats is None:  # (the server is stopping, or a replica set is between primaries)
            return
        self.started = stats["server"]["started"]
        if not self.started and now >= self._note_at:
            self._note_at = now + self.NOTE_EVERY_S
            self._note_waiting(stats)
        if self.bar is not None:
            version = stats["server"]["version"]
            self.bar.update(version - self.bar.n)
            clocks = " ".join(str(w["clock"]) for w in stats["workers"])
            self.bar.set_postfix_str(f"clocks {clocks}  live {stats['server']['live']}", refresh=True)

    def say(self, line: str) -> None:
        """Print ``line`` on stdout (above the progress bar, when there is one)."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def _note_waiting(self, stats: dict) -> None:
        workers = stats["workers"]
        missing = [w["rank"] for w in workers if not w["live"]]
        progress = describe_join_progress(len(workers) - len(missing), len(workers), missing)
        line = f"aps: waiting for workers to join: {progress}"
        if missing:
            line += f" (see {os.path.join(self.log_dir, f'worker-{missing[0]}.log')})"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress(workers: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=None, unit=" updates", dynamic_ncols=True, leave=True, desc=f"{workers} workers")


def _last_line(path: str, limit: int = 1 << 16) -> str:
    """The last line of ``path`` that is not blank (read from its last ``limit`` bytes; a
    carriage return ends a line too), or "" when there is none."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - limit))
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")


def _show_tail(path: str, lines: int = 15) -> None:
    try:
        with open(path) as fh:
            tail = fh.readlines()[-lines:]
    except OSError:
        return
    print(f"--- last lines of {path}", file=sys.stderr)
    sys.stderr.writelines(tail)


def _stop_all(procs: list[subprocess.Popen], stop: _Signals) -> None:
    """SIGTERM every worker's process group, then SIGKILL what is left after a
    grace period, or at once when another signal arrives meanwhile."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    signals_before = stop.count
    deadline = time.monotonic() + _GRACE
    while any(p.poll() is None for p in alive) and time.monotonic() < deadline and stop.count == signals_before:
        time.sleep(0.02)
    for p in procs:
        _signal_group(p, signal.SIGKILL)  # the group, too: children the script started
        if p.poll() is None:
            p.wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # start_new_session: the group's id is the worker's pid
    except (ProcessLookupError, PermissionError):
        pass
