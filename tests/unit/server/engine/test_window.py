"""StalenessWindow: the gate rules, on the native module and its reference twin."""

import math

import pytest
from hypothesis import given, settings
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


def run_two_speeds(window, fast, slow, pushes=60):
    """Event-driven: rank 0 needs ``fast`` seconds per iteration, rank 1 ``slow``.
    Returns (time, rank, gap) at every release."""
    next_push = {0: fast, 1: slow}
    releases = []
    for _ in range(pushes):
        rank = min(next_push, key=next_push.get)
        now = next_push[rank]
        released = window.push(rank, now)
        if rank not in released:
            next_push[rank] = float("inf")  # held: waits for a release
        for r in released:
            releases.append((now, r, window.gap(r)))
            next_push[r] = now + (fast if r == 0 else slow)
    return releases


@pytest.mark.parametrize("fast, slow", [(1, 10), (1, 5), (2, 9)])
def test_dssp_never_releases_beyond_the_upper_bound(Window, fast, slow):
    """A literal reading of DSSP's step 4 lets the fast worker, its credits spent,
    ask the controller again and run ever further ahead (gaps 3, 4, 5, ... here);
    the grant is cut to the room left below s_U (docs/design/engine.md)."""
    releases = run_two_speeds(joined(Window, 2, 0, 2), fast, slow)
    gaps = [gap for _, rank, gap in releases if rank == 0]
    assert max(gaps) == 2  # it runs beyond s_L = 0 ...
    assert all(gap <= 2 for _, _, gap in releases)  # ... and never beyond s_U = 2


def controller_as_written(a_p, a_p_prev, a_s, a_s_prev, r_max):
    """docs/algorithms.md's controller, transcribed line by line."""
    if math.isnan(a_p_prev) or math.isnan(a_s_prev):
        return 0  # fewer than two pushes: no interval
    i_p = a_p - a_p_prev
    i_s = a_s - a_s_prev
    sim_p = [a_p + r * i_p for r in range(r_max + 1)]
    sim_s = [a_s + (k + 1) * i_s for k in range(r_max + 1)]
    cost = [min(abs(s - p) for s in sim_s) for p in sim_p]
    return cost.index(min(cost))  # ties go to the smaller r


times = st.floats(0, 1e4, allow_nan=False)
gaps = st.floats(1e-3, 100)


@given(times, gaps, times, st.one_of(gaps, st.just(0.0)), st.one_of(st.integers(0, 16), st.integers(17, 300)),
       st.booleans(), st.booleans())
def test_controller_against_a_transcription_of_the_formula(a_p, i_p, a_s, i_s, r_max, p_new, s_new):
    args = (a_p + i_p, math.nan if p_new else a_p, a_s + i_s, math.nan if s_new else a_s, r_max)
    expected = controller_as_written(*args)
    assert _core.dssp_controller(*args) == expected
    assert _reference.dssp_controller(*args) == expected


@given(st.lists(st.tuples(st.integers(0, 2), st.floats(0.01, 5)), min_size=1, max_size=40))
def test_window_consults_the_controller_with_the_right_histories(pushes):
    """Whenever the window consults the controller, r* equals the formula applied to
    the pusher's and the slowest worker's last two arrival times."""
    window = joined(_core.StalenessWindow, 3, 1, 5)
    now = 0.0
    for rank, dt in pushes:
        if window.is_held(rank):
            continue
        now += dt
        slow = min((r for r in range(3) if window.is_live(r)), key=lambda r: (window.clock(r), r))
        before = (window.arrivals(slow), window.controller_calls)
        history = window.arrivals(rank)
        window.push(rank, now)
        if window.controller_calls != before[1]:
            s_new, s_prev = before[0] if slow != rank else (now, history[0])
            assert window.last_r_star == controller_as_written(now, history[0], s_new, s_prev, 4)


def test_restore_then_join_at_the_saved_clocks(Window):
    """Resuming: the slowest clock comes back first, then each rank where it was, held or not."""
    window = Window(3, 1)
    window.restore(5, 2, 7)
    assert window.min_clock == 5 and window.last_r_star == 2 and window.controller_calls == 7
    assert window.join(2) == 5  # a rank that was not live starts at the slowest clock
    assert window.join(0, 7, True, 0) == 7 and window.is_held(0)
    assert window.join(1, 5) == 5 and window.min_clock == 5
    assert window.push(1, 1.0) == [1]  # rank 1 at 6: rank 0 still two ahead of rank 2
    assert window.is_held(0)
    assert window.push(2, 1.0) == [2, 0]  # the slowest moves to 6: rank 0 is released
    with pytest.raises(ValueError):
        window.restore(0)  # only with nobody live
    with pytest.raises(ValueError):
        Window(2).join(0, 3, True)  # an unbounded window holds nobody


def test_a_rank_placed_below_the_others_becomes_the_slowest(Window):
    window = joined(Window, 2, 1)
    window.push(0, 1.0)
    window.push(1, 1.0)
    window.leave(1)
    assert window.join(1, 0) == 0 and window.min_clock == 0 and window.gap(0) == 1


