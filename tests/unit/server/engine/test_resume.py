"""Resume is exact: an engine restored from a checkpoint of another, with every worker
rejoining, goes on exactly as the original would have (weights bit for bit, version,
clocks, who is held), for every policy; and the duplicate rule answers a push sent
again without applying it.

The engines are driven directly (no sockets), with random schedules; the state goes
through JSON as it does on disk.
"""

from __future__ import annotations

import json
import pathlib
import random

import numpy as np
import pytest

from aps.checkpoint import Checkpoint
from aps.errors import CheckpointError, OutOfOrder
from aps.layout import Layout
from aps.tables import Table
from aps.wire.rows import RowSection

from tests.harness import Harness

SETTINGS = [
    {"sync": "bsp"},
    {"sync": "bsp", "backup_workers": 1},
    {"sync": "asp"},
    {"sync": "asp", "lr_staleness": "inverse", "async_scale": "mean"},
    {"sync": "ssp", "staleness": 1},
    {"sync": "dssp", "staleness": 2, "max_staleness": 2},  # s_L == s_U: no timing-dependent grants
    {"sync": "softsync", "softsync_n": 1},
    {"sync": "softsync", "softsync_n": 2, "staleness": 1},
]
OPTIMIZERS = [
    {"optimizer": "sgd", "momentum": 0.9, "lr": 0.1},
    {"optimizer": "adam", "lr": 0.05},
]


def checkpoint_of(harness: Harness) -> Checkpoint:
    """What the checkpointer would write and read back: the manifest through JSON, copies of the arrays."""
    engine = harness.engine
    manifest, arrays = engine.durability.checkpoint_state()
    manifest = json.loads(json.dumps(manifest))
    layout = engine.model.layout
    weights = {name: view.copy() for name, view in layout.views(engine.model.table.current_array()).items()}
    state = {}
    for key, flat in arrays.items():
        if key == "aggregate" or key.startswith(("tables/", "round/")):
            state[key] = flat.copy()
        else:
            state.update((f"{key}/{name}", view.copy()) for name, view in layout.views(flat).items())
    return Checkpoint(pathlib.Path("/nowhere/checkpoint-00000001-v0"), manifest, weights, state)


class Driver:
    """Workers that push (then pull) random gradients whenever they are free to."""

    def __init__(self, harness: Harness, seed: int) -> None:
        self.h = harness
        self.rng = random.Random(seed)
        self.grads = np.random.default_rng(seed).standard_normal((64, harness.numel)).astype(np.float32)
        self.rows = np.random.default_rng(seed).standard_normal((64, 4)).astype(np.float32)

    def step(self) -> None:
        h = self.h
        free = [r for r in range(h.P) if not h.workers[r].waiting]
        assert free, "every worker is held: the policy deadlocked"
        rank = self.rng.choice(free)
        h.tick(self.rng.uniform(0.1, 2.0))
        rows = None
        if h.layout.tables:  # rows of the table with every push, and now and then rows alone
            ids = np.array([self.rng.randrange(12) for _ in range(5)], np.int64)
            rows = [RowSection(0, ids, self.rows[self.rng.randrange(59):][:5])]
        grad = None if rows and self.rng.random() < 0.25 else self.grads[self.rng.randrange(64)]
        h.push(rank, grad, then_pull=True, rows=rows)
        assert not h.workers[rank].errors, h.workers[rank].errors


def observe(h: Harness):
    window = h.window.state()
    return (h.engine.version, h.engine.training.pushes, h.policy.dropped, window[0], window[2], window[3], window[4],
            tuple(h.policy.is_held(r) for r in range(h.P)), tuple(w.waiting for w in h.workers),
            h.engine.model.table.current_array().tobytes(),
            tuple(value.tobytes() for rows in h.engine.model.rows.values() for value in rows.arrays().values()))


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o["optimizer"])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_resumed_engine_goes_on_exactly_as_the_original(setting, optimizer, seed):
    """With the rows of a table pushed beside the dense gradient (or alone), the rows of a
    round the checkpoint caught open included."""
    table = Table(rows=100, dim=4, init="normal:0.1", optimizer="adam" if seed % 2 else "sgd", lr=0.1)
    options = {"workers": 3, "numel": 5, "tables": (("items", table),), **setting, **optimizer}
    original = Harness(**options)
    original.join_all(np.linspace(-1, 1, 5, dtype=np.float32))
    driver = Driver(original, seed)
    cut = random.Random(seed).randrange(5, 40)
    for _ in range(cut):
        driver.step()
    checkpoint = checkpoint_of(original)
    waiting = [w.waiting for w in original.workers]

    resumed = Harness(**options)
    resumed.engine.durability.restore(checkpoint)
    assert resumed.engine.version == original.engine.version
    assert not resumed.engine.roster.started
    for rank in range(resumed.P):  # everyone reconnects; those whose pull was held ask again
        resumed.join(rank, rejoin=True)
        assert not resumed.workers[rank].errors
    assert resumed.engine.roster.started
    for rank in range(resumed.P):
        resumed.workers[rank].version = original.workers[rank].version
        if waiting[rank]:
            resumed.pull(rank)
    resumed.now = original.now
    assert observe(resumed)[:8] == observe(original)[:8]

    twin = Driver(resumed, seed)
    twin.rng.setstate(driver.rng.getstate())
    for _ in range(40):
        driver.step()
        twin.step()
        assert observe(resumed) == observe(original)


