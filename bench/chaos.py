#!/usr/bin/env python
"""A chaos soak: real shards and workers under a seeded fault schedule, checked by a ledger.

For ``--minutes`` per sync policy: ``--shards`` real ``aps serve --shard I`` processes
(checkpointing every ``--checkpoint-every-updates`` updates into a small tmpfs each),
``--workers`` real worker processes, and faults drawn from ``--seed``: kill -9 and
SIGSTOP/SIGCONT of workers and shards, shard restarts with ``--resume`` (from the newest
checkpoint, or from an older one), network cuts (network namespaces), a full
checkpoint disk, and strangers flooding a shard with connections that never
authenticate. The model is a ledger (SGD lr=1, one weight per (shard, rank, clock)), so
the final weights say whether any gradient was applied twice or lost beyond what the
crashes allow (with ``--replicas 2``, each shard a replica set: none may be lost). Reports faults injected and survived by kind, applied twice, lost
against the bound, stalls beyond the documented deadline, server RSS growth: a table
and JSON (see docs/design/tools.md, "Chaos soak"). Needs root for namespaces and tmpfs
(without, cuts and disk-full are left out and the report says so). Example::

    python bench/chaos.py --minutes 30 --seed 1 --out bench/results/chaos-30min.json
"""

from __future__ import annotations

import signal
import sys


from aps.cli._args import ArgumentParser, choice_list, command_line
from aps.lab.bench import machine_info, write_report
from aps.testing.chaos import FAULT_KINDS, POLICIES, SoakConfig, run_soak
from aps.testing.chaos_replicas import run_replicated_soak


def _terminate(signum, frame):
    raise KeyboardInterrupt  # the soak's cleanup runs on the way out, as for Ctrl-C


def print_table(rows: list[dict]) -> None:
    print(f"\n{'sync':<5} {'faults':>7} {'survived':>9} {'pushes':>8} {'twice':>6} {'lost':>5} {'bound':>6} "
          f"{'stalls':>7} {'slowest':>8} {'RSS +MiB':>9}")
    for r in rows:
        rss = "-" if r["rss_growth_mib_max"] is None else f"{r['rss_growth_mib_max']:.1f}"
        print(f"{r['sync']:<5} {r['faults_injected']:>7} {r['faults_survived']:>9} {r['pushes_acknowledged']:>8} "
              f"{r['applied_twice']:>6} {r['lost']:>5} {r['lost_bound']:>6} {r['stalls']:>7} "
              f"{r['slowest_call_s']:>7.2f}s {rss:>9}")
    for r in rows:
        kinds = ", ".join(f"{k} {v['survived']}/{v['injected']}" for k, v in r["faults_by_kind"].items())
        print(f"  {r['sync']}: {kinds}")
        if r["applied_twice"]:
            where = ", ".join(f"shard {p['shard']}: {p['applied_twice']}" for p in r["ledger"]["per_shard"])
            print(f"  {r['sync']}: applied twice on {where}; {len(r['crashes'])} shard resumes, "
                  f"{r['older_resumes']} from an older checkpoint; first at {r['ledger']['twice_at'][:3]}")
        if r.get("replicas", 1) > 1:
            print(f"  {r['sync']}: {r['replicas']} replicas a shard: {r['failovers']} failovers, taking over in "
                  f"{r['failover_s']} s; {r['no_takeover']} without a takeover")
        for note in r["notes"] + r["cleanup_errors"]:
            print(f"  {r['sync']}: {note}")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", type=choice_list(tuple(POLICIES)), default=list(POLICIES),
                        help="the sync policies, one soak each")
    parser.add_argument("--minutes", type=float, default=2.0, help="of training under faults, per policy")
    parser.add_argument("--seed", type=int, default=0, help="draws the fault schedule")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--transport", choices=("tcp", "shm"), default="tcp",
                        help="the workers' (shm: a cut then only stops new connections; data goes by Unix socket)")
    parser.add_argument("--network", choices=("auto", "netns", "loopback"), default="auto",
                        help="namespaces (cuts possible) or loopback; auto: namespaces when usable")
    parser.add_argument("--faults", type=choice_list(FAULT_KINDS), default=list(FAULT_KINDS),
                        help="the kinds of fault to draw from")
    parser.add_argument("--step-time", type=float, default=0.02, help="seconds each worker sleeps per step")
    parser.add_argument("--checkpoint-every-updates", type=int, default=40)
    parser.add_argument("--max-fault", type=float, default=6.0, help="longest stop, cut, full disk or flood (s)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="replicas a shard (aps serve --replicas, a real etcd): none acknowledged may be lost")
    parser.add_argument("--keep-run-dir", action="store_true", help="keep the logs and checkpoints")
    parser.add_argument("--quiet", action="store_true", help="no line per fault")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    rows = []
    try:
        for sync in args.sync:
            config = SoakConfig(sync=sync, seconds=args.minutes * 60, seed=args.seed, shards=args.shards,
                                workers=args.workers, transport=args.transport, network=args.network,
                                step_time=args.step_time, checkpoint_every_updates=args.checkpoint_every_updates,
                                max_fault_s=args.max_fault, kinds=tuple(args.faults), keep_run_dir=args.keep_run_dir,
                                quiet=args.quiet, replicas=args.replicas)
            rows.append(run_replicated_soak(config) if args.replicas > 1 else run_soak(config))
    except KeyboardInterrupt:
        print("\ninterrupted: every process stopped, namespaces and mounts removed", file=sys.stderr)
        if not rows:
            return 130
    print_table(rows)
    totals = {key: sum(r[key] for r in rows) for key in ("faults_injected", "faults_survived", "applied_twice",
                                                         "lost", "stalls")}
    report = {"benchmark": "chaos", "command": command_line(), **machine_info(), "minutes": args.minutes,
              "totals": totals, "rows": rows}
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
