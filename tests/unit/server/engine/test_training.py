"""Training (aps.server.engine.training) through its seams: the ``Roster`` it reads (members
seated here by hand, as membership would), the ``Model`` it computes on, the sync policy,
the update lane (inline, or held to see an update under way), the seats it records each
push in, and the reports the lane's jobs make to it (``UpdateOwner``)."""

import numpy as np
import pytest

from aps import _core
from aps.config import ServerConfig
from aps.errors import NonFiniteGradient, NotInitialized, OutOfOrder
from aps.layout import Layout
from aps.server.engine.lane import UpdateLane
from aps.server.engine.members import Member, Roster
from aps.server.engine.model import Model
from aps.server.engine.stats import ServerStats
from aps.server.engine.sync import make_policy
from aps.server.engine.training import Training
from aps.wire.protocol import HyperGroup

N = 3
LAYOUT = Layout(("w",), ((N,),))


class Part:
    """A Training on real records, the model registered with zeros, nobody seated yet."""

    def __init__(self, offload=None, **options) -> None:
        options.setdefault("sync", "asp")
        options.setdefault("lr", 1.0)
        self.config = ServerConfig(**options)
        self.policy = make_policy(self.config)
        self.model = Model(self.config, self.policy, _core)
        self.model.create(LAYOUT, np.zeros(N, np.float32))
        self.roster = Roster()
        self.stats = ServerStats(self.config.workers, lambda: 0.0)
        self.training = Training(self.config, self.model, self.roster, self.policy, self.stats,
                                 UpdateLane(offload, 1), lambda: 0.0)
        self.released: list[tuple[int, int, list[float]]] = []
        self.results = []
        self.errors = []

    def seat(self, rank: int, *, rejoin: bool = False) -> Member:
        """What membership does for a join: the member in the roster and (unless it comes back
        on a new connection, still live in the policy) in the policy, joined."""
        member = Member(rank)
        member.grad = np.zeros(N, np.float32)
        member.grad_bytes = memoryview(member.grad).cast("B")
        member.joined = True
        member.rejoin = rejoin
        self.roster.members[rank] = member
        if not rejoin:
            self.policy.join(rank)
        return member

    def ready(self, rank: int):
        def on_ready(snapshot, clock):
            self.released.append((rank, snapshot.version, snapshot.array.tolist()))
            snapshot.release()

        return on_ready

    def push(self, member: Member, grad, version: int = 0, **options) -> None:
        member.grad[:] = grad
        self.training.push(member, version, self.results.append, self.errors.append, **options)


def test_a_pull_waits_until_training_starts_and_is_then_served():
    part = Part(workers=1)
    member = part.seat(0)
    with pytest.raises(NotInitialized):
        part.training.pull(Member(0), part.ready(0))
    part.training.pull(member, part.ready(0))
    assert part.released == [] and member.waiter is not None
    part.roster.started = True
    part.training.serve_waiting()
    assert part.released == [(0, 0, [0.0, 0.0, 0.0])] and member.waiter is None


def test_a_push_is_applied_counted_and_recorded_in_its_ranks_seat():
    part = Part(workers=1)
    part.roster.started = True
    member = part.seat(0)
    part.push(member, [1.0, 2.0, 3.0], request_id=7, clock=0)
    assert part.model.weights.tolist() == [-1.0, -2.0, -3.0] and part.training.pushes == 1
    result = part.results[0]
    assert (result.version, result.clock, result.dropped) == (1, 1, False)
    seat = part.roster.seats[0]
    assert (seat.push_id, seat.push_clock, seat.result) == (7, 0, result)
    assert part.stats.workers[0].pushes == 1


def test_a_push_sent_again_after_a_lost_reply_is_answered_and_not_applied_twice():
    part = Part(workers=1)
    part.roster.started = True
    member = part.seat(0)
    part.push(member, [1.0, 1.0, 1.0], request_id=7, clock=0)
    again = part.seat(0, rejoin=True)  # the worker reconnected
    assert part.training.is_duplicate(again, 7, 0) and not part.training.is_duplicate(again, 8, 1)
    part.push(again, [5.0, 5.0, 5.0], version=1, request_id=7, clock=0)
    assert part.model.weights.tolist() == [-1.0, -1.0, -1.0] and part.stats.duplicates == 1
    assert part.results[1].version == part.results[0].version and part.training.pushes == 1


