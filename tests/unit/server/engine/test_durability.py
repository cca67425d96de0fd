"""Durability (aps.server.engine.durability) through its seams: what a checkpoint takes of
the other parts and hands back to them on a restore, through ``Resumable`` (membership:
a recording stand-in here), ``Counted`` (training's push count) and ``Loaded`` (the loads'
digests); the ``Model`` and ``Roster`` it saves and restores; the update lane a capture
runs in; and the run's identity and counters it keeps itself."""

import json
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest

from aps import _core
from aps.checkpoint import Checkpoint
from aps.config import ServerConfig
from aps.errors import CheckpointError, LayoutMismatch, MalformedFrame
from aps.layout import Layout
from aps.server.engine.durability import MAX_LINEAGE, Durability
from aps.server.engine.lane import CallJob, UpdateLane
from aps.server.engine.members import Member, PushResult, Roster
from aps.server.engine.model import Model
from aps.server.engine.scalars import Scalars
from aps.server.engine.stats import ServerStats
from aps.server.engine.sync import make_policy

N = 3
LAYOUT = Layout(("w",), ((N,),))


class Membership:
    """What a restore hands membership, recorded."""

    def __init__(self) -> None:
        self.resumed: list = []

    def resume(self, placements):
        self.resumed.append(placements)


class Part:
    """A Durability over real records and stand-ins for the parts it reads."""

    def __init__(self, **options) -> None:
        options.setdefault("sync", "ssp")
        options.setdefault("staleness", 1)
        options.setdefault("workers", 2)
        options.setdefault("momentum", 0.9)
        self.config = ServerConfig(**options)
        self.policy = make_policy(self.config)
        self.model = Model(self.config, self.policy, _core)
        self.roster = Roster()
        self.membership = Membership()
        self.training = SimpleNamespace(pushes=0)
        self.loads = SimpleNamespace(loaded_state=None, loaded_weights=None)
        self.lane = UpdateLane(None, 1 << 22)
        self.durability = Durability(self.config, self.model, self.roster, self.membership, self.training,
                                     self.loads, self.policy, ServerStats(self.config.workers, lambda: 0.0),
                                     Scalars(), self.lane)


def trained() -> Part:
    """A run with a model, two live ranks at clocks 2 and 1, five pushes, a seat, a load and a claim."""
    part = Part()
    part.model.create(LAYOUT, np.array([1.0, 2.0, 3.0], np.float32))
    part.model.table.version = 4
    for rank, clock in ((0, 2), (1, 1)):
        part.policy.join(rank, clock)
    seat = part.roster.seat(0)
    seat.push_id, seat.push_clock, seat.result = 9, 1, PushResult(4, 2, False, 0, 1.0)
    part.training.pushes = 5
    part.loads.loaded_weights = b"w" * 16
    part.durability.claim("shards", 3)
    part.durability.address = "tcp://127.0.0.1:1"
    return part


def checkpoint(part: Part) -> Checkpoint:
    """The state as written and read back (the manifest through JSON, the arrays per tensor)."""
    manifest, arrays = part.durability.checkpoint_state()
    manifest = json.loads(json.dumps(manifest))
    views = LAYOUT.views
    state = {f"{key}/{name}": view.copy() for key, flat in arrays.items() for name, view in views(flat).items()}
    weights = {name: view.copy() for name, view in views(part.model.table.current_array()).items()}
    return Checkpoint(pathlib.Path("/nowhere/checkpoint-00000001-v4"), manifest, weights, state)


def test_a_checkpoint_holds_what_every_part_keeps():
    part = trained()
    manifest, arrays = part.durability.checkpoint_state()
    assert manifest["version"] == 4 and manifest["pushes"] == 5 and manifest["claims"] == {"shards": 3}
    assert manifest["seats"]["0"]["push_id"] == 9 and manifest["loaded_weights"] == (b"w" * 16).hex()
    assert manifest["served_at"] == "tcp://127.0.0.1:1" and manifest["lineage"] == [part.durability.incarnation]
    assert "draining" not in manifest and "loaded_state" not in manifest["optimizer"]
    assert set(arrays) == {"momentum_buffer"}
    part.roster.draining = True
    assert part.durability.checkpoint_state()[0]["draining"] is True


