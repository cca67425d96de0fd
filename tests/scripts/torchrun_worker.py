"""A training process under torchrun (tests/integration/test_torchrun.py): aps as it is, with
torchrun's RANK and WORLD_SIZE; logs every step to LOG_DIR/pid-<pid>.jsonl until LOG_DIR/STOP."""

import json
import os
import pathlib
import time

import torch

import aps.torch

here = pathlib.Path(os.environ["LOG_DIR"])
model = torch.nn.Linear(8, 1)
optimizer = aps.torch.Optimizer(model, transport="tcp")
worker = optimizer.worker
log = open(here / f"pid-{os.getpid()}.jsonl", "a", buffering=1)
print(json.dumps({"pid": os.getpid(), "rank": worker.rank, "world_size": int(os.environ["WORLD_SIZE"]),
                  "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "version": worker.version,
                  "joined_running": worker.shards[0]._core.joined_running}), file=log)
x, y = torch.randn(64, 8), torch.randn(64, 1)
while not (here / "STOP").exists():
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    print(json.dumps({"version": worker.version, "live": worker.num_workers}), file=log)
    time.sleep(0.05)
worker.close()
print(json.dumps({"done": True}), file=log)
