#!/usr/bin/env python
"""Aggregate push_pull throughput of a model sharded over 1, 2 and 4 servers, every link at 1 Gbit/s.

Separate hosts are network namespaces (aps/testing/netns.py), each host's link limited
to ``--rate-mbit`` in each direction by tbf. The servers (``aps serve --shard I
--shards K``, ASP, plain SGD: every push is applied) run on hosts ``ps0..ps3``
(shard I on ``psI``), and four workers, one process per host on ``w0..w3``, run
a push_pull loop of the whole model over TCP. Every configuration (1, 2 and 4
shards) is started once, with its own servers and workers, and measured in
timed windows interleaved across repeats (1 2 4, 4 2 1, ...): in a window the
four workers of one configuration run from a common start to a common end
while the others are idle.

A worker's rate is from its first to its last push_pull that completed inside
the window (every worker runs throughout, so each of those steps ran under the
full load), as payload bytes pushed + pulled per second; the aggregate is their
sum, and a configuration's figure is the median over its windows. Each window
also records the CPU time of the servers and workers (as cores busy), the
machine's CPU use (busy and softirq), the bytes each link carried (tbf
counters), and, sampled every 50 ms, how much of the servers' and the workers'
links was busy in each direction and in both at once: to tell a link-bound
window from a CPU-bound one, and links used both ways at once from links used
one way at a time.

Needs root, iproute2 and tc. Example:
``python bench/shards.py --out bench/results/shards.json``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import select
import statistics
import subprocess
import sys
import threading
import time


import numpy as np

from aps.cli._args import ArgumentParser, format_size, int_list, parse_size
from aps.lab.bench import machine_info, write_report

TOKEN = "shards bench token"
WORKERS = 4
SERVER_OPTIONS = ("--workers", str(WORKERS), "--sync", "asp", "--optimizer", "sgd", "--lr", "0.01",
                  "--momentum", "0", "--log-level", "warning")


# The worker process (``--agent``) --------------------------------------------------------------
def agent(argv: list[str]) -> int:
    """One worker: joins, says ``ready``, then for each ``window START END`` line on stdin
    runs push_pull from START until END (wall clock) and prints one JSON line: the times
    its steps completed and its CPU time over the window."""
    import aps

    addresses, rank, workers, numel = argv[0].split(","), int(argv[1]), int(argv[2]), int(argv[3])
    compression = argv[4] if len(argv) > 4 else "none"  # none, bf16, bf16+pulls (fp16 likewise)
    name = compression.split("+")[0]
    worker = aps.Worker(addresses if len(addresses) > 1 else addresses[0], rank, workers, transport="tcp",
                        compression=None if name == "none" else name, compress_pulls=compression.endswith("+pulls"))
    with worker:
        worker.init({"w": np.zeros(numel, np.float32)})
        grad = worker.flat_grad
        grad.fill(1 / 1024)  # small: the weights stay finite over any run
        print("ready", worker.transport, flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] != "window":
                break
            start, end = float(words[1]), float(words[2])
            time.sleep(max(0.0, start - time.time()))
            cpu0, t0 = time.process_time(), time.time()
            done = []
            while time.time() < end:
                worker.push_pull(grad)
                done.append(time.time())
            print(json.dumps({"rank": rank, "start": t0, "completed": done, "cpu_s": time.process_time() - cpu0,
                              "version": worker.version}), flush=True)
    return 0


# Measuring -------------------------------------------------------------------------------------
def read_line(proc: subprocess.Popen, timeout: float) -> str:
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise RuntimeError(f"no answer in {timeout} s from {proc.args[-4:]}")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{proc.args[-4:]} exited with {proc.wait(10)}")
    return line.strip()


_SENT = re.compile(r"qdisc tbf \S+: (?:dev (\S+) )?root.*?\n\s*Sent (\d+) bytes \d+ pkt \(dropped (\d+), "
                   r"overlimits (\d+)", re.S)


def tbf_counters(network) -> dict[str, dict[str, int]]:
    """Bytes sent (and drops) by every tbf qdisc: ``up`` (a host's egress) and ``down``
    (the bridge's egress towards the host), per host name."""
    out: dict[str, dict[str, int]] = {}
    ports = {host.bridge_port: host.name for host in network.hosts}
    text = subprocess.run(["tc", "-s", "-n", network.bridge_netns, "qdisc", "show"], capture_output=True, text=True,
                          timeout=10, check=True).stdout
    for dev, sent, dropped, _ in _SENT.findall(text):
        if dev in ports:
            out.setdefault(ports[dev], {})["down"] = int(sent)
            out[ports[dev]]["down_dropped"] = int(dropped)
    for host in network.hosts:
        text = subprocess.run(["tc", "-s", "-n", host.netns, "qdisc", "show", "dev", host.interface],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        for _, sent, dropped, _ in _SENT.findall(text):
            out.setdefault(host.name, {})["up"] = int(sent)
            out[host.name]["up_dropped"] = int(dropped)
    return out


def eth0_bytes(pid: int) -> tuple[int, int]:
    """(received, sent) bytes of eth0 in the network namespace of process ``pid``."""
    with open(f"/proc/{pid}/net/dev") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise RuntimeError(f"no eth0 in the namespace of pid {pid}")


class PhaseSampler(threading.Thread):
    """Samples the eth0 byte counters of one process per host every ``interval`` seconds
    from ``start`` to ``end``: how each direction of the links was used over time."""

    def __init__(self, pids: list[int], start: float, end: float, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pids, self.start_at, self.end, self.interval = pids, start, end, interval
        self.samples: list[tuple[float, int, int]] = []

    def run(self) -> None:
        time.sleep(max(0.0, self.start_at - time.time()))
        next_at = time.monotonic()
        while time.time() <= self.end:
            rx = tx = 0
            for pid in self.pids:
                r, t = eth0_bytes(pid)
                rx, tx = rx + r, tx + t
            self.samples.append((time.monotonic(), rx, tx))
            next_at += self.interval
            time.sleep(max(0.0, next_at - time.monotonic()))

    def summary(self, capacity: float) -> dict:
        """Per interval, the fraction of ``capacity`` (bytes/s, all the hosts' links one way)
        received (``in``) and sent (``out``): their means, the mean of the smaller of the two
        (the part of the time both directions were busy at once) and their correlation
        (near -1: one direction at a time)."""
        s = np.array(self.samples, dtype=np.float64)
        if len(s) < 3:
            return {}
        dt = np.diff(s[:, 0])
        rx, tx = np.diff(s[:, 1]) / dt / capacity, np.diff(s[:, 2]) / dt / capacity
        both = np.minimum(rx, tx)
        corr = float(np.corrcoef(rx, tx)[0, 1]) if rx.std() > 0 and tx.std() > 0 else None
        return {"in": float(rx.mean()), "out": float(tx.mean()), "both_at_once": float(both.mean()),
                "correlation": corr, "in_p90": float(np.percentile(rx, 90)), "out_p90": float(np.percentile(tx, 90)),
                "intervals": len(dt), "interval_s": float(dt.mean())}


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


class Config:
    """The servers and the four workers of one shard count, started in ``network``; the
    workers' ``compression``: ``none``, ``bf16`` (pushes) or ``bf16+pulls`` (fp16 likewise)."""

    def __init__(self, shards: int, server_hosts, worker_hosts, numel: int, compression: str = "none") -> None:
        self.shards = shards
        self.compression = compression
        env = {"APS_TOKEN": TOKEN}
        self.servers = [server_hosts[i].serve("--shard", str(i), "--shards", str(shards), *SERVER_OPTIONS, env=env)
                        for i in range(shards)]
        addresses = ",".join(server.address for server in self.servers)
        script = os.path.abspath(__file__)
        self.workers = [
            host.popen([sys.executable, script, "--agent", addresses, str(rank), str(WORKERS), str(numel),
                        compression],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
            for rank, host in enumerate(worker_hosts)
        ]
        for proc in self.workers:
            line = read_line(proc, 120)
            if line != "ready tcp":
                raise RuntimeError(f"a worker of {shards} shard(s) said {line!r}")

    @property
    def server_pids(self) -> list[int]:
        return [server.proc.pid for server in self.servers]

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self.workers]

    def window(self, network, seconds: float, payload: int) -> dict:
        import psutil

        start = time.time() + 0.5
        end = start + seconds
        for proc in self.workers:
            proc.stdin.write(f"window {start!r} {end!r}\n")
            proc.stdin.flush()
        links0 = tbf_counters(network)
        server_phases = PhaseSampler(self.server_pids, start + 0.5, end)
        worker_phases = PhaseSampler(self.worker_pids, start + 0.5, end)
        server_phases.start()
        worker_phases.start()
        time.sleep(max(0.0, start - time.time()))
        sys0, servers0, workers0, t0 = (psutil.cpu_times(), cpu_seconds(self.server_pids),
                                        cpu_seconds(self.worker_pids), time.monotonic())
        time.sleep(max(0.0, end - time.time()))
        sys1, servers1, workers1, t1 = (psutil.cpu_times(), cpu_seconds(self.server_pids),
                                        cpu_seconds(self.worker_pids), time.monotonic())
        links1 = tbf_counters(network)
        reports = [json.loads(read_line(proc, 120)) for proc in self.workers]
        server_phases.join(10)
        worker_phases.join(10)
        link = network.hosts[0].rate_mbit * 1e6 / 8
        elapsed = t1 - t0
        per_worker = []
        for report in reports:
            done = [t for t in report["completed"] if t <= end]
            steady = None
            if len(done) >= 2:
                steady = (len(done) - 1) * 2 * payload / (done[-1] - done[0])
            per_worker.append({"rank": report["rank"], "steps_in_window": len(done), "steady_bytes_per_s": steady,
                               "window_bytes_per_s": len(done) * 2 * payload / seconds,
                               "cpu_cores": report["cpu_s"] / max(time.time() - report["start"], 1e-9)})
        complete = all(w["steady_bytes_per_s"] is not None for w in per_worker)
        aggregate = sum(w["steady_bytes_per_s"] for w in per_worker) if complete else None
        delta = {name: getattr(sys1, name) - getattr(sys0, name) for name in sys0._fields}
        total = sum(delta.values()) or 1e-9
        cpus = psutil.cpu_count() or 1
        links = {}
        link_seconds = seconds  # the tbf counters span the window and the steps that ended after it
        for name in links1:
            up = links1[name].get("up", 0) - links0.get(name, {}).get("up", 0)
            down = links1[name].get("down", 0) - links0.get(name, {}).get("down", 0)
            links[name] = {"up_bytes": up, "down_bytes": down,
                           "dropped": (links1[name].get("up_dropped", 0) - links0.get(name, {}).get("up_dropped", 0)
                                       + links1[name].get("down_dropped", 0)
                                       - links0.get(name, {}).get("down_dropped", 0))}
        return {
            "shards": self.shards,
            "compression": self.compression,
            "seconds": seconds,
            "aggregate_bytes_per_s": aggregate,
            "aggregate_window_bytes_per_s": sum(w["window_bytes_per_s"] for w in per_worker),
            "round_trips_per_s": None if aggregate is None else aggregate / (2 * payload),
            "workers": per_worker,
            "cpu": {
                "servers_cores": (servers1 - servers0) / elapsed,
                "workers_cores": (workers1 - workers0) / elapsed,
                "machine_busy_cores": (1 - (delta["idle"] + delta.get("iowait", 0)) / total) * cpus,
                "machine_softirq_cores": delta.get("softirq", 0) / total * cpus,
                "machine_system_cores": delta.get("system", 0) / total * cpus,
                "steal_cores": delta.get("steal", 0) / total * cpus,
                "cpus": cpus,
            },
            "links": links,
            "link_seconds": link_seconds,
            "phases": {"servers": server_phases.summary(self.shards * link),
                       "workers": worker_phases.summary(len(self.workers) * link)},
        }

    def close(self) -> None:
        for proc in self.workers:
            try:
                proc.stdin.write("stop\n")
                proc.stdin.flush()
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.workers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for server in self.servers:
            server.stop()


def _phase(summary: dict) -> str:
    if not summary:
        return "-"
    corr = summary["correlation"]
    return (f"{summary['in']:.2f}/{summary['out']:.2f}/{summary['both_at_once']:.2f} "
            f"(corr {'-' if corr is None else f'{corr:+.2f}'})")


def link_bound(shards: int, link_bytes_per_s: float, workers: int = WORKERS) -> dict:
    """Aggregate push + pull bytes/s the links allow with ``shards`` servers and ``workers``
    workers, each on its own link: pushes cross the workers' uplinks and the servers'
    downlinks, pulls the reverse, so min(shards, workers) links carry each direction.
    ``both_ways_at_once``: every link busy in both directions all the time;
    ``one_way_at_a_time``: every worker pushing at the same time, then pulling (each link
    used in one direction at a time), half of that."""
    each_way = min(shards, workers) * link_bytes_per_s
    return {"both_ways_at_once_bytes_per_s": 2 * each_way, "one_way_at_a_time_bytes_per_s": each_way}


def finish(report: dict, medians: dict, out: str | None) -> int:
    """Print a report's ratios and the configurations' medians (MB/s), and write it to ``out``."""
    print(json.dumps({"ratios": report["ratios"], "ratios_per_repeat": report["ratios_per_repeat"],
                      "medians_MB_per_s": {k: None if v is None else round(v / 1e6, 1) for k, v in medians.items()}},
                     indent=2))
    write_report(report, out)
    return 0


def report_head(name: str, argv: list[str], args, payload: int, started: float) -> dict:
    """What every report of a benchmark over these hosts begins with: the command, the
    machine, the links and the windows."""
    from aps.testing.netns import kernel_hz, tbf_params

    return {
        "benchmark": name,
        "command": " ".join(["python", f"bench/{name}.py", *argv]),
        **machine_info(),
        "kernel": platform.release(),
        "kernel_hz": kernel_hz(),
        "link_mbit": args.rate_mbit,
        "tbf": tbf_params(args.rate_mbit),
        "model_bytes": payload,
        "model": format_size(payload),
        "workers": WORKERS,
        "server_options": list(SERVER_OPTIONS),
        "seconds_per_window": args.seconds,
        "repeats": args.repeats,
        "wall_seconds": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--agent":
        return agent(argv[1:])
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=parse_size, default=64 << 20, help="model size (default 64M)")
    parser.add_argument("--shards", type=int_list, default=[1, 2, 4], help="shard counts (default 1,2,4)")
    parser.add_argument("--seconds", type=float, default=14.0, help="seconds per window (default 14)")
    parser.add_argument("--repeats", type=int, default=5, help="windows per configuration (default 5)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="every link's limit (default 1000)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)

    from aps.testing.netns import Network, netns_unavailable_reason

    reason = netns_unavailable_reason(shaping=True)
    if reason is not None:
        print(f"bench/shards.py: {reason}", file=sys.stderr)
        return 1
    payload = args.model // 4 * 4
    numel = payload // 4
    link = args.rate_mbit * 1e6 / 8
    windows = []
    started = time.monotonic()
    with Network(max_hosts=2 * WORKERS) as network:
        count = max(args.shards)
        server_hosts = [network.add_host(f"ps{i}", rate_mbit=args.rate_mbit) for i in range(count)]
        worker_hosts = [network.add_host(f"w{i}", rate_mbit=args.rate_mbit) for i in range(WORKERS)]
        configs = {}
        try:
            for shards in args.shards:
                configs[shards] = Config(shards, server_hosts, worker_hosts, numel)
                print(f"{shards} shard(s): servers {[s.address for s in configs[shards].servers]}, "
                      f"{WORKERS} workers ready", flush=True)
            for shards in args.shards:  # one unrecorded window each: connections warm, pages touched
                configs[shards].window(network, 3.0, payload)
            for repeat in range(args.repeats):
                order = args.shards if repeat % 2 == 0 else args.shards[::-1]
                for shards in order:
                    row = configs[shards].window(network, args.seconds, payload)
                    row["repeat"] = repeat
                    windows.append(row)
                    cpu = row["cpu"]
                    agg = row["aggregate_bytes_per_s"]
                    print(f"repeat {repeat} {shards} shard(s): "
                          f"{'-' if agg is None else f'{agg / 1e6:.0f}'} MB/s aggregate, "
                          f"steps {[w['steps_in_window'] for w in row['workers']]}; cpu: servers "
                          f"{cpu['servers_cores']:.2f}, workers {cpu['workers_cores']:.2f}, machine "
                          f"{cpu['machine_busy_cores']:.2f} of {cpu['cpus']} (softirq "
                          f"{cpu['machine_softirq_cores']:.2f}) cores; server links in/out/both "
                          f"{_phase(row['phases']['servers'])}, worker links {_phase(row['phases']['workers'])}",
                          flush=True)
        finally:
            for config in configs.values():
                config.close()
    configs_out = []
    medians = {}
    for shards in args.shards:
        rows = [w for w in windows if w["shards"] == shards]
        samples = [w["aggregate_bytes_per_s"] for w in rows if w["aggregate_bytes_per_s"] is not None]
        medians[shards] = statistics.median(samples) if samples else None
        bound = link_bound(shards, link)
        server_links = [f"ps{i}" for i in range(shards)]
        configs_out.append({
            "shards": shards,
            "median_bytes_per_s": medians[shards],
            "median_round_trips_per_s": None if medians[shards] is None else medians[shards] / (2 * payload),
            "samples_bytes_per_s": samples,
            "link_bound": bound,
            "fraction_of_both_ways_bound": None if medians[shards] is None
            else medians[shards] / bound["both_ways_at_once_bytes_per_s"],
            "over_one_way_bound": None if medians[shards] is None
            else medians[shards] / bound["one_way_at_a_time_bytes_per_s"],
            "median_cpu": {key: statistics.median(w["cpu"][key] for w in rows) for key in rows[0]["cpu"]},
            "median_phases": {
                side: {key: statistics.median(w["phases"][side][key] for w in rows
                                              if w["phases"][side] and w["phases"][side][key] is not None)
                       for key in ("in", "out", "both_at_once", "correlation", "in_p90", "out_p90")}
                for side in ("servers", "workers")},
            "median_server_link_use": {
                "down_to_servers": statistics.median(
                    sum(w["links"][h]["down_bytes"] for h in server_links) / w["link_seconds"] / (shards * link)
                    for w in rows),
                "up_from_servers": statistics.median(
                    sum(w["links"][h]["up_bytes"] for h in server_links) / w["link_seconds"] / (shards * link)
                    for w in rows),
            },
        })
    base = medians.get(1)
    ratios = {}
    per_repeat = {}
    for shards in args.shards:
        if shards == 1 or base is None or medians[shards] is None:
            continue
        ratios[f"{shards}/1"] = medians[shards] / base
        pairs = []
        for repeat in range(args.repeats):
            one = [w for w in windows if w["repeat"] == repeat and w["shards"] == 1]
            many = [w for w in windows if w["repeat"] == repeat and w["shards"] == shards]
            if one and many and one[0]["aggregate_bytes_per_s"] and many[0]["aggregate_bytes_per_s"]:
                pairs.append(many[0]["aggregate_bytes_per_s"] / one[0]["aggregate_bytes_per_s"])
        per_repeat[f"{shards}/1"] = pairs
    targets = {"2/1": 1.8, "4/1": 3.2}
    report = {
        **report_head("shards", argv, args, payload, started),
        "ratios": ratios,
        "ratios_per_repeat": per_repeat,
        "targets": targets,
        "met": {key: ratios[key] >= target for key, target in targets.items() if key in ratios},
        "expectation": {
            "link_bytes_per_s_each_way": link,
            "note": "pushes cross the workers' uplinks and the servers' downlinks, pulls the reverse; with K "
                    "shards on K hosts and 4 workers on 4 hosts, K links carry each direction, so the links allow "
                    "2 x K x 125 MB/s of pushes + pulls (K = 1, 2, 4: ratios 2 and 4) when every link is busy "
                    "both ways at once, and half of that when the workers all push, then all pull (each link "
                    "used one way at a time). A worker's push_pull sends its whole gradient, then receives the "
                    "weights: its own link is busy both ways at once only while one shard's reply overlaps "
                    "another shard's upload, or, for the servers' links, while some workers push as others pull",
            "per_config": {str(k): link_bound(k, link) for k in args.shards},
            "ratios_both_ways_at_once": {f"{k}/1": min(k, WORKERS) for k in args.shards if k != 1},
        },
        "configs": configs_out,
        "windows": windows,
    }
    for row in configs_out:
        median, phases, cpu = row["median_bytes_per_s"], row["median_phases"]["servers"], row["median_cpu"]
        print(f"{row['shards']} shard(s): median {'-' if median is None else f'{median / 1e6:.0f}'} MB/s, links allow "
              f"{row['link_bound']['both_ways_at_once_bytes_per_s'] / 1e6:.0f} both ways at once; server links in "
              f"{phases['in']:.2f} out {phases['out']:.2f} both at once {phases['both_at_once']:.2f} "
              f"(corr {phases['correlation']:+.2f}, p90 in {phases['in_p90']:.2f} out {phases['out_p90']:.2f}); machine cpu {cpu['machine_busy_cores']:.2f} of {cpu['cpus']} cores")
    return finish(report, medians, args.out)


if __name__ == "__main__":
    sys.exit(main())
