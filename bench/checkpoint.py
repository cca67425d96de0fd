#!/usr/bin/env python
"""What checkpoints cost, and what they save: throughput, loop pauses, writes, restarts after kill -9.

Real ``aps serve`` processes and worker processes (ASP, so each push is one update;
SGD with momentum 0.9 by default, so there is optimizer state to copy) on a model of
``--size`` bytes (default 64 MiB). Two servers run side by side with their own
workers: one without checkpoints, one with ``--checkpoint-every 1`` (into a temporary
directory under /tmp); their workers train in turn, in interleaved windows, and the
throughput of each window is the server's version delta over it. During every window
the bench process also pings the training server from an idle connection of its own
(raw PING frames, not a worker), so the event loop's pauses are seen from outside
too, beside what the server measures itself (``loop_ms`` of each checkpoint).

Then the checkpointing server is killed with SIGKILL three times while its workers
train, and restarted each time on the same port with ``--resume``; the workers
reconnect by themselves. Measured: the wall time from the kill to the first
push_pull a worker completes against the new server (and to the last worker's), the
server's own start-to-listening time, and the updates lost (the workers' last version
before the kill minus the version of the checkpoint the server resumed from),
against the updates of one checkpoint interval (the kill falls at a random time up to
two intervals after a checkpoint was seen written). Example:
``python bench/checkpoint.py --out bench/results/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import psutil


import aps
from aps.checkpoint import directory_bytes, list_checkpoints, read_checkpoint
from aps.cli._args import ArgumentParser, format_size, parse_size
from aps.lab.bench import machine_info, write_report
from aps.cli.status import fetch_stats
from aps.wire.protocol import Op
from aps.client.sockets import exchange, handshake
from aps.client.tcp import BlockingConnection
from aps.testing import ServerProcess

SPAWN = mp.get_context("spawn")
NEVER = 1e18  # a monotonic time no completion reaches
TARGETS = {"throughput_ratio": 0.9, "loop_ms": 5.0, "restart_s": 3.0, "lost_per_interval": 1.0}


# Worker processes -----------------------------------------------------------------------------------


class Shared:
    """What the bench and one group of worker processes share (per rank: counters, times, versions)."""

    def __init__(self, workers: int) -> None:
        self.gate = SPAWN.Event()  # set: train; clear: stay idle between push_pulls
        self.stop = SPAWN.Event()
        self.ready = SPAWN.Array("q", workers, lock=False)
        self.count = SPAWN.Array("q", workers, lock=False)
        self.last_version = SPAWN.Array("q", workers, lock=False)
        self.first_after = SPAWN.Array("d", workers, lock=False)  # first completion after `mark` (monotonic)
        self.first_version = SPAWN.Array("q", workers, lock=False)
        self.mark = SPAWN.Value("d", NEVER, lock=False)
        self.errors = SPAWN.Queue()


def train(address: str, rank: int, workers: int, numel: int, transport: str, shared: Shared) -> None:
    """push_pull in a loop while the gate is open; note each completion's time and version."""
    logging.getLogger("aps").setLevel(logging.ERROR)  # reconnect notices would clutter the table
    try:
        worker = aps.Worker(address, rank, workers, transport=transport)
        worker.init({"w": np.zeros(numel, np.float32)})
        grad = worker.flat_grad
        grad.fill(1e-6)
        shared.ready[rank] = 1
        while not shared.stop.is_set():
            if not shared.gate.wait(0.2):
                continue
            worker.push_pull(grad)
            now = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the host
            shared.count[rank] += 1
            shared.last_version[rank] = worker.version
            if now > shared.mark.value and shared.first_after[rank] < shared.mark.value:
                shared.first_version[rank] = worker.version
                shared.first_after[rank] = now
        worker.close()
    except BaseException as exc:  # reported by the bench
        shared.errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")


class Group:
    """A server and its worker processes."""

    def __init__(self, server: ServerProcess, workers: int, numel: int, transport: str) -> None:
        self.server = server
        self.shared = Shared(workers)
        self.procs = [SPAWN.Process(target=train, daemon=True,
                                    args=(server.address, r, workers, numel, transport, self.shared))
                      for r in range(workers)]
        for proc in self.procs:
            proc.start()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.shared.ready):
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready after {timeout:.0f} s:\n{self.server.log()[-3000:]}")
            time.sleep(0.05)

    def check(self) -> None:
        if not self.shared.errors.empty():
            raise RuntimeError(f"a worker failed: {self.shared.errors.get()}")

    def idle(self) -> None:
        """Close the gate and wait until the push_pulls in flight are done."""
        self.shared.gate.clear()
        before = list(self.shared.count)
        time.sleep(0.3)
        while list(self.shared.count) != before:
            before = list(self.shared.count)
            time.sleep(0.2)

    def close(self) -> None:
        self.shared.stop.set()
        self.shared.gate.set()
        for proc in self.procs:
            proc.join(15)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
        self.server.stop(30)


