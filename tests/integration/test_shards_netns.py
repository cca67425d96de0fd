"""A sharded model across separate hosts (network namespaces, aps/testing/netns.py): real
``aps serve --shard I --shards K`` processes on their own hosts, real worker processes
(tests/scripts/shard_worker.py) on others, over TCP.

- BSP across two shards equals the same run against one unsharded server, exactly;
- a shard killed under SSP: the workers get an error naming it within seconds,
  and with checkpoints, a shard restarted with ``--resume`` on the same host and
  port lets the workers (reconnecting by themselves) finish, its version going
  on from its checkpoint;
- every link limited to 1 Gbit/s: a sharded run completes, no faster than the links.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from aps.checkpoint import list_checkpoints, read_checkpoint
from aps.layout import Layout, shard_bounds

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "scripts" / "shard_worker.py")
TOKEN = {"APS_TOKEN": "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"}
ENV = {**os.environ, **TOKEN}

_spec = importlib.util.spec_from_file_location("shard_worker", SCRIPT)
shard_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shard_worker)
LAYOUT = Layout.from_arrays(shard_worker.initial())


class WorkerProcess:
    """One shard_worker.py process in a host; its stdout lines are collected as they come."""

    def __init__(self, host, addresses: list[str], rank: int, world: int, steps: int, *options: str,
                 log_dir: Path) -> None:
        self.rank = rank
        self.stderr_path = log_dir / f"worker-{host.name}-{rank}-{time.monotonic_ns()}.log"
        self._stderr = open(self.stderr_path, "w")
        argv = [PY, SCRIPT, ",".join(addresses), str(rank), str(world), str(steps), *options]
        self.proc = host.popen(argv, stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL,
                               text=True, env=ENV)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.strip())
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def steps_done(self) -> int:
        return sum(line.startswith("step ") for line in self.lines)

    def wait_steps(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.steps_done < count:
                left = deadline - time.monotonic()
                if left <= 0 or (not self._reader.is_alive() and self.steps_done < count):
                    raise AssertionError(f"rank {self.rank}: {self.steps_done} of {count} steps after {timeout} s"
                                         f"\n{self.lines[-3:]}\n{self.stderr()}")
                self._changed.wait(min(left, 0.2))

    def result(self, timeout: float) -> dict:
        """The final JSON line (after the process exited within ``timeout`` seconds)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {self.rank} still running after {timeout} s\n{self.stderr()}") from None
        self._reader.join(10)
        self._stderr.close()
        assert self.lines and self.lines[-1].startswith("{"), (self.proc.returncode, self.lines[-3:], self.stderr())
        out = json.loads(self.lines[-1])
        out["returncode"] = self.proc.returncode
        return out

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""


def start_workers(hosts, addresses: list[str], world: int, steps: int, *options: str, log_dir: Path):
    """``world`` workers spread round-robin over ``hosts``."""
    return [WorkerProcess(hosts[rank % len(hosts)], addresses, rank, world, steps, *options, log_dir=log_dir)
            for rank in range(world)]


def serve_shards(hosts, *options: str) -> list:
    count = len(hosts)
    return [host.serve("--shard", str(index), "--shards", str(count), *options, env=TOKEN)
            for index, host in enumerate(hosts)]


def stats(host, address: str) -> dict:
    """``aps status --json`` of a server, run inside ``host`` (the servers are reachable only there)."""
    done = host.run([PY, "-m", "aps", "status", "--json", address], env=ENV, timeout=20)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_model_spans_the_shard_boundary():
    cut = shard_bounds(LAYOUT.numel, 2)[1]
    ends = np.cumsum([int(np.prod(shape)) for shape in shard_worker.SHAPES.values()])
    assert cut not in ends and 0 < cut < LAYOUT.numel  # a tensor is cut in two
    assert any("[" in name for name in LAYOUT.shard(1, 2).names), LAYOUT.shard(1, 2).names  # a piece of one
    assert 1000 <= LAYOUT.numel <= 10000


