#!/usr/bin/env python
"""What aps.torch.Optimizer's torch.optim features cost, as ratios measured in one run.

One ``aps serve`` process (ASP, SGD with momentum) and one worker process
training a model of ``--model`` bytes of float32 parameters (linear layers),
``step()`` only (the gradients stay as they are: no forward or backward, so
only what aps does is timed), over TCP and over shared memory:

- ``scheduled / constant``: a LambdaLR that changes every group's learning
  rate at every step (a HYPER request before each push) against a constant
  rate, three param groups. Bound: 1.05.
- ``state_dict / step``: one ``opt.state_dict()`` (the momentum buffer
  fetched from the server and repacked per parameter) against one ``step()``.
- ``bf16 / float32``: the same model in bfloat16 (float32 master weights on
  the server; 16-bit gradients and weights on the wire over TCP, a widening
  and a rounding copy on the worker) against float32.

Windows of ``--steps`` steps are interleaved across ``--repeats``; each ratio is
of medians. Example: ``python bench/torch_optimizer.py --out bench/results/torch-optimizer.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


import torch
from torch import nn

import aps.torch
from aps.cli._args import ArgumentParser, parse_size
from aps.testing import ServerProcess

SCHEDULE_BOUND = 1.05


def make_model(numel: int, dtype: torch.dtype) -> nn.Module:
    side = 1024
    layers = max(1, numel // (side * side + side))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(side, side) for _ in range(layers)]).to(dtype)


def groups(model: nn.Module) -> list[dict]:
    weights = [p for p in model.parameters() if p.ndim > 1]
    return [{"params": weights[:-1], "weight_decay": 1e-4}, {"params": weights[-1:]},
            {"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0}]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=parse_size, default=64 << 20, help="float32 bytes of parameters (default 64M)")
    parser.add_argument("--steps", type=int, default=20, help="steps per window (default 20)")
    parser.add_argument("--repeats", type=int, default=5, help="windows per configuration (default 5)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report: dict = {"model_bytes": args.model, "steps": args.steps, "repeats": args.repeats, "transports": {}}
    for transport in ("tcp", "shm"):
        times: dict[str, list[float]] = {"constant": [], "scheduled": [], "state_dict": [], "bf16": [], "float32": []}
        setups = {}
        servers = []
        try:
            for name, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
                server = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "0.01", "--momentum", "0.9",
                                       "--log-level", "warning")
                servers.append(server)
                model = make_model(args.model // 4, dtype)
                opt = aps.torch.Optimizer(groups(model), server.address, 0, 1, model=model, transport=transport)
                with torch.no_grad():
                    for param in model.parameters():
                        if param.grad is None:  # a 16-bit parameter's own .grad (float32 ones are views)
                            param.grad = torch.zeros_like(param)
                        param.grad.normal_(0, 1e-3)
                setups[name] = (model, opt)
            opt = setups["float32"][1]
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

            def window(name: str) -> float:
                model, opt = setups["float32" if name in ("constant", "scheduled", "state_dict") else name]
                start = time.perf_counter()
                for _ in range(args.steps):
                    if name == "state_dict":
                        opt.state_dict()
                        continue
                    opt.step()
                    if name == "scheduled":
                        schedule.step()
                return (time.perf_counter() - start) / args.steps

            for name in times:  # warm up every path once
                window(name)
            for _ in range(args.repeats):
                for name in times:  # "constant" keeps the rate the schedule set last: no HYPER
                    times[name].append(window(name))
        finally:
            for _, opt in setups.values():
                opt.close()
            for server in servers:
                server.stop()
        medians = {name: statistics.median(values) for name, values in times.items()}
        result = {
            "median_s": medians,
            "scheduled_over_constant": medians["scheduled"] / medians["constant"],
            "state_dict_over_step": medians["state_dict"] / medians["constant"],
            "bf16_over_float32": medians["bf16"] / medians["float32"],
        }
        report["transports"][transport] = result
        print(f"{transport}: step {medians['constant'] * 1e3:.1f} ms; scheduled/constant "
              f"{result['scheduled_over_constant']:.3f} (bound {SCHEDULE_BOUND}); state_dict/step "
              f"{result['state_dict_over_step']:.2f}; bf16/float32 {result['bf16_over_float32']:.2f}", flush=True)
    report["ok"] = all(t["scheduled_over_constant"] <= SCHEDULE_BOUND for t in report["transports"].values())
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