def test_restore_refuses_a_checkpoint_of_another_policy_or_size():
    original = Harness(workers=2, sync="ssp", staleness=1)
    original.join_all()
    checkpoint = checkpoint_of(original)
    with pytest.raises(CheckpointError, match="sync policy is 'ssp'"):
        Harness(workers=2, sync="asp").engine.durability.restore(checkpoint)
    with pytest.raises(CheckpointError, match="3 workers"):
        Harness(workers=3, sync="ssp", staleness=1).engine.durability.restore(checkpoint)
    with pytest.raises(CheckpointError, match="sgd"):
        Harness(workers=2, sync="ssp", staleness=1, optimizer="adam").engine.durability.restore(checkpoint)
    engine = Harness(workers=2, sync="ssp", staleness=1).engine
    del checkpoint.state  # nothing half-restored is kept
    checkpoint.state = {}
    Harness(workers=2, sync="ssp", staleness=1, momentum=0.0).engine.durability.restore(checkpoint)  # sgd without state: fine
    momentum = checkpoint_of(_momentum_harness())
    momentum.state = {}
    with pytest.raises(CheckpointError, match="momentum_buffer"):
        engine_m = Harness(workers=2, sync="ssp", staleness=1, momentum=0.9).engine
        engine_m.durability.restore(momentum)
    assert engine_m.model.table is None and engine_m.model.layout is None
    assert engine.model.table is None


def test_a_checkpoint_keeps_the_tables_rows_and_their_state_exactly():
    tables = (("items", Table(rows=10**9, dim=4, optimizer="adam", lr=0.1)), ("empty", Table(rows=9, dim=2)))
    original = Harness(workers=1, sync="asp")
    original.layout = Layout(original.layout.names, original.layout.shapes, tables)
    original.join_all()
    rows = original.engine.model.rows["items"]
    rows.push(np.array([5, 7, 5]), np.ones((3, 4), np.float32))
    rows.push(np.array([10**8]), np.full((1, 4), 2.0, np.float32))
    checkpoint = checkpoint_of(original)
    assert checkpoint.manifest["table_steps"] == {"items": 2, "empty": 0}
    restored = Harness(workers=1, sync="asp").engine
    restored.durability.restore(checkpoint)
    assert restored.model.layout.tables == tables and len(restored.model.rows["empty"]) == 0
    again = restored.model.rows["items"]
    assert again.steps == 2
    for key, value in rows.arrays().items():
        assert np.array_equal(again.arrays()[key], value), key
    for rows_now in (rows, again):  # and they go on alike
        rows_now.push(np.array([7, 11]), np.full((2, 4), -1.0, np.float32))
    assert np.array_equal(again.pull([5, 7, 11, 10**8]), rows.pull([5, 7, 11, 10**8]))


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c.manifest.update(table_steps=[1]), "table_steps are not whole numbers"),
    (lambda c: c.manifest.update(table_steps={"items": -3}), "table_steps are not whole numbers"),
    (lambda c: c.state.update({"tables/items/exp_avg": np.zeros((1, 4), np.float32)}), "exp_avg has shape"),
    (lambda c: c.state.update({"tables/items/ids": np.array([3, 3])}), "names an id twice"),
    (lambda c: c.state.pop("tables/items/exp_avg_sq"), "a checkpoint has"),
])
def test_a_checkpoint_with_bad_tables_is_refused_and_nothing_is_kept(change, message):
    tables = (("items", Table(rows=100, dim=4, optimizer="adam")),)
    original = Harness(workers=1, sync="asp")
    original.layout = Layout(original.layout.names, original.layout.shapes, tables)
    original.join_all()
    original.engine.model.rows["items"].push(np.array([1, 2]), np.ones((2, 4), np.float32))
    checkpoint = checkpoint_of(original)
    change(checkpoint)
    engine = Harness(workers=1, sync="asp").engine
    with pytest.raises(CheckpointError, match=message):
        engine.durability.restore(checkpoint)
    assert engine.model.table is None and engine.model.rows == {}


def _momentum_harness() -> Harness:
    h = Harness(workers=2, sync="ssp", staleness=1, momentum=0.9)
    h.join_all()
    return h


