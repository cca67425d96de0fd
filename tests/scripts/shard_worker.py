"""A worker process for the sharded multi-host tests: trains a fixed model against the server(s)
given and prints one JSON line at the end.

    python shard_worker.py ADDRESSES RANK WORLD STEPS [--sleep S] [--no-reconnect]
        [--server-timeout S] [--reconnect-timeout S] [--progress] [--numel N]

ADDRESSES is one server or several, comma-separated (the shards of one model).
The model has a few tensors (3091 floats, so that with two shards a tensor
spans the shard boundary); its gradients are dyadic (integers / 64) and depend
on (rank, step) only, so their sums are exact in any order. ``--numel N``
trains one flat tensor of N floats instead (its gradient a dyadic constant per
(rank, step); the weights are then left out of the output). With
``--progress`` a line ``step N`` is printed after each step. The last line is a
JSON object: the final weights and versions and the seconds the steps took, or
``{"error": TYPE, "message": ...}`` (exit 3) when a request failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np

import aps

SHAPES = {"embed": (30, 40), "hidden": (1500,), "head": (17, 23)}


def initial() -> dict[str, np.ndarray]:
    """Fixed starting weights (dyadic too)."""
    out = {}
    for index, (name, shape) in enumerate(SHAPES.items()):
        size = int(np.prod(shape))
        out[name] = (((np.arange(size) * (index + 3)) % 97 - 48) / 16).astype(np.float32).reshape(shape)
    return out


def gradient(rank: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([rank, step])
    return {name: (rng.integers(-8, 9, shape) / 64).astype(np.float32) for name, shape in SHAPES.items()}


def big_gradient(numel: int) -> Callable[[int, int], np.ndarray]:
    grad = np.empty(numel, np.float32)

    def make(rank: int, step: int) -> np.ndarray:
        grad.fill(((rank + 1) * (step % 5 + 1)) / 64)
        return grad

    return make


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("addresses")
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of 'compute' per step")
    parser.add_argument("--no-reconnect", action="store_true")
    parser.add_argument("--server-timeout", type=float, default=60.0)
    parser.add_argument("--reconnect-timeout", type=float, default=300.0)
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--numel", type=int, help="train one flat tensor of this many floats")
    args = parser.parse_args()
    if args.numel:
        params, make_gradient = {"w": np.zeros(args.numel, np.float32)}, big_gradient(args.numel)
    else:
        params, make_gradient = initial(), gradient
    addresses = args.addresses.split(",")
    options = {"server_timeout": args.server_timeout, "reconnect": not args.no_reconnect,
               "reconnect_timeout": args.reconnect_timeout}
    step = -1
    dropped = 0
    try:
        worker = aps.Worker(addresses if len(addresses) > 1 else addresses[0], args.rank, args.world,
                            transport="tcp", **options)
        with worker:
            worker.init(params)
            started = time.monotonic()
            for step in range(args.steps):
                if args.sleep:
                    time.sleep(args.sleep)
                worker.push_pull(make_gradient(args.rank, step))
                dropped += worker.last_push_dropped
                if args.progress:
                    print(f"step {step}", flush=True)
            seconds = time.monotonic() - started
            shards = getattr(worker, "shards", (worker,))
            result = {
                "rank": args.rank,
                "steps": args.steps,
                "version": worker.version,
                "clock": worker.clock,
                "shard_versions": [shard.version for shard in shards],
                "dropped": dropped,
                "seconds": seconds,
                "nbytes": worker.layout.nbytes,
                "weights": {} if args.numel else {name: value.ravel().tolist() for name, value in worker.weights.items()},
            }
    except aps.APSError as exc:
        print(json.dumps({"rank": args.rank, "step": step, "error": type(exc).__name__, "message": str(exc),
                          "at": time.time()}), flush=True)
        return 3
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