def test_a_push_out_of_order_is_refused_and_changes_nothing():
    part = Part(workers=2, sync="ssp", staleness=0)
    part.roster.started = True
    a, _ = part.seat(0), part.seat(1)
    with pytest.raises(OutOfOrder, match="version 5"):
        part.training.push(a, 5, part.results.append, part.errors.append)
    with pytest.raises(NotInitialized):
        part.training.push(Member(1), 0, part.results.append, part.errors.append)
    part.push(a, [1.0, 1.0, 1.0])
    assert part.policy.is_held(0)  # lockstep: rank 1 has not pushed
    with pytest.raises(OutOfOrder, match="held"):
        part.training.push(a, 1, part.results.append, part.errors.append)
    assert part.training.pushes == 1


def test_a_non_finite_gradient_is_refused_and_counted_and_the_weights_stay():
    part = Part(workers=1)
    part.roster.started = True
    member = part.seat(0)
    part.push(member, [1.0, np.inf, 1.0])
    assert isinstance(part.errors[0], NonFiniteGradient) and "'w'" in str(part.errors[0])
    assert part.model.weights.tolist() == [0.0, 0.0, 0.0] and part.stats.rejected == 1
    assert part.training.pushes == 0 and 0 not in part.roster.seats


def test_a_round_closes_with_one_update_and_the_waiters_need_its_version():
    held = []
    part = Part(offload=lambda kernel, done: held.append((kernel, done)), workers=2, sync="bsp")
    part.roster.started = True
    rounds = []
    part.training.on_round = rounds.append
    a, b = part.seat(0), part.seat(1)
    for member, grad in ((a, [2.0, 0.0, 0.0]), (b, [0.0, 4.0, 0.0])):
        part.push(member, grad)
        kernel, done = held.pop()
        done(kernel())
    part.training.pull(a, part.ready(0))
    assert part.training.decided_version == 1 and part.model.version == 0  # the update is under way
    assert part.released == []  # a released worker sees every update decided before it
    kernel, done = held.pop()
    done(kernel())
    assert rounds == [1] and part.released == [(0, 1, [-1.0, -2.0, 0.0])]


def test_a_workers_values_apply_to_its_following_pushes_once_set():
    part = Part(workers=1)
    part.roster.started = True
    member = part.seat(0)
    groups = [HyperGroup(N, 0.5, 0.0, 0.0, 0.0)]
    part.training.set_hyperparameters(member, groups, check_only=True)
    assert member.hyper is None
    part.training.set_hyperparameters(member, groups)
    part.push(member, [2.0, 2.0, 2.0])
    assert part.model.weights.tolist() == [-1.0, -1.0, -1.0]


def test_a_pull_below_min_waits_and_a_worker_that_left_is_not_answered():
    part = Part(workers=2)
    part.roster.started = part.roster.below_quorum = True
    a, b = part.seat(0), part.seat(1)
    part.training.pull(a, part.ready(0))
    part.training.pull(b, part.ready(1))
    part.training.stop_waiting(1)
    part.roster.below_quorum = False
    part.training.serve_waiting()
    assert [rank for rank, _, _ in part.released] == [0]


def test_a_gradient_streams_only_when_the_lane_is_free_and_it_is_applied_alone():
    part = Part(workers=2)
    part.roster.started = True
    member, other = part.seat(0), part.seat(1)
    stream = part.training.begin_streaming_push(member, 0)
    assert stream is not None and part.training.begin_streaming_push(other, 0) is None  # the lane is reserved
    member.grad[:] = [1.0, 1.0, 1.0]
    stream.feed(N)
    part.training.push(member, 0, part.results.append, part.errors.append, stream=stream)
    assert part.model.weights.tolist() == [-1.0, -1.0, -1.0] and part.training.pushes == 1
    bsp = Part(workers=1, sync="bsp")
    bsp.roster.started = True
    assert bsp.training.begin_streaming_push(bsp.seat(0), 0) is None  # accumulated, not applied alone
