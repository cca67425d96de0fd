"""Elastic membership (``--workers MIN:MAX``) on the engine: start at MIN, joins up to MAX
under an asked or assigned rank, leaves, the hold below MIN, and what each policy does
with a join (docs/algorithms.md, "Elastic membership")."""

import numpy as np
import pytest

from aps.errors import RankOutOfRange, RankTaken, WorkerCountMismatch
from aps.wire.protocol import ANY_RANK
from tests.harness import Harness

ONES = np.ones(4, np.float32)


def elastic(**options):
    options.setdefault("numel", 4)
    return Harness(**options)


def test_training_starts_at_min_and_later_workers_join_the_running_model():
    h = elastic(workers="2:4", sync="asp")
    h.join(0)
    assert not h.engine.roster.started and h.engine.membership.join_progress() == (1, 2, [])
    h.join(1)
    assert h.engine.roster.started and not h.workers[0].waiting and not h.workers[1].waiting
    h.push(0, ONES, then_pull=True)
    h.join(3)  # a third worker, under rank 3: answered at once with the newest weights
    assert not h.workers[3].waiting and h.workers[3].version == 1
    assert h.engine.roster.members[3].joined_running


def test_an_elastic_server_takes_any_count_up_to_max_and_a_fixed_one_its_own_or_none():
    h = elastic(workers="2:4")
    for count in (0, 1, 3, 4):
        h.engine.membership.check_join(0, count)
    with pytest.raises(WorkerCountMismatch, match="2:4"):
        h.engine.membership.check_join(0, 5)
    with pytest.raises(RankOutOfRange):
        h.engine.membership.check_join(4, 4)
    fixed = elastic(workers=3)
    fixed.engine.membership.check_join(0, 0)  # (a worker that did not say: it takes the server's count)
    with pytest.raises(WorkerCountMismatch):
        fixed.engine.membership.check_join(0, 2)


def test_a_free_rank_is_assigned_never_used_ones_first_then_the_longest_gone():
    h = elastic(workers="1:4", sync="asp")
    layout = h.layout
    seated = []
    for _ in range(3):
        member = h.engine.membership.join(ANY_RANK, 0, layout, np.zeros(4, np.float32), lambda snap, clock: snap.release(),
                               pytest.fail)
        seated.append(member)
    assert [m.rank for m in seated] == [0, 1, 2]
    h.engine.membership.leave(seated[1])
    h.engine.membership.leave(seated[0])
    assert h.engine.membership.assign_rank() == 3  # never seated
    h.join(3)
    assert h.engine.membership.assign_rank() == 1  # left before rank 0 did
    h.join(1)
    h.join(0)
    with pytest.raises(RankTaken, match="every rank"):
        h.engine.membership.check_join(ANY_RANK, 0)


def test_bsp_a_worker_joining_a_round_under_way_waits_for_it_and_takes_part_in_the_next():
    h = elastic(workers="2:3", sync="bsp")
    h.join(0)
    h.join(1)
    h.push(0, ONES, then_pull=True)  # the round's first gradient: its members are 0 and 1
    h.join(2)
    assert h.workers[2].waiting and h.held(2)  # its INIT waits for the round
    h.push(1, 3 * ONES, then_pull=True)  # the round closes on its members alone
    assert h.engine.version == 1
    np.testing.assert_allclose(h.engine.weights, -2 * ONES)  # the mean of 1 and 3
    assert not h.workers[2].waiting and h.workers[2].version == 1
    for rank, g in ((0, 1), (1, 2), (2, 6)):  # the next round waits for all three
        assert h.engine.version == 1
        h.push(rank, g * ONES, then_pull=True)
    assert h.engine.version == 2
    np.testing.assert_allclose(h.engine.weights, -5 * ONES)


def test_bsp_a_round_whose_members_all_left_is_applied_for_a_worker_that_joined_meanwhile():
    h = elastic(workers="1:3", sync="bsp")
    h.join(0)
    h.join(1)
    h.push(0, ONES)  # the round's members: 0 and 1
    h.join(2)
    assert h.workers[2].waiting
    h.leave(0)
    assert h.engine.version == 0 and h.workers[2].waiting  # rank 1 is still to push
    h.leave(1)
    assert h.engine.version == 1 and not h.workers[2].waiting  # rank 0's gradient stays in the round
    np.testing.assert_allclose(h.engine.weights, -ONES)


def test_bsp_a_worker_joining_after_every_member_left_takes_part_in_the_open_round():
    h = elastic(workers="1:3", sync="bsp")
    h.join(0)
    h.join(1)
    h.push(0, ONES)
    h.leave(0)
    h.leave(1)  # the round holds rank 0's gradient, and nobody is left
    h.join(2)
    assert not h.workers[2].waiting and not h.held(2)
    h.push(2, 3 * ONES, then_pull=True)
    assert h.engine.version == 1 and not h.workers[2].waiting
    np.testing.assert_allclose(h.engine.weights, -2 * ONES)  # the mean of 1 and 3


