"""The virtual clock against real runs on ``aps compare``'s setting: four worker processes, one 2.5
times slower, against ``train_virtual`` with the same speeds, jitter, data, learning rate and batch."""

import json
import statistics
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from aps.cli._args import parse_setting  # noqa: E402
from aps.workloads import load  # noqa: E402
from aps.lab.virtual import agreement, train_virtual  # noqa: E402

SPEEDS = [1.0, 1.0, 1.0, 2.5]


@pytest.mark.slow
def test_virtual_runs_agree_with_real_ones_within_their_spread(tmp_path):
    """ASP and SSP s=3, three real runs of 4 s and three virtual runs as long in gradients: a
    virtual run is as far from a real one as real runs are from each other (the run-to-run spread),
    in the staleness distribution and in the accuracy against gradients applied."""
    out = tmp_path / "real"
    done = subprocess.run(
        [sys.executable, "-m", "aps", "compare", "--workers", "4", "--speeds", "1,1,1,2.5", "--clusters",
         "heterogeneous", "--paradigms", "asp,ssp:3", "--lr-staleness", "none", "--budget", "3", "--repeats", "3",
         "--dataset", "digits", "--step-time", "0.04", "--jitter", "0.1", "--eval-every", "0.2", "--target", "0.9",
         "--no-progress", "--no-dashboard", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = json.loads((out / "results.json").read_text())
    dataset = load("digits", seed=0)
    for sync in ("asp", "ssp:3"):
        real = [r for r in records if r["sync"] == sync]
        count = int(statistics.median(r["curve_gradients"][-1][0] for r in real))
        virtual = [train_virtual(parse_setting(sync), SPEEDS, dataset=dataset, jitter=0.1, iterations=count,
                                 seed=seed) for seed in range(3)]
        a = agreement(real, virtual, points=10)
        print(sync, {k: v for k, v in a.items() if not k.startswith("final")})
        # Staleness: the same distribution, as far from a real run's as real runs are from each other. (ASP's
        # mean is P - 1 whatever the timing; SSP's depends on it.)
        real_mean, virtual_mean = statistics.fmean(a["mean_staleness_real"]), statistics.fmean(a["mean_staleness_virtual"])
        assert abs(virtual_mean - real_mean) <= 0.05 * real_mean + 0.05, (sync, real_mean, virtual_mean)
        assert a["staleness_tvd_virtual_real"] <= 1.5 * a["staleness_tvd_real_real"] + 0.03, (sync, a)
        # Accuracy against gradients applied, over the gradients every run reached.
        assert a["accuracy_distance_virtual_real"] <= 1.5 * a["accuracy_distance_real_real"] + 0.015, (sync, a)
