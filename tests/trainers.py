"""What the trainer integrations' tests share: worker processes run from a script in tests/scripts."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest


def run_worker_scripts(script: pathlib.Path, address: str, workers: int, out: pathlib.Path,
                       timeout: float = 300.0) -> list[dict]:
    """Run ``script ADDRESS RANK WORKERS OUT/RANK.json`` as each of ``workers`` processes at once;
    their JSON results, in rank order (a failed one fails the test with its error output)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    _wait([subprocess.Popen([sys.executable, str(script), address, str(rank), str(workers),
                             str(out / f"{rank}.json")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True) for rank in range(workers)], timeout)
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(workers)]


def launch_workers(script: pathlib.Path, address: str, workers: int, out: pathlib.Path, how: str,
                   env: dict[str, str] | None = None, timeout: float = 300.0) -> None:
    """Run ``script OUT`` as ``workers`` processes launched as the docs say, ``how``: "torchrun"
    (``torchrun --standalone --nproc-per-node WORKERS``) or "env" (``RANK=$rank WORLD_SIZE=WORKERS
    python script OUT``, nothing else of torch.distributed set); ``APS_ADDRESS`` names the server.
    A failed one fails the test with its error output."""
    env = {**os.environ, "APS_ADDRESS": address, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if how == "torchrun":
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
        if torchrun is None:
            pytest.skip("torchrun is not installed next to this Python")
        commands = [([torchrun, "--standalone", "--nproc-per-node", str(workers), str(script), str(out)], env)]
    elif how == "env":
        commands = [([sys.executable, str(script), str(out)], {**env, "RANK": str(rank), "WORLD_SIZE": str(workers)})
                    for rank in range(workers)]
    else:
        raise ValueError(f"launched by torchrun or env, not {how!r}")
    _wait([subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
           for command, environment in commands], timeout)


def _wait(procs: list[subprocess.Popen], timeout: float) -> None:
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