def test_a_push_sent_again_is_answered_and_not_applied_twice():
    h = Harness(workers=1, sync="asp")
    h.join_all()
    member = h.workers[0].member
    grad = np.ones(h.numel, np.float32)
    member.grad[:] = grad
    results = []
    h.engine.training.push(member, 0, results.append, pytest.fail, request_id=7, clock=0)
    h.leave(0)  # the reply was lost with the connection; the worker reconnects
    w0 = h.workers[0]
    member = w0.member = h.engine.membership.join(0, 1, h.layout, None, h._ready(w0), w0.errors.append, rejoin=True)
    member.grad[:] = grad
    h.engine.training.push(member, 0, results.append, pytest.fail, request_id=7, clock=0)  # the same push again
    assert [r.version for r in results] == [1, 1] and h.engine.version == 1
    assert h.engine.stats.duplicates == 1
    np.testing.assert_array_equal(h.engine.model.table.current_array(), -grad)
    h.engine.training.push(member, 1, results.append, pytest.fail, request_id=0, clock=1)  # id 0 names no request
    h.engine.training.push(member, 2, results.append, pytest.fail, request_id=0, clock=1)
    assert h.engine.version == 3


def test_a_bsp_push_sent_again_after_a_rejoin_counts_its_worker_present_once():
    """Rank 0's gradient is in the open round when its connection drops; it rejoins and
    sends the push again: the round closes with each gradient once."""
    h = Harness(workers=2, sync="bsp")
    h.join_all()
    w0, w1 = h.workers
    g0, g1 = np.full(h.numel, 1.0, np.float32), np.full(h.numel, 3.0, np.float32)
    w0.member.grad[:] = g0
    h.engine.training.push(w0.member, 0, lambda r: None, pytest.fail, request_id=5, clock=0)
    h.leave(0)  # the reply was lost with the connection
    w0.member = h.engine.membership.join(0, 2, h.layout, None, h._ready(w0), w0.errors.append, rejoin=True)
    assert h.policy.clock(0) == 1  # it goes on from the clock it had
    w0.member.grad[:] = g0
    h.engine.training.push(w0.member, 0, lambda r: None, pytest.fail, request_id=5, clock=0)
    assert h.engine.version == 0  # the round still waits for rank 1
    h.push(1, g1)
    assert h.engine.version == 1
    np.testing.assert_allclose(h.engine.model.table.current_array(), -(g0 + g1) / 2)  # lr 1, the mean of two


def test_reconnect_attempts_come_fast_at_first_then_back_off_with_jitter():
    from aps.client.recovery import RECONNECT

    _retry_wait = RECONNECT.wait

    eager = [_retry_wait(t, 0) for t in (0.0, 1.0, 4.9) for _ in range(50)]
    assert all(0.1 <= w <= 0.2 for w in eager) and len(set(eager)) > 1  # jittered
    for n in range(40):  # then doubling from 0.2 s up to 5 s, each wait jittered within [d/2, d]
        delay = min(5.0, 0.2 * 2**n)
        assert all(delay / 2 <= _retry_wait(6.0, n) <= delay for _ in range(20)), n


def test_a_first_connection_refused_is_tried_again_on_the_same_schedule_from_50_ms_to_half_a_second():
    from aps.client.recovery import FIRST_CONNECT

    for n in range(20):
        delay = min(0.5, 0.05 * 2**n)
        waits = [FIRST_CONNECT.wait(0.0, n) for _ in range(20)]
        assert all(delay / 2 <= w <= delay for w in waits) and len(set(waits)) > 1, n


def resumed_pair(sync: str, **options) -> tuple[Harness, Checkpoint]:
    """Two workers; rank 0 pushed once more than rank 1 (held under SSP s=0, in the open
    round under BSP), and a checkpoint of that."""
    h = Harness(workers=2, sync=sync, **options)
    h.join_all()
    h.push(0, np.ones(h.numel, np.float32), then_pull=True)
    assert h.held(0) or sync == "softsync"  # softsync: its gradient waits in the buffer
    return h, checkpoint_of(h)


@pytest.mark.parametrize("sync, options", [("bsp", {}), ("ssp", {"staleness": 0})])
def test_new_worker_processes_after_a_resume_start_afresh(sync, options):
    """The whole job was restarted: fresh processes (no REJOIN) are not held at a gate they
    know nothing of; a rank whose gradient is in the open round pushes again (dropped)."""
    original, checkpoint = resumed_pair(sync, **options)
    resumed = Harness(workers=2, sync=sync, **options)
    resumed.engine.durability.restore(checkpoint)
    resumed.join_all()
    assert resumed.engine.roster.started and not resumed.held(0)
    for rank in (0, 1):
        resumed.push(rank, np.full(resumed.numel, 2.0, np.float32), then_pull=True)
    assert not any(w.errors for w in resumed.workers), [w.errors for w in resumed.workers]
    if sync == "bsp":  # rank 0's first gradient (ones) and rank 1's (twos) make the round; the resent one is dropped
        assert resumed.engine.version == 1 and resumed.policy.dropped == 1
        np.testing.assert_allclose(resumed.engine.model.table.current_array(), -1.5)


