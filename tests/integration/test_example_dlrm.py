"""examples/dlrm.py as users run it: ``aps launch`` with workers under ASP and SSP, each
printing the test AUC of every epoch, the last one well above chance."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples", "dlrm.py")
EPOCHS = 2


def launch(tmp_path, workers: int, *sync: str) -> list[list[float]]:
    """Run the example under ``aps launch`` with tiny flags; each rank's AUC per epoch."""
    done = subprocess.run(
        [sys.executable, "-m", "aps", "launch", "--host", "127.0.0.1", "--port", "0", "--workers", str(workers),
         *sync, "--optimizer", "adam", "--lr", "0.003", "--no-progress", "--no-dashboard", "--log-dir", str(tmp_path),
         SCRIPT, "--epochs", str(EPOCHS), "--steps", "20", "--batch-size", "128", "--test-size", "2048"],
        capture_output=True, text=True, timeout=240)
    logs = [(tmp_path / f"worker-{rank}.log").read_text() for rank in range(workers)]
    assert done.returncode == 0, done.stderr + "\n".join(logs)
    aucs = []
    for rank, log in enumerate(logs):
        epochs = re.findall(rf"^rank {rank} epoch (\d+): loss [0-9.]+, test AUC ([0-9.]+), weights version \d+",
                            log, re.MULTILINE)
        assert [int(epoch) for epoch, _ in epochs] == list(range(1, EPOCHS + 1)), log
        aucs.append([float(auc) for _, auc in epochs])
    return aucs


def test_dlrm_under_asp_learns_the_clicks(tmp_path):
    # 2 workers x 40 steps: about 0.75 (the hidden model's own AUC is 0.87)
    for rank_aucs in launch(tmp_path, 2, "--sync", "asp"):
        assert rank_aucs[-1] > 0.55, rank_aucs


@pytest.mark.slow  # (4 worker processes: about 17 s alone on 2 cores, more beside the suite)
def test_dlrm_under_ssp_with_four_workers_learns_the_clicks(tmp_path):
    for rank_aucs in launch(tmp_path, 4, "--sync", "ssp", "--staleness", "2"):
        assert rank_aucs[-1] > 0.55, rank_aucs
