#!/usr/bin/env python
"""The server's update passes against PyTorch's fused CPU optimizers, as ratios measured in one run.

Each of SGD with momentum, Adam and AdamW, at each ``--sizes`` (MiB of float32
parameters): the server's pass as the server runs it (``Optimizer.step``: the
next weights into a fresh snapshot slot and the next state into a spare, so
that an update is a transaction; then ``commit``) against
``torch.optim.SGD/Adam/AdamW(fused=True)`` updating the same sizes in place,
with one thread and with every thread (``torch.set_num_threads``; aps's
kernels run on ``--kernel-threads``, 1 by default, and on every thread). Where
``deepspeed`` is installed, ``DeepSpeedCPUAdam`` (its AVX-512/AVX2 CPU Adam,
compiled at first use; it runs on torch's threads) is timed for Adam and
AdamW too. aps's passes run on each instruction set this processor runs
(``--isas``; ``aps serve --kernel-isa``: Adam, AdamW and a round's sum are
compiled for several, the same results bit for bit); ``aps`` is the default
one, the widest. ``ratio`` is the peer's time over aps's: 1.0 or more means the
server's pass is at least as fast. Windows of ``--updates`` updates are
interleaved over ``--repeats``; medians. Example:
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

from aps import _core
from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, write_report
from aps.layout import line_aligned
from aps.server.engine.optim import KernelThreads, make_optimizer

try:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
except ImportError:  # (not installed: aps does not depend on it)
    DeepSpeedCPUAdam = None

OPTIMIZERS = {
    "sgd-momentum": ("sgd", {"lr": 0.01, "momentum": 0.9}, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9,
                                                                                     fused=True)),
    "adam": ("adam", {"lr": 1e-3}, lambda p: torch.optim.Adam(p, lr=1e-3, fused=True)),
    "adamw": ("adamw", {"lr": 1e-3, "weight_decay": 0.01},
              lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True)),
}


DEEPSPEED = {"adam": {"lr": 1e-3, "adamw_mode": False}, "adamw": {"lr": 1e-3, "weight_decay": 0.01, "adamw_mode": True}}


def aps_setup(name: str, numel: int, threads: KernelThreads):
    kind, options = OPTIMIZERS[name][:2]
    rng = np.random.default_rng(0)
    slots = [line_aligned(numel), line_aligned(numel)]  # (as the server makes its slots)
    slots[0][:] = rng.standard_normal(numel, dtype=np.float32)
    grad = line_aligned(numel)  # (as the server receives a gradient: see aps.server.requests.intake)
    grad[:] = np.float32(1e-3) * rng.standard_normal(numel, dtype=np.float32)
    optimizer = make_optimizer(kind, numel, threads=threads, **options)

    def update() -> None:
        assert optimizer.step(slots[1], slots[0], grad)
        optimizer.commit()
        slots.reverse()  # (the new version becomes current, as the table publishes it)

    return update


def torch_setup(name: str, numel: int, deepspeed: bool = False):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel) * 1e-3
    optimizer = DeepSpeedCPUAdam([param], **DEEPSPEED[name]) if deepspeed else OPTIMIZERS[name][2]([param])
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
    parser.add_argument("--kernel-threads", type=int, default=1,
                        help="threads of aps's passes (aps serve --kernel-threads; default 1)")
    parser.add_argument("--isas", default=",".join(_core.kernel_isas()),
                        help="instruction sets of aps's passes, comma-separated (default: every one this processor "
                        f"runs, {','.join(_core.kernel_isas())}); the last is the one called aps")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    isas = args.isas.split(",")
    for isa in isas:
        _core.set_kernel_isa(isa)  # (refuses one this processor cannot run)
    threads = os.cpu_count() or 1
    ours = KernelThreads(args.kernel_threads)
    report: dict = {**machine_info(), "threads": threads, "kernel_threads": args.kernel_threads, "isa": isas[-1],
                    "isas": isas, "fused_multiply_add": _core.fused_multiply_add(), "updates": args.updates,
                    "repeats": args.repeats, "deepspeed": DeepSpeedCPUAdam is not None, "results": []}
    for size in (int(s) for s in args.sizes.split(",")):
        numel = (size << 20) // 4
        for name in OPTIMIZERS:
            setups = {"aps": aps_setup(name, numel, ours), "torch": torch_setup(name, numel)}
            if DeepSpeedCPUAdam is not None and name in DEEPSPEED:
                setups["deepspeed"] = torch_setup(name, numel, deepspeed=True)
            for update in setups.values():
                update()  # (pages touched, state made)
            times: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                for isa in isas:
                    _core.set_kernel_isa(isa)
                    times.setdefault(f"aps-{isa}", []).append(timed(setups["aps"], args.updates))
                for peer in (p for p in setups if p != "aps"):
                    for count in sorted({1, threads}):
                        torch.set_num_threads(count)
                        times.setdefault(f"{peer}-{count}", []).append(timed(setups[peer], args.updates))
            medians = {key: statistics.median(values) for key, values in times.items()}
            medians["aps"] = medians.pop(f"aps-{isas[-1]}")
            row = {"optimizer": name, "mib": size, "ms": {key: round(v * 1e3, 3) for key, v in medians.items()},
                   "ratio": {key: round(v / medians["aps"], 3) for key, v in medians.items() if key != "aps"}}
            report["results"].append(row)
            peers = "; ".join(f"{key} {medians[key] * 1e3:.2f} ms ({ratio:.2f}x)" for key, ratio in row["ratio"].items())
            print(f"{size:4d} MiB {name:13s} aps {medians['aps'] * 1e3:8.2f} ms; {peers}", flush=True)
            del setups
    ours.close()
    write_report(report, args.out)
    if not args.out:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
