"""What the trainer integrations' tests share: worker processes run from a script in tests/scripts."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys


def run_worker_scripts(script: pathlib.Path, address: str, workers: int, out: pathlib.Path,
                       timeout: float = 300.0) -> list[dict]:
    """Run ``script ADDRESS RANK WORKERS OUT/RANK.json`` as each of ``workers`` processes at once;
    their JSON results, in rank order (a failed one fails the test with its error output)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script), address, str(rank), str(workers),
                               str(out / f"{rank}.json")], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for rank in range(workers)]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(workers)]
