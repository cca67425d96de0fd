"""``aps bench`` (also ``bench/pushpull.py``): push_pull throughput against a raw-socket bound.

For each payload size and worker count, a real ``aps serve`` process (ASP,
plain SGD, so every push is applied) serves that many worker processes doing
``push_pull`` round trips on 127.0.0.1. In the same run the benchmark
measures the bound: a plain blocking-socket ping-pong of the same payload
between two processes (send N bytes, receive N bytes back), which is what
moving the bytes costs with no server logic at all.

The machine is shared and noisy, so measurements are interleaved: every
repeat measures the bound and then each aps configuration back to back, and
a configuration's ratio to the bound is the median of its per-repeat ratios.
Every figure that matters is such a ratio; absolute numbers mean little.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

__all__ = ["add_bench_arguments", "main", "run_bench"]

_DEFAULT_SIZES = "4K,64K,1M,16M,64M"
_CTX = mp.get_context("fork")


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(text[:-1]) * factor
    return int(text)


def _format_size(nbytes: int) -> str:
    for suffix, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{suffix}"
    return str(nbytes)


def _timed_loop(step, seconds: float, min_iters: int) -> tuple[int, float]:
    """Run ``step`` for at least ``seconds`` and ``min_iters`` calls; returns (calls, elapsed)."""
    count = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        step()
        count += 1
        now = time.perf_counter()
        if count >= min_iters and now >= deadline:
            return count, now - start


# Sessions: processes that stay up across repeats; each measure() is one window.


class _Session:
    """Child processes that each run one timed window per ``measure`` call."""

    def __init__(self, target, args_list) -> None:
        self._go = _CTX.Barrier(len(args_list) + 1)
        self._results = _CTX.Queue()
        self._control = _CTX.Queue()
        self.procs = [
            _CTX.Process(target=_session_child, args=(target, args, self._go, self._control, self._results), daemon=True)
            for args in args_list
        ]
        for proc in self.procs:
            proc.start()

    def measure(self, seconds: float, min_iters: int) -> list[tuple[int, float]]:
        for _ in self.procs:
            self._control.put((seconds, min_iters))
        self._go.wait(timeout=300)
        out = [self._results.get(timeout=300 + 10 * seconds) for _ in self.procs]
        for item in out:
            if isinstance(item, str):
                raise RuntimeError(item)
        return out

    def close(self) -> None:
        for _ in self.procs:
            self._control.put(None)
        try:
            self._go.wait(timeout=30)
        except Exception:
            pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _session_child(target, args, go, control, results) -> None:
    try:
        with target(*args) as step:
            step()  # connect, join, warm caches
            while True:
                order = control.get()
                go.wait()
                if order is None:
                    return
                seconds, min_iters = order
                _timed_loop(step, min(seconds, 0.1), 2)  # warm up
                results.put(_timed_loop(step, seconds, min_iters))
    except Exception as exc:  # reported to the parent
        results.put(f"{type(exc).__name__}: {exc}")
        try:
            go.abort()
        except Exception:
            pass


class _PingPongClient:
    """Context manager yielding one blocking-socket ping-pong step of ``nbytes`` each way."""

    def __init__(self, port: int, nbytes: int) -> None:
        self.port, self.nbytes = port, nbytes

    def __enter__(self):
        self.sock = socket.create_connection(("127.0.0.1", self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = memoryview(np.ones(self.nbytes, np.uint8))
        back = memoryview(np.empty(self.nbytes, np.uint8))
        sock = self.sock

        def step() -> None:
            sock.sendall(out)
            _recv_exact(sock, back)

        return step

    def __exit__(self, *exc) -> None:
        self.sock.close()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError
        got += n


def _echo_server(listener: socket.socket, nbytes: int) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(nbytes))
    try:
        while True:
            _recv_exact(conn, buf)
            conn.sendall(buf)
    except (EOFError, OSError):
        pass
    finally:
        conn.close()


class _PushPullClient:
    """Context manager yielding one aps push_pull step on a model of ``nbytes``."""

    def __init__(self, address: str, rank: int, workers: int, nbytes: int) -> None:
        self.args = (address, rank, workers)
        self.numel = nbytes // 4

    def __enter__(self):
        from .worker import Worker

        self.worker = worker = Worker(*self.args, transport="tcp")
        worker.init({"w": np.zeros(self.numel, np.float32)})
        grad = worker.flat_grad  # zeros: the weights stay finite whatever the lr
        return lambda: worker.push_pull(grad)

    def __exit__(self, *exc) -> None:
        self.worker.close()


class BoundSession:
    """The bound: one echo process and one client process, blocking sockets."""

    def __init__(self, nbytes: int) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.echo = _CTX.Process(target=_echo_server, args=(listener, nbytes), daemon=True)
        self.echo.start()
        self.session = _Session(_PingPongClient, [(listener.getsockname()[1], nbytes)])
        listener.close()

    def measure(self, seconds: float, min_iters: int) -> list[tuple[int, float]]:
        return self.session.measure(seconds, min_iters)

    def close(self) -> None:
        self.session.close()
        self.echo.join(10)
        if self.echo.is_alive():
            self.echo.kill()


class ApsSession:
    """A real ``aps serve`` process and ``workers`` worker processes."""

    def __init__(self, nbytes: int, workers: int) -> None:
        self.server, address = start_server(workers)
        try:
            self.session = _Session(_PushPullClient, [(address, r, workers, nbytes) for r in range(workers)])
        except BaseException:
            stop_server(self.server)
            raise

    def measure(self, seconds: float, min_iters: int) -> list[tuple[int, float]]:
        return self.session.measure(seconds, min_iters)

    def close(self) -> None:
        self.session.close()
        stop_server(self.server)


def start_server(workers: int, extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``aps serve`` on a free port; returns the process and its address."""
    cmd = [sys.executable, "-m", "aps", "serve", "--port", "0", "--workers", str(workers)]
    cmd += extra or ["--sync", "asp", "--lr", "0.01", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    prefix = "aps: serving on "
    if not line.startswith(prefix):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"aps serve did not start: {line!r}")
    return proc, line[len(prefix) :]


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _summarize(samples: list[list[tuple[int, float]]], nbytes: int) -> dict:
    """Per-repeat round-trip time (mean over workers) and aggregate throughput."""
    rtts, rates, trips = [], [], 0
    for windows in samples:
        rtts.append(statistics.fmean(elapsed / count for count, elapsed in windows))
        total = sum(count for count, _ in windows)
        rates.append(2 * nbytes * total / max(elapsed for _, elapsed in windows) / 1e9)
        trips += total
    return {"rtt_us": statistics.median(rtts) * 1e6, "gbps": statistics.median(rates), "round_trips": trips,
            "rtt_samples_us": [r * 1e6 for r in rtts], "gbps_samples": rates}


