#!/usr/bin/env python
"""What watching costs training: push_pull throughput with an open dashboard and a scrape a second, and without.

Two real ``aps serve`` processes (ASP, plain SGD, so every push is applied), each
with its own worker process(es) doing push_pull round trips on a model of
``--size`` bytes (default 64 MiB) over TCP (:class:`aps.lab.bench.ApsSession`, as
``aps bench`` runs them): one with its HTTP side (``--http-port 0``), one without.
Their workers train in turn, in interleaved windows. Every repeat starts both
servers afresh (which one first alternates), so that where the kernel puts two
otherwise identical servers and their memory, worth a few per cent either way
on this kind of machine, does not favour one side for the whole run; after a
warm-up window each, they get four windows in the order A B B A (which side is
A alternates too). A repeat's ratio is its mean throughput with the HTTP side
over its mean throughput without; the figure is the median of the repeats'
ratios, against a target of 0.95.

During every window of the server with the HTTP side, a watcher process of its
own (not the bench's, nor a worker's) does what that server sees of an
operator's browser and of Prometheus: it opens the dashboard's WebSocket
(``/ws``, with the browser's ``Origin``), sends the token message, takes the
hello, then reads and parses every ``stats`` frame (about two a second) while
the window lasts; and it scrapes ``/metrics`` once a second on a keep-alive
connection, reading each body and checking each answer is a 200. Both use
aiohttp's client. The browser itself would run on the operator's machine, so
the page is not rendered here: only its connection is, and what reading it
costs the watcher process (on this machine, so charged to the windows with the
HTTP side). Between those windows the watcher closes the WebSocket and stops
scraping, so the windows without run with no HTTP traffic on the machine.

The row fails if the median ratio is below the target, if a window's viewer got
no frame, if a window had no scrape, if a scrape did not answer 200, or if the
server closed a viewer. Also reported, without a target: each server's CPU time
per round trip, the watcher's CPU time, and what the rest of the machine used
during each window (the machine is shared: a busy window shows up there).
Example: ``python bench/dashboard.py --out bench/results/dashboard.json``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time

import psutil

from aps.cli._args import ArgumentParser, command_line, format_size, parse_size
from aps.lab.bench import ApsSession, machine_info, summarize, write_report

SPAWN = mp.get_context("spawn")
TARGET = 0.95  # throughput with the HTTP side watched / without, median over repeats
KINDS = ("without", "with")
VARIANT = {"without": "aps", "with": "aps dashboard"}  # see aps.lab.bench.VARIANTS


# The watcher process: one dashboard viewer and one Prometheus scraper ---------------------------------


def watch(conn, scrape_every: float) -> None:
    """The watcher process's body: on each ("open", ``http://HOST:PORT/``) from ``conn``, open
    that server's dashboard and start scraping it; on the following "close", stop both and
    send back what they saw; None ends it."""
    asyncio.run(_watch(conn, scrape_every))


async def _watch(conn, scrape_every: float) -> None:
    import aiohttp

    loop = asyncio.get_running_loop()
    me = psutil.Process()
    async with aiohttp.ClientSession() as http:
        while (order := await loop.run_in_executor(None, conn.recv)) is not None:
            _, base = order
            cpu = sum(me.cpu_times()[:2])
            window = _Window()
            try:
                await window.open(http, base, scrape_every)
            except Exception as exc:  # reported to the bench, which then stops
                await window.abandon()
                conn.send({"error": f"{type(exc).__name__}: {exc}"})
                continue
            conn.send({"opened": True})
            last = await loop.run_in_executor(None, conn.recv) is None  # "close", or None: close and end
            try:
                report = await window.close()
            except Exception as exc:
                await window.abandon()
                report = {"error": f"{type(exc).__name__}: {exc}"}
            report["watcher_cpu_s"] = sum(me.cpu_times()[:2]) - cpu
            if last:
                return
            conn.send(report)


class _Window:
    """One window's viewer (a WebSocket reading every frame) and scraper (GET /metrics on a cadence)."""

    def __init__(self) -> None:
        self.frame_times: list[float] = []
        self.frame_bytes = 0
        self.other_messages: list[str] = []
        self.closed_by_server: str | None = None
        self.scrapes: list[dict] = []
        self.ws = self.reader = self.scraper = None
        self.stop = asyncio.Event()

    async def open(self, http, base: str, scrape_every: float) -> None:
        """Connect as the page does, take the hello, then start reading frames and scraping."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.ws = await http.ws_connect(base + "ws", origin=base.rstrip("/"))
        await self.ws.send_str(json.dumps({"token": ""}))
        message = await self.ws.receive(timeout=10)
        hello = json.loads(message.data) if isinstance(message.data, str) else {}
        if hello.get("type") != "hello":
            raise RuntimeError(f"the dashboard's first message was not a hello: {message.type} {message.data!r:.200}")
        self.hello_bytes = len(message.data)
        self.hello_ms = 1e3 * (loop.time() - started)
        self.opened = loop.time()
        self.reader = asyncio.create_task(self._read())
        self.scraper = asyncio.create_task(self._scrape(http, base + "metrics", scrape_every))

    async def _read(self) -> None:
        import aiohttp

        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                self.other_messages.append(str(message.type))
                continue
            frame = json.loads(message.data)  # what the page does with each frame before drawing it
            if frame.get("type") == "stats":
                self.frame_times.append(asyncio.get_running_loop().time())
                self.frame_bytes += len(message.data)
            else:
                self.other_messages.append(str(frame.get("type")))
        if not self.stop.is_set():
            self.closed_by_server = f"closed by the server: code {self.ws.close_code}"

    async def _scrape(self, http, url: str, every: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not self.stop.is_set():
            began = loop.time()
            try:
                async with http.get(url) as response:
                    body = await response.read()
                    self.scrapes.append({"status": response.status, "ms": 1e3 * (loop.time() - began),
                                         "bytes": len(body)})
            except Exception as exc:  # counted as a failed scrape
                self.scrapes.append({"status": f"{type(exc).__name__}: {exc}", "ms": 1e3 * (loop.time() - began),
                                     "bytes": 0})
            due += every
            try:
                await asyncio.wait_for(self.stop.wait(), max(0.0, due - loop.time()))
            except asyncio.TimeoutError:
                pass

    async def close(self) -> dict:
        loop = asyncio.get_running_loop()
        open_s = loop.time() - self.opened
        self.stop.set()
        await self.scraper
        await self.ws.close()
        await self.reader
        gaps = [b - a for a, b in zip(self.frame_times, self.frame_times[1:])]
        ok = [s for s in self.scrapes if s["status"] == 200]
        return {
            "open_s": open_s, "hello_ms": self.hello_ms, "hello_bytes": self.hello_bytes,
            "frames": len(self.frame_times), "frame_bytes": self.frame_bytes,
            "frame_gap_max_s": max(gaps, default=None), "other_messages": self.other_messages,
            "closed_by_server": self.closed_by_server,
            "scrapes": len(self.scrapes), "scrapes_200": len(ok),
            "scrape_failures": [s["status"] for s in self.scrapes if s["status"] != 200],
            "scrape_ms_median": statistics.median(s["ms"] for s in ok) if ok else None,
            "scrape_ms_max": max((s["ms"] for s in ok), default=None),
            "scrape_bytes": ok[-1]["bytes"] if ok else 0,
        }

    async def abandon(self) -> None:
        self.stop.set()
        for task in (self.scraper, self.reader):
            if task is not None:
                task.cancel()
        if self.ws is not None:
            await self.ws.close()


class Watcher:
    """The watcher process, driven from the bench: :meth:`open` before a window, :meth:`close` after."""

    def __init__(self, scrape_every: float) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=watch, args=(child, scrape_every), daemon=True)
        self.proc.start()
        child.close()

    def _answer(self, timeout: float = 60.0) -> dict:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the watcher did not answer within {timeout:g} s")
        return self.conn.recv()

    def open(self, base: str) -> None:
        self.conn.send(("open", base))
        answer = self._answer()
        if "error" in answer:
            raise RuntimeError(f"the watcher could not open the dashboard: {answer['error']}")

    def close(self) -> dict:
        self.conn.send("close")
        answer = self._answer()
        if "error" in answer:
            raise RuntimeError(f"the watcher failed: {answer['error']}")
        return answer

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# The run ----------------------------------------------------------------------------------------------


def _cpu_s(procs: list[psutil.Process]) -> float:
    return sum(sum(proc.cpu_times()[:2]) for proc in procs)


def _machine() -> tuple[float, float, float]:
    """The machine's CPU seconds so far: busy, idle, stolen by the hypervisor."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    steal = getattr(times, "steal", 0.0)
    return sum(times) - idle - steal, idle, steal


