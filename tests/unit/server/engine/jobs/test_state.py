"""The state jobs (aps.server.engine.jobs.state) through their one seam, the ``StateOwner``
they report to (a stand-in here, over a real table): each checks again at its turn, writes
only once everything about what it loads is right, and reports what it did."""

import numpy as np

from aps import _core
from aps.errors import WeightsRefused
from aps.layout import Layout
from aps.server.engine.jobs.state import LoadWeightsJob, ReadStateJob, StateCopies
from aps.server.engine.lane import UpdateLane
from aps.server.engine.members import Member
from aps.server.engine.optim import make_optimizer
from aps.server.engine.table import ParameterTable
from aps.wire.protocol import weights_digest

N = 3


class Owner:
    """What a state job sees of the engine; the checks answer as told, the reports recorded."""

    def __init__(self) -> None:
        self.table = ParameterTable(Layout(("w",), ((N,),)), np.zeros(N, np.float32),
                                    make_optimizer("sgd", N, lr=1.0, momentum=0.9))
        self.kernels = _core
        self.state_copies = StateCopies()
        self.state_generation = 0
        self.refusal: Exception | None = None
        self.reports: list[tuple] = []

    def check_weights(self, digest, numel, version):
        if self.refusal is not None:
            raise self.refusal
        return False

    def weights_loaded(self, digest, slot):
        self.table.replace(slot)
        self.reports.append(("weights", digest))

    def check_state(self, head):
        return False

    def state_loaded(self, head):
        self.reports.append(("state", head.digest))


def test_weights_are_written_aside_and_published_through_the_owner():
    owner, done, failed = Owner(), [], []
    values = np.array([1.0, 2.0, 3.0], np.float32)
    digest = weights_digest((values,))
    UpdateLane(None, 1).submit(LoadWeightsJob(owner, digest, values, 0, done.append, failed.append))
    assert done == [True] and owner.reports == [("weights", digest)] and owner.table.weights.tolist() == [1, 2, 3]


def test_weights_refused_at_their_turn_or_not_finite_change_nothing():
    owner, done, failed = Owner(), [], []
    owner.refusal = WeightsRefused("a gradient was taken meanwhile")
    values = np.ones(N, np.float32)
    lane = UpdateLane(None, 1)
    lane.submit(LoadWeightsJob(owner, weights_digest((values,)), values, 0, done.append, failed.append))
    owner.refusal = None
    bad = np.array([1.0, np.inf, 1.0], np.float32)
    lane.submit(LoadWeightsJob(owner, weights_digest((bad,)), bad, 0, done.append, failed.append))
    assert done == [] and [type(e) for e in failed] == [WeightsRefused, WeightsRefused]
    assert "weight 1 is inf" in str(failed[1]) and owner.reports == [] and owner.table.weights.tolist() == [0] * N


def test_readers_of_one_moment_share_one_copy_of_the_state():
    owner, copies, failed = Owner(), [], []
    reader = Member(0)
    lane = UpdateLane(None, 1)
    lane.submit(ReadStateJob(owner, reader, copies.append, failed.append))
    lane.submit(ReadStateJob(owner, reader, copies.append, failed.append))
    assert copies[0] is copies[1] and copies[0].version == 0 and len(copies[0].arrays) == N
    owner.state_generation += 1  # a load since: a copy of then is not the state now
    lane.submit(ReadStateJob(owner, reader, copies.append, failed.append))
    assert copies[2] is not copies[0] and failed == []
