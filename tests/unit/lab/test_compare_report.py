"""What ``aps demo`` / ``aps compare`` say about their table: which paradigm won and how sure
that is (one run: gaps of a few seconds are noise), and how long the whole comparison takes."""

import pytest

pytest.importorskip("matplotlib")  # aps.cli.compare draws the plot

from aps.lab.compare import estimate_seconds, reading, startup_seconds  # noqa: E402


def record(label, time, *, best=0.96, cluster="heterogeneous", repeat=0):
    return {"cluster": cluster, "label": label, "time_to_target_s": time, "best_accuracy": best, "repeat": repeat}


def test_one_run_calls_a_gap_of_a_few_seconds_a_tie_and_says_how_to_be_surer():
    # the new user's run: DSSP tied ASP (13.2 s each) and beat SSP s=3 by 8 s
    records = [record("ASP", 13.2), record("DSSP [3,15]", 13.2), record("SSP s=3", 21.2), record("BSP", None, best=0.9)]
    text = reading(records, 0.95)
    assert text.startswith("On the heterogeneous cluster, ASP reached 0.95 first (13.2 s)"), text
    assert "DSSP [3,15] (13.2 s) only a few seconds behind: level with it, as far as one run can tell" in text
    assert "clearly behind: SSP s=3 (+8.0 s)" in text and "never reached it: BSP" in text
    assert "one run of each: gaps of a few seconds are noise" in text
    assert "aps demo --repeats 3" in text and "aps demo --virtual" in text


def test_a_small_gap_of_one_run_is_noise_a_large_one_is_not():
    assert "level with it" in reading([record("ASP", 30.0), record("SSP s=3", 32.5)], 0.95)
    assert "clearly behind: SSP s=3 (+2.0 s)" not in reading([record("ASP", 10.0), record("SSP s=3", 12.0)], 0.95)
    assert "clearly behind: SSP s=3 (+12.0 s)" in reading([record("ASP", 10.0), record("SSP s=3", 22.0)], 0.95)


def test_over_repeats_the_spread_decides():
    apart = [record("ASP", t, repeat=i) for i, t in enumerate((10.0, 11.0, 12.0))] + \
            [record("SSP s=3", t, repeat=i) for i, t in enumerate((12.5, 13.0, 14.0))]
    text = reading(apart, 0.95, command="aps compare")
    assert "ASP reached 0.95 first (11.0 s, median of 3)" in text and "clearly behind: SSP s=3 (+2.0 s)" in text
    assert "3 runs each" in text and "noise" not in text
    overlapping = apart[:3] + [record("SSP s=3", t, repeat=i) for i, t in enumerate((11.5, 13.0, 30.0))]
    text = reading(overlapping, 0.95)
    assert "SSP s=3 (13.0 s) within the spread of the runs: level with it" in text and "clearly" not in text


def test_no_paradigm_reaching_the_target_says_so():
    text = reading([record("ASP", None, best=0.81), record("BSP", None, best=0.9)], 0.95)
    assert "no paradigm reached 0.95 within the budget (the best was BSP at 0.900)" in text


def test_each_cluster_is_read_on_its_own():
    records = [record("ASP", 5.0, cluster="homogeneous"), record("BSP", 5.5, cluster="homogeneous"),
               record("ASP", 8.0), record("BSP", 20.0)]
    text = reading(records, 0.9)
    assert "On the homogeneous cluster, ASP" in text and "On the heterogeneous cluster, ASP" in text
    assert "BSP (5.5 s) only a few seconds behind" in text and "clearly behind: BSP (+12.0 s)" in text


def test_a_virtual_reading_counts_virtual_seconds():
    text = reading([record("ASP", 240.0, repeat=0), record("ASP", 250.0, repeat=1),
                    record("SSP s=3", 420.0, repeat=0), record("SSP s=3", 430.0, repeat=1)], 0.95, virtual=True)
    assert "(245.0 virtual s, median of 2)" in text and "clearly behind: SSP s=3 (+180.0 virtual s)" in text


def test_the_estimate_counts_the_workers_start_up():
    # a new user's demo was said to take 28 s and took 48 s: the start-up of the worker
    # processes (PyTorch, the dataset) was one constant, whatever their number and the cores
    assert startup_seconds(1, cores=2) == pytest.approx(2 * 3.5)
    assert startup_seconds(4, cores=2) == pytest.approx(3 * 3.5)  # four processes share two cores
    assert startup_seconds(8, cores=2) == pytest.approx(5 * 3.5)
    assert startup_seconds(8, cores=2) > startup_seconds(4, cores=2) > startup_seconds(2, cores=2)
    assert estimate_seconds(5, 30.0, 4, cores=2) == pytest.approx(startup_seconds(4, cores=2) + 5 * 33.0)
    # a loaded machine: the start-up shares the cores with the others' runnable processes
    assert startup_seconds(2, cores=2, load=0.5) == startup_seconds(2, cores=2)  # under a core's worth: no change
    assert startup_seconds(2, cores=2, load=3.0) == pytest.approx(2 * startup_seconds(2, cores=2))
    assert estimate_seconds(1, 2.0, 2, cores=2, load=3.0) == pytest.approx(2 * 7.0 + (2.0 + 3.0))
