"""``aps simulate``: compare sync paradigms on a simulated cluster before spending a real one.

A discrete-event simulation of P workers whose iteration times come from
given distributions, driving the real server engine (the same sync policy
classes, the same native ``StalenessWindow``, the same update lane) on a
virtual clock. Each worker loops: compute for one iteration time, push, wait
for the gate, repeat. The model is a single float, so the figures measure
synchronization only: how many iterations per second the cluster completes,
how long workers wait at the gate, and how stale the applied gradients are.
Communication time is not modelled separately; fold it into the iteration
times.

Example::

    aps simulate --speeds 1,1,1,3 --jitter 0.2 --iterations 20000 \\
        --sync bsp --sync asp --sync ssp:3 --sync dssp:3:15
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
import time

import numpy as np

from .._engine import Engine
from ..config import ServerConfig
from ..errors import APSError, ConfigurationError
from ..layout import Layout
from ._args import Setting, number, parse_setting, parse_speeds, require, sync_setting

__all__ = ["DEFAULT_SETTINGS", "SimulationError", "register", "simulate", "worker_speeds"]

DEFAULT_SETTINGS = ("bsp", "asp", "ssp:3", "ssp:15", "dssp:3:15", "softsync:1")
#: The cluster ``aps simulate`` runs without --speeds or --workers: four workers, one three times slower.
DEFAULT_SPEEDS = (1.0, 1.0, 1.0, 3.0)


class SimulationError(APSError):
    """The simulated cluster stopped making progress (a deadlock)."""


def worker_speeds(
    speeds: str | None, workers: int | None, hetero: str | None, seed: int
) -> list[float]:
    """Mean iteration time per worker, from ``--speeds`` or ``--workers`` with ``--hetero``."""
    if speeds:
        values = parse_speeds(speeds, workers)
    else:
        if not workers:
            raise ConfigurationError("give --speeds, or --workers (with --hetero for uneven speeds)")
        values = [1.0] * workers
        if hetero:
            kind, _, sigma_text = hetero.partition(":")
            try:
                sigma = float(sigma_text)
            except ValueError:
                sigma = -1.0
            if kind != "lognormal" or sigma < 0:
                raise ConfigurationError(f"--hetero takes lognormal:SIGMA, got {hetero!r}")
            rng = np.random.default_rng(seed + 7919)
            values = list(np.exp(rng.normal(0.0, sigma, workers)))
    if not values or any(not v > 0 or math.isinf(v) for v in values):
        raise ConfigurationError("iteration times must be positive")
    return values


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return sorted_values[index]


def simulate(setting: Setting, speeds: list[float], *, iterations: int, jitter: float = 0.0, seed: int = 0) -> dict:
    """Run one setting until the cluster has pushed ``iterations`` gradients in all.

    Returns a JSON-able dict: ``sync``, ``iterations_per_s`` (per simulated
    second), gate waits (``mean_wait``, ``p99_wait``, ...), staleness of the
    applied gradients (``mean_staleness``, ``staleness_hist``, ...),
    ``max_gap`` (the largest ``t_i - min_j t_j`` at any release), and more.

    Raises:
        SimulationError: every worker is waiting and none can push (deadlock).
    """
    P = len(speeds)
    config = ServerConfig(workers=P, lr=0.0, heartbeat_timeout=0, **setting.options)
    sim_now = [0.0]
    engine = Engine(config, now=lambda: sim_now[0])
    window = engine.policy.window
    rng = np.random.default_rng(seed)
    base = np.asarray(speeds, dtype=np.float64)
    # Iteration times: lognormal around each worker's mean, drawn in blocks.
    noise_block = 4096
    noise = np.empty(0)
    noise_at = [0]

    def iteration_time(rank: int) -> float:
        nonlocal noise
        if jitter <= 0:
            return float(base[rank])
        if noise_at[0] >= len(noise):
            noise = np.exp(rng.normal(-0.5 * jitter * jitter, jitter, noise_block))
            noise_at[0] = 0
        value = noise[noise_at[0]]
        noise_at[0] += 1
        return float(base[rank] * value)

    events: list[tuple[float, int, int]] = []
    sequence = [0]
    pushed_at = [0.0] * P
    version = [0] * P
    done_per_worker = [0] * P
    waits: list[float] = []
    staleness: list[int] = []
    max_gap = [0]
    errors: list[BaseException] = []

    def schedule(rank: int, start: float) -> None:
        sequence[0] += 1
        heapq.heappush(events, (start + iteration_time(rank), sequence[0], rank))

    def released(rank: int):
        def ready(snapshot, clock) -> None:
            snapshot.release()
            version[rank] = snapshot.version
            now = sim_now[0]
            gap = window.gap(rank)
            if gap > max_gap[0]:
                max_gap[0] = gap
            waits.append(now - pushed_at[rank])
            schedule(rank, now)

        return ready

    def pushed(rank: int):
        def done(result) -> None:
            done_per_worker[rank] += 1
            if not result.dropped:
                staleness.append(result.staleness)
            engine.pull(members[rank], ready_callbacks[rank])

        return done

    layout = Layout(("w",), ((1,),))
    ready_callbacks = [released(r) for r in range(P)]
    done_callbacks = [pushed(r) for r in range(P)]
    members = [
        engine.join(r, P, layout, np.zeros(1, np.float32), lambda snap, clock, r=r: (snap.release(), schedule(r, 0.0)),
                    errors.append)
        for r in range(P)
    ]
    wall = time.perf_counter()
    total = 0
    while total < iterations:
        if not events:
            raise SimulationError(f"{setting.label}: every worker waits and none can push (after {total} iterations)")
        now, _, rank = heapq.heappop(events)
        sim_now[0] = now
        pushed_at[rank] = now
        engine.push(members[rank], version[rank], done_callbacks[rank], errors.append)
        total += 1
        if errors:
            raise SimulationError(f"{setting.label}: {errors[0]}")
    wall = time.perf_counter() - wall
    end = sim_now[0]
    waits.sort()
    staleness.sort()
    hist: dict[str, int] = {}
    for value in staleness:
        hist[str(value)] = hist.get(str(value), 0) + 1
    return {
        "sync": setting.label,
        "policy": engine.policy.describe(),
        "workers": P,
        "iterations": total,
        "simulated_s": end,
        "iterations_per_s": total / end if end > 0 else 0.0,
        "updates": engine.version,
        "dropped": engine.policy.dropped,
        "mean_wait": statistics.fmean(waits) if waits else 0.0,
        "p50_wait": _percentile(waits, 50),
        "p99_wait": _percentile(waits, 99),
        "max_wait": waits[-1] if waits else 0.0,
        "mean_staleness": statistics.fmean(staleness) if staleness else 0.0,
        "p50_staleness": _percentile(staleness, 50),
        "p99_staleness": _percentile(staleness, 99),
        "max_staleness": staleness[-1] if staleness else 0,
        "staleness_hist": hist,
        "max_gap": max_gap[0],
        "iterations_per_worker": {"min": min(done_per_worker), "max": max(done_per_worker)},
        "wall_s": wall,
    }


def format_table(results: list[dict]) -> str:
    header = (
        f"{'sync':<16} {'iter/s':>8} {'mean wait':>10} {'p99 wait':>9} {'stale mean':>10} {'p99':>5} "
        f"{'max':>5} {'max gap':>7} {'updates':>8} {'slowest/fastest':>15}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        per = r["iterations_per_worker"]
        lines.append(
            f"{r['sync']:<16} {r['iterations_per_s']:>8.3f} {r['mean_wait']:>10.3f} {r['p99_wait']:>9.3f} "
            f"{r['mean_staleness']:>10.2f} {r['p99_staleness']:>5} {r['max_staleness']:>5} {r['max_gap']:>7} "
            f"{r['updates']:>8} {per['min']:>7}/{per['max']:<7}"
        )
    return "\n".join(lines)


def register(commands) -> None:
    parser = commands.add_parser(
        "simulate",
        help="compare sync paradigms on a simulated cluster",
        description="Discrete-event simulation of P workers of given speeds, driving the real sync policies on "
        "a virtual clock: iterations per second, gate waits, staleness and the largest gap, per paradigm. "
        "Without --speeds or --workers it simulates four workers, one three times slower (--speeds 1,1,1,3).",
    )
    parser.add_argument("--speeds", metavar="S,S,...",
                        help="mean iteration time per worker, e.g. 1,1,1,3 (sets P; default 1,1,1,3)")
    parser.add_argument("--workers", type=int,
                        help="number of workers, all at speed 1 unless --hetero (default: as many as --speeds gives)")
    parser.add_argument("--hetero", metavar="lognormal:SIGMA", help="draw each worker's mean iteration time from a lognormal distribution (default: all 1)")
    parser.add_argument("--jitter", type=number, default=0.0, help="lognormal spread of each iteration's time")
    parser.add_argument("--iterations", type=int, default=10000, help="total iterations, all workers together")
    parser.add_argument(
        "--sync", action="append", type=sync_setting, metavar="SETTING",
        help=f"bsp[:K], asp, ssp:S, dssp:S_L:S_U, softsync:N[:S] (repeatable; default {' '.join(DEFAULT_SETTINGS)})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random iteration times")
    parser.add_argument("--json", action="store_true", help="print JSON (one object per setting) instead of a table")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON to FILE (default: print only)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require(args.iterations >= 1, f"--iterations must be at least 1, got {args.iterations}")
    require(args.jitter >= 0, f"--jitter must be >= 0, got {args.jitter:g}")
    require(args.workers is None or args.workers >= 1, f"--workers must be at least 1, got {args.workers}")
    if args.speeds is None and args.workers is None:
        require(args.hetero is None, "--hetero draws the speeds of --workers workers: give --workers too")
        args.speeds = ",".join(f"{s:g}" for s in DEFAULT_SPEEDS)
    speeds = worker_speeds(args.speeds, args.workers, args.hetero, args.seed)
    settings = args.sync or [parse_setting(text) for text in DEFAULT_SETTINGS]
    results = []
    for item in settings:
        try:
            results.append(simulate(item, speeds, iterations=args.iterations, jitter=args.jitter, seed=args.seed))
        except ConfigurationError as exc:
            raise ConfigurationError(f"--sync {item.label}: {exc}") from None
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        spread = f"speeds {','.join(f'{s:g}' for s in speeds)}" if len(speeds) <= 16 else (
            f"mean iteration time {statistics.fmean(speeds):.2f} (min {min(speeds):.2f}, max {max(speeds):.2f})"
        )
        print(f"{len(speeds)} workers, {spread}, jitter {args.jitter:g}, {args.iterations} iterations per setting")
        print(format_table(results))
    return 0
