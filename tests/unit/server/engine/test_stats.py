"""Server statistics: the recent update rate and the bytes each transport moved."""

import time

import numpy as np
import pytest

from aps.server.engine.stats import RATE_WINDOW_S, ServerStats
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
    from aps.server.engine.stats import EXACT_BELOW, Histogram

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
    h.engine.training.set_hyperparameters(h.workers[0].member, groups)
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
    resumed.engine.durability.restore(checkpoint_of(original))
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
    assert resumed.engine.durability.checkpoint_state()[0]["counters"] == {"rejected": 1, "duplicates": 2}  # carried on


@pytest.mark.parametrize("counters", [[1], "x", {"rejected": "many"}, {"duplicates": -1}])
def test_carried_counters_of_the_wrong_kind_are_refused_and_change_nothing(counters):
    stats = ServerStats(1)
    stats.carry({"rejected": 4})
    with pytest.raises((TypeError, ValueError)):
        stats.carry(counters)
    assert stats.run_counters() == {"rejected": 4, "duplicates": 0}


def tables_harness(**options) -> Harness:
    from aps.tables import Table

    tables = (("items", Table(rows=10**9, dim=8)), ("users", Table(rows=100, dim=4, optimizer="adagrad")))
    h = Harness(workers=1, sync="asp", numel=4, tables=tables, **options)
    h.join_all()
    return h


def pull_rows(h: Harness, table: int, ids) -> None:
    from aps.wire.rows import RowSection

    h.pull(0, [RowSection(table, np.asarray(ids, np.int64), None)])
    assert not h.workers[0].errors and not h.workers[0].waiting


def push_rows(h: Harness, table: int, ids, dim: int) -> None:
    from aps.wire.rows import RowSection

    ids = np.asarray(ids, np.int64)
    h.push(0, None, rows=[RowSection(table, ids, np.full((len(ids), dim), 0.5, np.float32))])
    assert not h.workers[0].errors and not h.workers[0].results[-1].dropped


def test_each_table_shows_its_rows_and_bytes_held_and_the_rows_pulled_and_pushed():
    from aps.cli.status import format_stats

    h = tables_harness()
    tables = h.engine.stats_snapshot()["server"]["tables"]
    assert list(tables) == ["items", "users"]  # in their declared order
    assert tables["items"] == {"dim": 8, "optimizer": "sgd", "rows": 0, "bytes": h.engine.model.rows["items"].nbytes,
                               "rows_pulled": 0, "rows_pushed": 0, "rows_evicted": 0}
    pull_rows(h, 0, [5, 7, 5, 10**8])  # a duplicate: counted; a pull makes no row
    tables = h.engine.stats_snapshot()["server"]["tables"]
    assert (tables["items"]["rows"], tables["items"]["rows_pulled"], tables["items"]["rows_pushed"]) == (0, 4, 0)
    first_bytes = tables["items"]["bytes"]
    assert first_bytes == h.engine.model.rows["items"].nbytes
    assert tables["users"]["rows"] == tables["users"]["rows_pulled"] == 0
    assert h.engine.stats_snapshot()["server"]["table_memory"]["bytes"] == 0
    push_rows(h, 0, np.arange(1000, 1200), 8)  # 200 new rows
    push_rows(h, 1, [1, 2, 2], 4)
    snapshot = h.engine.stats_snapshot()["server"]
    tables = snapshot["tables"]
    assert (tables["items"]["rows"], tables["items"]["rows_pulled"], tables["items"]["rows_pushed"]) == (200, 4, 200)
    assert tables["items"]["bytes"] >= first_bytes + 200 * 8 * 4  # grows with the rows (values)
    assert snapshot["table_memory"] == {"bytes": 200 * (8 * 4 + 36) + 2 * (2 * 4 * 4 + 36),
                                        "limit": h.engine.model.table_memory.limit, "default": True,
                                        "available_at_start": h.engine.model.table_memory.available}
    assert snapshot["table_memory"]["limit"] > 0  # (the default: half the memory available at start)
    assert (tables["users"]["rows"], tables["users"]["rows_pulled"], tables["users"]["rows_pushed"]) == (2, 0, 3)
    assert tables["users"]["bytes"] >= 2 * 2 * 4 * 4  # values and Adagrad's state
    assert tables["users"]["optimizer"] == "adagrad"

    lines = format_stats(h.engine.stats_snapshot()).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("table "))
    assert lines[header].split() == ["table", "dim", "optimizer", "rows", "held", "bytes", "rows", "pulled", "rows",
                                     "pushed", "evicted"]
    assert lines[header + 1].split()[:4] == ["items", "8", "sgd", "200"]
    assert lines[header + 1].split()[-3:] == ["4", "200", "0"]
    assert lines[header + 2].split()[:4] == ["users", "4", "adagrad", "2"]
    assert lines[header + 2].split()[-3:] == ["0", "3", "0"]
    assert lines[header + 3] == "" and lines[header + 4].lstrip().startswith("rank")  # then the workers