@pytest.mark.parametrize("sync", ["bsp", "softsync"])
def test_no_update_is_formed_before_the_workers_are_back(sync):
    """A rank that comes back and leaves again before the start does not close the round."""
    original, checkpoint = resumed_pair(sync, **({"softsync_n": 1} if sync == "softsync" else {}))
    resumed = Harness(workers=2, sync=sync, **({"softsync_n": 1} if sync == "softsync" else {}))
    resumed.engine.durability.restore(checkpoint)
    resumed.join(0, rejoin=True)
    resumed.leave(0)
    resumed.join(1, rejoin=True)
    assert resumed.engine.version == 0 and not resumed.engine.roster.started


def test_a_resumed_run_waits_only_for_the_ranks_that_were_live():
    h = Harness(workers=3, sync="asp")
    h.join_all()
    h.push(0, np.ones(h.numel, np.float32))
    h.leave(2)  # rank 2 was gone before the checkpoint
    checkpoint = checkpoint_of(h)
    resumed = Harness(workers=3, sync="asp")
    resumed.engine.durability.restore(checkpoint)
    resumed.join(0, rejoin=True)
    assert resumed.engine.membership.join_progress() == (1, 2, [1]) and not resumed.engine.roster.started
    resumed.join(1, rejoin=True)
    assert resumed.engine.roster.started
    resumed.join(2)  # and rank 2 may come back later, as any joining worker
    assert resumed.live(2) and not resumed.workers[2].errors


def test_a_dssp_worker_that_reconnects_keeps_its_grant():
    """Released beyond s_L with credit, it loses its connection: it comes back not held, with
    its credit, and its next push is accepted."""
    h = Harness(workers=2, sync="dssp", staleness=0, max_staleness=4)
    h.join_all()
    window = h.window
    granted = False
    for _ in range(20):  # rank 1 pushes every second, rank 0 ten times as often, when it may
        h.tick(1.0)
        h.push(1, np.ones(h.numel, np.float32), then_pull=True)
        for _ in range(10):
            if h.held(0):
                break
            h.tick(0.1)
            h.push(0, np.ones(h.numel, np.float32), then_pull=True)
            if window.credit(0) > 0 and not h.held(0):
                granted = True
                break
        if granted:
            break
    assert granted and window.gap(0) > 0, (window.gap(0), window.credit(0))
    clock, credit = window.clock(0), window.credit(0)
    h.leave(0)
    h.workers[0].member = h.engine.membership.join(0, 2, h.layout, None, h._ready(h.workers[0]), h.workers[0].errors.append,
                                        rejoin=True)
    assert window.clock(0) == clock and window.credit(0) == credit and not h.held(0)
    h.push(0, np.ones(h.numel, np.float32))
    assert not h.workers[0].errors


def test_a_fresh_process_is_never_taken_for_a_duplicate():
    """A new process for rank 0 numbers its requests from 1 again, at the clock the old one had."""
    h = Harness(workers=2, sync="ssp", staleness=3)
    h.join_all()
    member = h.workers[0].member
    member.grad[:] = 1.0
    h.engine.training.push(member, 0, lambda r: None, pytest.fail, request_id=2, clock=0)
    h.leave(0)
    h.join(0)  # fresh: not a REJOIN
    member = h.workers[0].member
    member.grad[:] = 1.0
    h.engine.training.push(member, 1, lambda r: None, pytest.fail, request_id=2, clock=0)
    assert h.engine.version == 2 and h.engine.stats.duplicates == 0


@pytest.mark.parametrize("shards", [1, 2])
def test_a_bsp_shard_resumed_alone_leaves_out_the_round_its_checkpoint_caught_open(shards):
    """docs/algorithms.md, "Sharded resume": a shard's workers go on with their next iteration,
    so the gradients of a round caught open must not be paired with later ones; one server
    (whose workers go back to its clocks) keeps the open round."""
    options = {"workers": 3, "numel": 3, "sync": "bsp", "shards": shards, "shard": 0}
    original = Harness(**options)
    original.join_all()
    for rank in range(3):
        original.push(rank, np.ones(3, np.float32), then_pull=True)
    original.push(1, np.full(3, 2.0, np.float32), then_pull=True)  # round 2 open, rank 1's gradient in it
    assert original.engine.version == 1
    resumed = Harness(**options)
    resumed.engine.durability.restore(checkpoint_of(original))
    for rank in range(3):
        resumed.join(rank, rejoin=True)
    clocks = [resumed.policy.clock(rank) for rank in range(3)]
    if shards == 1:
        assert clocks == [1, 2, 1] and resumed.policy.is_held(1)  # it waits in its round, as before
        return
    assert clocks == [1, 1, 1]  # rank 1 back at the last closed round, with the others
    assert not resumed.policy.is_held(1)
    for rank in range(3):  # every rank pushes its next iteration
        resumed.push(rank, np.full(3, 4.0, np.float32), then_pull=True)
    # the round closes on the three new gradients only: -1 (round 1) - 4 (round 2)
    assert resumed.engine.version == 2
    assert np.array_equal(resumed.engine.model.table.current_array(), np.full(3, -5.0, np.float32))


