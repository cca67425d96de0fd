#!/usr/bin/env python
"""Data across workers of uneven speed: a fixed split against a shared queue, measured in one run.

Four worker processes train the digits MLP under ASP, one of them ``--slowdown`` times
slower (``aps launch``'s pacing: ``--step-time`` seconds an iteration, times its slowdown),
for ``--epochs`` epochs of the same data, read either way:

- ``split``: torch's ``DistributedSampler`` with aps's rank and worker count (what DDP does, and
  what the trainer integrations give each worker): each worker reads its quarter of every
  epoch, so the slow worker's quarter takes it ``--slowdown`` times as long;
- ``queue``: ``aps.torch.ElasticSampler``: each epoch's chunks are claimed from a counter on the
  server, so a fast worker takes more of them, each sample once an epoch.

Both read every sample ``--epochs`` times in all. Rank 0 (a fast worker) evaluates the
weights it pulled on the test set every few steps; reported, per arm, medians over
``--repeats`` interleaved runs: the time until that accuracy first reaches ``--target``, the
time until every worker is done, and the final test accuracy (of the last weights, read by
the last worker to finish). Example:
``python bench/sampler.py --out bench/results/sampler.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, start_server, stop_server, write_report

WORKERS = 4
ARMS = ("split", "queue")


def worker(address: str, rank: int, arm: str, epochs: int, start: float, out: str) -> None:
    """One worker process: trains, then writes its evaluations and finish time to ``out``."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import aps.torch
    from aps import workloads

    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = workloads.load("digits", seed=0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = aps.torch.Optimizer(model, address, rank=rank, num_workers=WORKERS, transport="tcp")
    dataset = TensorDataset(data.x_train, data.y_train)
    sampler = DistributedSampler(dataset, num_replicas=WORKERS, rank=rank, seed=1) if arm == "split" else \
        aps.torch.ElasticSampler(len(dataset), optimizer.worker, chunk=32, seed=1)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(data.x_test).argmax(1) == data.y_test).float().mean())

    while time.time() < start:  # (every worker starts its clock at once, all joined)
        time.sleep(0.005)
    evaluations, steps = [], 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
            if rank == 0 and steps % 5 == 0:
                evaluations.append((time.time() - start, accuracy()))
    optimizer.worker.pull()  # (the server's newest weights, into the model: its parameters are views of them)
    result = {"rank": rank, "steps": steps, "finished_s": time.time() - start, "final_accuracy": accuracy(),
              "evaluations": evaluations}
    optimizer.worker.leave(finished=True)
    with open(out, "w") as file:
        json.dump(result, file)


def one_run(arm: str, args) -> dict:
    server, address = start_server(WORKERS, ["--sync", "asp", "--lr", "0.02", "--momentum", "0.9",
                                             "--log-level", "warning"])
    folder = tempfile.mkdtemp(prefix="aps-sampler-")
    start = time.time() + 8.0  # (imports and joins take a few seconds)
    procs = []
    try:
        for rank in range(WORKERS):
            env = dict(os.environ, APS_STEP_TIME=str(args.step_time), OMP_NUM_THREADS="1",
                       APS_SLOWDOWN=str(args.slowdown if rank == WORKERS - 1 else 1.0))
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", address, str(rank), arm, str(args.epochs), repr(start),
                 os.path.join(folder, f"{rank}.json")], env=env))
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"a {arm} worker failed ({proc.returncode})")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        stop_server(server)
    results = [json.load(open(os.path.join(folder, f"{rank}.json"))) for rank in range(WORKERS)]
    last = max(results, key=lambda r: r["finished_s"])
    reached = next((t for t, acc in results[0]["evaluations"] if acc >= args.target), None)
    return {"arm": arm, "finished_s": last["finished_s"], "final_accuracy": last["final_accuracy"],
            "target_s": reached, "steps": [r["steps"] for r in results], "evaluations": results[0]["evaluations"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        address, rank, arm, epochs, start, out = argv[1:]
        worker(address, int(rank), arm, int(epochs), float(start), out)
        return 0
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20, help="epochs of the digits (default 20)")
    parser.add_argument("--step-time", type=float, default=0.03, help="seconds a fast worker's iteration takes "
                        "(default 0.03)")
    parser.add_argument("--slowdown", type=float, default=4.0, help="the slow worker's factor (default 4)")
    parser.add_argument("--target", type=float, default=0.9, help="the test accuracy to reach (default 0.9)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, interleaved (default 3)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    runs = []
    for repeat in range(args.repeats):
        for arm in ARMS:
            run = one_run(arm, args)
            runs.append(run)
            print(f"repeat {repeat} {arm:5s}: {args.target} reached at {run['target_s']} s, all done at "
                  f"{run['finished_s']:.1f} s, final accuracy {run['final_accuracy']:.3f}, steps {run['steps']}",
                  flush=True)
    summary = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        reached = [r["target_s"] for r in mine if r["target_s"] is not None]
        summary[arm] = {"target_s": statistics.median(reached) if reached else None,
                        "reached": f"{len(reached)}/{len(mine)}",
                        "finished_s": statistics.median(r["finished_s"] for r in mine),
                        "final_accuracy": statistics.median(r["final_accuracy"] for r in mine)}
        print(f"{arm:5s}: to {args.target}: {summary[arm]['target_s']} s ({summary[arm]['reached']} runs), "
              f"all done {summary[arm]['finished_s']:.1f} s, final accuracy {summary[arm]['final_accuracy']:.3f}")
    report = {"benchmark": "sampler", "command": " ".join(["python", "bench/sampler.py", *argv]), **machine_info(),
              "workers": WORKERS, "epochs": args.epochs, "step_time_s": args.step_time, "slowdown": args.slowdown,
              "target": args.target, "summary": summary, "runs": runs}
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