def window(session: ApsSession, watcher: Watcher | None, nbytes: int, seconds: float, min_iters: int) -> dict:
    """One timed window of ``session``'s workers (with the watcher open around it, if given), and
    what else the machine did meanwhile: CPU seconds of the server, of its workers, and of
    everything else (other processes of this machine included)."""
    server = psutil.Process(session.server.pid)
    workers = [psutil.Process(proc.pid) for proc in session.session.procs]
    if watcher is not None:
        watcher.open(session.http_address)
    try:
        cpu = _cpu_s([server]), _cpu_s(workers), _machine()
        samples = session.measure(seconds, min_iters)
        server_s, workers_s = _cpu_s([server]) - cpu[0], _cpu_s(workers) - cpu[1]
        busy, idle, steal = (b - a for a, b in zip(cpu[2], _machine()))
    finally:
        seen = watcher.close() if watcher is not None else None
    trips = sum(count for count, _ in samples)
    return {"gbps": summarize([samples], nbytes)["gbps"], "round_trips": trips,
            "rtt_ms": 1e3 * statistics.fmean(elapsed / count for count, elapsed in samples), "samples": samples,
            "server_cpu_s": server_s, "server_cpu_ms_per_round_trip": 1e3 * server_s / trips,
            "workers_cpu_s": workers_s, "other_cpu_s": busy - server_s - workers_s,
            "machine_idle": idle / (busy + idle + steal), "steal_s": steal,
            "watched": seen}