def _lost_iterations(sync: str, shards: int, **options) -> tuple[Harness, Harness]:
    """Rank 0 pushes 1, rank 1 pushes 1 (both released), a checkpoint; then rank 0 pushes 2
    more and rank 1 one more. Returns the original and an engine resumed from the
    checkpoint (the shard that came back older), nobody rejoined yet."""
    original = Harness(workers=2, sync=sync, shards=shards, numel=4, **options)
    original.join_all()
    one = np.ones(4, np.float32)
    for rank in (0, 1):
        original.push(rank, one, then_pull=True)
    checkpoint = checkpoint_of(original)
    for rank in (0, 1, 0):
        original.push(rank, one, then_pull=True)
    assert [original.policy.clock(r) for r in (0, 1)] == [3, 2]
    resumed = Harness(workers=2, sync=sync, shards=shards, numel=4, **options)
    resumed.engine.durability.restore(checkpoint)
    assert [resumed.engine.membership._placements[r][0] for r in (0, 1)] == [1, 1]
    return original, resumed


@pytest.mark.parametrize("sync, options", [("ssp", {"staleness": 1}), ("dssp", {"staleness": 1, "max_staleness": 3}),
                                           ("asp", {}), ("softsync", {"softsync_n": 2})])
def test_a_shard_resumed_older_counts_a_rejoining_ranks_lost_iterations_as_done(sync, options):
    """docs/algorithms.md, "Sharded resume": the resumed shard takes each rejoining rank's own
    clock (its other shards kept those iterations), so every shard's gate sees the ranks in
    one order; the push each had in flight, computed on weights this shard no longer holds,
    is dropped and ends its iteration. Nothing of the lost iterations is applied."""
    original, h = _lost_iterations(sync, 2, **options)
    weights = h.engine.model.table.current_array().copy()
    h.join(0, rejoin=True, clock=3)
    h.join(1, rejoin=True, clock=2)
    assert [h.policy.clock(r) for r in (0, 1)] == [3, 2]
    assert not h.held(0) and not h.held(1)
    assert all(w.waiting is False for w in h.workers)  # both back: training goes on
    # rank 1's push in flight, computed on the original's newest weights: dropped, counted
    h.push(1, np.ones(4, np.float32), version=original.engine.version, request_id=9, clock=2)
    assert not h.workers[1].errors, h.workers[1].errors
    result = h.workers[1].results[-1]
    assert result.dropped and h.policy.clock(1) == 3 and h.policy.dropped == 1
    ranks = h.engine.stats_snapshot()["workers"]
    assert [(w["dropped"], w["dropped_resumed"], w["dropped_stale"]) for w in ranks] == [(0, 0, 0), (1, 1, 0)]
    np.testing.assert_array_equal(h.engine.model.table.current_array(), weights)
    # a push from the rank's own weights goes on as any other
    h.pull(0)
    h.push(0, np.ones(4, np.float32), request_id=10, clock=3)
    assert h.policy.clock(0) == 4 and not h.workers[0].errors


@pytest.mark.parametrize("sync, shards", [("ssp", 1), ("bsp", 2)])
def test_one_server_and_bsp_shards_resume_at_the_checkpoints_clocks(sync, shards):
    """One server (the checkpoint is all there is), and BSP shards (they come back to one round:
    REWIND), keep the checkpoint's clocks whatever the rejoining worker says; a push computed
    on weights newer than the server's is refused there, as before."""
    options = {"staleness": 1} if sync == "ssp" else {}
    original, h = _lost_iterations(sync, shards, **options)
    h.join(0, rejoin=True, clock=3)
    h.join(1, rejoin=True, clock=2)
    assert [h.policy.clock(r) for r in (0, 1)] == [1, 1]
    with pytest.raises(OutOfOrder, match="claims weights of version"):
        h.push(1, np.ones(4, np.float32), version=original.engine.version, request_id=9, clock=2)


