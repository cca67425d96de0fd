"""The virtual clock against real runs on ``aps compare``'s setting: four worker processes, one 2.5
times slower, against ``train_virtual`` with the same speeds, jitter, data, learning rate and batch."""

import itertools
import json
import statistics
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from aps.cli._args import parse_setting  # noqa: E402
from aps.workloads import load  # noqa: E402
from aps.workloads.virtual import curve_distance, mean_staleness, staleness_distance, train_virtual  # noqa: E402

SPEEDS = [1.0, 1.0, 1.0, 2.5]


def _mean_distance(pairs, distance, key) -> float:
    return statistics.fmean(distance(a[key], b[key]) for a, b in pairs)


@pytest.mark.slow
def test_virtual_runs_agree_with_real_ones_within_their_spread(tmp_path):
    """ASP and SSP s=3, two real runs of 5 s and three virtual runs as long in gradients: the
    staleness distributions are the same, and a virtual run's accuracy against gradients applied
    is as far from a real run's as runs of one kind are from each other (the run-to-run spread)."""
    out = tmp_path / "real"
    done = subprocess.run(
        [sys.executable, "-m", "aps", "compare", "--workers", "4", "--speeds", "1,1,1,2.5", "--clusters",
         "heterogeneous", "--paradigms", "asp,ssp:3", "--lr-staleness", "none", "--budget", "5", "--repeats", "2",
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
        across = list(itertools.product(virtual, real))
        within = list(itertools.combinations(real, 2)) + list(itertools.combinations(virtual, 2))
        # Staleness: the same distribution; the virtual clock keeps the server's own books.
        real_mean = statistics.fmean(mean_staleness(r["staleness_hist"]) for r in real)
        virtual_mean = statistics.fmean(mean_staleness(v["staleness_hist"]) for v in virtual)
        assert abs(virtual_mean - real_mean) <= 0.05 * real_mean + 0.05, (sync, real_mean, virtual_mean)
        tvd_across = _mean_distance(across, staleness_distance, "staleness_hist")
        tvd_within = _mean_distance(within, staleness_distance, "staleness_hist")
        assert tvd_across <= 1.5 * tvd_within + 0.03, (sync, tvd_across, tvd_within)
        # Accuracy against gradients applied, over the gradients every run reached.
        end = min(r["curve_gradients"][-1][0] for r in real + virtual)
        points = [end * (i + 1) / 10 for i in range(10)]

        def distance(a, b):
            return curve_distance(a, b, points)

        accuracy_across = _mean_distance(across, distance, "curve_gradients")
        accuracy_within = _mean_distance(within, distance, "curve_gradients")
        print(f"{sync}: staleness {real_mean:.2f} real, {virtual_mean:.2f} virtual; TVD {tvd_across:.3f} across, "
              f"{tvd_within:.3f} within; accuracy distance {accuracy_across:.3f} across, {accuracy_within:.3f} within")
        assert accuracy_across <= 1.5 * accuracy_within + 0.01, (sync, accuracy_across, accuracy_within)
