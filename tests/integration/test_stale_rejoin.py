"""A worker that comes back after a freeze or a network cut under SSP/DSSP: its push in
flight is older than the policy's bound allows, so it is dropped and counted, not applied
(docs/algorithms.md, "The bound across a reconnect"). Real ``aps serve`` processes and real
worker processes; a SIGSTOP freeze over both transports, a 10 s silent cut of the worker's
link between two network namespaces over TCP.

Every gradient is a ledger entry (SGD, lr=1): a worker's ordinary pushes each add -1 to
its own weight, and the push in flight across the freeze adds -1 to a marker weight of its
own, so the final weights say exactly which gradients were applied.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aps.cli.status import fetch_stats
from aps.testing import TOKEN, wait_for

from .test_http import get, http_address

PY = sys.executable
ENV = dict(os.environ)  # (the workers import aps as the tests do: installed, never from the checkout)
P = 3  # workers
THE_ONE = 1  # the rank that is frozen or cut off
HEARTBEAT = 1.5  # the server's --heartbeat-timeout

# argv: address rank workers transport mode marker_dir after
#   mode "steady": push_pull until marker_dir/stop exists.
#   mode "freeze": two steps, then pull, SIGSTOP itself (the test sends SIGCONT), push the
#       gradient computed on those weights, then ``after`` more steps.
#   mode "pause": the same, but instead of freezing it writes marker_dir/ready and waits for
#       marker_dir/go (the test cuts its link in between), so its push goes into a dead link.
# It prints one JSON line: what it saw.
WORKER = r"""
import json, os, signal, sys, time
import numpy as np
import aps

address, rank, workers, transport, mode, marker, after = sys.argv[1:8]
rank, workers, after = int(rank), int(workers), int(after)
numel = 2 * workers  # weight r: rank r's ordinary pushes; weight workers + r: its push across the cut
ordinary = np.zeros(numel, np.float32)
ordinary[rank] = 1.0
across = np.zeros(numel, np.float32)
across[workers + rank] = 1.0
report = {"rank": rank}
with aps.Worker(address, rank, workers, transport=transport, heartbeat=0.3, server_timeout=2.0,
                reconnect_timeout=60) as worker:
    worker.init({"w": np.zeros(numel, np.float32)})
    if mode == "steady":
        pushes = 0
        while not os.path.exists(os.path.join(marker, "stop")):
            worker.push_pull(ordinary)
            pushes += 1
        report["pushes"] = pushes
    else:
        for _ in range(2):
            worker.push_pull(ordinary)
        worker.pull()
        report["clock_before"], report["version_before"] = worker.clock, worker.version
        if mode == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            open(os.path.join(marker, "ready"), "w").close()
            while not os.path.exists(os.path.join(marker, "go")):
                time.sleep(0.01)
        worker.push(across)
        report["dropped"] = worker.last_push_dropped
        report["clock_after"], report["version_after"] = worker.clock, worker.version
        weights = worker.pull()["w"]
        report["version_pulled"] = worker.version
        for _ in range(after):
            weights = worker.push_pull(ordinary)["w"]
            report.setdefault("later_dropped", 0)
            report["later_dropped"] += worker.last_push_dropped
        report["pushes"] = 3 + after
print(json.dumps(report), flush=True)
"""


def start_worker(popen, address: str, rank: int, transport: str, mode: str, marker: Path, after: int = 20):
    return popen([PY, "-c", WORKER, address, str(rank), str(P), transport, mode, str(marker), str(after)],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=ENV)


def report_of(proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker exit {proc.returncode}: {err}"
    return json.loads(out.strip().splitlines()[-1])


def is_stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


def bound(workers: int, s: int) -> int:
    """The most versions an applied gradient can be stale under SSP(s) (DSSP: s = s_U) with
    ``workers`` ranks that only ever reconnect (docs/algorithms.md): (P - 1)(2s + 1)."""
    return (workers - 1) * (2 * s + 1)


def check_the_run(stats: dict, reports: dict[int, dict], s: int) -> None:
    """What the server and the workers say: the push across the freeze was dropped and
    counted as stale (and only it), no applied gradient was staler than the bound, and the
    ledger holds every applied gradient once and the dropped one not at all."""
    one = reports[THE_ONE]
    assert one["dropped"], f"the push in flight across the freeze was applied: {one}"
    assert one["later_dropped"] == 0
    assert one["version_pulled"] >= one["version_after"]  # it goes on from the newest weights
    server, workers = stats["server"], stats["workers"]
    assert server["dropped_stale"] == 1 and server["dropped"] == 1
    worst = 0
    for w in workers:
        assert w["dropped_stale"] == (1 if w["rank"] == THE_ONE else 0), w
        own = max(map(int, w["staleness_hist"]), default=0)
        assert own <= bound(P, s), f"rank {w['rank']} had a gradient applied {own} versions stale"
        assert w["pushes"] == reports[w["rank"]]["pushes"], (w, reports[w["rank"]])
        worst = max(worst, own)
    print(f"the push across the freeze: computed on version {one['version_before']}, dropped at "
          f"{one['version_after']} ({one['version_after'] - one['version_before']} versions later); the stalest "
          f"gradient applied: {worst} versions (bound (P - 1)(2s + 1) = {bound(P, s)})")
    weights = stats["weights"]
    for rank, report in reports.items():
        assert weights[rank] == -(report["pushes"] - (rank == THE_ONE)), (rank, weights)
        assert weights[P + rank] == 0.0, f"rank {rank}'s push across the freeze was applied: {weights}"
    assert server["version"] == sum(r["pushes"] for r in reports.values()) - 1


def final_weights(address: str) -> list[float]:
    """The server's weights now, read by a pull of a fresh worker for a rank that has left."""
    import aps

    with aps.Worker(address, THE_ONE, P, transport="tcp") as worker:
        return worker.init({"w": np.zeros(2 * P, np.float32)})["w"].tolist()


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise KeyError((name, labels))