def test_sharded_bsp_across_hosts_equals_one_server(network, tmp_path):
    shard_hosts = [network.add_host(f"ps{i}") for i in range(2)]
    lone_host = network.add_host("ps")
    worker_hosts = [network.add_host(f"w{i}") for i in range(2)]
    options = ("--workers", "3", "--sync", "bsp", "--lr", "0.5", "--momentum", "0.5")
    shards = serve_shards(shard_hosts, *options)
    lone = lone_host.serve(*options, env=TOKEN)
    steps = 6
    sharded_run = start_workers(worker_hosts, [s.address for s in shards], 3, steps, log_dir=tmp_path)
    lone_run = start_workers(worker_hosts, [lone.address], 3, steps, log_dir=tmp_path)
    sharded = [w.result(60) for w in sharded_run]
    reference = [w.result(60) for w in lone_run]
    for out in (*sharded, *reference):
        assert out["returncode"] == 0 and "error" not in out, out
    assert [out["shard_versions"] for out in sharded] == [[steps, steps]] * 3
    assert [out["version"] for out in reference] == [steps] * 3
    start = shard_worker.initial()
    for name in LAYOUT.names:
        expected = np.asarray(reference[0]["weights"][name], np.float32)
        assert not np.array_equal(expected, start[name].ravel()), name
        for out in (*sharded, *reference):  # every worker holds the same weights after the last BSP round
            assert np.array_equal(np.asarray(out["weights"][name], np.float32), expected), (name, out["rank"])
    for server in (*shards, lone):
        assert server.alive()
        log = server.log()
        assert "all 3 workers joined" in log and "198.18.0." in log, log


@pytest.mark.slow  # (a shard killed and restarted across namespaces: about 18 s beside the suite)
def test_a_killed_shard_then_a_restarted_one(network, tmp_path):
    """Under SSP: a shard SIGKILLed fails the workers with an error naming it (no reconnecting);
    then, with checkpoints, a shard SIGKILLed and restarted with --resume on the same host
    and port lets reconnecting workers finish, its version going on from its checkpoint."""
    shard_hosts = [network.add_host(f"ps{i}") for i in range(2)]
    worker_hosts = [network.add_host(f"w{i}") for i in range(2)]
    ssp = ("--workers", "3", "--sync", "ssp", "--staleness", "2", "--lr", "0.01")

    # Part 1: no reconnecting -> a clear error, in bounded time, on every worker.
    shards = serve_shards(shard_hosts, *ssp)
    addresses = [s.address for s in shards]
    workers = start_workers(worker_hosts, addresses, 3, 100_000, "--sleep", "0.01", "--progress",
                            "--no-reconnect", "--server-timeout", "3", log_dir=tmp_path)
    for worker in workers:
        worker.wait_steps(5, timeout=30)
    killed_at = time.time()
    os.kill(shards[1].proc.pid, signal.SIGKILL)
    for worker in workers:
        out = worker.result(timeout=15)
        assert out["returncode"] == 3 and out["error"] in ("APSConnectionError", "ServerSilent"), out
        assert shards[1].address in out["message"], out  # names the server that went away
        assert shards[0].address not in out["message"], out
        assert out["at"] - killed_at < 5.0, out
    assert shards[1].proc.wait(5) == -signal.SIGKILL
    assert shards[0].alive()
    shards[0].stop()

    # Part 2: checkpoints every second; kill shard 1, restart it with --resume on the same port.
    dirs = [tmp_path / f"ckpt{i}" for i in range(2)]
    durable = ("--checkpoint-every", "1")
    shards = [host.serve("--shard", str(i), "--shards", "2", *ssp, *durable, "--checkpoint-dir", str(dirs[i]),
                         env=TOKEN) for i, host in enumerate(shard_hosts)]
    addresses = [s.address for s in shards]
    steps = 120
    workers = start_workers(worker_hosts, addresses, 3, steps, "--sleep", "0.02", "--progress",
                            "--server-timeout", "10", "--reconnect-timeout", "30", log_dir=tmp_path)
    for worker in workers:
        worker.wait_steps(10, timeout=30)
    # a checkpoint now (not waiting for the timer: the workers must still be training at the kill)
    done = worker_hosts[0].run([PY, "-m", "aps", "checkpoint", "now", shards[1].address], env=ENV, timeout=30)
    assert done.returncode == 0, done.stderr
    assert any(read_checkpoint(path).version > 0 for path in list_checkpoints(dirs[1]))
    assert all(worker.proc.poll() is None for worker in workers), "the workers finished before the kill"
    os.kill(shards[1].proc.pid, signal.SIGKILL)
    assert shards[1].proc.wait(5) == -signal.SIGKILL
    newest_before = read_checkpoint(list_checkpoints(dirs[1])[0]).version  # newest first
    restarted = shard_hosts[1].serve("--port", str(shards[1].port), "--shard", "1", "--shards", "2", *ssp, *durable,
                                     "--checkpoint-dir", str(dirs[1]), "--resume", env=TOKEN)
    assert restarted.address == shards[1].address
    log = restarted.wait_for_log("resumed from", timeout=10)
    resumed_version = int(re.search(r"resumed from \S+: version (\d+)", log).group(1))
    assert resumed_version == newest_before > 0
    results = [worker.result(timeout=60) for worker in workers]
    for out in results:
        assert out["returncode"] == 0 and "error" not in out, (out, workers[out["rank"]].stderr())
    for worker in workers:
        assert "lost the server at " + restarted.address in worker.stderr(), worker.stderr()
    final = [stats(worker_hosts[0], address) for address in addresses]
    assert final[1]["server"]["resumed_from"] and final[1]["server"]["version"] > resumed_version, final[1]["server"]
    assert final[0]["server"]["version"] == 3 * steps  # SSP applies each push: shard 0 missed none
    # the shard went on from its checkpoint: the updates it made after that were lost
    assert final[1]["server"]["version"] <= final[0]["server"]["version"]
    # the worker that pushed last to each shard holds that shard's final weights in its one flat buffer
    bounds = shard_bounds(LAYOUT.numel, 2)
    restarted.stop()  # a clean shutdown writes a checkpoint of the final weights
    shards[0].stop()
    for index in range(2):
        newest = read_checkpoint(list_checkpoints(dirs[index])[0])  # newest first
        assert newest.version == final[index]["server"]["version"]
        last = [out for out in results if out["shard_versions"][index] == newest.version]
        assert last, ([out["shard_versions"] for out in results], newest.version)
        flat = np.concatenate([np.asarray(last[0]["weights"][name], np.float32) for name in LAYOUT.names])
        lo, hi = bounds[index], bounds[index + 1]
        assert np.array_equal(flat[lo:hi], newest.flat_weights()), index


