"""The gradient jobs (aps.server.engine.jobs.updates) through their one seam, the
``UpdateOwner`` they report to (a recording stand-in here, over a real table, policy and
kernels): a gradient is planned at its turn, computed aside and adopted or given back, and
the owner hears exactly one report for it."""

import numpy as np

from aps import _core
from aps.config import ServerConfig
from aps.errors import NonFiniteGradient
from aps.layout import Layout
from aps.server.engine.jobs.updates import Aggregate, AggregateJob, PushJob
from aps.server.engine.lane import UpdateLane
from aps.server.engine.members import Member
from aps.server.engine.optim import make_optimizer
from aps.server.engine.rows import Tables
from aps.server.engine.sync import PlanKind, make_policy
from aps.server.engine.table import ParameterTable

N = 3


class Owner:
    """What a job sees of the engine, with every report recorded."""

    def __init__(self, **options) -> None:
        config = ServerConfig(lr=1.0, **options)
        self.policy = make_policy(config)
        self.table = ParameterTable(Layout(("w",), ((N,),)), np.zeros(N, np.float32),
                                    make_optimizer("sgd", N, lr=1.0))
        self.aggregate = Aggregate(N) if self.policy.aggregates else None
        self.rows = Tables()
        self.kernels = _core
        self.reports: list[tuple] = []

    def gradient_committed(self, member, plan, arrived, hyper=None):
        self.policy.commit(member.rank, plan, arrived)  # (the owner's bookkeeping: the round goes on)
        self.reports.append(("committed", member.rank, plan.kind))
        return "answer"

    def weights_pushed_on(self, member, version):
        return None

    def gradient_compensated(self, member, version, compensated):
        self.reports.append(("compensated", member.rank, compensated))

    def gradient_refused(self, rank, reason):
        self.reports.append(("refused", rank, reason))
        return NonFiniteGradient("refused")

    def aggregate_committed(self, applied):
        self.reports.append(("aggregate", applied))


def member(owner: Owner, rank: int, grad) -> Member:
    m = Member(rank)
    m.grad = np.asarray(grad, np.float32)
    owner.policy.join(rank)
    return m


def test_a_gradient_is_applied_published_and_reported_once():
    owner, answers, errors = Owner(sync="asp"), [], []
    UpdateLane(None, 1).submit(PushJob(owner, member(owner, 0, [1.0, 2.0, 3.0]), 0, 0.0, answers.append,
                                       errors.append))
    assert owner.table.version == 1 and owner.table.weights.tolist() == [-1.0, -2.0, -3.0]
    assert owner.reports == [("committed", 0, PlanKind.APPLY)] and answers == ["answer"] and errors == []


def test_a_refused_gradient_gives_its_slot_back_and_is_reported_refused():
    owner, answers, errors = Owner(sync="asp"), [], []
    slots = owner.table.slot_count
    UpdateLane(None, 1).submit(PushJob(owner, member(owner, 0, [1.0, np.nan, 3.0]), 0, 0.0, answers.append,
                                       errors.append))
    assert owner.table.version == 0 and owner.table.weights.tolist() == [0.0, 0.0, 0.0]
    assert [report[0] for report in owner.reports] == ["refused"] and answers == [] and len(errors) == 1
    assert owner.table.slot_count <= slots + 1 and "'w'" in str(owner.reports[0][2])


def test_an_accumulated_gradient_goes_into_the_running_sum_and_the_round_is_applied_once():
    owner, answers = Owner(sync="bsp", workers=2), []
    lane = UpdateLane(None, 1)
    members = [member(owner, 0, [2.0, 0.0, 0.0]), member(owner, 1, [0.0, 2.0, 0.0])]
    for m in members:
        lane.submit(PushJob(owner, m, 0, 0.0, answers.append, answers.append))
    assert owner.aggregate.current.tolist()[:N] == [2.0, 2.0, 0.0] and owner.table.version == 0
    lane.submit(AggregateJob(owner, 0.5))
    assert owner.table.weights.tolist() == [-1.0, -1.0, 0.0] and owner.reports[-1] == ("aggregate", True)


def test_an_aggregate_update_that_would_overflow_still_ends_its_round():
    owner = Owner(sync="bsp", workers=2)
    owner.aggregate.current[:N] = np.float32(3e38)
    UpdateLane(None, 1).submit(AggregateJob(owner, 1e10))
    assert owner.table.version == 0 and owner.reports == [("aggregate", False)]