def test_a_rejoining_worker_that_says_a_clock_beyond_2_53_is_refused_and_seats_nobody():
    """The clock a resumed shard takes from a rejoining worker is bounded: the window's int64
    arithmetic (clock + 1 at each push, the slowest clock) must never wrap."""
    from aps.errors import MalformedFrame
    from aps.server.engine.membership import MAX_CLOCK

    _, h = _lost_iterations("ssp", 2, staleness=1)
    for clock in (MAX_CLOCK + 1, (1 << 64) - 1):
        with pytest.raises(MalformedFrame, match="a clock is at most 2"):
            h.join(0, rejoin=True, clock=clock)
        assert 0 not in h.engine.roster.members and not h.policy.window.state()[1][0]
    h.join(0, rejoin=True, clock=MAX_CLOCK)  # the bound itself is taken
    assert h.policy.clock(0) == MAX_CLOCK


@pytest.mark.parametrize("sharded", [True, False])
def test_a_bsp_worker_back_on_two_shards_lands_in_the_same_rounds_on_both(sharded):
    """docs/algorithms.md, "Sharded BSP across reconnects": rank 0's connections drop while
    ranks 1 and 2 push round 1. Shard A has it back before their gradients come, so its round 1
    waits for rank 0; shard B saw them first, and closed round 1 without it. Rank 0's next
    gradient goes into round 1 on A and is dropped on B (a round it missed), so its following
    one is in round 2 on both. (One server seats it at the round clock instead: nothing to align.)"""
    g = {(r, i): np.full(3, float(1 + r + 3 * i), np.float32) for r in range(3) for i in range(3)}
    options = {"workers": 3, "numel": 3, "sync": "bsp", "shards": 2 if sharded else 1}
    a, b = Harness(**options, shard=0), Harness(**options, shard=1 if sharded else 0)
    for h in (a, b):
        h.join_all()
        for rank in range(3):
            h.push(rank, g[rank, 0], then_pull=True)
        assert h.engine.version == 1
    a.leave(0)
    a.join(0, rejoin=True, clock=1)
    for rank in (1, 2):
        a.push(rank, g[rank, 1], then_pull=True)
        b.push(rank, g[rank, 1], then_pull=True)
    assert a.engine.version == 1  # waiting for rank 0
    b.leave(0)
    assert b.engine.version == 2  # closed without it
    b.join(0, rejoin=True, clock=1)
    if not sharded:
        assert b.policy.clock(0) == 2  # at the round clock, as a new arrival
        return
    assert b.policy.clock(0) == 1 and b.policy.round_clock == 2  # at its own clock, one round behind
    for h in (a, b):
        h.push(0, g[0, 1], then_pull=True)
    assert a.engine.version == 2 and b.engine.version == 2
    assert b.workers[0].results[-1].dropped and b.policy.clock(0) == 2  # dropped on B, where round 1 is over
    for h in (a, b):
        for rank in range(3):
            h.push(rank, g[rank, 2], then_pull=True)
        assert h.engine.version == 3 and not any(w.errors for w in h.workers)
    mean = lambda *keys: sum(g[k] for k in keys) / len(keys)  # noqa: E731
    first, last = mean((0, 0), (1, 0), (2, 0)), mean((0, 2), (1, 2), (2, 2))
    np.testing.assert_array_equal(a.engine.model.table.current_array(), -(first + mean((0, 1), (1, 1), (2, 1)) + last))
    np.testing.assert_array_equal(b.engine.model.table.current_array(), -(first + mean((1, 1), (2, 1)) + last))


def test_a_bsp_worker_that_joins_a_round_under_way_goes_on_at_the_next_rounds_clock():
    """Held until the round closes, it takes part in the next: its clock is that round's, so
    its first gradient is in it (not taken for one of a round it missed)."""
    h = Harness(workers=3, numel=3, sync="bsp")
    h.join_all()
    for rank in range(3):
        h.push(rank, np.ones(3, np.float32), then_pull=True)
    h.leave(2)
    h.push(0, np.full(3, 2.0, np.float32), then_pull=True)  # round 1 under way without rank 2
    h.join(2)  # a new process for rank 2
    assert h.held(2) and h.policy.clock(2) == 2 and h.policy.round_clock == 1
    h.push(1, np.full(3, 4.0, np.float32), then_pull=True)
    assert h.engine.version == 2 and not h.held(2) and h.policy.round_clock == 2
    for rank in range(3):
        h.push(rank, np.full(3, 6.0, np.float32), then_pull=True)
    assert h.engine.version == 3 and not any(r.dropped for w in h.workers for r in w.results)
    np.testing.assert_array_equal(h.engine.model.table.current_array(), np.full(3, -1.0 - 3.0 - 6.0, np.float32))


