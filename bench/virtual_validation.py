#!/usr/bin/env python
"""The virtual clock against real runs, on ``aps compare``'s setting.

Runs ``aps compare`` (real server and worker processes on wall time: four
workers, iteration times 1,1,1,2.5 step times, jitter 0.1) for each paradigm
``--repeats`` times, then the same paradigms on a virtual clock (``aps simulate
--train``'s ``train_virtual``: same speeds, jitter, dataset, learning rate and
batch size) for ``--seeds`` seeds, each run as long in gradients as the
median real run of its paradigm. Reports, per paradigm:

- the accuracy against gradients applied: the mean distance between a
  virtual and a real curve, against the mean distance between two real
  curves (their run-to-run spread);
- the staleness distributions: total variation distance between a virtual
  and a real run's, against two real runs', and the mean staleness of each.

Writes the JSON report and a figure (accuracy against gradients applied and
the staleness distributions, real and virtual, one column per paradigm).
Example: ``python bench/virtual_validation.py --out bench/results/virtual-validation``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys


from aps.cli._args import ArgumentParser, parse_setting
from aps.lab.bench import machine_info
from aps.lab.compare import label
from aps.workloads import load
from aps.lab.simulate import draw_staleness
from aps.server.engine.stats import merge_counts
from aps.lab.virtual import agreement, train_virtual


def real_runs(args, out: str) -> list[dict]:
    command = [sys.executable, "-m", "aps", "compare", "--workers", str(len(args.speeds.split(","))),
               "--speeds", args.speeds, "--clusters", "heterogeneous", "--paradigms", args.paradigms,
               "--lr-staleness", "none", "--budget", str(args.budget), "--step-time", str(args.step_time),
               "--jitter", str(args.jitter), "--dataset", args.dataset, "--lr", str(args.lr),
               "--batch-size", str(args.batch_size), "--repeats", str(args.repeats), "--eval-every",
               str(args.budget / 25), "--target", str(args.target), "--no-progress", "--no-dashboard", "--out", out]
    subprocess.run(command, check=True)
    with open(os.path.join(out, "results.json")) as fh:
        return json.load(fh)


def virtual_runs(args, gradients: dict[str, int]) -> list[dict]:
    dataset = load(args.dataset, seed=0)
    speeds = [float(s) for s in args.speeds.split(",")]
    records = []
    for sync, count in gradients.items():
        for seed in range(args.seeds):
            horizon = count * statistics.fmean(speeds) / len(speeds)
            record = train_virtual(parse_setting(sync), speeds, dataset=dataset, lr=args.lr,
                                   batch_size=args.batch_size, jitter=args.jitter, iterations=count,
                                   eval_every=horizon / 25, target=args.target, seed=seed)
            record.update(label=label(sync), cluster="virtual", repeat=seed)
            records.append(record)
    return records


def figure(paradigms: list[str], real: list[dict], virtual: list[dict], path: str, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(paradigms), figsize=(4.2 * len(paradigms), 7.0), dpi=110, squeeze=False)
    for column, sync in enumerate(paradigms):
        top, bottom = axes[0][column], axes[1][column]
        for kind, records, style, color in (("real", real, "-", "C0"), ("virtual", virtual, "--", "C3")):
            runs = [r for r in records if r["sync"] == sync]
            for index, r in enumerate(runs):
                xs, ys = zip(*r["curve_gradients"])
                top.plot(xs, ys, style, color=color, lw=1.0, alpha=0.8, label=kind if index == 0 else None)
            total = merge_counts(r["staleness_hist"] for r in runs)
            if set(total) == {0}:
                if kind == "real":
                    bottom.text(0.5, 0.5, "every gradient fresh (staleness 0),\nreal and virtual", ha="center",
                                va="center", transform=bottom.transAxes)
                continue
            draw_staleness(bottom, total, kind, color, style)
        top.set_title(label(sync), fontsize=10)
        top.set_xlabel("gradients applied")
        top.set_ylabel("test accuracy")
        top.grid(alpha=0.3)
        top.legend(fontsize=8, loc="lower right")
        bottom.set_xlabel("staleness of an applied gradient")
        bottom.set_ylabel("fraction of gradients")
        bottom.grid(alpha=0.3)
        if bottom.get_legend_handles_labels()[0]:
            bottom.legend(fontsize=8)
    fig.text(0.01, 0.005, command, fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paradigms", default="asp,ssp:3,dssp:3:15,bsp", help="sync settings, comma-separated")
    parser.add_argument("--speeds", default="1,1,1,2.5", help="iteration times in step times (aps compare's)")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per real run (default 20)")
    parser.add_argument("--step-time", type=float, default=0.04, help="a speed-1 worker's iteration, s")
    parser.add_argument("--jitter", type=float, default=0.1)
    parser.add_argument("--dataset", default="mnist", choices=("mnist", "digits"))
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=3, help="real runs per paradigm (default 3)")
    parser.add_argument("--seeds", type=int, default=3, help="virtual runs per paradigm (default 3)")
    parser.add_argument("--out", required=True, help="directory for real/, results.json and validation.png")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    paradigms = [p.strip() for p in args.paradigms.split(",") if p.strip()]
    real = real_runs(args, os.path.join(args.out, "real"))
    gradients = {sync: int(statistics.median(r["curve_gradients"][-1][0] for r in real if r["sync"] == sync))
                 for sync in paradigms}
    virtual = virtual_runs(args, gradients)
    report = {
        "command": "python bench/virtual_validation.py " + " ".join(argv),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "paradigms": {sync: agreement([r for r in real if r["sync"] == sync],
                                      [v for v in virtual if v["sync"] == sync]) for sync in paradigms},
        "virtual": [{k: v for k, v in r.items() if k not in ("evaluations",)} for r in virtual],
    }
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(report, fh, indent=2)
    figure(paradigms, real, virtual, os.path.join(args.out, "validation.png"), report["command"])
    for sync, a in report["paradigms"].items():
        spread = a["accuracy_distance_real_real"]
        print(f"{label(sync):<14} accuracy vs gradients: virtual-real {a['accuracy_distance_virtual_real']:.3f}, "
              f"real-real {spread:.3f};  staleness TVD virtual-real {a['staleness_tvd_virtual_real']:.3f}, "
              f"real-real {a['staleness_tvd_real_real']:.3f};  mean staleness real "
              f"{statistics.fmean(a['mean_staleness_real']):.2f}, virtual {statistics.fmean(a['mean_staleness_virtual']):.2f}")
    print(f"wrote {args.out}/results.json and validation.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
