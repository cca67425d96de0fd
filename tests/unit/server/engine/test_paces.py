"""The workers' step rates, from their step counts and the seconds the steps took."""

from aps.server.engine.paces import Paces


def test_a_rate_needs_two_reports_and_then_follows_the_newest_interval_by_half():
    paces = Paces()
    paces.report(3, 0, 0.0)
    assert paces.rates([3]) == {}
    paces.report(3, 20, 2.0)
    assert paces.rates([3]) == {3: 10.0}
    paces.report(3, 40, 3.0)  # 20/s now
    assert paces.rates([3]) == {3: 15.0}
    paces.report(3, 60, 7.0)  # a straggler for a while: 5/s
    assert paces.rates([3]) == {3: 10.0}


def test_only_the_ranks_asked_for_are_answered():
    paces = Paces()
    for rank in (0, 1):
        paces.report(rank, 0, 0.0)
    paces.report(0, 10, 1.0)
    paces.report(1, 4, 1.0)
    assert paces.rates([0, 1, 2]) == {0: 10.0, 1: 4.0}
    assert paces.answer(1, [0, 1, 2]) == (4.0, 10.0)
    assert paces.answer(1, [1]) == (4.0, 4.0)
    assert paces.answer(2, [0, 1, 2]) == (None, 10.0)
    assert Paces().answer(0, [0]) == (None, None)


def test_a_count_that_goes_down_is_another_process_and_starts_again():
    paces = Paces()
    paces.report(0, 50, 5.0)
    paces.report(0, 60, 6.0)
    assert paces.rates([0]) == {0: 10.0}
    paces.report(0, 5, 0.5)  # a new process under rank 0
    assert paces.rates([0]) == {}
    paces.report(0, 15, 1.0)
    assert paces.rates([0]) == {0: 20.0}


def test_a_report_with_nothing_to_measure_over_changes_nothing():
    paces = Paces()
    paces.report(0, 0, 0.0)
    paces.report(0, 10, 1.0)
    paces.report(0, 10, 6.0)  # no step since: not a rate of 0 (the interval goes on)
    assert paces.rates([0]) == {0: 10.0}
    paces.report(0, 30, 3.0)  # 20 steps in the 2 s since the last count that moved
    assert paces.rates([0]) == {0: 10.0 / 2 + 10.0 / 2}
    paces.report(0, 32, 0.5)  # (the seconds went down: another process)
    assert paces.rates([0]) == {}


def test_a_rate_no_one_could_run_is_not_the_fastest():
    """Of three workers or more, one that says it took 2**53 steps in a millisecond does not make
    the others sync after every step: the fastest is taken among rates within PLAUSIBLE times
    the upper median. (Of two, there is nothing to tell the liar by.)"""
    paces = Paces()
    for rank, steps in ((0, 10), (1, 25), (2, 1 << 53)):
        paces.report(rank, 0, 0.0)
        paces.report(rank, steps, 1.0 if rank < 2 else 1e-3)
    assert paces.answer(0, [0, 1, 2]) == (10.0, 25.0)
    assert paces.answer(2, [0, 1, 2])[1] == 25.0
    assert paces.answer(0, [0, 2])[1] == (1 << 53) / 1e-3


def test_an_honest_straggler_however_slow_leaves_the_fastest_as_it_is():
    paces = Paces()
    for rank, steps in ((0, 300), (1, 1)):  # 300 times as slow
        paces.report(rank, 0, 0.0)
        paces.report(rank, steps, 1.0)
    assert paces.answer(1, [0, 1]) == (1.0, 300.0)


def test_an_interval_too_short_to_measure_gives_no_rate_and_every_rate_is_finite():
    paces = Paces()
    paces.report(0, 0, 0.0)
    paces.report(0, 1 << 53, 5e-324)  # (the smallest float64 after 0: an infinite rate)
    assert paces.rates([0]) == {} and paces.answer(0, [0]) == (None, None)
    paces.report(0, 1 << 53, 1.0)
    assert paces.rates([0]) == {0: float(1 << 53)}
