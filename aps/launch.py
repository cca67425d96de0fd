"""``aps launch``: an embedded server and N local worker processes of a training script.

::

    aps launch --workers 4 --sync dssp --step-time 0.05 --slowdown 1,1,1,3 train.py --epochs 5
    aps launch --workers 4 --sync ssp --example mnist --epochs 3   (--example comes last)

Each worker runs the script with ``APS_ADDRESS``, ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` set (as ``torchrun`` would), one torch thread
(``OMP_NUM_THREADS=1``), and its output in ``LOG_DIR/worker-RANK.log``. With
``--step-time T --slowdown ...`` each worker's iterations are padded to its
multiple of ``T`` by ``aps.torch.Optimizer`` (``APS_STEP_TIME``,
``APS_SLOWDOWN``, ``APS_JITTER``): emulated devices of different speeds, by
sleeping rather than by burning CPU. Ctrl-C, SIGTERM or any worker exiting
with an error stops every worker (each in its own process group) and the
server; no process is left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from .config import add_server_arguments, config_from_args
from .errors import ConfigurationError
from .server import Server

__all__ = ["add_launch_arguments", "run_launch"]

EXAMPLES = ("mnist", "digits")
_GRACE = 5.0  # seconds between SIGTERM and SIGKILL


class _Stop(Exception):
    """SIGTERM, turned into an exception in the launcher's main thread."""


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="emulated iteration time T of a speed-1 worker, in seconds (0: no emulation)")
    parser.add_argument("--slowdown", default="", help="per-worker multiples of T, e.g. 1,1,1,3 (default all 1)")
    parser.add_argument("--jitter", type=float, default=0.0, help="random variation of emulated iteration times")
    parser.add_argument("--log-dir", default="aps-logs", help="where worker-RANK.log go (default ./aps-logs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--example", nargs=argparse.REMAINDER, metavar="NAME [ARGS]",
        help=f"last: run the built-in example ({' or '.join(EXAMPLES)}: python -m aps.train) with ARGS instead of a script",
    )
    parser.add_argument("script", nargs="?", help="the training script each worker runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def run_launch(args: argparse.Namespace) -> int:
    if (args.script is None) == (args.example is None):
        raise ConfigurationError("give a training script, or --example NAME")
    if args.example is not None and (not args.example or args.example[0] not in EXAMPLES):
        raise ConfigurationError(f"--example takes one of {', '.join(EXAMPLES)}, then the example's arguments")
    if args.port is None:
        args.port = 0
    config = config_from_args(args)
    workers = config.workers
    slowdown = [float(s) for s in args.slowdown.split(",")] if args.slowdown else [1.0] * workers
    if len(slowdown) != workers or any(s <= 0 for s in slowdown):
        raise ConfigurationError(f"--slowdown needs {workers} positive numbers, got {args.slowdown!r}")
    if args.example:
        command = [sys.executable, "-m", "aps.train", "--dataset", args.example[0], *args.example[1:]]
    else:
        if not os.path.exists(args.script):
            raise ConfigurationError(f"no such script: {args.script}")
        command = [sys.executable, args.script, *args.script_args]
    os.makedirs(args.log_dir, exist_ok=True)

    previous = signal.signal(signal.SIGTERM, _raise_stop)
    # Ctrl-C must work even when started with SIGINT ignored (a background job of a shell script)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    background = Server(config).run_in_background().start()
    procs: list[subprocess.Popen] = []
    try:
        print(f"aps: serving on {background.address}; {workers} workers; logs in {args.log_dir}/", flush=True)
        for rank in range(workers):
            env = dict(
                os.environ,
                APS_ADDRESS=background.address,
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
            log = open(os.path.join(args.log_dir, f"worker-{rank}.log"), "w")
            try:
                procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            finally:
                log.close()
        return _watch(procs, background.server, args)
    except (KeyboardInterrupt, _Stop):
        print("\naps: interrupted: stopping the workers and the server", file=sys.stderr, flush=True)
        return 130
    finally:
        _stop_all(procs)
        background.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _raise_stop(signum, frame) -> None:
    raise _Stop()


def _watch(procs: list[subprocess.Popen], server: Server, args) -> int:
    """Wait for every worker; stop at the first failure. Returns the exit status."""
    bar = _progress(len(procs)) if not args.no_progress else None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"\naps: worker {rank} exited with status {code}; stopping the others", file=sys.stderr)
                _show_tail(os.path.join(args.log_dir, f"worker-{rank}.log"))
                return code if 0 < code < 128 else 1
            if all(code == 0 for code in codes):
                if bar is not None:
                    _update(bar, server)
                print(f"\naps: all {len(procs)} workers finished; logs in {args.log_dir}/", flush=True)
                return 0
            if bar is not None:
                _update(bar, server)
            time.sleep(0.2)
    finally:
        if bar is not None:
            bar.close()


def _progress(workers: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=None, unit=" updates", dynamic_ncols=True, leave=True, desc=f"{workers} workers")


def _update(bar, server: Server) -> None:
    try:
        stats = server.stats(timeout=2.0)
    except Exception:
        return
    version = stats["server"]["version"]
    bar.update(version - bar.n)
    clocks = " ".join(str(w["clock"]) for w in stats["workers"])
    bar.set_postfix_str(f"clocks {clocks}  live {stats['server']['live']}", refresh=True)


def _show_tail(path: str, lines: int = 15) -> None:
    try:
        with open(path) as fh:
            tail = fh.readlines()[-lines:]
    except OSError:
        return
    print(f"--- last lines of {path}", file=sys.stderr)
    sys.stderr.writelines(tail)


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every worker's process group, then SIGKILL what is left after a grace period."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        _signal_group(p, signal.SIGKILL)  # the group, too: children the script started
        if p.poll() is None:
            p.wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # start_new_session: the group's id is the worker's pid
    except (ProcessLookupError, PermissionError):
        pass
