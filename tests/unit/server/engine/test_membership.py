"""Membership (aps.server.engine.membership) through its seams: the ``Gate`` it asks of
training (a recording fake here), the ``Roster`` it writes, the ``Model`` it registers,
the update lane its joins and leaves go through (inline), the server's callbacks
(``on_quorum``, ``on_membership_change``) and ``resume``, the seam durability uses."""

import numpy as np
import pytest

from aps import _core
from aps.config import ServerConfig
from aps.errors import (
    InternalServerError,
    LayoutMismatch,
    NonFiniteGradient,
    RankOutOfRange,
    RankTaken,
    WorkerCountMismatch,
)
from aps.layout import Layout
from aps.server.engine.lane import UpdateLane
from aps.server.engine.members import Roster
from aps.server.engine.membership import Membership
from aps.server.engine.model import Model
from aps.server.engine.stats import ServerStats
from aps.server.engine.sync import make_policy

N = 3
LAYOUT = Layout(("w",), ((N,),))


class Gate:
    """Training as membership sees it: every call recorded, waiters kept to answer by hand."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.decided_version = 0
        self.skips_lost_iterations = False
        self.rejoins_at_own_clock = False

    def wait(self, member, on_ready, *, gate):
        self.calls.append(("wait", member.rank, gate))
        member.waiter, member.gate = on_ready, gate  # (as training holds it until it may go on)

    def stop_waiting(self, rank):
        self.calls.append(("stop", rank))

    def serve_waiting(self):
        self.calls.append(("serve",))

    def after(self, outcome):
        self.calls.append(("after", tuple(outcome.released), outcome.aggregate_scale))


class Part:
    """A Membership on real records (model, roster, policy, stats, inline lane) and a fake gate."""

    def __init__(self, **options) -> None:
        options.setdefault("sync", "asp")
        self.config = ServerConfig(**options)
        self.policy = make_policy(self.config)
        self.model = Model(self.config, self.policy, _core)
        self.roster = Roster()
        self.gate = Gate()
        self.errors: list[Exception] = []
        self.membership = Membership(self.config, self.model, self.roster, self.policy,
                                     ServerStats(self.config.workers, lambda: 0.0), UpdateLane(None, 1 << 22),
                                     self.gate, lambda: 0.0)

    def join(self, rank, values=None, *, rejoin=False, clock=-1, layout=LAYOUT):
        return self.membership.join(rank, 0, layout, np.zeros(N, np.float32) if values is None else values,
                                    lambda snapshot, clock: None, self.errors.append, rejoin=rejoin, clock=clock)


def test_the_first_join_registers_the_model_and_the_last_one_starts_training():
    part = Part(workers=2)
    first = part.join(0, np.arange(N, dtype=np.float32))
    assert part.model.table is not None and part.model.weights.tolist() == [0.0, 1.0, 2.0]
    assert part.roster.members == {0: first} and first.joined and len(first.grad) == N
    assert part.gate.calls == [("wait", 0, False)] and not part.roster.started
    assert part.membership.waiting_to_start(first)
    part.join(1, np.full(N, 9.0, np.float32))  # (a later worker's values are not the model's)
    assert part.roster.started and part.gate.calls[-2:] == [("wait", 1, False), ("serve",)]
    assert part.model.weights.tolist() == [0.0, 1.0, 2.0]
    assert part.membership.join_progress() == (2, 2, [])


def test_a_join_is_refused_for_its_count_its_rank_a_taken_rank_or_another_model():
    part = Part(workers=2)
    with pytest.raises(WorkerCountMismatch):
        part.membership.check_join(0, 3)
    with pytest.raises(RankOutOfRange):
        part.membership.check_join(2, 2)
    part.join(0)
    with pytest.raises(RankTaken):
        part.membership.check_join(0, 2)
    with pytest.raises(LayoutMismatch, match="Start a fresh server"):
        part.membership.check_join(1, 2, Layout(("w",), ((N + 1,),)))
    part.join(1, layout=Layout(("v",), ((N,),)))  # checked again at its turn: refused, the rank free again
    assert isinstance(part.errors[-1], LayoutMismatch) and 1 not in part.roster.members


def test_non_finite_initial_weights_register_nothing_and_free_the_rank():
    part = Part(workers=1)
    member = part.join(0, np.array([0.0, np.nan, 0.0], np.float32))
    assert isinstance(part.errors[0], NonFiniteGradient) and part.model.table is None
    assert not member.connected and part.roster.members == {} and part.gate.calls == []


def test_joins_without_values_wait_for_the_registrar_and_are_refused_when_it_gives_up():
    part = Part(workers=3)
    owner = object()
    assert part.membership.claim_registration(LAYOUT, owner) and part.membership.registering
    assert not part.membership.claim_registration(LAYOUT, object())  # one registrar at a time
    with pytest.raises(LayoutMismatch):  # checked against the layout being registered
        part.membership.check_join(1, 3, Layout(("w",), ((N + 1,),)))
    waiting = part.membership.join(1, 3, LAYOUT, None, lambda s, c: None, part.errors.append)
    assert not waiting.joined and part.gate.calls == []  # parked until the model is in
    part.membership.release_registration(owner)
    assert isinstance(part.errors[0], InternalServerError) and not part.membership.registering
    assert 1 not in part.roster.members


def test_a_parked_join_goes_on_once_the_registrar_has_joined():
    part = Part(workers=2)
    part.membership.claim_registration(LAYOUT, "owner")
    waiting = part.membership.join(1, 2, LAYOUT, None, lambda s, c: None, part.errors.append)
    part.join(0, np.ones(N, np.float32))
    assert waiting.joined and part.roster.started and not part.errors
    assert not part.membership.registering


def test_a_leave_unseats_the_member_keeps_its_seat_and_hands_the_outcome_to_training():
    part = Part(workers=2, sync="ssp", staleness=1)
    a, b = part.join(0), part.join(1)
    part.policy.commit(0, part.policy.plan(0, 0, 0), 0.0)  # rank 0 ends an iteration: clock 1
    part.gate.calls.clear()
    part.membership.leave(a, "left")
    assert part.roster.members == {1: b} and not a.connected and not a.joined
    assert part.gate.calls[0] == ("stop", 0) and part.gate.calls[-1][0] == "after"
    seat = part.roster.seats[0]
    assert seat.clock == 1 and seat.left == 1
    calls = len(part.gate.calls)
    part.membership.leave(a)  # gone already: nothing more
    assert len(part.gate.calls) == calls


def test_a_free_rank_is_one_never_seated_then_the_one_that_left_longest_ago():
    part = Part(workers=3)
    members = [part.join(rank) for rank in range(3)]
    with pytest.raises(RankTaken):
        part.membership.assign_rank()
    part.membership.leave(members[2])
    part.membership.leave(members[0])
    assert part.membership.assign_rank() == 2  # left first
    part.join(2)
    assert part.membership.assign_rank() == 0


def test_below_min_training_holds_and_goes_on_when_enough_are_back():
    part = Part(workers="2:3")
    said = []
    part.membership.on_quorum = said.append
    a, _ = part.join(0), part.join(1)
    assert part.roster.started and not part.roster.below_quorum
    part.membership.leave(a)
    assert part.roster.below_quorum and said == [True]
    part.gate.calls.clear()
    part.join(2)
    assert not part.roster.below_quorum and said == [True, False] and ("serve",) in part.gate.calls


def test_a_worker_that_finished_lets_the_others_end_below_min():
    part = Part(workers="2:3")
    a, _ = part.join(0), part.join(1)
    part.membership.leave(a, "finished")
    assert part.roster.draining and not part.roster.below_quorum


def test_a_resumed_run_waits_for_the_checkpoints_ranks_and_puts_them_back_where_they_were():
    part = Part(workers=3, sync="ssp", staleness=2)
    part.policy.restore({"name": "ssp", "min_clock": 4, "last_r_star": 0, "controller_calls": 0,
                         "clocks": [4, 5, 0], "live": [True, True, False], "held": [False, False, False],
                         "credits": [0, 0, 0]})
    part.model.create(LAYOUT, np.zeros(N, np.float32))
    part.membership.resume({0: (4, False, 0), 1: (5, False, 0)})
    assert part.membership.resumed and part.membership.join_progress() == (0, 2, [0, 1])
    assert part.membership.assign_rank() == 2  # a rank the run waits for is given last
    part.join(1, rejoin=True, clock=5)
    assert part.policy.clock(1) == 5 and not part.roster.started
    part.join(0, rejoin=True, clock=4)
    assert part.policy.clock(0) == 4 and part.roster.started
    part.membership.resume(None)
    assert not part.membership.resumed and part.membership.join_progress()[1] == 3


def test_a_resumed_elastic_run_that_gave_up_waiting_starts_with_any_min_workers():
    part = Part(workers="1:2", sync="asp")
    changed = []
    part.membership.on_membership_change = lambda: changed.append(True)
    part.model.create(LAYOUT, np.zeros(N, np.float32))
    part.membership.resume({0: (3, False, 0), 1: (3, False, 0)})
    part.join(1, rejoin=True, clock=3)
    assert not part.roster.started and changed
    part.membership.give_up_waiting()
    assert part.roster.started and part.roster.seats[0].clock == 3  # rank 0 comes back as any that left