def repeat(number: int, args) -> dict:
    """Fresh servers, a warm-up window each, then windows A B B A; what they measured."""
    kinds = KINDS if number % 2 == 0 else KINDS[::-1]  # which server starts first
    first = KINDS[(number // 2) % 2]  # which side is A
    order = [first, KINDS[1 - KINDS.index(first)]]
    order += order[::-1]
    sessions: dict[str, ApsSession] = {}
    windows = []
    try:
        for kind in kinds:
            sessions[kind] = ApsSession(args.size, args.workers, "tcp", VARIANT[kind])
        for kind in KINDS:  # warm-up: connections, buffers, the HTTP side's first requests
            window(sessions[kind], args.watcher if kind == "with" else None, args.size, args.warmup,
                   args.min_iters)
        for kind in order:
            result = window(sessions[kind], args.watcher if kind == "with" else None, args.size, args.seconds,
                            args.min_iters)
            windows.append({"kind": kind, **result})
    finally:
        for session in sessions.values():
            try:
                session.close()
            except Exception as exc:  # close the rest regardless
                print(f"closing a server: {exc}", file=sys.stderr)
    gbps = {kind: statistics.fmean(w["gbps"] for w in windows if w["kind"] == kind) for kind in KINDS}
    seen = [w["watched"] for w in windows if w["watched"]]
    return {"repeat": number + 1, "started_first": kinds[0], "order": order,
            "gbps_without": gbps["without"], "gbps_with": gbps["with"], "ratio": gbps["with"] / gbps["without"],
            "frames": sum(s["frames"] for s in seen), "scrapes": sum(s["scrapes"] for s in seen),
            "scrapes_200": sum(s["scrapes_200"] for s in seen), "windows": windows}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=64 << 20,
                        help="the model in bytes, a multiple of 4, K/M/G suffixes (default 64M)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes per server (default 1)")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one window (default 2)")
    parser.add_argument("--warmup", type=float, default=1.0, help="length of the warm-up windows (default 1)")
    parser.add_argument("--repeats", type=int, default=15, help="fresh server pairs, four windows each (default 15)")
    parser.add_argument("--min-iters", type=int, default=5, help="least round trips per window (default 5)")
    parser.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes (default 1)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    if args.size <= 0 or args.size % 4:
        parser.error(f"--size must be a positive multiple of 4 bytes, got {args.size}")
    if args.workers < 1 or args.repeats < 1 or min(args.seconds, args.warmup, args.scrape_every) <= 0:
        parser.error("--workers and --repeats must be at least 1, --seconds, --warmup and --scrape-every > 0")

    began = time.monotonic()
    print(f"{format_size(args.size)}iB, {args.workers} worker(s) per server over tcp, {args.repeats} repeats of "
          f"4 windows of {args.seconds:g} s", flush=True)
    args.watcher = Watcher(args.scrape_every)
    repeats = []
    try:
        for number in range(args.repeats):
            r = repeat(number, args)
            repeats.append(r)
            other = {kind: statistics.fmean(w["other_cpu_s"] for w in r["windows"] if w["kind"] == kind)
                     / args.seconds for kind in KINDS}
            print(f"  repeat {number + 1:>2} ({' '.join(k.replace('without', 'w/o') for k in r['order'])}): {r['gbps_without']:.3f} GB/s "
                  f"without, {r['gbps_with']:.3f} with: {r['ratio']:.3f}x; {r['frames']} frames, "
                  f"{r['scrapes_200']}/{r['scrapes']} scrapes answered 200; rest of the machine "
                  f"{other['without']:.2f} and {other['with']:.2f} cores", flush=True)
    finally:
        args.watcher.stop()
    total_s = time.monotonic() - began

    ratios = [r["ratio"] for r in repeats]
    ratio = statistics.median(ratios)
    windows = {kind: [w for r in repeats for w in r["windows"] if w["kind"] == kind] for kind in KINDS}
    seen = [w["watched"] for w in windows["with"]]
    frames = sum(s["frames"] for s in seen)
    scrapes = sum(s["scrapes"] for s in seen)
    scrapes_200 = sum(s["scrapes_200"] for s in seen)
    problems = []
    if any(s["frames"] == 0 for s in seen):
        problems.append("a window's viewer got no frame")
    if any(s["scrapes"] == 0 for s in seen):
        problems.append("a window had no scrape")
    if scrapes_200 != scrapes:
        problems.append(f"{scrapes - scrapes_200} scrape(s) did not answer 200")
    if any(s["closed_by_server"] for s in seen):
        problems.append("the server closed a viewer's WebSocket")
    met = ratio >= TARGET and not problems
    cpu_per_trip = {kind: statistics.median(w["server_cpu_ms_per_round_trip"] for w in windows[kind]) for kind in KINDS}
    other_cores = {kind: statistics.median(w["other_cpu_s"] for w in windows[kind]) / args.seconds for kind in KINDS}
    gbps = {kind: statistics.median(r[f"gbps_{kind}"] for r in repeats) for kind in KINDS}
    open_s = sum(s["open_s"] for s in seen)
    row = {
        "figure": "push_pull throughput, dashboard open and /metrics scraped / no HTTP side",
        "value": ratio, "unit": "x", "target": f">= {TARGET}", "met": met, "problems": problems,
        "note": f"median of {len(ratios)} repeats' ratios; {gbps['without']:.3f} vs {gbps['with']:.3f} GB/s; "
                f"{frames} frames received, {scrapes_200}/{scrapes} scrapes answered 200",
    }
    report = {
        "benchmark": "dashboard", "command": command_line(), **machine_info(),
        "payload_bytes": args.size, "workers": args.workers, "transport": "tcp", "sync": "asp", "optimizer": "sgd",
        "window_s": args.seconds, "warmup_s": args.warmup, "repeats": args.repeats,
        "scrape_every_s": args.scrape_every, "total_s": total_s,
        "target": TARGET, "median_ratio": ratio, "ratios": ratios, "met": met, "figures": [row],
        "gbps_median": gbps, "frames_received": frames, "frames_per_open_s": frames / open_s, "scrapes": scrapes,
        "scrapes_200": scrapes_200,
        "server_cpu_ms_per_round_trip_median": cpu_per_trip,
        "rest_of_machine_cores_median": other_cores,
        "watcher_cpu_s": sum(s["watcher_cpu_s"] for s in seen), "watcher_open_s": open_s,
        "per_repeat": repeats,
    }
    print(f"\npush_pull of {format_size(args.size)}iB, {args.workers} worker(s) over tcp, ASP, SGD; "
          f"{total_s:.0f} s in all")
    print(f"{'figure':<72} {'value':>7} {'target':>8} {'met':>4}  note")
    print(f"{row['figure']:<72} {ratio:>7.3f} {row['target']:>8} {'yes' if met else 'NO':>4}  {row['note']}")
    for problem in problems:
        print(f"  failed: {problem}")
    print(f"per-repeat ratios: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"server CPU per round trip: {cpu_per_trip['without']:.2f} ms without, {cpu_per_trip['with']:.2f} ms with; "
          f"watcher CPU {report['watcher_cpu_s']:.2f} s over {open_s:.0f} s open; the rest of the machine (the "
          f"idle server, this process, other processes): {other_cores['without']:.2f} and "
          f"{other_cores['with']:.2f} cores, median")
    print("machine:", ", ".join(f"{k} {v}" for k, v in machine_info().items()))
    write_report(report, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
