#!/usr/bin/env python
"""push_pull throughput with compressed (bf16) pushes and pulls against float32, every link at 1 Gbit/s.

The setting of bench/shards.py (network namespaces as hosts, each host's link
limited to ``--rate-mbit`` each way by tbf; ASP, plain SGD; four workers on four
hosts, one process each, a push_pull loop of the whole model over TCP), with one
server and the workers sending float32 (``none``), bf16 pushes (``bf16``), or
bf16 pushes and pulls (``bf16+pulls``). Each configuration is started once and
measured in timed windows interleaved across repeats. Throughput is counted in
float32-equivalent bytes (2 x the model's float32 size per push_pull, whatever
crossed the wire), so the ratios are ratios of push_pulls per second.

Needs root, iproute2 and tc. Example:
``python bench/compression.py --out bench/results/compression.json``.
"""

from __future__ import annotations

import statistics
import sys
import time


from shards import WORKERS, Config, _phase, finish, report_head

from aps.cli._args import ArgumentParser, parse_size

TARGET = 1.6


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=parse_size, default=64 << 20, help="model size (default 64M)")
    parser.add_argument("--compression", default="none,bf16,bf16+pulls",
                        help="configurations, comma-separated (default none,bf16,bf16+pulls; fp16 likewise)")
    parser.add_argument("--seconds", type=float, default=14.0, help="seconds per window (default 14)")
    parser.add_argument("--repeats", type=int, default=5, help="windows per configuration (default 5)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="every link's limit (default 1000)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    kinds = args.compression.split(",")
    if kinds[0] != "none":
        parser.error("the first configuration is the float32 baseline: none")

    from aps.testing.netns import Network, netns_unavailable_reason

    reason = netns_unavailable_reason(shaping=True)
    if reason is not None:
        print(f"bench/compression.py: {reason}", file=sys.stderr)
        return 1
    payload = args.model // 4 * 4
    windows = []
    started = time.monotonic()
    with Network(max_hosts=1 + WORKERS) as network:
        server_host = network.add_host("ps0", rate_mbit=args.rate_mbit)
        worker_hosts = [network.add_host(f"w{i}", rate_mbit=args.rate_mbit) for i in range(WORKERS)]
        configs: dict[str, Config] = {}
        try:
            for kind in kinds:  # one at a time: each configuration has the hosts to itself in its windows
                configs[kind] = Config(1, [server_host], worker_hosts, payload // 4, kind)
                print(f"{kind}: server {configs[kind].servers[0].address}, {WORKERS} workers ready", flush=True)
            for kind in kinds:  # one unrecorded window each: connections warm, pages touched
                configs[kind].window(network, 3.0, payload)
            for repeat in range(args.repeats):
                for kind in (kinds if repeat % 2 == 0 else kinds[::-1]):
                    row = configs[kind].window(network, args.seconds, payload)
                    row["repeat"] = repeat
                    windows.append(row)
                    agg, cpu = row["aggregate_bytes_per_s"], row["cpu"]
                    print(f"repeat {repeat} {kind}: {'-' if agg is None else f'{agg / 1e6:.0f}'} MB/s "
                          f"(float32-equivalent), steps {[w['steps_in_window'] for w in row['workers']]}; cpu: "
                          f"server {cpu['servers_cores']:.2f}, workers {cpu['workers_cores']:.2f}, machine "
                          f"{cpu['machine_busy_cores']:.2f} of {cpu['cpus']} cores; server link in/out/both "
                          f"{_phase(row['phases']['servers'])}", flush=True)
        finally:
            for config in configs.values():
                config.close()
    medians, samples = {}, {}
    for kind in kinds:
        samples[kind] = [w["aggregate_bytes_per_s"] for w in windows
                         if w["compression"] == kind and w["aggregate_bytes_per_s"] is not None]
        medians[kind] = statistics.median(samples[kind]) if samples[kind] else None
    base = medians["none"]
    ratios, per_repeat = {}, {}
    for kind in kinds[1:]:
        if base and medians[kind]:
            ratios[f"{kind}/none"] = medians[kind] / base
        pairs = []
        for repeat in range(args.repeats):
            one = [w["aggregate_bytes_per_s"] for w in windows if w["repeat"] == repeat and w["compression"] == "none"]
            other = [w["aggregate_bytes_per_s"] for w in windows if w["repeat"] == repeat and w["compression"] == kind]
            if one and other and one[0] and other[0]:
                pairs.append(other[0] / one[0])
        per_repeat[f"{kind}/none"] = pairs
    link = args.rate_mbit * 1e6 / 8
    report = {
        **report_head("compression", argv, args, payload, started),
        "medians_float32_equivalent_bytes_per_s": medians,
        "samples": samples,
        "ratios": ratios,
        "ratios_per_repeat": per_repeat,
        "target": {"ratio": TARGET, "of": "bf16+pulls/none"},
        "met": ratios.get("bf16+pulls/none", 0.0) >= TARGET,
        "expectation": {
            "link_bytes_per_s_each_way": link,
            "note": "one server link carries every push in and every pull out. bf16 pushes halve the bytes in and "
                    "leave the bytes out as they are: while the link is used both ways at once the pulls bound it "
                    "(ratio 1), while it is used one way at a time 64+64 becomes 32+64 (ratio 1.33); bf16 pulls "
                    "halve the rest (ratio 2 either way)",
            "ratio_bounds": {"bf16/none": [1.0, 4 / 3], "bf16+pulls/none": [2.0, 2.0]},
        },
        "windows": windows,
    }
    return finish(report, medians, args.out)


if __name__ == "__main__":
    sys.exit(main())
