"""``aps bench`` (also ``bench/pushpull.py``): push_pull throughput against bounds measured in the same run.

For each payload size, transport and worker count, a real ``aps serve``
process (ASP, plain SGD, so every push is applied) serves that many worker
processes doing ``push_pull`` round trips. In the same run the benchmark
measures what each transport cannot beat:

- TCP: a plain blocking-socket ping-pong of the same payload between two
  processes on 127.0.0.1 (send N bytes, receive N bytes back);
- shared memory: one memcpy plus one fused update pass of the same size
  (what a push_pull costs when no byte crosses a socket), the update pass
  alone (what a zero-copy push_pull, ``aps zero-copy``, cannot beat: its pull
  reads the slot where it lies), and, for the round trip of small payloads, a
  1-byte pipe ping-pong between two processes (what waking the other side
  costs).

The machine is shared and noisy, so measurements are interleaved: every
repeat measures the bounds and then each aps configuration back to back, and
a configuration's ratio is the median of its per-repeat ratios. Every
figure that matters is such a ratio; absolute numbers mean little.

``--streaming both`` also runs each TCP configuration against a server that
applies gradients only once they have fully arrived (``--stream-min-bytes
0``), to show what applying them while they arrive is worth.

The measuring machinery (:class:`Session` and the bound and aps sessions)
is public for ``bench/peers.py``, which puts other systems beside aps.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigurationError
from .settings import command_line, format_size

__all__ = [
    "VARIANTS",
    "ApsSession",
    "BoundSession",
    "CopyUpdateBound",
    "PipeBound",
    "Session",
    "TlsFiles",
    "machine_info",
    "measure",
    "summarize",
    "write_report",
]

_DEFAULT_SIZES = "4K,64K,1M,16M,64M"
_CTX = mp.get_context("fork")


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


class Session:
    """Child processes that each run one timed window per ``measure`` call.

    ``target(*args)`` is a context manager yielding one step (a callable);
    each process enters one, and every :meth:`measure` runs all of them for
    one window at once.
    """

    def __init__(self, target, args_list) -> None:
        self._go = _CTX.Barrier(len(args_list) + 1)
        self._results = _CTX.Queue()
        self._control = _CTX.Queue()
        self.procs = [
            _CTX.Process(
                target=_session_child, args=(target, args, self._go, self._control, self._results), daemon=True
            )
            for args in args_list
        ]
        for proc in self.procs:
            proc.start()

    def measure(self, seconds: float, min_iters: int) -> list[tuple[int, float]]:
        for _ in self.procs:
            self._control.put((seconds, min_iters))
        try:
            self._go.wait(timeout=300)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"a measuring process failed: {self._results.get(timeout=10)}") from None
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
        out = np.ones(self.nbytes, np.uint8).data
        back = np.empty(self.nbytes, np.uint8).data
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

    def __init__(
        self,
        address: str,
        rank: int,
        workers: int,
        nbytes: int,
        transport: str,
        tls_ca: str | None = None,
        options: dict | None = None,
    ) -> None:
        self.args = (address, rank, workers)
        self.transport = transport
        self.numel = nbytes // 4
        self.tls_ca = tls_ca
        self.options = options or {}

    def __enter__(self):
        import ssl

        from ..client.worker import Worker

        tls = ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else None
        self.worker = worker = Worker(*self.args, transport=self.transport, tls=tls, **self.options)
        worker.init({"w": np.zeros(self.numel, np.float32)})
        grad = worker.flat_grad  # zeros: the weights stay finite whatever the lr
        assert grad is not None  # init made it
        return lambda: worker.push_pull(grad)

    def __exit__(self, *exc) -> None:
        self.worker.close()


class BoundSession:
    """The bound: one echo process and one client process, blocking sockets."""

    def __init__(self, nbytes: int) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.echo = _CTX.Process(target=_echo_server, args=(listener, nbytes), daemon=True)
        self.echo.start()
        self.session = Session(_PingPongClient, [(listener.getsockname()[1], nbytes)])
        listener.close()

    def measure(self, seconds: float, min_iters: int) -> list[tuple[int, float]]:
        return self.session.measure(seconds, min_iters)

    def close(self) -> None:
        self.session.close()
        self.echo.join(10)
        if self.echo.is_alive():
            self.echo.kill()


class _PipePingPong:
    """Context manager yielding a 1-byte ping-pong over two pipes to an echo process."""

    def __enter__(self):
        down_read, down_write = os.pipe()
        up_read, up_write = os.pipe()
        # A plain fork: this runs inside a (daemonic) measuring process.
        self.child = os.fork()
        if self.child == 0:
            os.close(down_write)
            os.close(up_read)
            while os.read(down_read, 1):
                os.write(up_write, b"x")
            os._exit(0)
        os.close(down_read)
        os.close(up_write)
        self.fds = (down_write, up_read)

        def step() -> None:
            os.write(down_write, b"x")
            os.read(up_read, 1)

        return step

    def __exit__(self, *exc) -> None:
        for fd in self.fds:
            os.close(fd)
        os.waitpid(self.child, 0)


class PipeBound:
    """The wake-up bound: a 1-byte pipe ping-pong between two processes."""

    def __init__(self) -> None:
        self.session = Session(_PipePingPong, [()])

    def measure(self, seconds: float, min_iters: int) -> list[tuple[int, float]]:
        return self.session.measure(seconds, min_iters)

    def close(self) -> None:
        self.session.close()


class _CopyUpdate:
    """Context manager yielding one memcpy plus one fused SGD pass over ``nbytes`` (``copy``
    False: the pass alone)."""

    def __init__(self, nbytes: int, copy: bool = True, shared: bool = False) -> None:
        self.numel = nbytes // 4
        self.copy = copy
        self.shared = shared

    def __enter__(self):
        from .. import _core

        if self.shared:  # in shared segments, as the server's slots and the worker's gradient are
            from ..wire.segments import Segment

            self.segments = [Segment.create(self.numel, "aps-bench") for _ in range(3)]
            w, g, slot = (segment.array for segment in self.segments)
            w[:] = 1.0
        else:  # (numpy's memory: transparent huge pages where the kernel gives them)
            w = np.ones(self.numel, np.float32)
            g = np.zeros(self.numel, np.float32)
            slot = np.empty_like(w)
        out = np.empty_like(w)

        def step() -> None:
            _core.sgd_step(slot, w, g, None, None, 0.01)  # the server's update, out of place
            np.copyto(out, slot)  # the worker's copy out of the slot

        def update() -> None:
            _core.sgd_step(slot, w, g, None, None, 0.01)

        return step if self.copy else update

    def __exit__(self, *exc) -> None:
        for segment in getattr(self, "segments", ()):
            segment.close()


class CopyUpdateBound:
    """The shared-memory bound: a memcpy and a fused update pass, in one process (``copy``
    False: the update pass alone, the bound of a zero-copy pull; ``shared``: over shared
    segments, whose pages the kernel may not make huge)."""

    def __init__(self, nbytes: int, copy: bool = True, shared: bool = False) -> None:
        self.session = Session(_CopyUpdate, [(nbytes, copy, shared)])

    def measure(self, seconds: float, min_iters: int) -> list[tuple[int, float]]:
        return self.session.measure(seconds, min_iters)

    def close(self) -> None:
        self.session.close()


#: What an aps row measures, by its system name: the server's extra flags.
VARIANTS = {
    "aps": [],
    "aps no-stream": ["--stream-min-bytes", "0"],
    "aps tls": ["--tls-cert"],
    "aps dashboard": ["--http-port", "0"],
    "aps zero-copy": [],
    "aps spin": [],
}
#: The worker's options of a variant (the others' workers are made with none).
CLIENT_OPTIONS = {"aps zero-copy": {"zero_copy": True}, "aps spin": {"spin": 200e-6}}
#: What shared memory measures: the worker copying its weights out of the slot, reading them
#: there, and polling 200 us for each reply before sleeping.
SHM_VARIANTS = ("aps", "aps zero-copy", "aps spin")


class ApsSession:
    """A real ``aps serve`` process and ``workers`` worker processes on ``transport``;
    ``variant`` (see VARIANTS): as it comes, applying TCP gradients only once they
    have arrived, over TLS (with a throwaway certificate, see :class:`TlsFiles`), or
    with the HTTP side on a free port (its address in :attr:`http_address`)."""

    def __init__(
        self, nbytes: int, workers: int, transport: str, variant: str = "aps", tls: TlsFiles | None = None
    ) -> None:
        extra = ["--sync", "asp", "--lr", "0.01", "--log-level", "warning"] + VARIANTS[variant]
        ca = None
        if variant == "aps tls":
            if tls is None:
                raise ValueError("the 'aps tls' variant needs its TlsFiles")
            extra.append(tls.server)
            ca = tls.ca
        self.server, address = start_server(workers, extra)
        #: ``http://HOST:PORT/`` of the server's HTTP side, or None without one.
        self.http_address: str | None = None
        try:
            if "--http-port" in extra:
                self.http_address = _read_dashboard(self.server)
            self.session = Session(
                _PushPullClient,
                [
                    (
                        address,
                        r,
                        workers,
                        nbytes,
                        transport,
                        ca,
                        CLIENT_OPTIONS.get(variant),
                    )
                    for r in range(workers)
                ],
            )
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
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline().strip()
    prefix = "aps: serving on "
    if not line.startswith(prefix):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"aps serve did not start: {line!r}")
    return proc, line[len(prefix) :]


def _read_dashboard(proc: subprocess.Popen) -> str:
    """The HTTP side's address, from the second line ``aps serve --http-port`` prints."""
    assert proc.stdout is not None  # start_server reads its stdout
    line = proc.stdout.readline().strip()
    prefix = "aps: dashboard on "
    if not line.startswith(prefix):
        raise RuntimeError(f"aps serve did not announce its HTTP side: {line!r}")
    return line[len(prefix) :]


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def summarize(samples: list[list[tuple[int, float]]], nbytes: int) -> dict:
    """Per-repeat round-trip time (mean over workers) and aggregate throughput."""
    rtts, rates, trips = [], [], 0
    for windows in samples:
        rtts.append(statistics.fmean(elapsed / count for count, elapsed in windows))
        total = sum(count for count, _ in windows)
        rates.append(2 * nbytes * total / max(elapsed for _, elapsed in windows) / 1e9)
        trips += total
    return {
        "rtt_us": statistics.median(rtts) * 1e6,
        "gbps": statistics.median(rates),
        "round_trips": trips,
        "rtt_samples_us": [r * 1e6 for r in rtts],
        "gbps_samples": rates,
    }