# Measurements ------------------------------------------------------------------------------------------


class Pinger(threading.Thread):
    """Raw PING round trips on a connection of its own (a client that never joins), every ``period`` s."""

    def __init__(self, port: int, period: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.conn = BlockingConnection("127.0.0.1", port, 10.0)
        handshake(self.conn, None, 10.0)
        self.period = period
        self.rtts: list[float] = []
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.wait(self.period):
                start = time.perf_counter()
                exchange(self.conn, Op.PING, 10.0)
                self.rtts.append(time.perf_counter() - start)
        except BaseException as exc:
            self.error = exc

    def finish(self) -> list[float]:
        self.halt.set()
        self.join(15)
        self.conn.close()
        if self.error is not None:
            raise RuntimeError(f"ping failed: {self.error}")
        return self.rtts


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def window(group: Group, seconds: float, settle: float, watch_checkpoints: bool) -> dict:
    """Open the gate; after ``settle`` s, the version delta over ``seconds``, the ping round trips,
    and (``watch_checkpoints``) every checkpoint the server reported meanwhile."""
    address = group.server.address
    group.shared.gate.set()
    time.sleep(settle)
    pinger = Pinger(group.server.port)
    stats = fetch_stats(address)
    v0, t0 = stats["server"]["version"], time.monotonic()
    cpu0, machine0 = stats["server"]["process"]["cpu_s"], psutil.cpu_times()
    pinger.start()
    checkpoints: dict[int, dict] = {}
    end = t0 + seconds
    while (now := time.monotonic()) < end:
        time.sleep(min(0.2, end - now))
        ckpt = fetch_stats(address)["server"]["checkpoint"]  # polled in both kinds of window: the same load
        if watch_checkpoints and ckpt is not None:
            checkpoints.setdefault(ckpt["written"], ckpt)
    stats = fetch_stats(address)
    v1, t1 = stats["server"]["version"], time.monotonic()
    cpu1, machine1 = stats["server"]["process"]["cpu_s"], psutil.cpu_times()
    busy = sum(machine1) - sum(machine0)
    rtts = pinger.finish()
    group.idle()
    group.check()
    if watch_checkpoints:
        settle_checkpoints(address)  # the checkpoint of the idle state must not fall into the next window
    skipped = stats["server"]["checkpoint"]["skipped"] if stats["server"]["checkpoint"] else 0
    return {"updates": v1 - v0, "seconds": t1 - t0, "updates_per_s": (v1 - v0) / (t1 - t0),
            "server_cpu_s_per_update": (cpu1 - cpu0) / max(v1 - v0, 1),
            "machine_idle": (machine1.idle - machine0.idle) / busy if busy > 0 else math.nan,
            "ping_ms": [1e3 * r for r in rtts], "checkpoints": list(checkpoints.values()), "skipped_total": skipped}


def settle_checkpoints(address: str, timeout: float = 10.0) -> None:
    """Wait until the server has written a checkpoint of its current version (it is idle)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server = fetch_stats(address)["server"]
        if server["checkpoint"] is not None and server["checkpoint"]["version"] == server["version"]:
            return
        time.sleep(0.05)


def disk_bound(directory: str, nbytes: int, repeats: int = 2) -> float:
    """Seconds to write ``nbytes`` to a new file in ``directory`` and fsync it (the best of ``repeats``)."""
    data = np.ones(nbytes // 4, np.float32)
    best = math.inf
    for i in range(repeats):
        path = os.path.join(directory, f".bound-{i}")
        start = time.perf_counter()
        with open(path, "wb") as fh:
            fh.write(memoryview(data))
            fh.flush()
            os.fsync(fh.fileno())
        best = min(best, time.perf_counter() - start)
        os.unlink(path)
    return best


def kill_and_resume(group: Group, directory: str, args: argparse.Namespace, rng: random.Random) -> dict:
    """Train, SIGKILL the server, restart it with --resume on the same port, wait for every worker."""
    shared = group.shared
    port = group.server.port
    written = (fetch_stats(group.server.address)["server"]["checkpoint"] or {}).get("written", 0)
    shared.mark.value = NEVER
    shared.gate.set()
    deadline = time.monotonic() + 30
    while ((fetch_stats(group.server.address)["server"]["checkpoint"] or {}).get("written", 0) <= written
           and time.monotonic() < deadline):
        time.sleep(0.05)
    # a random phase: the server's cycle (interval, tick, write) is longer than --checkpoint-every
    time.sleep(rng.uniform(0.0, 2 * args.checkpoint_every))
    stats_version = fetch_stats(group.server.address)["server"]["version"]
    killed = time.monotonic()
    group.server.proc.kill()
    group.server.proc.wait()
    shared.mark.value = time.monotonic()
    workers_version = max(shared.last_version)
    old = group.server
    old.stop()  # reaped already: closes its pipe and removes its log file
    started = time.monotonic()
    group.server = ServerProcess("--port", str(port), "--checkpoint-dir", directory, "--checkpoint-every",
                                 str(args.checkpoint_every), "--resume", timeout=60)
    listening = time.monotonic()
    deadline = listening + 120
    while not all(t < NEVER and t > shared.mark.value for t in shared.first_after):
        group.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not come back: {list(shared.first_after)}\n{group.server.log()}")
        time.sleep(0.01)
    log = group.server.wait_for_log("resumed from")
    match = re.search(r"resumed from (\S+): version (\d+)", log)
    resumed_version = int(match.group(2))
    resumed_path = match.group(1)
    if read_checkpoint(resumed_path, verify=False).version != resumed_version:
        raise RuntimeError(f"{resumed_path}: the log and the manifest disagree on the version")
    firsts = list(shared.first_after)
    version_at_kill = max(stats_version, workers_version)
    return {
        "version_at_kill": version_at_kill, "workers_version_at_kill": workers_version,
        "stats_version_before_kill": stats_version, "resumed_version": resumed_version,
        "resumed_from": os.path.basename(resumed_path), "lost_updates": version_at_kill - resumed_version,
        "kill_to_listening_s": listening - killed, "server_start_to_listening_s": listening - started,
        "kill_to_first_pull_s": min(firsts) - killed, "kill_to_all_workers_s": max(firsts) - killed,
        "first_versions": list(shared.first_version), "log_timing": log_timing(log),
    }


def log_timing(log: str) -> dict:
    """Seconds from the server's first log line to its "resumed from" and "listening on" lines."""
    stamps = {}
    first = None
    for line in log.splitlines():
        match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
        if not match:
            continue
        t = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1e3
        first = t if first is None else first
        for key, text in (("resumed", "resumed from"), ("listening", "listening on")):
            if text in line and key not in stamps:
                stamps[key] = round(t - first, 3)
    return stamps


# The run ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=64 << 20, help="the model in bytes, K/M/G suffixes "
                        "(default 64M)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes per server (default 2)")
    parser.add_argument("--transport", choices=("tcp", "shm"), default="tcp", help="the workers' (default tcp)")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                        help="sgd (momentum 0.9) or adam (default sgd)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of a throughput window (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="window pairs (default 3)")
    parser.add_argument("--checkpoint-every", type=float, default=1.0, help="seconds (default 1)")
    parser.add_argument("--restarts", type=int, default=3, help="kill -9 and resume, this many times (default 3)")
    parser.add_argument("--seed", type=int, default=1, help="for the kill phases (default 1)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    numel = args.size // 4
    optimizer = ["--optimizer", "sgd", "--momentum", "0.9"] if args.optimizer == "sgd" else ["--optimizer", "adam"]
    common = ["--workers", str(args.workers), "--sync", "asp", *optimizer, "--lr", "0.01"]
    directory = tempfile.mkdtemp(prefix="aps-bench-checkpoint-", dir="/tmp")
    rng = random.Random(args.seed)
    groups: dict[str, Group] = {}
    began = time.monotonic()
    try:
        groups["without"] = Group(ServerProcess(*common), args.workers, numel, args.transport)
        groups["with"] = Group(ServerProcess(*common, "--checkpoint-dir", directory, "--checkpoint-every",
                                             str(args.checkpoint_every)), args.workers, numel, args.transport)
        for group in groups.values():
            group.wait_ready()
        for kind, group in groups.items():  # warm-up: connections, buffers, page cache, the first checkpoints
            window(group, 2.0, 0.3, kind == "with")

        # 1-3: interleaved windows, the order alternating
        windows: dict[str, list[dict]] = {"without": [], "with": []}
        for repeat in range(args.repeats):
            for kind in (("without", "with") if repeat % 2 == 0 else ("with", "without")):
                result = window(groups[kind], args.seconds, 0.5, kind == "with")
                windows[kind].append(result)
                print(f"  window {repeat + 1} {kind:>7} checkpoints: {result['updates_per_s']:6.2f} updates/s, "
                      f"server CPU {1e3 * result['server_cpu_s_per_update']:5.1f} ms/update, machine idle "
                      f"{100 * result['machine_idle']:4.1f}%, "
                      f"ping p99 {percentile(result['ping_ms'], 99):6.2f} ms, max {max(result['ping_ms']):6.2f} ms"
                      + (f", {len(result['checkpoints'])} checkpoints" if kind == "with" else ""), flush=True)
        groups["without"].close()
        del groups["without"]
        newest = list_checkpoints(directory)[0]
        checkpoint_bytes = directory_bytes(newest)
        bound_s = disk_bound(directory, checkpoint_bytes)

        # 4-5: kill -9 and resume
        restarts = []
        for i in range(args.restarts):
            row = kill_and_resume(groups["with"], directory, args, rng)
            restarts.append(row)
            print(f"  restart {i + 1}: first pull {row['kill_to_first_pull_s']:.2f} s after the kill (all workers "
                  f"{row['kill_to_all_workers_s']:.2f} s), server listening {row['server_start_to_listening_s']:.2f} s "
                  f"after its start; version {row['version_at_kill']} at the kill, resumed from "
                  f"{row['resumed_version']}: {row['lost_updates']} lost", flush=True)
    finally:
        for group in groups.values():
            try:
                group.close()
            except Exception as exc:  # clean up the rest regardless
                print(f"closing a group: {exc}", file=sys.stderr)
        shutil.rmtree(directory, ignore_errors=True)
    total_s = time.monotonic() - began

    # Figures --------------------------------------------------------------------------------------------
    rates = {kind: [w["updates_per_s"] for w in ws] for kind, ws in windows.items()}
    ratios = [w / wo for w, wo in zip(rates["with"], rates["without"])]
    throughput_ratio = statistics.median(ratios)
    checkpoints = [c for w in windows["with"] for c in w["checkpoints"]]
    cpu = {kind: statistics.median(w["server_cpu_s_per_update"] for w in ws) for kind, ws in windows.items()}
    idle = {kind: statistics.median(w["machine_idle"] for w in ws) for kind, ws in windows.items()}
    cpu_ratio = cpu["with"] / cpu["without"]
    loop_ms = [c["loop_ms"] for c in checkpoints]
    write_s = [c["seconds"] for c in checkpoints]
    versions = sorted({c["version"] for c in checkpoints})
    spacing = [b - a for a, b in zip(versions, versions[1:])]
    ping = {kind: [p for w in ws for p in w["ping_ms"]] for kind, ws in windows.items()}
    rate_with = statistics.median(rates["with"])
    per_interval = rate_with * args.checkpoint_every
    per_spacing = statistics.median(spacing) if spacing else math.nan
    lost = [r["lost_updates"] for r in restarts]
    worst = per_spacing + rate_with * max(write_s)
    first_pull = [r["kill_to_first_pull_s"] for r in restarts]
    all_back = [r["kill_to_all_workers_s"] for r in restarts]
    listen = [r["server_start_to_listening_s"] for r in restarts]
    model_bytes = numel * 4
    state_arrays = 1 if args.optimizer == "sgd" else 2

    def row(name, value, unit, target=None, met=None, note=""):
        return {"figure": name, "value": value, "unit": unit, "target": target, "met": met, "note": note}

    rows = [
        row("throughput with / without checkpoints", throughput_ratio, "x", f">= {TARGETS['throughput_ratio']}",
            throughput_ratio >= TARGETS["throughput_ratio"],
            f"median of {len(ratios)} pairs; {statistics.median(rates['without']):.2f} vs {rate_with:.2f} updates/s"),
        row("server CPU per update with / without", cpu_ratio, "x", None, None,
            f"{1e3 * cpu['without']:.1f} -> {1e3 * cpu['with']:.1f} ms per update; machine idle "
            f"{100 * idle['without']:.0f}% -> {100 * idle['with']:.0f}%"),
        row("loop pause per checkpoint, max (server)", max(loop_ms, default=math.nan), "ms",
            f"< {TARGETS['loop_ms']:g}", max(loop_ms, default=math.inf) < TARGETS["loop_ms"],
            f"{len(loop_ms)} checkpoints sampled"),
        row("loop pause per checkpoint, median (server)", statistics.median(loop_ms) if loop_ms else math.nan, "ms",
            f"< {TARGETS['loop_ms']:g}", bool(loop_ms) and statistics.median(loop_ms) < TARGETS["loop_ms"]),
        row("ping p99 with / without checkpoints", percentile(ping["with"], 99) / percentile(ping["without"], 99),
            "x", None, None, f"{percentile(ping['without'], 99):.2f} -> {percentile(ping['with'], 99):.2f} ms "
            f"(median {percentile(ping['without'], 50):.2f} -> {percentile(ping['with'], 50):.2f} ms)"),
        row("ping max with / without checkpoints", max(ping["with"]) / max(ping["without"]), "x", None, None,
            f"{max(ping['without']):.2f} -> {max(ping['with']):.2f} ms; {len(ping['with'])} and "
            f"{len(ping['without'])} pings"),
        row("checkpoint write time, median", statistics.median(write_s), "s",
            f"< {args.checkpoint_every:g} (--checkpoint-every)", statistics.median(write_s) < args.checkpoint_every,
            f"max {max(write_s):.2f} s; {statistics.median(write_s) / bound_s:.1f}x a plain write+fsync of as many "
            f"bytes ({bound_s:.2f} s)"),
        row("checkpoint size on disk / model", checkpoint_bytes / model_bytes, "x", None, None,
            f"{checkpoint_bytes / (1 << 20):.1f} MiB: weights + {state_arrays} optimizer state array(s)"),
        row("kill -9 to first served pull, median", statistics.median(first_pull), "s",
            f"< {TARGETS['restart_s']:g}", statistics.median(first_pull) < TARGETS["restart_s"],
            f"{len(first_pull)} restarts"),
        row("kill -9 to first served pull, max", max(first_pull), "s", f"< {TARGETS['restart_s']:g}",
            max(first_pull) < TARGETS["restart_s"], f"all workers back: max {max(all_back):.2f} s"),
        row("server start to listening, median", statistics.median(listen), "s", None, None,
            f"max {max(listen):.2f} s"),
        row("updates lost / updates per interval, max", max(lost) / per_interval, "x",
            f"<= {TARGETS['lost_per_interval']:g}", max(lost) / per_interval <= TARGETS["lost_per_interval"],
            f"lost {lost}; {per_interval:.1f} updates per {args.checkpoint_every:g} s; "
            f"{per_spacing:.1f} between successive checkpoints seen"),
        row("updates lost worst case / updates per interval", worst / per_interval, "x",
            f"<= {TARGETS['lost_per_interval']:g}", worst / per_interval <= TARGETS["lost_per_interval"],
            f"derived: a kill just before a write ends loses the spacing ({per_spacing:.1f}) + the updates "
            f"during the longest write ({rate_with * max(write_s):.1f})"),
        row("updates lost / updates between checkpoints, max", max(lost) / per_spacing, "x", None, None,
            f"spacing: median of {len(spacing)} successive checkpoints' versions"),
    ]
    report = {
        "benchmark": "checkpoint", "command": " ".join(["python", *sys.argv]), **machine_info(),
        "model_bytes": model_bytes, "workers": args.workers, "transport": args.transport,
        "optimizer": args.optimizer, "sync": "asp", "checkpoint_every_s": args.checkpoint_every,
        "window_s": args.seconds, "repeats": args.repeats, "total_s": total_s, "targets": TARGETS,
        "figures": rows,
        "updates_per_s": rates, "throughput_ratios": ratios,
        "checkpoints": checkpoints, "checkpoint_version_spacing": spacing,
        "checkpoint_bytes": checkpoint_bytes, "plain_write_fsync_s": bound_s,
        "ping_ms": {kind: {"n": len(p), "p50": percentile(p, 50), "p99": percentile(p, 99),
                           "p999": percentile(p, 99.9), "max": max(p)} for kind, p in ping.items()},
        "restarts": restarts,
    }
    print(f"\ncheckpoints of a {format_size(model_bytes)}iB model ({args.optimizer}), {args.workers} workers over "
          f"{args.transport}, ASP, --checkpoint-every {args.checkpoint_every:g}; {total_s:.0f} s in all")
    print(f"{'figure':<45} {'value':>9} {'':<3} {'target':>22} {'met':>4}  note")
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['figure']:<45} {r['value']:>9.3g} {r['unit']:<3} {r['target'] or '-':>22} {met:>4}  {r['note']}")
    print("machine:", ", ".join(f"{k} {v}" for k, v in machine_info().items()))
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
