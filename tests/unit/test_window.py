"""StalenessWindow: the gate rules, on the native module and its reference twin."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aps import _core, _reference


@pytest.fixture(params=[_core.StalenessWindow, _reference.StalenessWindow], ids=["native", "reference"])
def Window(request):
    return request.param


def joined(Window, n, *bounds):
    window = Window(n, *bounds)
    for rank in range(n):
        assert window.join(rank) == 0
    return window


def test_asp_releases_every_push(Window):
    window = joined(Window, 3)
    assert not window.bounded
    for t in range(1, 6):
        assert window.push(0, float(t)) == [0]
    assert window.clock(0) == 5 and window.min_clock == 0 and window.gap(0) == 5
    assert window.max_clock == 5


def test_ssp_holds_beyond_s_and_releases_when_the_slowest_catches_up(Window):
    window = joined(Window, 3, 2, 2)
    assert window.push(0, 1.0) == [0]
    assert window.push(0, 2.0) == [0]
    assert window.push(0, 3.0) == []  # gap 3 > s = 2
    assert window.is_held(0)
    with pytest.raises(ValueError):
        window.push(0, 4.0)  # a held worker cannot push
    assert window.push(1, 4.0) == [1]  # min still 0 (rank 2)
    assert window.is_held(0)
    assert window.push(2, 5.0) == [2, 0]  # min becomes 1: gap(0) = 2
    assert not window.is_held(0)


def test_ssp_zero_is_lockstep(Window):
    window = joined(Window, 2, 0, 0)
    assert window.push(0, 1.0) == []
    assert window.push(1, 1.0) == [1, 0]


def test_leave_releases_and_rejoin_starts_at_the_slowest(Window):
    window = joined(Window, 3, 1, 1)
    window.push(0, 1.0)
    window.push(1, 1.0)
    window.push(0, 2.0)  # clock 2, gap 2 > 1: held
    assert window.is_held(0)
    assert window.leave(2) == [0]  # rank 2 (clock 0) held everyone back
    assert window.num_live == 2 and window.min_clock == 1
    assert window.join(2) == 1  # rejoins at the slowest live clock
    with pytest.raises(ValueError):
        window.join(2)
    window.leave(0)
    window.leave(1)
    window.leave(2)
    assert window.num_live == 0
    assert window.join(1) == 1  # nobody live: where the slowest was


def test_errors(Window):
    window = Window(2, 1, 1)
    with pytest.raises(ValueError):
        window.push(0, 0.0)  # not live
    with pytest.raises(IndexError):
        window.join(2)
    with pytest.raises(ValueError):
        Window(0)
    with pytest.raises(ValueError):
        Window(2, 3, 2)


def test_dssp_grants_credits_to_the_fastest_within_the_upper_bound(Window):
    # s_L = 1, s_U = 4: the fast worker pushes every 1.0 s, the slow every 3.0 s.
    window = joined(Window, 2, 1, 4)
    window.push(1, 3.0)
    window.push(1, 6.0)
    t = 0.0
    released_gaps = []
    for _ in range(6):
        t += 1.0
        if window.is_held(0):
            break
        released = window.push(0, t)
        if 0 in released:
            released_gaps.append(window.gap(0))
    assert max(released_gaps) <= 4
    assert max(released_gaps) > 1  # it ran beyond s_L
    assert 0 <= window.last_r_star <= 3


@given(st.floats(0, 100), st.floats(0.01, 10), st.floats(0, 100), st.floats(0.01, 10), st.integers(0, 12))
def test_controller_native_equals_reference(a_p, i_p, a_s, i_s, r_max):
    args = (a_p + i_p, a_p, a_s + i_s, a_s, r_max)
    assert _core.dssp_controller(*args) == _reference.dssp_controller(*args)
    assert 0 <= _core.dssp_controller(*args) <= max(r_max, 0)


def test_controller_without_history_grants_nothing():
    assert _core.dssp_controller(5.0, math.nan, 3.0, 1.0, 5) == 0
    assert _core.dssp_controller(5.0, 4.0, 3.0, math.nan, 5) == 0
