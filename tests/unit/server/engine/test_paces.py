"""The workers' step rates, measured on the server's clock from their step counts."""

import pytest

from aps.server.engine.paces import Paces


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock():
    return Clock()


def test_a_rate_needs_two_reports_and_then_follows_the_newest_interval_by_half(clock):
    paces = Paces(clock)
    paces.report(3, 0)
    assert paces.rates([3]) == {}
    clock.t += 2.0
    paces.report(3, 20)
    assert paces.rates([3]) == {3: 10.0}
    clock.t += 1.0
    paces.report(3, 40)  # 20/s now
    assert paces.rates([3]) == {3: 15.0}
    clock.t += 4.0
    paces.report(3, 60)  # a straggler for a while: 5/s
    assert paces.rates([3]) == {3: 10.0}


def test_only_the_ranks_asked_for_are_answered(clock):
    paces = Paces(clock)
    for rank in (0, 1):
        paces.report(rank, 0)
    clock.t += 1.0
    paces.report(0, 10)
    paces.report(1, 4)
    assert paces.rates([0, 1, 2]) == {0: 10.0, 1: 4.0}
    assert paces.rates([1]) == {1: 4.0}


def test_a_count_that_goes_down_is_another_process_and_starts_again(clock):
    paces = Paces(clock)
    paces.report(0, 50)
    clock.t += 1.0
    paces.report(0, 60)
    assert paces.rates([0]) == {0: 10.0}
    clock.t += 1.0
    paces.report(0, 5)  # a new process under rank 0
    assert paces.rates([0]) == {}
    clock.t += 0.5
    paces.report(0, 15)
    assert paces.rates([0]) == {0: 20.0}


def test_a_report_with_nothing_to_measure_over_changes_nothing(clock):
    paces = Paces(clock)
    paces.report(0, 0)
    clock.t += 1.0
    paces.report(0, 10)
    clock.t += 5.0
    paces.report(0, 10)  # no step since: not a rate of 0 (the interval goes on)
    paces.report(0, 10)
    assert paces.rates([0]) == {0: 10.0}
    clock.t += 5.0
    paces.report(0, 110)  # 100 steps over the whole 10 s since the last count
    assert paces.rates([0]) == {0: 10.0}
