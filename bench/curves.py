#!/usr/bin/env python
"""What serving the logged curves costs the server's loop: /api/scalars at the bound.

The server keeps at most CURVE_POINTS points per curve, MAX_NAMES curves per rank; a
checkpoint keeps SAVED_CURVES curves. At that bound (128 ranks of 32 full curves, about
two million numbers) the curves' JSON takes about a second to write. The loop also
carries training (every request of every worker), so it must not stop for it: the
server copies the curves on the loop and writes the JSON on a thread.

This fills a server's curves to the bound (``Scalars.restore``), serves them from its
HTTP side (aiohttp, a real loopback socket), and fetches /api/scalars ``--repeats``
times (from another process, as a browser would) with a fresh point logged before each (so that each fetch writes the curves
anew), while a probe on the loop sleeps 1 ms at a time and records its longest gap:
how long the loop could not run anything else. Two arms in one run: as served
("thread") and with the JSON written on the loop as before ("loop"). The figure is
the ratio of the thread arm's longest gap to the loop arm's, against a target of at
most 0.1. Example: ``python bench/curves.py --out bench/results/curves.json``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import numpy as np
from aiohttp.test_utils import TestClient, TestServer

from aps.cli._args import ArgumentParser
from aps.config import ServerConfig
from aps.lab.bench import machine_info, write_report
from aps.server.http import HttpSide
from aps.server.engine.scalars import CURVE_POINTS, MAX_NAMES, SAVED_CURVES, Scalars
from aps.wire.scalars import LogReport

TARGET = 0.1


def full_curves(ranks: int) -> Scalars:
    """``ranks`` ranks of MAX_NAMES curves of CURVE_POINTS - 1 points each."""
    points = CURVE_POINTS - 1
    names = [f"metric_{i}" for i in range(MAX_NAMES)]
    index = [[rank, name, points, 1, points] for rank in range(ranks) for name in names]
    steps = np.tile(np.arange(points + 1, dtype=np.int64), len(index))
    values = np.random.default_rng(0).standard_normal(len(steps))
    scalars = Scalars()
    scalars.restore(index, steps, values)
    return scalars


async def fetch_all(scalars: Scalars, repeats: int, arm: str) -> dict:
    http = HttpSide(ServerConfig(workers=1, sync="asp"), lambda: {"server": {}, "workers": []}, None,
                    scalars=scalars)
    if arm == "loop":  # as before: the JSON written on the loop
        async def on_the_loop():
            drawn = scalars.drawn()
            return drawn.seq, drawn.pieces()
        http._curves_json = on_the_loop
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    done = False

    async def probe():
        while not done:
            began = loop.time()
            await asyncio.sleep(0.001)
            gaps.append(loop.time() - began)

    walls, longest, size = [], [], 0
    async with TestClient(TestServer(http.app())) as client:
        prober = asyncio.create_task(probe())
        for step in range(repeats):
            scalars.record(0, LogReport(points=[(CURVE_POINTS + step, "metric_0", 0.5)]))
            gaps.clear()
            began = time.perf_counter()
            # (read by another process, as a browser would: not on the loop measured, nor
            # by a thread of its process that would take turns at its GIL)
            status, size = await _fetch(str(client.make_url("/api/scalars")))
            walls.append(time.perf_counter() - began)
            longest.append(max(gaps, default=0.0))
            assert status == 200
        done = True
        await prober
    return {"arm": arm, "request_s": statistics.median(walls), "longest_gap_s": statistics.median(longest),
            "body_bytes": size}


_FETCH = """
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as answer:
    body = answer.read()
assert json.loads(body)["curves"]
print(answer.status, len(body))
"""


async def _fetch(url: str) -> tuple[int, int]:
    """(status, bytes) of a GET of ``url`` by another process, which checks the body is JSON."""
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _FETCH, url, stdout=asyncio.subprocess.PIPE)
    out, _ = await child.communicate()
    if child.returncode:
        raise RuntimeError(f"fetching {url} failed ({child.returncode})")
    status, size = map(int, out.split())
    return status, size


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=SAVED_CURVES // MAX_NAMES,
                        help=f"ranks of {MAX_NAMES} full curves (default {SAVED_CURVES // MAX_NAMES})")
    parser.add_argument("--repeats", type=int, default=5, help="fetches per arm (default 5)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    scalars = full_curves(args.ranks)
    rows = [asyncio.run(fetch_all(scalars, args.repeats, arm)) for arm in ("thread", "loop")]
    for row in rows:
        print(f"{row['arm']:6s}: /api/scalars {row['request_s'] * 1e3:7.0f} ms, the loop's longest gap "
              f"{row['longest_gap_s'] * 1e3:7.1f} ms ({row['body_bytes'] / 2**20:.1f} MiB of JSON)")
    ratio = rows[0]["longest_gap_s"] / rows[1]["longest_gap_s"]
    met = ratio <= TARGET
    print(f"the loop's longest gap, thread / loop: {ratio:.3f} (target <= {TARGET}: {'met' if met else 'NOT met'})")
    report = {"benchmark": "curves", "command": " ".join(["python", *sys.argv]), **machine_info(),
              "points": args.ranks * MAX_NAMES * (CURVE_POINTS - 1), "rows": rows,
              "gap_ratio": ratio, "target": TARGET, "met": met}
    write_report(report, args.out)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
