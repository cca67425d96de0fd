#!/usr/bin/env python
"""Elastic membership's two targets, measured (issue: elastic training on cluster engines).

``join``: what a join costs the running workers. A server of ``--workers 1:3`` (ASP) holds a
64 MiB model; two workers run a push_pull loop (over TCP, then shared memory; ``--think``
seconds between two: their compute, elsewhere) and a third joins twice (the first join may
grow the server's pool of snapshot slots: its spare is made off the update lane). Every
push_pull of the running workers is timed; the figure is the longest one that overlapped
the join, against the median of those before it: the target is at most one round trip
more (``longest <= 2 x median``). On a machine of few cores the joining process's own work
(its buffers, the weights copied in) competes with the running workers for the CPUs: the
control, measured the same way in the same run, is no join at all but that work alone (a
fresh 64 MiB buffer filled by a copy, in the bench's process).

``resize``: what a resize from 4 to 8 workers buys. Separate hosts are network namespaces
(aps/testing/netns.py), each worker host's link limited to ``--rate-mbit`` (1 Gbit/s) in
each direction by tbf (a 128 KiB bucket: the link carries its rate, no bursts above it),
the server's host unlimited. A server of ``--workers 4:8`` (ASP,
plain SGD, a 1 MiB model) serves 8 worker processes, one per host; windows with 4 live
workers and windows with 8 alternate (the other 4 join before an 8-window, every one of
them a new join, and leave after it). A window's figure is the server's updates per
second over it (each push applied alone: the steps the workers finished in it); the target is a median 8-window figure at least 1.6 x the median 4-window one.

Needs root, iproute2 and tc for ``resize``. Example:
``python bench/elastic.py --out bench/results/elastic.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, write_report

#: The worker links' tbf bucket: two GSO packets, so a link carries its rate and no more
#: (a bucket of a timer tick's worth, 500 KB at 1 Gbit/s and HZ 250, refills while a worker
#: waits for its reply and passes half of each 1 MiB message at once: aps.testing.netns.tbf_params).
BURST = 128 << 10
TOKEN = "elastic-bench-" + "Qm9vdHN0cmFwIHRva2VuIGZvciB0aGUgZWxhc3RpYyBiZW5jaA"  # (a bench of its own network)


def agent(argv: list[str]) -> int:
    """A worker of ``resize``: on ``join`` it joins (rank assigned), on ``leave`` it leaves,
    on ``run START END`` it runs push_pull from START to END (wall clock) and says how many
    ended inside, on ``quit`` it exits."""
    import aps

    address, numel = argv[0], int(argv[1])
    worker = None
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "join":
            worker = aps.Worker(address, transport="tcp", token=TOKEN)
            worker.init({"w": np.zeros(numel, np.float32)})
            worker.flat_grad.fill(1 / 1024)
            print("joined", worker.rank, flush=True)
        elif words[0] == "leave":
            worker.leave()
            worker = None
            print("left", flush=True)
        elif words[0] == "run":  # push_pull from START to END; the steps that ended inside
            start, end, steps = float(words[1]), float(words[2]), 0
            time.sleep(max(0.0, start - time.time()))
            while time.time() < end:
                worker.push_pull(worker.flat_grad)
                steps += time.time() <= end
            print("ran", steps, flush=True)
        else:
            break
    if worker is not None:
        worker.close()
    return 0


def join_agent(argv: list[str]) -> int:
    """A running worker of ``join``: joins, says ``ready``, runs push_pull until its stdin
    closes (sleeping THINK seconds between two, its compute elsewhere: a GPU's), then prints
    the (start, end) wall-clock times of every step as JSON."""
    import aps

    address, transport, numel, think = argv[0], argv[1], int(argv[2]), float(argv[3])
    steps, stop = [], threading.Event()
    with aps.Worker(address, transport=transport) as worker:
        worker.init({"w": np.zeros(numel, np.float32)})
        print("ready", flush=True)
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        grad = worker.flat_grad
        while not stop.is_set():
            began = time.time()
            worker.push_pull(grad)
            steps.append((began, time.time()))
            time.sleep(think)
    print(json.dumps(steps), flush=True)
    return 0


def measure_join(transport: str, mib: int, seconds: float, think: float = 0.0) -> dict:
    import aps
    from aps.testing import ServerProcess

    numel = mib << 18
    server = ServerProcess("--workers", "1:3", "--sync", "asp", "--lr", "0.0001", "--momentum", "0",
                           "--max-frame-bytes", str((mib + 16) << 20), "--log-level", "warning")
    try:
        agents = [subprocess.Popen([sys.executable, __file__, "--join-agent", server.address, transport, str(numel),
                                    str(think)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        for proc in agents:
            assert proc.stdout.readline().strip() == "ready"
        joins = []  # (began, ended) of each join: a first, then a second once the first has left
        for _ in range(2):
            time.sleep(seconds)
            joined_at = time.time()
            with aps.Worker(server.address, transport=transport) as newcomer:
                newcomer.init({"w": np.zeros(numel, np.float32)})
                joins.append((joined_at, time.time()))
                time.sleep(seconds / 2)
        # The control: not a join, the work any newcomer's process does on this machine whatever
        # the server: its weights received into a fresh buffer (pages faulted in, 64 MiB copied).
        time.sleep(seconds)
        began = time.time()
        sent = np.full(numel, 0.5, np.float32)
        received = np.empty(numel, np.float32)
        np.copyto(received, sent)
        joins.append((began, time.time()))
        del sent, received
        for proc in agents:
            proc.stdin.close()
        steps = []
        for proc in agents:
            out = proc.stdout.read()
            proc.wait(60)
            steps += json.loads(out.strip().splitlines()[-1])
    finally:
        server.stop()
    median = statistics.median([end - began for began, end in steps if end < joins[0][0]])
    rows = []
    for joined_at, joined in joins:
        around = [end - began for began, end in steps if end >= joined_at and began <= joined]
        longest = max(around) if around else 0.0
        rows.append({"join_s": joined - joined_at, "longest_around_join_s": longest,
                     "push_pulls_around_join": len(around), "delay_in_round_trips": (longest - median) / median})
    first = rows[0]
    return {"transport": transport, "model_mib": mib, "think_s": think, "median_push_pull_s": median, **first,
            "second_join": rows[1], "control": rows[2],
            "target_met": first["longest_around_join_s"] <= 2 * median}


def measure_resize(rate_mbit: float, mib: float, window: float, repeats: int) -> dict:
    from aps.testing.netns import Network, require_netns

    require_netns(shaping=True)
    numel = int(mib * (1 << 18))
    with Network(max_hosts=9) as network:
        server_host = network.add_host("ps")
        hosts = [network.add_host(f"w{i}", rate_mbit=rate_mbit, burst=BURST) for i in range(8)]
        server = server_host.serve("--workers", "4:8", "--sync", "asp", "--lr", "0.0001", "--momentum", "0",
                                   "--log-level", "warning", env={"APS_TOKEN": TOKEN})
        agents = [host.popen([sys.executable, __file__, "--agent", server.address, str(numel)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for host in hosts]

        def say(group, command: str, expect: str) -> list[str]:
            for proc in group:
                proc.stdin.write(command + "\n")
                proc.stdin.flush()
            replies = [proc.stdout.readline().strip() for proc in group]
            assert all(reply.startswith(expect) for reply in replies), replies
            return replies

        for proc in agents:
            assert proc.stdout.readline().strip() == "ready"
        base, extra = agents[:4], agents[4:]
        say(base, "join", "joined")
        windows: dict[int, list[float]] = {4: [], 8: []}
        busy: dict[int, list[float]] = {4: [], 8: []}  # the machine's CPUs busy (all cores) in each window
        for repeat in range(repeats):
            for live in ((4, 8) if repeat % 2 == 0 else (8, 4)):
                group = base + (extra if live == 8 else [])
                if live == 8:
                    say(extra, "join", "joined")
                time.sleep(0.5)
                start = time.time() + 0.2
                cpu0 = _cpu_times()
                replies = say(group, f"run {start} {start + window}", "ran")
                cpu1 = _cpu_times()
                windows[live].append(sum(int(reply.split()[1]) for reply in replies) / window)
                busy[live].append(1 - (cpu1[1] - cpu0[1]) / max(1, cpu1[0] - cpu0[0]))
                if live == 8:
                    say(extra, "leave", "left")
        for proc in agents:
            proc.stdin.write("quit\n")
            proc.stdin.flush()
    four, eight = statistics.median(windows[4]), statistics.median(windows[8])
    # A push_pull sends the model and receives it, one after the other, over the worker's link.
    link_bound = rate_mbit * 1e6 / 8 / (2 * numel * 4)
    return {"rate_mbit": rate_mbit, "tbf_burst_bytes": BURST, "model_mib": mib, "window_s": window,
            "link_bound_per_worker": link_bound, "per_worker_4": four / 4, "per_worker_8": eight / 8,
            "updates_per_s": windows,
            "cpu_busy": busy, "cpus": os.cpu_count(),
            "median_4": four, "median_8": eight, "ratio": eight / four, "target": 1.6, "target_met": eight / four >= 1.6}


def _cpu_times() -> tuple[int, int]:
    """All CPUs' time and idle time (iowait included) so far, in ticks, from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--agent":
        return agent(argv[1:])
    if argv and argv[0] == "--join-agent":
        return join_agent(argv[1:])
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("join", "resize"), help="one of the two (default both)")
    parser.add_argument("--join-mib", type=int, default=64)
    parser.add_argument("--think", type=float, default=0.0,
                        help="seconds the running workers of join spend between two push_pulls (their compute)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--window", type=float, default=4.0, help="seconds a resize window lasts")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", help="write the report (JSON) here")
    args = parser.parse_args(argv)
    report: dict = {"bench": "elastic", "machine": machine_info(), "command": "python bench/elastic.py " + " ".join(argv)}
    if args.only in (None, "join"):
        report["join"] = [measure_join(t, args.join_mib, 3.0, args.think) for t in ("tcp", "shm")]
        for row in report["join"]:
            print(f"join of a {row['model_mib']} MiB model over {row['transport']} (workers think {args.think:g} s): "
                  f"longest push_pull around it "
                  f"{row['longest_around_join_s'] * 1e3:.1f} ms against a median of "
                  f"{row['median_push_pull_s'] * 1e3:.1f} ms ({row['delay_in_round_trips']:.2f} round trips "
                  f"more; target <= 1: {'met' if row['target_met'] else 'NOT met'}); a second join: "
                  f"{row['second_join']['delay_in_round_trips']:.2f}; the control (a fresh 64 MiB buffer filled, "
                  f"no join): {row['control']['delay_in_round_trips']:.2f}", flush=True)
    if args.only in (None, "resize"):
        row = report["resize"] = measure_resize(args.rate_mbit, 1.0, args.window, args.repeats)
        print(f"resize 4 -> 8 workers, 1 MiB, ASP, {row['rate_mbit']:g} Mbit/s a worker host: "
              f"{row['median_4']:.0f} -> {row['median_8']:.0f} updates/s = {row['ratio']:.2f}x "
              f"(target >= 1.6: {'met' if row['target_met'] else 'NOT met'}); a worker's "
              f"{row['per_worker_4']:.0f} -> {row['per_worker_8']:.0f} updates/s against its link's "
              f"{row['link_bound_per_worker']:.0f}; CPUs busy "
              f"{statistics.median(row['cpu_busy'][4]):.0%} -> {statistics.median(row['cpu_busy'][8]):.0%} "
              f"of {row['cpus']}", flush=True)
    if args.out:
        write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
