"""A worker script for ``aps launch --step-time``: trains a tiny model for a while, prints its clock."""

import time

import torch

import aps.torch

model = torch.nn.Linear(4, 1)
with aps.torch.Optimizer(model) as opt:
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    print(f"rank {opt.worker.rank} clock {opt.clock}", flush=True)