def test_a_restore_hands_each_part_its_state_back():
    original = trained()
    saved = checkpoint(original)
    part = Part()
    part.durability.restore(saved)
    assert part.model.weights.tolist() == [1.0, 2.0, 3.0] and part.model.version == 4
    assert part.membership.resumed == [{0: (2, False, 0), 1: (1, False, 0)}]
    assert part.training.pushes == 5 and part.loads.loaded_weights == b"w" * 16 and part.loads.loaded_state is None
    assert part.roster.seats[0].push_id == 9 and part.roster.seats[0].result.version == 4
    assert part.durability.run_id == original.durability.run_id and part.durability.counters == {"shards": 3}
    assert part.durability.lineage == [original.durability.incarnation, part.durability.incarnation]
    assert part.durability.resumed_from == "/nowhere/checkpoint-00000001-v4"


def test_a_checkpoint_that_does_not_fit_leaves_nothing_behind():
    saved = checkpoint(trained())
    part = Part(sync="softsync")
    with pytest.raises(CheckpointError, match="sync policy is 'ssp'"):
        part.durability.restore(saved)
    assert part.model.table is None and part.model.layout is None and part.roster.seats == {}
    assert part.membership.resumed == [None] and part.loads.loaded_weights is None
    assert part.durability.resumed_from is None


def test_a_checkpoint_is_restored_only_before_anyone_joins():
    part = Part()
    part.roster.members[0] = Member(0)
    with pytest.raises(CheckpointError, match="before anyone joins"):
        part.durability.restore(checkpoint(trained()))
    assert part.membership.resumed == []


def test_each_value_of_a_counter_is_handed_out_once():
    part = Part()
    assert [part.durability.claim("batches", 2) for _ in range(3)] == [0, 2, 4]
    with pytest.raises(MalformedFrame, match="1 to"):
        part.durability.claim("", 1)
    with pytest.raises(MalformedFrame, match="2\\*\\*53"):
        part.durability.claim("batches", 2**53)
    assert part.durability.counters == {"batches": 6}


def test_the_first_record_of_the_shards_runs_stands():
    with pytest.raises(MalformedFrame, match="--shards > 1"):
        Part().durability.record_shard_runs(["a"])
    part = Part(shards=2, shard=1)
    own = part.durability.run_id
    with pytest.raises(MalformedFrame, match="shard 1"):
        part.durability.record_shard_runs(["a", "b"])
    assert part.durability.record_shard_runs(["a", own]) == ["a", own]
    with pytest.raises(LayoutMismatch, match="shard 0 now holds run b"):
        part.durability.record_shard_runs(["b", own])
    assert json.loads(part.durability.shard_description)["runs"] == ["a", own]


def test_a_lineage_that_does_not_hold_together_is_left_out_and_a_long_one_keeps_its_newest():
    part = Part()
    own = part.durability.incarnation
    part.durability.carry_lineage(["not an id"])
    assert part.durability.lineage == [own] and part.durability.lineage_text == own
    older = [f"{i:016x}" for i in range(MAX_LINEAGE + 5)]
    part.durability.carry_lineage(older)
    assert len(part.durability.lineage) == MAX_LINEAGE and part.durability.lineage[-1] == own
    assert part.durability.lineage[0] == older[6]


def test_a_capture_runs_in_the_update_lane_after_what_was_queued_before_it():
    held = []
    part = Part()
    part.lane = part.durability.lane = UpdateLane(lambda kernel, done: held.append(done), 1)
    order = []

    class Busy(CallJob):
        def prepare(self):
            return 1  # a kernel: held off the loop until done is called

    part.lane.submit(Busy(lambda: order.append("update")))
    part.durability.capture_checkpoint(CallJob(lambda: order.append("capture")))
    assert order == []
    held.pop()(True)
    assert order == ["update", "capture"]
