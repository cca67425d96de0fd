"""Server statistics: the recent update rate and the bytes each transport moved."""

import time

import numpy as np
import pytest

from aps.server.stats import RATE_WINDOW_S, ServerStats
from tests.harness import Harness


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_recent_rate_is_windowed_and_falls_to_zero():
    clock = Clock()
    stats = ServerStats(1, clock)
    stats.training_started = clock.now
    version = 0
    for _ in range(20 * 50):  # 50 updates a second for 20 s
        clock.now += 0.02
        version += 1
        stats.published(version)
    recent, mean = stats.update_rates(version)
    assert recent == pytest.approx(50, rel=0.05) and mean == pytest.approx(50, rel=0.01)
    for _ in range(5 * 10):  # then 10 a second for 5 s: the recent rate follows, the mean does not
        clock.now += 0.1
        version += 1
        stats.published(version)
    recent, mean = stats.update_rates(version)
    assert recent == pytest.approx((5 * 10 + (RATE_WINDOW_S - 5) * 50) / RATE_WINDOW_S, rel=0.1)
    clock.now += RATE_WINDOW_S + 1  # training ended: nothing for a whole window
    recent, mean = stats.update_rates(version)
    assert recent == 0.0 and mean > 0
    clock.now += 3600  # and long after
    assert stats.update_rates(version)[0] == 0.0


def test_the_rate_of_a_young_server_counts_from_its_start():
    clock = Clock()
    stats = ServerStats(1, clock)
    for version in range(1, 11):  # 10 updates in its first 2 s
        clock.now += 0.2
        stats.published(version)
    assert stats.update_rates(10)[0] == pytest.approx(5.0, rel=0.01)


def test_the_snapshot_counts_bytes_per_transport_and_reports_the_process():
    h = Harness(workers=1, sync="asp")
    h.engine.stats.traffic["tcp"].bytes_in += 100
    h.engine.stats.traffic["shm"].bytes_in += 4000
    h.engine.stats.traffic["shm"].bytes_out += 8000
    server = h.engine.stats_snapshot()["server"]
    assert (server["bytes_in"], server["bytes_out"]) == (4100, 8000)
    assert server["transports"] == {"tcp": {"bytes_in": 100, "bytes_out": 0},
                                    "shm": {"bytes_in": 4000, "bytes_out": 8000}}
    process = server["process"]
    assert process["rss_bytes"] > 1 << 20 and process["cpu_s"] > 0 and process["threads"] >= 1


def test_histograms_stay_small_whatever_they_are_fed():
    from aps.server.stats import EXACT_BELOW, Histogram

    hist = Histogram()
    values = list(range(100_000)) + [1 << 40]
    for value in values:
        hist.add(value)
    assert len(hist.counts) < EXACT_BELOW + 64  # exact below EXACT_BELOW, power-of-two buckets above
    assert hist.counts[3] == 1 and hist.counts[256] == 256 and hist.counts[1 << 16] == 100_000 - (1 << 16)
    assert hist.mean == sum(values) / len(values) and hist.max == 1 << 40


def test_each_connected_rank_shows_the_optimizer_values_its_pushes_are_applied_with():
    from aps.cli.status import format_stats
    from aps.wire.protocol import HyperGroup

    h = Harness(workers=3, sync="asp", numel=8, optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4)
    h.join_all()
    h.leave(2)
    rows = h.engine.stats_snapshot()["workers"]
    server_values = {"stop": 8, "lr": 0.05, "weight_decay": 1e-4, "momentum": 0.9, "dampening": 0.0}
    assert [(w["hyperparameters"], w["hyperparameters_own"]) for w in rows] == [
        ([server_values], False), ([server_values], False), (None, None)]
    table = format_stats(h.engine.stats_snapshot())
    assert lr_column(table) == ["0.05", "0.05", "-"]
    assert "* the worker's own" not in table  # nobody set their own: no mark, no footnote

    # Rank 0 sets its own (two groups: neighbours with equal values are one), as a HYPER request does.
    groups = [HyperGroup(2, 0.1, 0.0, 0.9, 0.0), HyperGroup(4, 0.1, 0.0, 0.9, 0.0), HyperGroup(8, 0.001, 1e-4, 0.9, 0.0)]
    h.engine.set_hyperparameters(h.workers[0].member, groups)
    rows = h.engine.stats_snapshot()["workers"]
    assert rows[0]["hyperparameters_own"] is True and rows[0]["hyperparameters"] == [
        {"stop": 4, "lr": 0.1, "weight_decay": 0.0, "momentum": 0.9, "dampening": 0.0},
        {"stop": 8, "lr": 0.001, "weight_decay": 1e-4, "momentum": 0.9, "dampening": 0.0}]
    assert rows[1]["hyperparameters"] == [server_values] and rows[1]["hyperparameters_own"] is False
    table = format_stats(h.engine.stats_snapshot())
    assert lr_column(table) == ["0.001..0.1*", "0.05", "-"]
    assert table.splitlines()[-1].startswith("* the worker's own optimizer values")


def lr_column(table: str) -> list[str]:
    """The ``lr`` column of ``aps status``'s table, one cell per rank (right-aligned under its header)."""
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    end = lines[header].index(" lr ") + 3
    rows = [line for line in lines[header + 1:] if line[:4].strip().isdigit()]
    return [line[end - 13:end].strip() for line in rows]


def test_counters_start_at_zero_with_the_process_and_the_run_totals_are_carried_apart():
    """A resumed engine's counters (what /metrics exports as counters) start at 0; the run's
    totals (the version, rejected and duplicate pushes) go on from the checkpoint's."""
    from .test_resume import checkpoint_of

    original = Harness(workers=1, sync="asp", numel=4)
    original.join_all()
    for _ in range(5):
        original.push(0, np.ones(4, np.float32))
    original.push(0, np.full(4, np.nan, np.float32))
    original.engine.stats.duplicates += 2  # (as two pushes sent again would)
    server = original.engine.stats_snapshot()["server"]
    assert server["counters"]["updates"] == server["version"] == 5
    assert (server["rejected"], server["duplicates"]) == (1, 2)

    resumed = Harness(workers=1, sync="asp", numel=4)
    resumed.engine.restore(checkpoint_of(original))
    server = resumed.engine.stats_snapshot()["server"]
    assert server["version"] == 5 and (server["rejected"], server["duplicates"]) == (1, 2)  # the run's
    counters = server["counters"]
    assert (counters["updates"], counters["pushes"], counters["rejected"], counters["duplicates"]) == (0, 0, 0, 0)
    assert abs(counters["since_unix"] - time.time()) < 60
    resumed.join(0, rejoin=True)
    for _ in range(3):
        resumed.push(0, np.ones(4, np.float32))
    server = resumed.engine.stats_snapshot()["server"]
    assert server["version"] == 8 and server["counters"]["updates"] == 3 and server["counters"]["pushes"] == 3
    assert resumed.engine.checkpoint_state()[0]["counters"] == {"rejected": 1, "duplicates": 2}  # carried on


@pytest.mark.parametrize("counters", [[1], "x", {"rejected": "many"}, {"duplicates": -1}])
def test_carried_counters_of_the_wrong_kind_are_refused_and_change_nothing(counters):
    stats = ServerStats(1)
    stats.carry({"rejected": 4})
    with pytest.raises((TypeError, ValueError)):
        stats.carry(counters)
    assert stats.run_counters() == {"rejected": 4, "duplicates": 0}
