#!/usr/bin/env python
"""The server's update passes against PyTorch's fused CPU optimizers, as ratios measured in one run.

Each of SGD with momentum, Adam and AdamW, at each ``--sizes`` (MiB of float32
parameters): the server's pass as the server runs it (``Optimizer.step``: the
next weights into a fresh snapshot slot and the next state into a spare, so
that an update is a transaction; then ``commit``) against
``torch.optim.SGD/Adam/AdamW(fused=True)`` updating the same sizes in place,
with one thread and with every thread (``torch.set_num_threads``; aps's
kernels run on one thread). ``ratio`` is torch's time over aps's: 1.0 or more
means the server's pass is at least as fast. Windows of ``--updates`` updates
are interleaved over ``--repeats``; medians. Example:
``python bench/kernels.py --out bench/results/kernels.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from aps.cli._args import ArgumentParser
from aps.server.optim import make_optimizer

OPTIMIZERS = {
    "sgd-momentum": ("sgd", {"lr": 0.01, "momentum": 0.9}, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9,
                                                                                     fused=True)),
    "adam": ("adam", {"lr": 1e-3}, lambda p: torch.optim.Adam(p, lr=1e-3, fused=True)),
    "adamw": ("adamw", {"lr": 1e-3, "weight_decay": 0.01},
              lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True)),
}


def aps_setup(name: str, numel: int):
    kind, options = OPTIMIZERS[name][:2]
    rng = np.random.default_rng(0)
    slots = [rng.standard_normal(numel, dtype=np.float32), np.empty(numel, np.float32)]
    grad = np.float32(1e-3) * rng.standard_normal(numel, dtype=np.float32)
    optimizer = make_optimizer(kind, numel, **options)

    def update() -> None:
        assert optimizer.step(slots[1], slots[0], grad)
        optimizer.commit()
        slots.reverse()  # (the new version becomes current, as the table publishes it)

    return update


def torch_setup(name: str, numel: int):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel) * 1e-3
    optimizer = OPTIMIZERS[name][2]([param])
    return optimizer.step


def timed(update, updates: int) -> float:
    started = time.perf_counter()
    for _ in range(updates):
        update()
    return (time.perf_counter() - started) / updates


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64,256", help="MiB of parameters, comma-separated (default 1,16,64,256)")
    parser.add_argument("--updates", type=int, default=5, help="updates per window (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="windows per configuration (default 5)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    threads = os.cpu_count() or 1
    report: dict = {"threads": threads, "updates": args.updates, "repeats": args.repeats, "results": []}
    for size in (int(s) for s in args.sizes.split(",")):
        numel = (size << 20) // 4
        for name in OPTIMIZERS:
            setups = {"aps": aps_setup(name, numel), "torch": torch_setup(name, numel)}
            for update in setups.values():
                update()  # (pages touched, state made)
            times: dict[str, list[float]] = {"aps": [], "torch-1": [], f"torch-{threads}": []}
            for _ in range(args.repeats):
                times["aps"].append(timed(setups["aps"], args.updates))
                for key, count in (("torch-1", 1), (f"torch-{threads}", threads)):
                    torch.set_num_threads(count)
                    times[key].append(timed(setups["torch"], args.updates))
            medians = {key: statistics.median(values) for key, values in times.items()}
            row = {"optimizer": name, "mib": size, "ms": {key: round(v * 1e3, 3) for key, v in medians.items()},
                   "ratio_1_thread": round(medians["torch-1"] / medians["aps"], 3),
                   f"ratio_{threads}_threads": round(medians[f"torch-{threads}"] / medians["aps"], 3)}
            report["results"].append(row)
            print(f"{size:4d} MiB {name:13s} aps {medians['aps'] * 1e3:8.2f} ms; torch fused 1 thread "
                  f"{medians['torch-1'] * 1e3:8.2f} ms ({row['ratio_1_thread']:.2f}x), {threads} threads "
                  f"{medians[f'torch-{threads}'] * 1e3:8.2f} ms ({row[f'ratio_{threads}_threads']:.2f}x)", flush=True)
            del setups
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
