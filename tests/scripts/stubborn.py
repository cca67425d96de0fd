"""A worker script for the launcher's teardown tests.

Joins an ASP server, records its pid and the pid of a child process it starts
(``$PID_DIR/RANK.pids``), then pushes forever; the rank given by ``$CRASH_RANK``
exits with status 3 instead. With ``$IGNORE_SIGTERM`` set, the worker and its
child ignore SIGTERM: only SIGKILL stops them.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np

import aps

rank = int(os.environ["RANK"])
if os.environ.get("IGNORE_SIGTERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child: an ignored signal stays ignored
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with aps.Worker.from_env() as worker:
    worker.init({"w": np.zeros(16, np.float32)})
    path = os.path.join(os.environ["PID_DIR"], f"{rank}.pids")
    with open(path + ".tmp", "w") as fh:
        fh.write(f"{os.getpid()} {child.pid}\n")
    os.replace(path + ".tmp", path)
    if os.environ.get("CRASH_RANK") == str(rank):
        time.sleep(0.5)
        print("crashing on purpose", flush=True)
        sys.exit(3)
    while True:
        worker.push_pull(worker.grads)
        time.sleep(0.01)