# The bound across a reconnect (docs/algorithms.md): the highest clock released, and which
# gradients it still admits.


def test_released_max_follows_every_release(Window):
    window = joined(Window, 3, 1)
    assert window.released_max == 0  # every worker joined at 0: released into iteration 0
    window.push(0, 1.0)  # released at 1
    assert window.released_max == 1
    window.push(0, 2.0)  # gap 2 > 1: held at 2, not released
    assert window.is_held(0) and window.released_max == 1
    window.push(1, 3.0)
    assert window.released_max == 1
    assert window.leave(2) == [0]  # the slowest goes: rank 0 is released at 2
    assert window.released_max == 2
    window.leave(0)
    window.leave(1)
    assert window.released_max == 2  # nobody live: it stays (it never decreases)
    assert window.join(1) == 1 and window.released_max == 2


def test_a_placed_rank_counts_as_released_unless_held(Window):
    window = joined(Window, 2, 2)
    window.leave(1)
    window.join(1, 2, True)  # held at 2: it has not started iteration 2
    assert window.released_max == 0
    window.leave(1)
    window.join(1, 2, False)
    assert window.released_max == 2


def test_a_gradient_is_admitted_while_nobody_has_started_beyond_its_iteration_plus_s(Window):
    s = 2
    window = joined(Window, 2, s)
    for t in range(1, 4):
        window.push(0, float(t))
        window.push(1, float(t))
    assert window.clock(0) == window.clock(1) == 3 == window.released_max
    # Rank 1 computed iteration 3 and lost its connection; rank 0 goes on alone.
    window.leave(1)
    for t in range(4, 9):
        window.push(0, float(t))
        assert window.admits(0)  # its own gradients: always within the bound
    assert window.released_max == 8  # rank 0 started iteration 8
    window.join(1)  # back, at the slowest clock
    assert window.clock(1) == 8 and window.admits(1)  # a gradient of this connection
    assert window.admits(1, 6) and not window.admits(1, 5)  # 6 + s >= 8 > 5 + s
    assert not window.admits(1, 3)  # the one it sent when the connection went
    assert window.admits(1, 100)  # a claim above its own clock is taken at its own clock
    assert window.admits(0, 0) is False and window.admits(0, 6)


def test_an_unbounded_window_admits_everything(Window):
    window = joined(Window, 2)
    for t in range(10):
        window.push(0, float(t))
    assert window.released_max == 10
    assert window.admits(1, 0) and window.admits(0, 0)


def test_dssp_admits_up_to_the_upper_bound(Window):
    window = joined(Window, 2, 0, 3)
    window.leave(1)
    for t in range(1, 6):
        window.push(0, float(t))
    window.join(1)
    assert window.released_max == 5
    assert window.admits(1, 2) and not window.admits(1, 1)  # 2 + s_U = 5


def test_restore_takes_the_mark_or_the_strictest_value(Window):
    window = Window(3, 1, 3)
    window.restore(5, 2, 7)  # a checkpoint that does not say: min + s_U
    assert window.released_max == 8
    window.join(0)
    assert window.admits(0, 5) and not window.admits(0, 4)  # every clock >= min is admitted
    window = Window(3, 1, 3)
    window.restore(5, released_max=6)
    assert window.released_max == 6 and window.state()[-1] == 6
    with pytest.raises(ValueError):
        Window(3, 1).restore(5, released_max=4)  # below the slowest clock: not a state
    unbounded = Window(2)
    unbounded.restore(4)
    assert unbounded.released_max == 4


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2), st.integers(0, 3),
       st.lists(st.tuples(st.sampled_from(["push", "leave", "join"]), st.integers(0, 3), st.integers(0, 12)),
                max_size=60))
def test_the_mark_stays_within_the_bound_and_own_gradients_are_always_admitted(n, lower, extra, ops):
    """Random pushes, leaves and joins on both windows: they agree (admits included, for every
    claim), the mark lies in [min, min + upper], and no rank's own gradient is ever refused."""
    windows = [cls(n, lower, lower + extra) for cls in (_core.StalenessWindow, _reference.StalenessWindow)]
    for window in windows:
        for rank in range(n):
            window.join(rank)
    now = 0.0
    for op, rank, claim in ops:
        rank %= n
        now += 1.0
        native, reference = windows
        if op == "push" and native.is_live(rank) and not native.is_held(rank):
            assert native.push(rank, now) == reference.push(rank, now)
        elif op == "leave" and native.is_live(rank):
            assert native.leave(rank) == reference.leave(rank)
        elif op == "join" and not native.is_live(rank):
            assert native.join(rank) == reference.join(rank)
        assert native.state() == reference.state()
        if native.num_live:
            assert native.min_clock <= native.released_max <= native.min_clock + lower + extra
        for r in range(n):
            if native.is_live(r):
                assert native.admits(r) and reference.admits(r)
                assert native.admits(r, claim) == reference.admits(r, claim)
