"""One process of an elastic run (tests/integration/test_elastic.py): joins under a rank the
server assigns, then pushes a one-hot gradient per iteration into a slot of its own (row
``ROW`` of the ledger, column = its iteration) and logs each push, until the file ``STOP``
exists (then it stops) or ``LEAVE`` does (then it leaves for good: worker.leave())."""

import json
import pathlib
import sys
import time

import numpy as np

import aps

row, rows, slots = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
here = pathlib.Path(sys.argv[4])
pause = float(sys.argv[5])
stop, leave = here / "STOP", here / f"LEAVE-{row}"
log = open(here / f"worker-{row}.jsonl", "a", buffering=1)

worker = aps.Worker(heartbeat=0.5)  # (no $RANK, no $WORLD_SIZE: the server assigns a rank)
worker.init({"w": np.zeros(rows * slots, np.float32)}, timeout=120)
print(json.dumps({"joined": worker.rank, "live": worker.num_workers, "range": worker.workers_range,
                  "version": worker.version}), file=log)
grad = np.zeros(rows * slots, np.float32)
for i in range(slots):
    if stop.exists() or leave.exists():
        break
    grad[:] = 0
    grad[row * slots + i] = 1
    version, began = worker.version, time.monotonic()
    worker.push_pull(grad)
    print(json.dumps({"i": i, "version": version, "dropped": worker.last_push_dropped, "rank": worker.rank,
                      "live": worker.num_workers, "s": time.monotonic() - began}), file=log)
    time.sleep(pause)
if leave.exists():
    worker.leave()
    print(json.dumps({"left": True}), file=log)
else:
    worker.close()
