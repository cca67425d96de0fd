#!/usr/bin/env python
"""What training on a virtual clock costs beyond its gradients.

Times one ``aps simulate --train`` run (``train_virtual``: 30 workers, ASP,
the MNIST CNN, ``--gradients`` gradients, accuracy measured 25 times) against
computing the same number of gradients of the same model and batch size alone
in a loop (``VirtualTrainer.compute`` on fixed weights, the workers' batches in
turn). The two alternate (loop, run, loop, run, ...) and the ratio is the
median of the per-repeat ratios; it is reported with and without the time
spent measuring accuracy. Example:
``python bench/virtual.py --out bench/results/virtual.json``.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np


from aps.cli._args import ArgumentParser, parse_setting
from aps.lab.bench import machine_info, write_report
from aps.workloads import load
from aps.lab.virtual import VirtualTrainer, train_virtual

TARGET = 1.2


def gradients_alone(dataset, workers: int, count: int, batch_size: int) -> float:
    """Seconds to compute ``count`` gradients in a loop, as the workers would, nothing else."""
    trainer = VirtualTrainer(dataset, workers, batch_size=batch_size, init_seed=0, seed=0)
    weights = trainer.initial.copy()
    grad = np.zeros(trainer.layout.numel, np.float32)
    start = time.perf_counter()
    for index in range(count):
        trainer.compute(index % workers, weights, grad)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=30, help="virtual workers (default 30)")
    parser.add_argument("--gradients", type=int, default=20000, help="gradients per run (default 20000)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--repeats", type=int, default=2, help="loop/run pairs (default 2)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    dataset = load("mnist", seed=0)
    speeds = list(np.exp(np.random.default_rng(1).normal(0.0, 0.3, args.workers)))
    pairs = []
    for repeat in range(args.repeats):
        alone = gradients_alone(dataset, args.workers, args.gradients, args.batch_size)
        record = train_virtual(parse_setting("asp"), speeds, dataset=dataset, iterations=args.gradients,
                               batch_size=args.batch_size, jitter=0.2, seed=repeat)
        pair = {"repeat": repeat, "gradients_alone_s": alone, "virtual_run_s": record["wall_s"],
                "virtual_gradient_s": record["gradient_s"], "virtual_eval_s": record["eval_s"],
                "ratio": record["wall_s"] / alone, "ratio_without_evaluations": (record["wall_s"] - record["eval_s"]) / alone,
                "best_accuracy": record["best_accuracy"], "mean_staleness": record["mean_staleness"]}
        pairs.append(pair)
        print(f"repeat {repeat}: {args.gradients} gradients alone {alone:.1f} s; the virtual run {record['wall_s']:.1f} s "
              f"({record['eval_s']:.1f} s of it measuring accuracy): {pair['ratio']:.3f}x "
              f"({pair['ratio_without_evaluations']:.3f}x without); best accuracy {record['best_accuracy']:.3f}",
              flush=True)
    ratio = statistics.median(p["ratio"] for p in pairs)
    bare = statistics.median(p["ratio_without_evaluations"] for p in pairs)
    report = {
        "benchmark": "virtual",
        "command": " ".join(["python", "bench/virtual.py", *argv]),
        **machine_info(),
        "workers": args.workers, "gradients": args.gradients, "batch_size": args.batch_size, "model": "mnist CNN",
        "ratio": ratio, "ratio_without_evaluations": bare, "target": TARGET, "met": ratio <= TARGET,
        "pairs": pairs,
    }
    print(f"virtual run / gradients alone: {ratio:.3f} (target <= {TARGET}), {bare:.3f} without measuring accuracy")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