async def _get(url: str) -> str:
    status, text, _ = await get(url)
    assert status == 200
    return text


SYNCS = {"ssp": ["--sync", "ssp", "--staleness", "2"],
         "dssp": ["--sync", "dssp", "--staleness", "1", "--max-staleness", "2"]}


@pytest.mark.slow
@pytest.mark.parametrize("sync", sorted(SYNCS))
def test_a_push_frozen_across_a_rejoin_is_dropped_not_applied(server_process, transport, sync, tmp_path):
    """Rank 1 is frozen (SIGSTOP) between its pull and its push; the server drops it after
    the heartbeat timeout and the other two train on for a few hundred versions; woken up,
    it reconnects and sends its push again: dropped and counted as stale, not applied
    hundreds of versions stale."""
    s = 2
    server = server_process("--workers", str(P), *SYNCS[sync], "--lr", "1", "--heartbeat-timeout", str(HEARTBEAT),
                            "--http-port", "0")
    http = http_address(server)
    procs = {rank: start_worker(subprocess.Popen, server.address, rank, transport,
                                "freeze" if rank == THE_ONE else "steady", tmp_path)
             for rank in range(P)}
    try:
        frozen = procs[THE_ONE]
        wait_for(lambda: is_stopped(frozen.pid), timeout=60, what="rank 1 to freeze itself")
        server.wait_for_log(f"worker {THE_ONE} timed out", timeout=HEARTBEAT + 20)
        at_leave = fetch_stats(server.address)["server"]["version"]
        wait_for(lambda: fetch_stats(server.address)["server"]["version"] > at_leave + 20 * bound(P, s),
                 timeout=60, what="the others to train on")
        os.kill(frozen.pid, signal.SIGCONT)
        one = report_of(frozen)
        (tmp_path / "stop").touch()
        reports = {rank: report_of(proc) for rank, proc in procs.items() if rank != THE_ONE}
        reports[THE_ONE] = one
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.communicate()
    stats = fetch_stats(server.address)
    stats["weights"] = final_weights(server.address)
    check_the_run(stats, reports, s)
    text = asyncio.run(_get(http + "metrics"))
    assert metric(text, "aps_gradients_not_applied_total", rank=str(THE_ONE), reason="stale") == 1
    assert metric(text, "aps_gradients_not_applied_total", rank="0", reason="stale") == 0
    assert metric(text, "aps_gradients_not_applied_total", rank=str(THE_ONE), reason="closed_round") == 0
    assert "is older than the ssp bound allows" in server.log() or "is older than the dssp bound allows" \
        in server.log()


def cut(host) -> None:
    """Cut ``host``'s link silently: its port on the bridge goes down, so packets either way are
    lost without a reset (a cable pulled out)."""
    subprocess.run(["ip", "-n", host.network.bridge_netns, "link", "set", "dev", host.bridge_port, "down"],
                   check=True, timeout=10)


def heal(host) -> None:
    subprocess.run(["ip", "-n", host.network.bridge_netns, "link", "set", "dev", host.bridge_port, "up"],
                   check=True, timeout=10)


def status_json(host, address: str, env: dict) -> dict:
    done = host.run([PY, "-m", "aps", "status", "--json", address], env=env, timeout=20)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_a_push_sent_into_a_10s_cut_is_dropped_not_applied(network, tmp_path):
    """The issue's reproduction: SSP s=2, rank 1's link to the server is cut silently for 10 s
    just as it sends a push; the server drops it after the heartbeat timeout, the others train
    on; the link comes back, the worker reconnects and sends the push again: dropped and
    counted, not applied thousands of versions stale."""
    s = 2
    server_host, near, far = network.add_host("ps"), network.add_host("near"), network.add_host("far")
    token = {"APS_TOKEN": TOKEN}
    server = server_host.serve("--workers", str(P), "--sync", "ssp", "--staleness", str(s), "--lr", "1",
                               "--heartbeat-timeout", str(HEARTBEAT), env=token)
    env = {**ENV, **token}

    def popen(argv, **kwargs):
        kwargs["env"] = env
        return (far if THE_ONE in popen.rank else near).popen(argv, **kwargs)

    procs = {}
    for rank in range(P):
        popen.rank = {rank}
        procs[rank] = start_worker(popen, server.address, rank, "tcp", "pause" if rank == THE_ONE else "steady",
                                   tmp_path)
    wait_for(lambda: (tmp_path / "ready").exists(), timeout=60, what="rank 1 to be ready")
    cut(far)
    started = time.monotonic()
    (tmp_path / "go").touch()  # its push goes into the dead link
    server.wait_for_log(f"worker {THE_ONE} timed out", timeout=HEARTBEAT + 20)
    while time.monotonic() - started < 10.0:
        time.sleep(0.1)
    heal(far)
    one = report_of(procs[THE_ONE], timeout=90)
    (tmp_path / "stop").touch()
    reports = {rank: report_of(proc) for rank, proc in procs.items() if rank != THE_ONE}
    reports[THE_ONE] = one
    stats = status_json(near, server.address, env)
    done = near.run([PY, "-c", "import json, sys, numpy as np, aps\n"
                     f"with aps.Worker(sys.argv[1], {THE_ONE}, {P}, transport='tcp') as w:\n"
                     f"    print(json.dumps(w.init({{'w': np.zeros({2 * P}, np.float32)}})['w'].tolist()))",
                     server.address], env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    stats["weights"] = json.loads(done.stdout)
    check_the_run(stats, reports, s)