@pytest.mark.parametrize("round_clock", [-1, 2**53 + 1])
def test_a_bsp_checkpoint_whose_round_clock_is_no_clock_is_refused_and_nothing_is_kept(round_clock):
    original = Harness(workers=2, sync="bsp")
    original.join_all()
    checkpoint = checkpoint_of(original)
    checkpoint.manifest["policy"]["round_clock"] = round_clock
    resumed = Harness(workers=2, sync="bsp")
    with pytest.raises(CheckpointError, match="round clock"):
        resumed.engine.durability.restore(checkpoint)
    assert resumed.engine.model.table is None


@pytest.mark.parametrize("sharded", [True, False])
def test_two_new_bsp_workers_reaching_two_shards_in_opposite_orders_both_train(sharded):
    """docs/algorithms.md, "Sharded BSP: a worker that joins": new processes for ranks 2 and 3
    reach shard A before and after round 1's first gradient, and shard B the other way round.
    Were the late one held for the round's close, A's round would wait for rank 2, which waits
    for B's INIT reply, held until B's round closes, which waits for rank 3, which waits for A's:
    neither would ever push. A shard of a sharded run seats each in the round under way, so
    both INITs are answered at once and the round closes on all four gradients on both shards.
    (One server holds the late one for the round's close, as before.)"""
    options = {"workers": 4, "numel": 3, "sync": "bsp", "shards": 2 if sharded else 1}
    a, b = Harness(**options, shard=0), Harness(**options, shard=1 if sharded else 0)
    for h, (early, late) in ((a, (2, 3)), (b, (3, 2))):
        h.join_all()
        for rank in range(4):
            h.push(rank, np.ones(3, np.float32), then_pull=True)
        h.leave(2)
        h.leave(3)  # their processes died; new ones come
        h.join(early)
        for rank in (0, 1):
            h.push(rank, np.full(3, 2.0, np.float32), then_pull=True)
        h.join(late)
        if not sharded:
            assert h.held(late) and h.workers[late].waiting  # its INIT waits for the round's close
            return
        assert not h.workers[early].waiting and not h.workers[late].waiting  # both INITs answered
        assert h.policy.clock(late) == h.policy.clock(early) == h.policy.round_clock == 1
    for h in (a, b):
        for rank in (2, 3):
            h.push(rank, np.full(3, 6.0, np.float32), then_pull=True)
        assert h.engine.version == 2 and not any(w.errors for w in h.workers)
        np.testing.assert_array_equal(h.engine.model.table.current_array(), np.full(3, -1.0 - 4.0, np.float32))


def _skip(h: Harness, rank: int, request_id: int | None = None, clock: int | None = None) -> None:
    """Rank ``rank``'s PUSH_PULL with Flag.SKIP: no gradient, then the round's weights."""
    worker = h.workers[rank]
    worker.waiting = True

    def done(result):
        worker.results.append(result)
        h.pull(rank)

    h.engine.training.push(worker.member, worker.version, done, worker.errors.append, dense=False, skip=True,
                           request_id=request_id, clock=clock)


def _one_round_apart() -> tuple[Harness, Harness, dict]:
    """Two shards A and B, three workers: rank 2's process ended after round 0, ranks 0 and 1
    pushed round 1 to both (B closed it), and a new rank 2 is seated at clock 1 on A (in round 1,
    which waits for it) and at clock 2 on B."""
    g = {(r, i): np.full(3, float(1 + r + 3 * i), np.float32) for r in range(3) for i in range(4)}
    a, b = (Harness(workers=3, numel=3, sync="bsp", shards=2, shard=s) for s in (0, 1))
    for h in (a, b):
        h.join_all()
        for rank in range(3):
            h.push(rank, g[rank, 0], then_pull=True)
        h.leave(2)  # its process died
    for rank in (0, 1):
        b.push(rank, g[rank, 1], then_pull=True)
    assert b.engine.version == 2 and b.policy.round_clock == 2
    a.join(2)  # before round 1's first gradient on A
    b.join(2)  # after round 1 closed on B
    for rank in (0, 1):
        a.push(rank, g[rank, 1], then_pull=True)
    assert (a.policy.clock(2), b.policy.clock(2), a.engine.version, b.engine.version) == (1, 2, 1, 2)  # A waits
    return a, b, g


