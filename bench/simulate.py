#!/usr/bin/env python
"""How fast ``aps simulate`` runs: 1,024 workers, 10,000 iterations, every paradigm.

The bound measured in the same run is the bare discrete-event loop the
simulator is built on (a heap of push events and lognormal iteration times,
every worker released at once, no policy, no engine), so the ratio is the
price of running the real sync policies. Writes a table and JSON.

Example: ``python bench/simulate.py --workers 1024 --iterations 10000``.
"""

from __future__ import annotations

import heapq
import sys
import time

import numpy as np

from aps.cli._args import ArgumentParser, parse_setting
from aps.lab.bench import machine_info, write_report
from aps.lab.simulate import DEFAULT_SETTINGS, simulate, worker_speeds


def bare_event_loop(speeds: list[float], iterations: int, jitter: float, seed: int) -> float:
    """The floor: the same events with no policy at all; returns wall seconds."""
    rng = np.random.default_rng(seed)
    noise = np.exp(rng.normal(-0.5 * jitter * jitter, jitter, iterations + len(speeds)))
    events = [(speeds[r] * noise[r], r, r) for r in range(len(speeds))]
    heapq.heapify(events)
    start = time.perf_counter()
    for i in range(iterations):
        now, _, rank = heapq.heappop(events)
        heapq.heappush(events, (now + speeds[rank] * noise[len(speeds) + i], len(speeds) + i, rank))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1024, help="simulated workers")
    parser.add_argument("--iterations", type=int, default=10000)
    parser.add_argument("--hetero", default="lognormal:0.5")
    parser.add_argument("--jitter", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    speeds = worker_speeds(None, args.workers, args.hetero, args.seed)
    rows = []
    bound = min(bare_event_loop(speeds, args.iterations, args.jitter, args.seed) for _ in range(3))
    print(f"{args.workers} workers ({args.hetero}, jitter {args.jitter}), {args.iterations} iterations per setting")
    print(f"bare event loop (the bound): {bound:.3f} s")
    print(f"{'setting':<12} {'wall s':>8} {'x bound':>8} {'iterations/s of wall':>21}")
    for text in DEFAULT_SETTINGS:
        result = simulate(parse_setting(text), speeds, iterations=args.iterations, jitter=args.jitter, seed=args.seed)
        wall = result["wall_s"]
        rows.append({"sync": text, "wall_s": wall, "ratio_to_bound": wall / bound,
                     "simulated_iterations_per_wall_s": args.iterations / wall})
        print(f"{text:<12} {wall:>8.3f} {wall / bound:>8.1f} {args.iterations / wall:>21.0f}")
    total = sum(r["wall_s"] for r in rows)
    print(f"all {len(rows)} settings: {total:.2f} s")
    report = {"benchmark": "simulate", "command": " ".join(["python", *sys.argv]), **machine_info(),
              "workers": args.workers, "iterations": args.iterations, "bound_s": bound, "total_s": total, "rows": rows}
    write_report(report, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
