#!/usr/bin/env python
"""Rows through a real server: a worker's pull_rows + push_rows against a dense push_pull of
the same bytes, in one run, over TCP and shared memory; and the rows a second 4 workers move.

One ``aps serve`` process (ASP) holds a dense model of ``--dense-mib`` MiB and a table of
``--rows`` declared rows of ``--dim`` float32 values (SGD). Per transport, one worker in this
process, interleaved windows of ``--steps`` steps:

- ``dense``: ``push_pull`` of the dense gradient (the bound: what moving those bytes costs);
- ``rows``: ``pull_rows`` of a batch of ``--batch`` Zipf(1.1) ids (``--touched`` distinct ids
  at most), then ``push_rows`` of their gradient rows: two round trips, 2 x batch x dim x 4
  bytes of rows (1 MiB each way at the defaults) plus the ids;
- ``step``: the training loop's step in one round trip, ``push_pull`` of the dense gradient
  with the last batch's rows and the next batch's ids.

Then ``--workers`` worker processes each run pull_rows + push_rows for ``--seconds``: the rows
moved per second, all together. Figures are medians; ratios are of medians. Example:
``python bench/rows_wire.py --out bench/results/rows_wire.json``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import aps
from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, write_report
from aps.testing import ServerProcess, run_processes


def zipf_ids(seed: int, count: int, batch: int, touched: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.zipf(1.1, batch) % touched).astype(np.int64) for _ in range(count)]


def per_step(step, count: int) -> float:
    began = time.perf_counter()
    for i in range(count):
        step(i)
    return (time.perf_counter() - began) / count


def model(dense_mib: float, rows: int, dim: int):
    dense = {"w": np.zeros(int(dense_mib * (1 << 20)) // 4, np.float32)}
    return dense, {"items": aps.Table(rows=rows, dim=dim, init="normal:0.01", optimizer="sgd", lr=0.01)}


def crowd_worker(address: str, rank: int, workers: int, seconds: float, dense_mib: float, rows: int, dim: int,
                 batch: int, touched: int) -> int:
    """One of the crowd: pull_rows + push_rows for ``seconds``; returns the rows it moved."""
    dense, tables = model(dense_mib, rows, dim)
    ids = zipf_ids(100 + rank, 64, batch, touched)
    grads = np.full((batch, dim), 1e-3, np.float32)
    moved = 0
    with aps.Worker(address, rank, workers) as worker:
        worker.init(dense, tables=tables)
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            batch_ids = ids[i % len(ids)]
            worker.pull_rows("items", batch_ids)
            worker.push_rows("items", batch_ids, grads)
            moved += 2 * len(batch_ids)
            i += 1
    return moved


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10**8, help="declared rows (default 10^8)")
    parser.add_argument("--touched", type=int, default=10**6, help="distinct ids at most (default 10^6)")
    parser.add_argument("--dim", type=int, default=64, help="values a row (default 64)")
    parser.add_argument("--batch", type=int, default=4096, help="ids a batch (default 4096: 1 MiB of rows)")
    parser.add_argument("--dense-mib", type=float, default=1.0, help="the dense model's MiB (default 1)")
    parser.add_argument("--steps", type=int, default=40, help="steps per window (default 40)")
    parser.add_argument("--repeats", type=int, default=9, help="windows per point (default 9)")
    parser.add_argument("--workers", type=int, default=4, help="workers of the crowd (default 4)")
    parser.add_argument("--seconds", type=float, default=10.0, help="the crowd's seconds (default 10)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    dense, tables = model(args.dense_mib, args.rows, args.dim)
    ids = zipf_ids(0, args.steps, args.batch, args.touched)
    grads = np.full((args.batch, args.dim), 1e-3, np.float32)
    gradient = np.full(dense["w"].shape, 1e-6, np.float32)
    report = {"benchmark": "rows_wire", "command": "python bench/rows_wire.py", **machine_info(),
              **{key: getattr(args, key) for key in ("rows", "touched", "dim", "batch", "dense_mib", "steps",
                                                     "repeats", "workers", "seconds")},
              "transports": []}
    server = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "0.001")
    try:
        for transport in ("tcp", "shm"):
            with aps.Worker(server.address, 0, 1, transport=transport) as worker:
                worker.init(dense, tables=tables)
                for warm in ids:  # the rows exist before they are timed (made by a push: a pull makes none)
                    worker.push_rows("items", warm, np.zeros((len(warm), args.dim), np.float32))
                out = np.empty((args.batch, args.dim), np.float32)

                def dense_step(i):
                    worker.push_pull(gradient)

                def rows_step(i):
                    worker.pull_rows("items", ids[i], out=out)
                    worker.push_rows("items", ids[i], grads)

                def loop_step(i):
                    worker.push_pull(gradient, rows={"items": (ids[i], grads)},
                                     pull_rows={"items": ids[(i + 1) % len(ids)]}, out={"items": out})

                samples = {"dense": [], "rows": [], "step": []}
                for _ in range(args.repeats):
                    for name, step in (("dense", dense_step), ("rows", rows_step), ("step", loop_step)):
                        samples[name].append(per_step(step, args.steps) * 1e6)
            medians = {name: statistics.median(values) for name, values in samples.items()}
            report["transports"].append({
                "transport": transport,
                "dense_push_pull_us": medians["dense"],
                "pull_rows_push_rows_us": medians["rows"],
                "push_pull_with_rows_us": medians["step"],
                "rows_over_dense": medians["rows"] / medians["dense"],
                "step_over_dense": medians["step"] / medians["dense"],
                "samples_us": samples,
            })
    finally:
        server.stop()
    crowd = ServerProcess("--workers", str(args.workers), "--sync", "asp", "--lr", "0.001")
    try:
        began = time.monotonic()
        moved = run_processes(crowd_worker, [(crowd.address, rank, args.workers, args.seconds, args.dense_mib,
                                              args.rows, args.dim, args.batch, args.touched)
                                             for rank in range(args.workers)], timeout=args.seconds * 4 + 120)
        report["crowd"] = {"workers": args.workers, "rows": sum(moved), "seconds": args.seconds,
                           "rows_per_second": sum(moved) / args.seconds, "wall_s": time.monotonic() - began}
    finally:
        crowd.stop()
    print(f"{'transport':>9} {'dense push_pull':>16} {'pull+push rows':>15} {'ratio':>6} {'one-trip step':>14} "
          f"{'ratio':>6}")
    for row in report["transports"]:
        print(f"{row['transport']:>9} {row['dense_push_pull_us']:>13.0f} us {row['pull_rows_push_rows_us']:>12.0f} us "
              f"{row['rows_over_dense']:>6.2f} {row['push_pull_with_rows_us']:>11.0f} us {row['step_over_dense']:>6.2f}")
    crowd_row = report["crowd"]
    print(f"{crowd_row['workers']} workers: {crowd_row['rows_per_second']:,.0f} rows/s pulled and pushed "
          f"({args.dim} values a row)")
    if args.out:
        write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