def test_a_new_bsp_worker_seated_a_round_apart_on_two_shards_skips_the_earlier_and_both_shards_agree():
    """docs/algorithms.md, "Sharded BSP: a worker that joins": a new process for rank 2 reaches
    shard B after B closed round 1 without it, and shard A before round 1's first gradient
    there: B seats it at clock 2, A in round 1. It skips A's round 1 (Flag.SKIP, as aps.Worker
    does when its shards' clocks differ by one): A closes that round on ranks 0 and 1 alone,
    as B did, and from then on both shards take the same gradients into the same rounds."""
    a, b, g = _one_round_apart()
    _skip(a, 2)
    assert a.engine.version == 2 and a.policy.clock(2) == 2 and not a.workers[2].waiting
    assert not a.workers[2].results[-1].dropped and a.policy.dropped == 0
    for h in (a, b):
        for rank in range(3):
            h.push(rank, g[rank, 2], then_pull=True)
        assert h.engine.version == 3 and not any(w.errors for w in h.workers)
    np.testing.assert_array_equal(a.engine.model.table.current_array(), b.engine.model.table.current_array())
    mean = lambda *keys: sum(g[k] for k in keys) / len(keys)  # noqa: E731
    expected = -(mean((0, 0), (1, 0), (2, 0)) + mean((0, 1), (1, 1)) + mean((0, 2), (1, 2), (2, 2)))
    np.testing.assert_array_equal(a.engine.model.table.current_array(), expected)


def test_a_skip_sent_again_after_a_reconnect_counts_its_worker_present_once():
    """Rank 2's SKIP closes A's round 1, and its reply is lost with its connection: it rejoins at
    its own clock and sends the SKIP again (same request id and clock), a duplicate, answered as
    one without taking part in the next round, and the shards agree from then on."""
    a, b, g = _one_round_apart()
    _skip(a, 2, request_id=7, clock=1)
    assert a.engine.version == 2 and a.policy.clock(2) == 2  # closed on ranks 0 and 1, as B's
    a.leave(2)  # (its connection went with the reply)
    a.join(2, rejoin=True, clock=1)
    _skip(a, 2, request_id=7, clock=1)  # sent again: a duplicate
    assert not a.workers[2].waiting and a.policy.clock(2) == 2 and a.engine.version == 2
    for h in (a, b):
        for rank in range(3):
            h.push(rank, g[rank, 2], then_pull=True)
        assert h.engine.version == 3 and not any(w.errors for w in h.workers)
    np.testing.assert_array_equal(a.engine.model.table.current_array(), b.engine.model.table.current_array())


def test_a_skip_sent_again_before_its_round_closed_counts_its_worker_present_again():
    """As above, but rank 0 had not pushed round 1 to A yet: rank 2's SKIP, its connection gone and
    back, the SKIP again (a duplicate) counts it present again, and round 1 closes only once rank
    0's gradient is in, without rank 2's."""
    g = {(r, i): np.full(3, float(1 + r + 3 * i), np.float32) for r in range(3) for i in range(3)}
    a = Harness(workers=3, numel=3, sync="bsp", shards=2, shard=0)
    a.join_all()
    for rank in range(3):
        a.push(rank, g[rank, 0], then_pull=True)
    a.push(1, g[1, 1], then_pull=True)
    _skip(a, 2, request_id=7, clock=1)
    a.leave(2)
    a.join(2, rejoin=True, clock=1)
    _skip(a, 2, request_id=7, clock=1)  # a duplicate: present again, held for the round
    assert a.held(2) and a.workers[2].waiting and a.engine.version == 1
    a.push(0, g[0, 1], then_pull=True)
    assert a.engine.version == 2 and not a.workers[2].waiting and a.policy.clock(2) == 2
    mean = lambda *keys: sum(g[k] for k in keys) / len(keys)  # noqa: E731
    expected = -(mean((0, 0), (1, 0), (2, 0)) + mean((0, 1), (1, 1)))
    np.testing.assert_array_equal(a.engine.model.table.current_array(), expected)


def test_a_skip_into_a_closed_round_is_dropped_and_a_round_of_skips_alone_waits_for_a_gradient():
    """A SKIP for a round that closed already (one backup worker) is dropped, its worker released at
    once. A round with nothing in it but a SKIP waits, even when every other worker's connection
    is gone, as any round does for those who come back: here rank 0 rejoins and pushes, and the
    round closes on its gradient."""
    h = Harness(workers=2, numel=2, sync="bsp", shards=2, backup_workers=1)
    h.join_all()
    h.push(0, np.ones(2, np.float32), then_pull=True)  # closes round 0 alone (one backup worker)
    assert h.engine.version == 1
    _skip(h, 1)  # rank 1's round is over: dropped, released at once
    assert h.workers[1].results[-1].dropped and h.policy.clock(1) == 1 and not h.workers[1].waiting
    h.leave(0)  # (its connection drops for a moment)
    _skip(h, 1)
    assert h.workers[1].waiting and h.engine.version == 1  # nothing to close the round with
    h.join(0, rejoin=True, clock=1)
    h.push(0, np.full(2, 2.0, np.float32), then_pull=True)
    assert h.engine.version == 2 and not h.workers[1].waiting and h.policy.clock(1) == 2
    np.testing.assert_array_equal(h.engine.model.table.current_array(), np.full(2, -3.0, np.float32))
