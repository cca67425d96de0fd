#!/usr/bin/env python
"""What delay compensation costs the server per update, as ratios measured in one run.

The server's update of a ``--model``-byte float32 model (the optimizer's fused
kernel writing the next weights into a free slot), plain and with each
``--compensation`` (``Compensation.apply``: block by block, the compensation
into scratch still in cache, the same kernel, and gap's step scale), for SGD,
SGD with momentum and Adam: the ratio of median times, compensated over plain,
in the same process. In memory traffic plain SGD moves 3 vectors (w, g in; w'
out), DC 4 (w_then more): about 1.3x; the rest is the compensation's
arithmetic (a division and a square root per element for dc-adaptive, two
divisions and the step scale for gap). Example:
``python bench/compensation.py --out bench/results/compensation.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from aps.cli._args import ArgumentParser, parse_size
from aps.lab.bench import machine_info, write_report
from aps.server.engine.compensation import Compensation
from aps.server.engine.optim import make_optimizer

OPTIMIZERS = {"sgd": {"lr": 0.01}, "momentum": {"lr": 0.01, "momentum": 0.9}, "adam": {"lr": 1e-3}}
KINDS = ("none", "dc", "dc-adaptive", "gap")


def one_update(optimizer, compensation, w_out, w_in, w_then, grad) -> None:
    """One update as the server's PushJob makes it (compensated: Compensation.apply)."""
    if compensation is None:
        assert optimizer.step(w_out, w_in, grad)
    else:
        compensation.begin()
        assert compensation.apply(optimizer, w_out, w_in, grad, 1, w_then, 1.0)
        compensation.commit()
    optimizer.commit()


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=parse_size, default=64 << 20, help="float32 bytes of parameters (default 64M)")
    parser.add_argument("--updates", type=int, default=5, help="updates per window (default 5)")
    parser.add_argument("--repeats", type=int, default=7, help="windows per configuration (default 7)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    n = args.model // 4
    rng = np.random.default_rng(0)
    w_in = rng.standard_normal(n, dtype=np.float32)
    w_then = w_in + np.float32(1e-3) * rng.standard_normal(n, dtype=np.float32)
    grad = np.float32(1e-3) * rng.standard_normal(n, dtype=np.float32)
    w_out = np.empty_like(w_in)
    report: dict = {**machine_info(), "model_bytes": args.model, "updates": args.updates, "repeats": args.repeats, "optimizers": {}}
    for name, options in OPTIMIZERS.items():
        setups = {}
        for kind in KINDS:
            optimizer = make_optimizer("adam" if name == "adam" else "sgd", n, **options)
            compensation = None if kind == "none" else Compensation(kind, 0.5, n)
            setups[kind] = (optimizer, compensation)
            one_update(optimizer, compensation, w_out, w_in, w_then, grad)  # (pages touched, state made)
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.repeats):  # interleaved: drifts of the machine touch every kind alike
            for kind in KINDS:
                started = time.perf_counter()
                for _ in range(args.updates):
                    one_update(*setups[kind], w_out, w_in, w_then, grad)
                times[kind].append((time.perf_counter() - started) / args.updates)
        medians = {kind: statistics.median(values) for kind, values in times.items()}
        report["optimizers"][name] = {
            "update_ms": {kind: round(value * 1e3, 3) for kind, value in medians.items()},
            "ratio": {kind: round(medians[kind] / medians["none"], 3) for kind in KINDS if kind != "none"},
            "gb_per_s_plain": round(3 * args.model / medians["none"] / 1e9, 2),
        }
        print(f"{name:9s} plain {medians['none'] * 1e3:7.2f} ms/update; "
              + ", ".join(f"{kind} {medians[kind] / medians['none']:.2f}x" for kind in KINDS if kind != "none"))
    write_report(report, args.out)
    if not args.out:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