_SMALL = 64 << 10  # payloads up to this size also get the pipe bound for their round trip


class TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 (``aps bench --tls``), in a
    temporary directory; the worker processes trust the CA."""

    def __init__(self) -> None:
        try:
            import trustme
        except ImportError:
            raise ConfigurationError(
                "aps bench --tls makes a throwaway certificate with trustme: pip install 'aps[bench]'"
            ) from None
        import tempfile

        self.directory = tempfile.mkdtemp(prefix="aps-bench-tls-")
        ca = trustme.CA()
        self.server = os.path.join(self.directory, "server.pem")
        self.ca = os.path.join(self.directory, "ca.pem")
        ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(self.server)
        ca.cert_pem.write_to_path(self.ca)

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)


def measure(
    sizes: list[int],
    worker_counts: list[int],
    seconds: float,
    min_iters: int,
    repeats: int,
    out: str | None,
    transports: Sequence[str] = ("tcp", "shm"),
    tcp_variants: tuple[str, ...] = ("aps",),
) -> dict:
    """Measure every configuration; print the table; write the JSON report to ``out`` (if given).

    ``tcp_variants``: the systems of VARIANTS measured over TCP (shared memory runs "aps")."""
    rows: list[dict] = []
    tls = TlsFiles() if "aps tls" in tcp_variants else None
    try:
        _measure(sizes, worker_counts, seconds, min_iters, repeats, transports, tcp_variants, tls, rows)
    finally:
        if tls is not None:
            tls.close()
    report = {
        "benchmark": "pushpull",
        "command": command_line(),
        **machine_info(),
        "seconds_per_window": seconds,
        "repeats": repeats,
        "rows": rows,
    }
    print()
    print(format_table(rows))
    write_report(report, out)
    if out:
        print(f"\nwrote {out}")
    return report


def _measure(sizes, worker_counts, seconds, min_iters, repeats, transports, tcp_variants, tls, rows) -> None:
    for nbytes in sizes:
        bounds: dict[str, BoundSession | CopyUpdateBound | PipeBound] = {}
        if "tcp" in transports:
            bounds["socket ping-pong"] = BoundSession(nbytes)
        if "shm" in transports:
            bounds["memcpy+update"] = CopyUpdateBound(nbytes)
            bounds["update pass"] = CopyUpdateBound(nbytes, copy=False)
            bounds["update pass shm"] = CopyUpdateBound(nbytes, copy=False, shared=True)
            if nbytes <= _SMALL:
                bounds["pipe ping-pong"] = PipeBound()
        sessions: dict[tuple[str, int, str], ApsSession] = {}
        samples: dict = {key: [] for key in bounds}
        try:
            for transport in transports:
                for workers in worker_counts:
                    for variant in tcp_variants if transport == "tcp" else SHM_VARIANTS:
                        sessions[transport, workers, variant] = ApsSession(nbytes, workers, transport, variant, tls)
                        samples[transport, workers, variant] = []
            for _ in range(repeats):
                for key, bound in bounds.items():
                    samples[key].append(bound.measure(seconds, min_iters))
                for config, session in sessions.items():
                    samples[config].append(session.measure(seconds, min_iters))
        finally:
            for bound in bounds.values():
                bound.close()
            for session in sessions.values():
                session.close()
        summary = {key: summarize(values, nbytes) for key, values in samples.items()}
        for name in bounds:
            kind = "tcp" if name == "socket ping-pong" else "shm"
            rows.append(
                {
                    "system": name,
                    "transport": kind,
                    "payload_bytes": nbytes,
                    "workers": 1,
                    **summary[name],
                    "ratio_throughput": None,
                    "ratio_rtt": None,
                    "ratio_to_tcp": None,
                    "ratio_update_pass": None,
                    "ratio_update_pass_shm": None,
                }
            )
            if name == "pipe ping-pong":
                rows[-1]["gbps"] = rows[-1]["gbps_samples"] = None  # a wake-up bound: its bytes mean nothing
        for (transport, workers, variant), a in ((k, summary[k]) for k in sessions):
            if transport == "tcp":
                throughput_bound = rtt_bound = summary["socket ping-pong"]
            else:
                throughput_bound = summary["memcpy+update"]
                rtt_bound = summary.get("pipe ping-pong", throughput_bound)
            row = {
                "system": variant,
                "transport": transport,
                "payload_bytes": nbytes,
                "workers": workers,
                **a,
                "ratio_throughput": _median_ratio(a["gbps_samples"], throughput_bound["gbps_samples"]),
                "ratio_rtt": _median_ratio(a["rtt_samples_us"], rtt_bound["rtt_samples_us"]),
                "ratio_to_tcp": None,
                "ratio_update_pass": None,
                "ratio_update_pass_shm": None,
            }
            if transport == "shm":  # (the round trip against the update pass alone: zero copy's bound)
                row["ratio_update_pass"] = _median_ratio(a["rtt_samples_us"], summary["update pass"]["rtt_samples_us"])
                row["ratio_update_pass_shm"] = _median_ratio(
                    a["rtt_samples_us"], summary["update pass shm"]["rtt_samples_us"]
                )
            if ("tcp", workers, "aps") in sessions and (transport, variant) != ("tcp", "aps"):
                row["ratio_to_tcp"] = _median_ratio(a["gbps_samples"], summary["tcp", workers, "aps"]["gbps_samples"])
            rows.append(row)
            _print_row(row)


def _median_ratio(values: list[float], bounds: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(values, bounds))


def write_report(report: dict, path: str | None) -> None:
    """Write a benchmark's JSON report to ``path`` (making its directory), when one is given."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)


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
    extra = f", {row['ratio_to_tcp']:.2f}x aps tcp" if row["ratio_to_tcp"] else ""
    if row.get("ratio_update_pass"):
        extra += (
            f", rtt {row['ratio_update_pass']:.2f}x the update pass "
            f"({row['ratio_update_pass_shm']:.2f}x over shared segments)"
        )
    system = "" if row["system"] == "aps" else f" ({row['system']})"
    print(
        f"  {format_size(row['payload_bytes']):>5} {row['transport']}{system} x{row['workers']}: "
        f"{row['gbps']:.2f} GB/s "
        f"({row['ratio_throughput']:.2f} of bound{extra}), rtt {row['rtt_us']:.0f} us ({row['ratio_rtt']:.2f}x bound)",
        flush=True,
    )


def _cell(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'payload':>8} {'system':<17} {'via':<4} {'workers':>7} {'rtt us':>10} {'GB/s':>7} "
        f"{'x bound GB/s':>12} {'x bound rtt':>11} {'x tcp':>6} {'x update':>8} {'x upd shm':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{format_size(row['payload_bytes']):>8} {row['system']:<17} {row['transport']:<4} {row['workers']:>7} "
            f"{row['rtt_us']:>10.1f} {_cell(row['gbps'], '.2f', 7)} {_cell(row['ratio_throughput'], '.2f', 12)} "
            f"{_cell(row['ratio_rtt'], '.2f', 11)} {_cell(row['ratio_to_tcp'], '.1f', 6)} "
            f"{_cell(row.get('ratio_update_pass'), '.2f', 8)} {_cell(row.get('ratio_update_pass_shm'), '.2f', 9)}"
        )
    return "\n".join(lines)