def run(sizes: list[int], worker_counts: list[int], seconds: float, min_iters: int, repeats: int, out: str | None) -> dict:
    rows = []
    for nbytes in sizes:
        bound = BoundSession(nbytes)
        sessions = {}
        try:
            for workers in worker_counts:
                sessions[workers] = ApsSession(nbytes, workers)
            bound_samples: list = []
            aps_samples: dict[int, list] = {w: [] for w in worker_counts}
            for _ in range(repeats):
                bound_samples.append(bound.measure(seconds, min_iters))
                for workers, session in sessions.items():
                    aps_samples[workers].append(session.measure(seconds, min_iters))
        finally:
            bound.close()
            for session in sessions.values():
                session.close()
        b = _summarize(bound_samples, nbytes)
        rows.append({"system": "socket ping-pong", "transport": "tcp", "payload_bytes": nbytes, "workers": 1, **b,
                     "ratio_throughput": 1.0, "ratio_rtt": 1.0})
        for workers in worker_counts:
            a = _summarize(aps_samples[workers], nbytes)
            ratio_gbps = statistics.median(x / y for x, y in zip(a["gbps_samples"], b["gbps_samples"]))
            ratio_rtt = statistics.median(x / y for x, y in zip(a["rtt_samples_us"], b["rtt_samples_us"]))
            rows.append({"system": "aps", "transport": "tcp", "payload_bytes": nbytes, "workers": workers, **a,
                         "ratio_throughput": ratio_gbps, "ratio_rtt": ratio_rtt})
            _print_row(rows[-1])
    report = {
        "benchmark": "pushpull",
        "command": " ".join(["aps", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else " ".join(sys.argv),
        **machine_info(),
        "seconds_per_window": seconds,
        "repeats": repeats,
        "rows": rows,
    }
    print()
    print(format_table(rows))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"\nwrote {out}")
    return report


def machine_info() -> dict:
    """What a reader needs to judge the figures: the host, its CPUs and how busy it was."""
    import psutil

    return {
        "host": platform.node(),
        "machine": platform.machine(),
        "cpus": psutil.cpu_count(logical=True),
        "physical_cpus": psutil.cpu_count(logical=False),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }


def _print_row(row: dict) -> None:
    print(
        f"  {_format_size(row['payload_bytes']):>5} x{row['workers']}: {row['gbps']:.2f} GB/s "
        f"({row['ratio_throughput']:.2f} of bound), rtt {row['rtt_us']:.0f} us ({row['ratio_rtt']:.2f}x bound)",
        flush=True,
    )


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'payload':>8} {'system':<17} {'workers':>7} {'rtt us':>10} {'GB/s':>7} {'x bound GB/s':>12} {'x bound rtt':>11}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{_format_size(row['payload_bytes']):>8} {row['system']:<17} {row['workers']:>7} "
            f"{row['rtt_us']:>10.1f} {row['gbps']:>7.2f} {row['ratio_throughput']:>12.2f} {row['ratio_rtt']:>11.2f}"
        )
    return "\n".join(lines)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=_DEFAULT_SIZES, help=f"payload sizes (default {_DEFAULT_SIZES})")
    parser.add_argument("--workers", default="1,2,4", help="worker process counts (default 1,2,4)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one measuring window (default 1.0)")
    parser.add_argument("--min-iters", type=int, default=5, help="least round trips per window (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved windows per point (default 5)")
    parser.add_argument("--out", default="bench/results/pushpull.json", help="JSON report path ('' for none)")


def run_bench(args: argparse.Namespace) -> int:
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    if any(n <= 0 or n % 4 for n in sizes):
        raise SystemExit("aps bench: sizes must be positive multiples of 4 bytes")
    counts = [int(c) for c in args.workers.split(",")]
    run(sizes, counts, args.seconds, args.min_iters, max(1, args.repeats), args.out or None)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))