def test_a_model_without_tables_shows_no_table_section():
    from aps.cli.status import format_stats

    h = Harness(workers=1, sync="asp", numel=4)
    assert h.engine.stats_snapshot()["server"]["tables"] == {}  # before the model too
    h.join_all()
    snap = h.engine.stats_snapshot()
    assert snap["server"]["tables"] == {}
    assert not any(line.startswith("table ") for line in format_stats(snap).splitlines())


def test_the_table_counters_start_at_zero_with_the_process_and_the_rows_held_go_on():
    from .test_resume import checkpoint_of

    original = tables_harness()
    push_rows(original, 0, np.arange(50), 8)
    pull_rows(original, 0, np.arange(60))
    before = original.engine.stats_snapshot()["server"]["tables"]["items"]
    assert (before["rows"], before["rows_pulled"], before["rows_pushed"]) == (50, 60, 50)

    resumed = Harness(workers=1, sync="asp", numel=4, tables=tuple(original.layout.tables))
    resumed.engine.durability.restore(checkpoint_of(original))
    after = resumed.engine.stats_snapshot()["server"]["tables"]["items"]
    assert after["rows"] == 50 and after["bytes"] > 0  # what the server holds: the checkpoint's rows
    assert (after["rows_pulled"], after["rows_pushed"], after["rows_evicted"]) == (0, 0, 0)  # this process's counts
    resumed.join(0, rejoin=True)
    pull_rows(resumed, 0, [1, 2])
    after = resumed.engine.stats_snapshot()["server"]["tables"]["items"]
    assert (after["rows"], after["rows_pulled"], after["rows_pushed"]) == (50, 2, 0)


def test_the_rows_evicted_are_counted():
    from aps.tables import Table

    table = Table(rows=10**6, dim=16, evict=True)
    h = Harness(workers=1, sync="asp", numel=4, tables=(("items", table),), table_memory=64 * 1024)
    h.join_all()
    for start in range(0, 2000, 100):
        ids = np.arange(start, start + 100)
        h.engine.model.rows.check([(0, ids, np.zeros((100, 16), np.float32))], [])  # (as a session does: room made)
        push_rows(h, 0, ids, 16)
    items = h.engine.stats_snapshot()["server"]["tables"]["items"]
    assert items["rows_pushed"] == 2000 and items["rows_evicted"] > 0
    assert items["rows"] + items["rows_evicted"] == 2000  # every id once: held, or evicted
    assert items["bytes"] <= 64 * 1024 + 100 * (table.row_bytes() + 32)


def test_rows_per_second_are_over_the_window_of_the_snapshots_shown():
    from aps.server.engine.stats import RowRates

    def server(uptime: float, pulled: int, pushed: int, **more) -> dict:
        tables = {"items": {"rows": 1, "bytes": 2, "rows_pulled": pulled, "rows_pushed": pushed, "rows_evicted": 0}}
        tables.update(more)
        return {"uptime_s": uptime, "tables": tables}

    rates = RowRates()
    first = rates.rated(server(100.0, 0, 0))["items"]
    assert first["rows_pulled_per_s"] is None and first["rows_pushed_per_s"] is None  # nothing to measure yet
    assert first["rows"] == 1 and first["rows_pulled"] == 0  # the table's figures, as they are
    seen = []
    for step in range(1, 41):  # 200 rows pulled and 50 pushed a second for 20 s, a snapshot each half second
        seen.append(rates.rated(server(100.0 + step / 2, 100 * step, 25 * step))["items"])
    assert seen[0]["rows_pulled_per_s"] == pytest.approx(200) and seen[-1]["rows_pushed_per_s"] == pytest.approx(50)
    again = rates.rated(server(120.0, 4000, 1000))["items"]  # the same snapshot shown again
    assert again["rows_pulled_per_s"] == pytest.approx(200)
    for step in range(1, 9):  # then nothing for 4 s: over the window, 6 s of 200/s
        out = rates.rated(server(120.0 + step / 2, 4000, 1000))["items"]
    assert out["rows_pulled_per_s"] == pytest.approx(200 * (RATE_WINDOW_S - 4) / RATE_WINDOW_S)
    for step in range(9, 2 * RATE_WINDOW_S + 1):  # a whole window of nothing: 0
        out = rates.rated(server(120.0 + step / 2, 4000, 1000))["items"]
    assert out["rows_pulled_per_s"] == 0.0 and out["rows_pushed_per_s"] == 0.0
    # Nobody watched for a minute: no rate from before (not over the window) until the next snapshot.
    assert rates.rated(server(200.0, 9000, 1000))["items"]["rows_pulled_per_s"] is None
    assert rates.rated(server(201.0, 9100, 1000))["items"]["rows_pulled_per_s"] == pytest.approx(100)
    # Another process (its clock starts again): measured from its own snapshots only.
    assert rates.rated(server(1.0, 10, 0))["items"]["rows_pulled_per_s"] is None
    assert rates.rated(server(2.0, 30, 0))["items"]["rows_pulled_per_s"] == pytest.approx(20)
