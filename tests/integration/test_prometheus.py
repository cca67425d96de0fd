"""A real Prometheus (Debian's ``prometheus``) scrapes a real ``aps serve`` every half second
while a real worker trains; the server is killed with SIGKILL and resumed from its checkpoint.
Prometheus's own ``increase()`` over the run must then count the updates applied, no more
(a counter that went back to the checkpoint's version would be read as a reset and the
resumed updates counted twice), and ``aps_version`` must say the run's version.

Skipped, saying why, without the ``prometheus`` binary (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from aps.cli.status import fetch_stats
from aps.server.http import METRICS_MAX_AGE_S, SNAPSHOT_MAX_AGE_S
from aps.wire.tokens import token_path
from aps.testing import workers as _workers

from aps.testing import SPAWN, ServerProcess, wait_for

PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 0.5

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    """``prometheus`` on loopback scraping ``target`` every SCRAPE_S, its storage in ``directory``."""

    def __init__(self, directory, target: str, credentials_file: str | None = None) -> None:
        self.port = free_port()
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {int(SCRAPE_S * 1000)}ms\n"
            f"  scrape_timeout: {int(SCRAPE_S * 800)}ms\n"
            "scrape_configs:\n"
            "  - job_name: aps\n"
            # (a loopback server's own token: Prometheus reads the file at every scrape, so a
            # server restarted on the port with a new one is scraped on)
            + (f"    authorization:\n      credentials_file: {credentials_file}\n" if credentials_file else "")
            + "    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        self.log = open(directory / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_for(self._ready, 30, "Prometheus to be ready", every=0.1)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """The result of an instant query (``at``: its evaluation time, Unix seconds)."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        url = f"http://127.0.0.1:{self.port}/api/v1/query?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def samples(self, selector: str) -> list[tuple[float, float]]:
        """The raw samples of one series: ``[(unix time, value)]``, oldest first."""
        series = self.query(f"{selector}[1h]")
        assert len(series) == 1, series
        return [(float(t), float(v)) for t, v in series[0]["values"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def test_a_real_prometheus_counts_the_updates_of_a_killed_and_resumed_run_once(tmp_path):
    if PROMETHEUS is None:
        pytest.skip("Prometheus is not installed (apt-get install prometheus)")
    port, http_port = free_port(), free_port()
    serve = ("--port", str(port), "--http-port", str(http_port), "--workers", "1", "--sync", "asp",
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "0.5")
    server = ServerProcess(*serve)
    prometheus = worker = None
    stop_path = str(tmp_path / "stop")
    try:
        prometheus = Prometheus(tmp_path, f"127.0.0.1:{http_port}", token_path("127.0.0.1", port))
        wait_for(lambda: prometheus.query("aps_updates_total"), 15, "a first scrape (before training)", every=0.1)
        worker = SPAWN.Process(target=_workers.resilient_worker, daemon=True,
                               args=(server.address, 0, 1, 64, 10**9, 0.002, "tcp", stop_path))
        worker.start()
        wait_for(lambda: fetch_stats(server.address)["server"]["checkpoint"] is not None
                 and fetch_stats(server.address)["server"]["version"] > 300, 30, "training and a checkpoint")
        # (on a loaded machine all of them may come between two scrapes: let one see the training)
        wait_for(lambda: any(v > 0 for _, v in prometheus.samples("aps_updates_total")), 15,
                 "a scrape of the first process while it trains", every=0.1)
        # Hold the worker a moment, so that the killed process's last version is known exactly;
        # the kill still lands at any point of Prometheus's scrape interval.
        os.kill(worker.pid, signal.SIGSTOP)
        time.sleep(0.2)
        killed_at = fetch_stats(server.address)["server"]["version"]
        server.proc.kill()
        server.proc.wait()
        server.stop()
        server = ServerProcess(*serve, "--resume")
        resumed = int(wait_for(lambda: re.search(r"resumed from \S+: version (\d+)", server.log()), 10,
                               "the resume in the log").group(1))
        # The worker goes on once Prometheus has scraped the new process before its first update,
        # so that the new process's count starts below the old one's (a reset Prometheus can see),
        # however long the machine's load makes the scrapes wait.
        wait_for(lambda: len({v for _, v in prometheus.samples("aps_server_start_time_seconds")}) == 2, 15,
                 "a scrape of the resumed process", every=0.1)
        os.kill(worker.pid, signal.SIGCONT)
        assert 0 < resumed <= killed_at
        wait_for(lambda: fetch_stats(server.address)["server"]["version"] > resumed + 300, 30, "training again")
        open(stop_path, "w").close()
        worker.join(30)
        assert worker.exitcode == 0
        final = fetch_stats(server.address)["server"]
        # (the worker's goodbye: nothing moves now) let Prometheus scrape the final figures twice:
        # /metrics serves one exposition for a second, made from a statistics snapshot up to half a
        # second old, so a scrape is sure to see them only once both have passed
        first_final = time.time() + METRICS_MAX_AGE_S + SNAPSHOT_MAX_AGE_S
        wait_for(lambda: sum(t > first_final for t, _ in prometheus.samples("aps_updates_total")) >= 2, 15,
                 "two scrapes of the final figures", every=0.2)

        updates = prometheus.samples("aps_updates_total")
        starts = dict(prometheus.samples("aps_server_start_time_seconds"))
        processes = sorted(set(starts.values()))
        assert len(processes) == 2, processes  # two server processes were scraped
        first = [v for t, v in updates if starts.get(t) == processes[0]]
        second = [v for t, v in updates if starts.get(t) == processes[1]]
        assert first[0] == 0 and first == sorted(first) and second == sorted(second)  # never backwards within one
        assert second[-1] == final["version"] - resumed == final["counters"]["updates"]
        assert second[0] <= final["version"] - resumed

        # What the run applied: the killed process's updates, then the resumed one's.
        applied = killed_at + (final["version"] - resumed)
        # Prometheus cannot see the killed process's updates after its last scrape (how many
        # depends on the machine's load: one scrape interval's worth on a quiet one), and it
        # never counts more than were made.
        unseen = killed_at - first[-1]
        assert 0 <= unseen < killed_at, (unseen, first)
        # increase() over the whole run, at the last sample: the first sample is 0 and the window
        # ends on a sample, so Prometheus extrapolates nothing: the counts themselves.
        t_first, t_last = updates[0][0], updates[-1][0]
        window_ms = int((t_last - t_first) * 1000) + 100
        counted = float(prometheus.query(f"increase(aps_updates_total[{window_ms}ms])", at=t_last)[0]["value"][1])
        assert counted == pytest.approx(applied - unseen, abs=1e-6), (counted, applied, unseen)
        resets = float(prometheus.query(f"resets(aps_updates_total[{window_ms}ms])", at=t_last)[0]["value"][1])
        assert resets == 1  # the new process: counted from 0, not a drop to the checkpoint's version

        # The version is the run's: a gauge, the checkpoint's version and on after the resume.
        versions = prometheus.samples("aps_version")
        assert versions[-1][1] == final["version"]
        assert all(v >= resumed for t, v in versions if starts.get(t) == processes[1])
        assert max(v for t, v in versions if starts.get(t) == processes[0]) == first[-1]

        # Every counter of each process only goes up, and the resumed one's start from 0.
        for series in prometheus.query('{__name__=~"aps_.*_total"}[1h]'):
            name = series["metric"]["__name__"]
            for process in processes:
                values = [float(v) for t, v in series["values"] if starts.get(float(t)) == process]
                assert values == sorted(values), (name, series["metric"], values)
        assert "Traceback" not in server.log()
    finally:
        if worker is not None and worker.is_alive():
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()
            worker.join(10)
        if prometheus is not None:
            prometheus.stop()
        server.stop()
