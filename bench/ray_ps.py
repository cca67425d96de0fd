#!/usr/bin/env python
"""aps against Ray's own parameter server, both on a local Ray cluster, measured in one run.

Ray's parameter-server example keeps the weights in an actor whose method applies a gradient
and returns the new weights; a worker actor calls it once a step (``ray.get`` of the result,
through Ray's object store). Here the same step, SGD on one float32 vector of each
``--sizes``, done both ways by a worker actor on this host:

- ``ray actor``: ``weights = ray.get(ps.apply_gradients.remote(grad))`` against a Ray actor
  holding the weights in numpy;
- ``aps``: ``worker.push_pull(grad)`` against an ``aps.ray.ServerActor`` (ASP, SGD), the worker
  made with the server's connection (shared memory, as on one host it would be).

Each system alone (its actors started for its window and killed after it), windows interleaved
over ``--repeats``; the time a step takes, median. Example:
``python bench/ray_ps.py --out bench/results/ray-ps.json``.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import ray

from aps.cli._args import ArgumentParser, size_list
from aps.lab.bench import machine_info, write_report

import aps.ray


@ray.remote(num_cpus=1)
class RayParameterServer:
    """Ray's example: the weights in an actor, a gradient applied and the weights returned."""

    def __init__(self, numel: int, lr: float = 0.01) -> None:
        self.weights = np.zeros(numel, np.float32)
        self.lr = lr

    def apply_gradients(self, grad: np.ndarray) -> np.ndarray:
        self.weights -= self.lr * grad
        return self.weights


@ray.remote(num_cpus=1)
class StepTimer:
    """A worker actor: times ``steps`` steps against one system."""

    def ray_steps(self, ps, numel: int, seconds: float) -> float:
        grad = np.full(numel, 1e-3, np.float32)
        ray.get(ps.apply_gradients.remote(grad))  # (warm)
        count, start = 0, time.perf_counter()
        while count < 3 or time.perf_counter() - start < seconds:
            weights = ray.get(ps.apply_gradients.remote(grad))
            count += 1
        assert weights.shape == (numel,)
        return (time.perf_counter() - start) / count

    def aps_steps(self, connection: dict, numel: int, seconds: float) -> tuple[float, str]:
        with aps.Worker(connection["address"], 0, 1, token=connection["token"]) as worker:
            worker.init({"w": np.zeros(numel, np.float32)})
            grad = np.full(numel, 1e-3, np.float32)
            worker.push_pull(grad)  # (warm)
            count, start = 0, time.perf_counter()
            while count < 3 or time.perf_counter() - start < seconds:
                worker.push_pull(grad)
                count += 1
            return (time.perf_counter() - start) / count, worker.transport


def window(system: str, numel: int, seconds: float) -> tuple[float, str]:
    timer = StepTimer.remote()
    if system == "ray actor":
        ps = RayParameterServer.remote(numel)
        try:
            return ray.get(timer.ray_steps.remote(ps, numel, seconds)), "object store"
        finally:
            ray.kill(ps)
            ray.kill(timer)
    server = aps.ray.ServerActor.remote(workers=1, sync="asp", optimizer="sgd", lr=0.01)
    try:
        return ray.get(timer.aps_steps.remote(ray.get(server.connection.remote()), numel, seconds))
    finally:
        ray.get(server.stop.remote())
        ray.kill(server)
        ray.kill(timer)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=size_list, default=size_list("1M,16M,64M"),
                        help="model sizes (default 1M,16M,64M)")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one window (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="windows per point, interleaved (default 3)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for nbytes in args.sizes:
            times: dict[str, list[float]] = {"aps": [], "ray actor": []}
            via = {}
            for _ in range(args.repeats):
                for system in times:
                    seconds, via[system] = window(system, nbytes // 4, args.seconds)
                    times[system].append(seconds)
            medians = {system: statistics.median(values) for system, values in times.items()}
            row = {"bytes": nbytes, "ms": {k: round(v * 1e3, 3) for k, v in medians.items()}, "via": via,
                   "ray_over_aps": round(medians["ray actor"] / medians["aps"], 2),
                   "samples_ms": {k: [round(v * 1e3, 3) for v in values] for k, values in times.items()}}
            rows.append(row)
            print(f"{nbytes >> 20:4d} MiB: aps {row['ms']['aps']:.2f} ms ({via['aps']}), Ray actor "
                  f"{row['ms']['ray actor']:.2f} ms: aps {row['ray_over_aps']:.2f}x as fast", flush=True)
    finally:
        ray.shutdown()
    write_report({"benchmark": "ray-ps", "command": " ".join(["python", "bench/ray_ps.py", *(argv or sys.argv[1:])]),
                  **machine_info(), "seconds": args.seconds, "repeats": args.repeats, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
