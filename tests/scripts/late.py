"""A worker script for ``aps launch``: rank 1 joins LATE_S seconds late, then everyone pushes once."""

import os
import time

import numpy as np

import aps

rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(float(os.environ.get("LATE_S", "7")))
with aps.Worker.from_env() as worker:
    worker.init({"w": np.zeros(4, np.float32)})
    worker.push_pull(worker.grads)
print(f"rank {rank} done", flush=True)