def test_softsync_a_join_counts_from_the_next_update():
    h = elastic(workers="2:3", sync="softsync", softsync_n=1)  # c = P
    h.join(0)
    h.join(1)
    h.push(0, ONES)
    h.join(2)  # P is 3 now, but this update began with 2
    h.push(1, ONES)
    assert h.engine.version == 1
    for rank in range(2):
        h.push(rank, ONES)
    assert h.engine.version == 1  # the next one takes 3
    h.push(2, ONES)
    assert h.engine.version == 2


@pytest.mark.parametrize("sync", ["ssp", "dssp"])
def test_a_newcomer_starts_at_the_slowest_live_clock(sync):
    h = elastic(workers="2:3", sync=sync, staleness=2)
    h.join(0)
    h.join(1)
    for _ in range(2):
        h.push(0, ONES, then_pull=True)
    h.push(1, ONES, then_pull=True)
    h.join(2)
    assert h.window.clock(2) == h.window.min_clock == 1
    assert h.window.gap(0) == 1  # the bound holds for everyone


@pytest.mark.parametrize("sync", ["bsp", "asp", "ssp", "dssp", "softsync"])
def test_below_min_every_pull_waits_and_a_join_lets_them_go(sync):
    h = elastic(workers="2:3", sync=sync)
    changes = []
    h.engine.membership.on_quorum = changes.append
    h.join(0)
    h.join(1)
    h.join(2)
    h.leave(2)
    assert not h.engine.roster.below_quorum and changes == []
    h.leave(1)
    assert h.engine.roster.below_quorum and changes == [True]
    assert h.engine.stats_snapshot()["server"]["quorum_holds"] == 1
    h.push(0, ONES, then_pull=True)  # (a push is taken: its worker had its weights)
    assert h.workers[0].waiting
    h.join(1)
    assert not h.engine.roster.below_quorum and changes == [True, False]
    assert not h.workers[0].waiting


def test_a_fixed_size_run_never_holds_for_a_quorum():
    h = elastic(workers=2, sync="asp")
    h.join_all()
    h.leave(1)
    assert not h.engine.roster.below_quorum
    h.push(0, ONES, then_pull=True)
    assert not h.workers[0].waiting


def resumed_from(original: Harness, **options) -> Harness:
    from tests.unit.server.engine.test_resume import checkpoint_of

    resumed = elastic(**options)
    resumed.engine.durability.restore(checkpoint_of(original))
    return resumed


def test_a_resumed_elastic_run_waits_for_its_ranks_then_for_any_min_and_late_ranks_come_back_as_rejoins():
    original = elastic(workers="2:3", sync="ssp", staleness=2)
    for rank in range(3):
        original.join(rank)
    for _ in range(4):
        for rank in range(3):
            original.push(rank, ONES, then_pull=True)
    resumed = resumed_from(original, workers="2:3", sync="ssp", staleness=2)
    resumed.join(0, rejoin=True, clock=4)
    resumed.join(1, rejoin=True, clock=4)
    assert not resumed.engine.roster.started and resumed.engine.membership.join_progress() == (2, 3, [2])  # the checkpoint's ranks
    resumed.engine.membership.give_up_waiting()  # (the server calls it after --quorum-timeout)
    assert resumed.engine.roster.started and not resumed.workers[0].waiting
    for _ in range(6):
        for rank in (0, 1):
            resumed.push(rank, ONES, then_pull=True)
    resumed.join(2, rejoin=True, clock=4)  # rank 2 comes back late: at the slowest live clock, not its own
    assert resumed.window.clock(2) == resumed.window.min_clock == 10 and not resumed.held(2)
    resumed.push(0, ONES, then_pull=True)
    assert not resumed.workers[0].waiting  # nobody waits for rank 2 to catch up


def test_bsp_a_late_rank_of_the_checkpoints_open_round_is_not_held_without_a_round():
    original = elastic(workers="1:3", sync="bsp")
    for rank in range(3):
        original.join(rank)
    original.push(2, ONES)  # rank 2's gradient is in the open round
    resumed = resumed_from(original, workers="1:3", sync="bsp")
    resumed.join(0, rejoin=True, clock=0)
    resumed.engine.membership.give_up_waiting()
    assert resumed.engine.roster.started
    resumed.push(0, ONES, then_pull=True)  # the round closes on 0 alone (with rank 2's gradient kept in it)
    resumed.leave(0)
    resumed.join(2, rejoin=True, clock=1)
    assert not resumed.workers[2].waiting and not resumed.held(2)


@pytest.mark.parametrize("sync", ["ssp", "dssp"])
def test_a_rank_held_when_it_left_is_not_held_when_it_comes_back_alone(sync):
    h = elastic(workers="1:3", sync=sync, staleness=1)
    h.join(0)
    h.join(1)
    h.push(1, ONES, then_pull=True)
    h.push(1, ONES, then_pull=True)  # two ahead of rank 0: held at the gate
    assert h.held(1)
    h.leave(1)  # its connection goes
    h.leave(0)  # the slower one leaves for good
    h.join(1, rejoin=True, clock=2)
    assert not h.held(1) and not h.workers[1].waiting