@pytest.mark.slow  # (shards and workers on namespaced hosts over shaped links: about 10 s)
def test_sharded_run_on_1_gbit_links(network, tmp_path):
    """Every host's link at 1 Gbit/s: a 4 MiB model on two shards, two workers (ASP) finish,
    and no worker moved its gradients faster than its link allows."""
    from aps.testing.netns import require_netns

    require_netns(shaping=True)
    rate_mbit = 1000
    shard_hosts = [network.add_host(f"ps{i}", rate_mbit=rate_mbit) for i in range(2)]
    worker_hosts = [network.add_host(f"w{i}", rate_mbit=rate_mbit) for i in range(2)]
    for host in (*shard_hosts, *worker_hosts):
        assert all("rate 1Gbit" in qdisc for qdisc in host.qdiscs().values())
    shards = serve_shards(shard_hosts, "--workers", "2", "--sync", "asp", "--lr", "0.01")
    numel, steps = 1 << 20, 30
    workers = start_workers(worker_hosts, [s.address for s in shards], 2, steps, "--numel", str(numel),
                            log_dir=tmp_path)
    results = [worker.result(timeout=60) for worker in workers]
    for out in results:
        assert out["returncode"] == 0 and "error" not in out, out
        assert out["nbytes"] == 4 * numel
    final = [stats(worker_hosts[0], s.address)["server"] for s in shards]
    assert [f["version"] for f in final] == [2 * steps, 2 * steps]  # ASP applied every push on each shard
    bounds = shard_bounds(numel, 2)
    for index, f in enumerate(final):  # each shard got its range of every gradient and sent it back
        assert f["bytes_in"] >= 2 * steps * 4 * (bounds[index + 1] - bounds[index])
    link_bytes_per_s = rate_mbit * 1e6 / 8
    for out in results:
        # every step sends the whole model up this worker's link and takes it back down
        up = out["steps"] * out["nbytes"] / out["seconds"]
        print(f"\nrank {out['rank']}: {up / 1e6:.1f} MB/s each way ({up / link_bytes_per_s:.2f} of the link)")
        assert up <= 1.05 * link_bytes_per_s, (up, link_bytes_per_s)
        assert up >= 0.05 * link_bytes_per_s, (up, link_bytes_per_s)  # and it did move
