"""The loads (aps.server.engine.loads) through their seams: ``Taken`` (training's push count,
a plain stand-in here), the ``Model`` whose state and weights they read and replace, the
``Roster`` whose members let go of the weights they were given, the update lane their jobs
run in (inline) and the jobs' ``StateOwner`` reports (``check_*``, ``state_loaded``,
``weights_loaded``)."""

from types import SimpleNamespace

import numpy as np
import pytest

from aps import _core
from aps.config import ServerConfig
from aps.errors import InvalidState, MalformedFrame, NotInitialized, PayloadSizeMismatch, WeightsRefused
from aps.layout import Layout
from aps.server.engine.lane import UpdateLane
from aps.server.engine.loads import Loads
from aps.server.engine.members import Member, Roster
from aps.server.engine.model import Model
from aps.server.engine.sync import make_policy
from aps.wire.protocol import StateHead, state_digest, weights_digest

N = 4
LAYOUT = Layout(("w",), ((N,),))


class Part:
    """Loads over a registered model (zeros), one joined member, and nothing pushed yet."""

    def __init__(self, **options) -> None:
        options.setdefault("sync", "asp")
        self.config = ServerConfig(**options)
        self.model = Model(self.config, make_policy(self.config), _core)
        self.model.create(LAYOUT, np.zeros(N, np.float32))
        self.roster = Roster()
        self.member = self.roster.members[0] = Member(0)
        self.member.joined = True
        self.training = SimpleNamespace(pushes=0)
        self.loads = Loads(self.config, self.model, self.roster, self.training, UpdateLane(None, 1 << 22))
        self.done: list = []
        self.failed: list = []

    def load_weights(self, values, digest=None, version=0):
        values = np.asarray(values, np.float32)
        digest = weights_digest((values,)) if digest is None else digest
        self.loads.load_weights(self.member, digest, values, version, self.done.append, self.failed.append)
        return digest


def test_weights_are_loaded_as_version_0_and_the_weights_given_before_are_let_go_of():
    part = Part()
    part.member.keep_pulled(part.model.table.snapshot())
    digest = part.load_weights([1.0, 2.0, 3.0, 4.0])
    assert part.done == [True] and part.model.weights.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert part.model.version == 0 and part.loads.loaded_weights == digest and part.member.pulled is None
    part.load_weights([1.0, 2.0, 3.0, 4.0])  # every rank may load the same weights
    assert part.done == [True, False]


def test_weights_are_refused_once_a_gradient_was_taken_or_other_weights_were_loaded():
    part = Part()
    part.training.pushes = 1
    with pytest.raises(WeightsRefused, match="taken 1 gradients"):
        part.loads.check_weights(b"d" * 16, N, 0)
    part.training.pushes = 0
    with pytest.raises(PayloadSizeMismatch):
        part.loads.check_weights(b"d" * 16, N + 1, 0)
    part.load_weights(np.ones(N))
    with pytest.raises(WeightsRefused, match="other weights"):
        part.loads.check_weights(b"d" * 16, N, 0)


def test_weights_that_do_not_match_their_digest_change_nothing():
    part = Part()
    part.load_weights(np.ones(N), digest=b"\0" * 16)
    assert isinstance(part.failed[0], WeightsRefused) and part.model.weights.tolist() == [0.0] * N
    assert part.loads.loaded_weights is None


def test_nothing_is_loaded_before_the_model_exists_or_the_member_joined():
    part = Part()
    part.model.forget()
    with pytest.raises(NotInitialized):
        part.loads.check_weights(b"d" * 16, N, 0)
    with pytest.raises(NotInitialized):
        part.loads.read_optimizer_state(part.member, part.done.append, part.failed.append)


def momentum_head(steps: int, buffer: np.ndarray, **changes) -> StateHead:
    fields = dict(optimizer="sgd", steps=steps, numel=N, arrays=("momentum_buffer",),
                  digest=state_digest(steps, [buffer]))
    fields.update(changes)
    return StateHead(**fields)


def test_a_state_is_checked_loaded_once_and_read_back_by_readers_sharing_one_copy():
    part = Part(momentum=0.9)
    buffer = np.arange(N, dtype=np.float32)
    with pytest.raises(MalformedFrame):
        part.loads.check_state(momentum_head(3, buffer, digest=None))
    with pytest.raises(InvalidState, match="adam"):
        part.loads.check_state(momentum_head(3, buffer, optimizer="adam"))
    head = momentum_head(3, buffer)
    assert part.loads.check_state(head) is False
    part.loads.load_optimizer_state(part.member, head, {"momentum_buffer": [buffer]}, part.done.append,
                                    part.failed.append)
    assert part.done == [True] and part.loads.loaded_state == head.digest and part.loads.state_generation == 1
    assert part.loads.check_state(head) is True  # the same again: a no-op
    copies = []
    part.loads.read_optimizer_state(part.member, copies.append, part.failed.append)
    part.loads.read_optimizer_state(part.member, copies.append, part.failed.append)
    assert copies[0] is copies[1] and copies[0].arrays.tolist() == buffer.tolist() and not part.failed
