"""The server's engine, driven directly: every rule of docs/algorithms.md without sockets."""

import json

import numpy as np
import pytest

from aps.errors import (
    LayoutMismatch,
    NonFiniteGradient,
    NotInitialized,
    OutOfOrder,
    RankOutOfRange,
    RankTaken,
    WorkerCountMismatch,
)
from aps.server.engine.members import Member
from aps.layout import Layout
from tests.harness import Harness


def e(rank, n):
    g = np.zeros(n, np.float32)
    g[rank] = 1.0
    return g


def test_init_waits_for_every_worker_then_starts():
    h = Harness(workers=3, sync="asp")
    h.join(0, np.arange(3, dtype=np.float32))
    h.join(1)
    assert not h.engine.roster.started and h.workers[0].waiting
    h.join(2)
    assert h.engine.roster.started
    # The first worker's values are the initial weights, for everyone.
    for w in h.workers:
        assert not w.waiting and w.weights.tolist() == [0.0, 1.0, 2.0]


def test_join_validation():
    h = Harness(workers=2, sync="asp")
    with pytest.raises(WorkerCountMismatch):
        h.engine.membership.join(0, 3, h.layout, np.zeros(2, np.float32), None, None)
    with pytest.raises(RankOutOfRange):
        h.engine.membership.join(2, 2, h.layout, np.zeros(2, np.float32), None, None)
    h.join(0)
    with pytest.raises(RankTaken):
        h.join(0)
    errors = []
    h.engine.membership.join(1, 2, Layout(("w",), ((3,),)), np.zeros(3, np.float32), None, errors.append)
    assert isinstance(errors[0], LayoutMismatch) and 1 not in h.engine.roster.members
    h.join(1)  # the seat is free again
    assert h.engine.roster.started


def test_non_finite_initial_weights_are_refused():
    h = Harness(workers=1, sync="asp")
    errors = []
    h.engine.membership.join(0, 1, h.layout, np.array([np.nan], np.float32), None, errors.append)
    assert isinstance(errors[0], NonFiniteGradient) and h.engine.model.table is None


def test_bsp_equals_large_batch_sgd():
    P, n, rounds, lr = 3, 5, 6, 0.1
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(n).astype(np.float32)
    grads = rng.standard_normal((rounds, P, n)).astype(np.float32)
    h = Harness(workers=P, sync="bsp", numel=n, lr=lr)
    h.join_all(w0)
    for t in range(rounds):
        for r in range(P):
            h.push(r, grads[t, r], then_pull=True)
        assert h.engine.version == t + 1
        assert {w.version for w in h.workers} == {t + 1}
    expected = w0.copy()
    for t in range(rounds):
        expected = expected - np.float32(lr) * grads[t].mean(axis=0)
    np.testing.assert_allclose(h.engine.weights, expected, rtol=1e-6, atol=1e-6)


def test_bsp_holds_until_the_round_closes():
    h = Harness(workers=3, sync="bsp")
    h.join_all()
    h.push(0, e(0, 3), then_pull=True)
    h.push(1, e(1, 3), then_pull=True)
    assert h.held(0) and h.workers[0].waiting and h.engine.version == 0
    with pytest.raises(OutOfOrder):
        h.push(0, e(0, 3))
    h.push(2, e(2, 3), then_pull=True)
    assert h.engine.version == 1 and not any(w.waiting for w in h.workers)
    np.testing.assert_allclose(h.engine.weights, [-1 / 3] * 3, rtol=1e-6)


def test_bsp_backup_workers_drop_late_gradients():
    h = Harness(workers=3, sync="bsp", backup_workers=1)
    h.join_all()
    h.push(0, e(0, 3), then_pull=True)
    h.push(1, e(1, 3), then_pull=True)  # P - k = 2 gradients close the round
    assert h.engine.version == 1
    h.push(2, e(2, 3), then_pull=True)  # computed on version 0: dropped
    assert h.workers[2].results[-1].dropped and h.policy.dropped == 1
    assert h.workers[2].version == 1  # released at once with the newest weights
    np.testing.assert_allclose(h.engine.weights, [-0.5, -0.5, 0.0])


def test_bsp_leave_closes_the_round_without_the_leaver():
    h = Harness(workers=3, sync="bsp")
    h.join_all()
    h.push(0, e(0, 3), then_pull=True)
    h.push(1, e(1, 3), then_pull=True)
    h.leave(2)
    assert h.engine.version == 1 and not h.workers[0].waiting
    np.testing.assert_allclose(h.engine.weights, [-0.5, -0.5, 0.0])
    # Rejoining, rank 2 resumes at the slowest live clock and the next round waits for it.
    h.join(2)
    assert h.window.clock(2) == h.window.min_clock == 1
    h.push(0, e(0, 3), then_pull=True)
    h.push(1, e(1, 3), then_pull=True)
    assert h.engine.version == 1
    h.push(2, e(2, 3), then_pull=True)
    assert h.engine.version == 2


def test_asp_applies_every_gradient_once_and_answers_at_once():
    h = Harness(workers=2, sync="asp")
    h.join_all()
    for _ in range(5):
        h.push(0, e(0, 2), then_pull=True)
        assert not h.workers[0].waiting
    h.push(1, e(1, 2), then_pull=True)
    assert h.engine.version == 6
    assert h.engine.weights.tolist() == [-5.0, -1.0]
    assert [r.staleness for r in h.workers[0].results] == [0] * 5
    assert h.workers[1].results[0].staleness == 5  # computed on version 0, applied at 5


def test_ssp_gate():
    h = Harness(workers=2, sync="ssp", staleness=1)
    h.join_all()
    h.push(0, e(0, 2), then_pull=True)
    assert not h.workers[0].waiting
    h.push(0, e(0, 2), then_pull=True)  # gap 2 > 1
    assert h.workers[0].waiting and h.held(0)
    h.push(1, e(1, 2), then_pull=True)
    assert not h.workers[0].waiting
    # Released by rank 1's push, rank 0 sees it (and its own updates).
    assert h.workers[0].version == 3


def test_leave_releases_held_workers():
    h = Harness(workers=2, sync="ssp", staleness=0)
    h.join_all()
    h.push(0, e(0, 2), then_pull=True)
    assert h.workers[0].waiting
    h.leave(1)
    assert not h.workers[0].waiting


def test_non_finite_gradient_changes_nothing(kernels):
    h = Harness(kernels=kernels, workers=1, sync="asp", momentum=0.9)
    h.join_all(np.ones(1, np.float32))
    h.push(0, np.array([0.5], np.float32))
    before = (h.engine.version, h.window.clock(0), h.engine.weights.copy(), h.engine.model.table.optimizer.momentum_buffer.copy())
    for bad in (np.nan, np.inf, -np.inf):
        h.push(0, np.array([bad], np.float32))
        assert isinstance(h.workers[0].errors[-1], NonFiniteGradient)
    after = (h.engine.version, h.window.clock(0), h.engine.weights, h.engine.model.table.optimizer.momentum_buffer)
    assert before[:2] == after[:2]
    np.testing.assert_array_equal(before[2], after[2])
    np.testing.assert_array_equal(before[3], after[3])
    assert h.engine.stats.rejected == 3
    h.push(0, np.array([0.5], np.float32))  # and it keeps working
    assert h.engine.version == 2


def test_requests_need_a_joined_member():
    h = Harness(workers=2, sync="asp")
    stranger = Member(1)
    with pytest.raises(NotInitialized):
        h.engine.training.pull(stranger, None)
    with pytest.raises(NotInitialized):
        h.engine.training.push(stranger, 0, None, None)


def test_a_gradient_from_the_future_is_refused():
    h = Harness(workers=2, sync="asp")
    h.join_all()
    with pytest.raises(OutOfOrder):
        h.push(0, e(0, 2), version=7)
    assert h.engine.version == 0 and h.engine.training.pushes == 0


def test_offloaded_kernels_keep_order():
    """Kernels finishing later (a helper thread) still commit in arrival order."""
    pending = []
    h = Harness(workers=2, sync="asp", offload=lambda kernel, done: pending.append((kernel, done)))
    h.engine.lane._threshold = 0
    h.join_all()
    h.push(0, e(0, 2), then_pull=True)
    h.push(1, e(1, 2), then_pull=True)
    assert h.engine.version == 0 and len(pending) == 1  # one kernel at a time
    while pending:
        kernel, done = pending.pop(0)
        done(kernel())
    assert h.engine.version == 2 and h.engine.weights.tolist() == [-1.0, -1.0]
    assert h.workers[0].version >= 1 and h.workers[1].version == 2


class TestStreamingPush:
    """Applying a large gradient piece by piece while it arrives."""

    N = 1000

    def stream_in(self, h, rank, grad, pieces=4, finish=True):
        member = h.workers[rank].member
        stream = h.engine.training.begin_streaming_push(member, h.workers[rank].version)
        assert stream is not None
        bounds = np.linspace(0, self.N, pieces + 1).astype(int)
        for start, stop in zip(bounds[:-1], bounds[1:]):
            member.grad[start:stop] = grad[start:stop]
            stream.feed(int(stop))
        if finish:
            h.engine.training.push(member, h.workers[rank].version, h.workers[rank].results.append, h.workers[rank].errors.append, stream=stream)
        return stream

    def test_equals_the_ordinary_path(self, kernels):
        rng = np.random.default_rng(3)
        grads = rng.standard_normal((3, self.N)).astype(np.float32)
        results = []
        for streaming in (False, True):
            h = Harness(kernels=kernels, workers=1, sync="asp", numel=self.N, lr=0.1, weight_decay=0.01)
            h.join_all(np.ones(self.N, np.float32))
            for g in grads:
                if streaming:
                    self.stream_in(h, 0, g)
                else:
                    h.push(0, g)
            results.append(h.engine.weights.copy())
            assert h.engine.version == 3 and h.window.clock(0) == 3 and h.engine.idle
        np.testing.assert_array_equal(results[0], results[1])

    def test_other_work_cancels_the_reservation(self):
        h = Harness(workers=2, sync="asp", numel=self.N)
        h.join_all()
        stream = self.stream_in(h, 0, np.ones(self.N, np.float32), finish=False)
        assert not h.engine.idle
        h.push(1, np.full(self.N, 2.0, np.float32))  # arrives first: not blocked by the stream
        assert not stream.active and h.engine.version == 1
        w0 = h.workers[0]
        h.engine.training.push(w0.member, 0, w0.results.append, w0.errors.append, stream=stream)
        assert h.engine.version == 2 and h.engine.idle
        np.testing.assert_array_equal(h.engine.weights, np.full(self.N, -3.0))
        assert w0.results[0].staleness == 1

    def test_abort_leaves_nothing_behind(self):
        h = Harness(workers=1, sync="asp", numel=self.N)
        h.join_all()
        stream = self.stream_in(h, 0, np.ones(self.N, np.float32), pieces=2, finish=False)
        stream.abort()  # the connection died mid-frame
        assert h.engine.idle and h.engine.version == 0 and (h.engine.weights == 0).all()
        slots = h.engine.model.table.slot_count
        self.stream_in(h, 0, np.ones(self.N, np.float32))
        assert h.engine.version == 1 and h.engine.model.table.slot_count == slots

    def test_a_bad_piece_ends_the_stream_and_the_gradient_is_refused(self):
        h = Harness(workers=1, sync="asp", numel=self.N, momentum=0.9)
        h.join_all()
        member = h.workers[0].member
        stream = h.engine.training.begin_streaming_push(member, 0)
        member.grad[:] = 1.0
        member.grad[self.N // 3] = np.nan
        stream.feed(self.N // 2)
        assert not stream.active and h.engine.idle  # the lane is free again at once
        errors = []
        h.engine.training.push(member, 0, None, errors.append, stream=stream)
        assert isinstance(errors[0], NonFiniteGradient)
        assert h.engine.version == 0 and h.engine.stats.rejected == 1 and (h.engine.weights == 0).all()
        assert (h.engine.model.table.optimizer.momentum_buffer == 0).all()

    @pytest.mark.parametrize("options", [{"sync": "bsp"}, {"sync": "softsync"}])
    def test_not_for_aggregating_policies(self, options):
        h = Harness(workers=1, numel=self.N, **options)
        h.join_all()
        assert h.engine.training.begin_streaming_push(h.workers[0].member, 0) is None

    @pytest.mark.parametrize("options", [{"momentum": 0.9, "nesterov": True}, {"optimizer": "adam", "lr": 1e-2}])
    def test_stateful_optimizers_stream_too(self, kernels, options):
        """Optimizer state is written aside and adopted at commit, so it streams."""
        rng = np.random.default_rng(4)
        grads = rng.standard_normal((4, self.N)).astype(np.float32)
        results = []
        for streaming in (False, True):
            h = Harness(kernels=kernels, workers=1, sync="asp", numel=self.N, **options)
            h.join_all(np.ones(self.N, np.float32))
            for i, g in enumerate(grads):
                if streaming and i != 2:
                    self.stream_in(h, 0, g)
                elif streaming:  # an aborted stream in the middle must leave no trace
                    stream = self.stream_in(h, 0, g, finish=False)
                    stream.abort()
                    h.push(0, g)
                else:
                    h.push(0, g)
            results.append(h.engine.weights.copy())
        np.testing.assert_allclose(results[0], results[1], rtol=1e-6)

    def test_not_for_a_held_worker(self):
        h = Harness(workers=2, sync="ssp", staleness=0, numel=self.N)
        h.join_all()
        h.push(0, np.ones(self.N, np.float32))
        assert h.held(0)
        assert h.engine.training.begin_streaming_push(h.workers[0].member, 0) is None


def test_softsync_numerics_by_hand():
    """4 workers, n = 2: one update per c = 2 gradients, w -= lr/c * sum(alpha(tau)/lr * g)."""
    h = Harness(workers=4, sync="softsync", softsync_n=2, lr=0.5, lr_staleness="inverse", numel=4)
    h.join_all(np.zeros(4, np.float32))
    g = [np.full(4, float(r + 1), np.float32) for r in range(4)]
    h.push(0, g[0])  # computed on v0, tau = 0: scale 1
    assert h.engine.version == 0  # one gradient buffered
    h.push(1, g[1])  # tau = 0; the buffer holds c = 2: update 1
    assert h.engine.version == 1
    expected = -0.5 / 2 * (1.0 * g[0] + 1.0 * g[1])
    np.testing.assert_allclose(h.engine.weights, expected)
    h.push(2, g[2])  # computed on v0, applied at v1: tau = 1, scale 1
    h.push(0, g[0], version=1)  # tau = 0
    expected = expected - 0.5 / 2 * (g[2] + g[0])
    np.testing.assert_allclose(h.engine.weights, expected)
    assert h.engine.version == 2
    h.push(3, g[3])  # computed on v0 at v2: tau = 2, scale 1/2
    h.push(1, g[1])  # computed on v0 at v2: tau = 2, scale 1/2
    expected = expected - 0.5 / 2 * (0.5 * g[3] + 0.5 * g[1])
    np.testing.assert_allclose(h.engine.weights, expected, rtol=1e-6)
    assert [r.staleness for r in h.workers[1].results] == [0, 2]
    assert [r.scale for r in h.workers[3].results] == [0.5]
    # No barrier: every push was answered at once.
    assert not any(h.held(r) for r in range(4))


def test_softsync_group_follows_the_live_workers():
    h = Harness(workers=4, sync="softsync", softsync_n=1, numel=4)  # c = P
    h.join_all()
    for r in range(3):
        h.push(r, np.ones(4, np.float32))
    assert h.engine.version == 0  # 3 of 4
    h.leave(3)  # c becomes 3: the buffer is complete
    assert h.engine.version == 1
    np.testing.assert_allclose(h.engine.weights, np.full(4, -1.0))  # the mean of three ones, lr 1


def test_softsync_with_an_ssp_bound():
    h = Harness(workers=2, sync="softsync", softsync_n=2, staleness=1, numel=2)
    h.join_all()
    h.push(0, np.ones(2, np.float32), then_pull=True)
    h.push(0, np.ones(2, np.float32), then_pull=True)  # gap 2 > 1
    assert h.held(0) and h.workers[0].waiting
    h.push(1, np.ones(2, np.float32), then_pull=True)
    assert not h.workers[0].waiting


@pytest.mark.parametrize("sync, extra", [("asp", {}), ("ssp", {"staleness": 10}), ("dssp", {})])
def test_inverse_learning_rate_divides_by_staleness(sync, extra):
    h = Harness(workers=2, sync=sync, lr=1.0, lr_staleness="inverse", numel=2, **extra)
    h.join_all()
    for _ in range(3):
        h.push(0, np.array([1.0, 0.0], np.float32), then_pull=True)
    h.push(1, np.array([0.0, 1.0], np.float32))  # computed on v0, applied at v3: lr / 3
    np.testing.assert_allclose(h.engine.weights, [-3.0, -1 / 3], rtol=1e-6)
    assert h.workers[1].results[0].staleness == 3


def test_async_scale_mean():
    h = Harness(workers=4, sync="asp", async_scale="mean", lr=1.0, numel=4)
    h.join_all()
    h.push(0, np.ones(4, np.float32))
    np.testing.assert_allclose(h.engine.weights, np.full(4, -0.25))
    h.leave(1)
    h.push(0, np.ones(4, np.float32), version=1)
    np.testing.assert_allclose(h.engine.weights, np.full(4, -0.25 - 1 / 3), rtol=1e-6)


def test_inverse_learning_rate_keeps_momentum_consistent():
    """The optimizer sees alpha(tau)/lr * g: momentum accumulates the scaled gradient."""
    h = Harness(workers=2, sync="asp", lr=1.0, momentum=0.5, lr_staleness="inverse", numel=1)
    h.join_all()
    h.push(0, np.array([1.0], np.float32))  # tau 0: buf = 1, w = -1
    h.push(1, np.array([1.0], np.float32))  # tau 1 (v0 at v1): d = 1, buf = 0.5 + 1 = 1.5, w = -2.5
    h.push(1, np.array([2.0], np.float32), version=0)  # tau 2: d = 1, buf = 0.75 + 1 = 1.75, w = -4.25
    np.testing.assert_allclose(h.engine.weights, [-4.25])
    np.testing.assert_allclose(h.engine.model.table.optimizer.momentum_buffer, [1.75])


def test_bsp_counts_each_rank_once_per_round_across_a_rejoin():
    h = Harness(workers=2, sync="bsp", numel=1)
    h.join_all()
    h.push(0, np.array([10.0], np.float32), then_pull=True)
    h.leave(0)
    h.join(0)  # back before the round closed: its gradient is in already
    h.push(0, np.array([10.0], np.float32), then_pull=True)
    assert h.workers[0].results[-1].dropped and h.held(0)  # dropped, and it waits for the round
    h.push(1, np.array([1.0], np.float32), then_pull=True)
    assert h.engine.version == 1 and not h.held(0)
    np.testing.assert_allclose(h.engine.weights, [-5.5])  # the mean of one gradient per rank


def test_bsp_rejoined_worker_takes_part_in_the_round_again():
    h = Harness(workers=2, sync="bsp", numel=1)
    h.join_all()
    h.push(0, np.array([2.0], np.float32), then_pull=True)
    h.leave(0)
    h.join(0)
    h.push(1, np.array([4.0], np.float32), then_pull=True)
    assert h.engine.version == 0  # the round waits for the rejoined worker to push again
    h.push(0, np.array([8.0], np.float32), then_pull=True)  # dropped: its first gradient counts
    assert h.engine.version == 1
    np.testing.assert_allclose(h.engine.weights, [-3.0])
    assert h.window.clock(0) == h.window.clock(1) == 1  # lockstep


def test_statistics_count_what_happened():
    h = Harness(workers=2, sync="ssp", staleness=0, numel=1)
    h.join_all()
    h.tick(1.0)
    h.push(0, np.ones(1, np.float32), then_pull=True)  # held: rank 1 has not pushed
    h.tick(5.0)
    h.push(1, np.ones(1, np.float32), version=0, then_pull=True)  # releases rank 0 after 5 s
    h.tick(1.0)
    h.push(0, np.array([np.nan], np.float32))
    assert isinstance(h.workers[0].errors[-1], NonFiniteGradient)
    stats = h.engine.stats_snapshot()
    w0, w1 = stats["workers"]
    assert (w0["pushes"], w0["rejected"], w0["waits"], w0["pulls"]) == (1, 1, 1, 1)
    assert w0["wait_s_total"] == pytest.approx(5.0) and w0["wait_s_max"] == pytest.approx(5.0)
    assert w0["staleness_hist"] == {"0": 1} and w1["staleness_hist"] == {"1": 1}
    assert w0["max_release_gap"] == 0 and w1["waits"] == 0 and w1["pulls"] == 1
    assert w1["last_interval_s"] is None  # one push: no interval yet
    server = stats["server"]
    assert (server["version"], server["pushes"], server["rejected"], server["live"]) == (2, 2, 1, 2)
    assert server["sync"] == "ssp s=0"
    h.tick(2.0)
    h.push(1, np.ones(1, np.float32), then_pull=True)
    assert h.engine.stats_snapshot()["workers"][1]["last_interval_s"] == pytest.approx(3.0)


def test_statistics_record_dssp_grants():
    h = Harness(workers=2, sync="dssp", staleness=0, max_staleness=3, numel=1)
    h.join_all()
    for t in (10.0, 20.0):  # the slow worker: one push every 10 s
        h.tick(10.0)
        h.push(1, np.ones(1, np.float32), then_pull=True)
        while not h.held(0):  # the fast one, every 1 s, as far as the gate lets it
            h.tick(1.0)
            h.push(0, np.ones(1, np.float32), then_pull=True)
            if h.workers[0].waiting:
                break
    workers = h.engine.stats_snapshot()["workers"]
    fast = workers[0]
    assert fast["r_star_hist"] and all(0 <= int(r) <= 3 for r in fast["r_star_hist"])
    assert sum(sum(w["r_star_hist"].values()) for w in workers) == h.window.controller_calls
    assert 0 < fast["max_release_gap"] <= 3


# The bound across a reconnect (docs/algorithms.md): a push computed before its worker
# reconnected is dropped when it is older than the policy's bound allows.


def away_while_the_others_train(h: Harness, rank: int, pushes: int) -> tuple[int, int]:
    """``rank`` has its weights (mid-iteration) when its connection goes; the others push
    ``pushes`` times each; it reconnects. Returns the version and clock its gradient in
    flight was computed at."""
    version, clock = h.workers[rank].version, h.window.clock(rank)
    h.leave(rank)
    for _ in range(pushes):
        for other in range(h.P):
            if other != rank:
                h.push(other, e(other, h.numel), then_pull=True)
    h.join(rank, rejoin=True)
    assert not h.workers[rank].waiting  # a rejoin's init returns at once
    return version, clock


@pytest.mark.parametrize("sync", [{"sync": "ssp", "staleness": 2},
                                  {"sync": "dssp", "staleness": 1, "max_staleness": 2},
                                  {"sync": "softsync", "softsync_n": 3, "staleness": 2}],
                         ids=["ssp", "dssp", "softsync-bounded"])
def test_a_push_from_before_a_reconnect_beyond_the_bound_is_dropped_and_counted(sync, kernels):
    h = Harness(kernels=kernels, workers=3, numel=4, **sync)
    h.join_all()
    h.push(1, e(1, 4), then_pull=True)
    version, clock = away_while_the_others_train(h, 1, 10)
    before = h.engine.weights.copy()
    h.push(1, e(3, 4), version=version, request_id=5, clock=clock)  # sent again with its first clock
    result = h.workers[1].results[-1]
    assert result.dropped and not h.workers[1].errors
    np.testing.assert_array_equal(h.engine.weights, before)  # nothing of it applied, or added to a group
    assert (h.policy.dropped, h.policy.dropped_stale) == (1, 1)
    stats = h.engine.stats_snapshot()
    assert stats["server"]["dropped_stale"] == 1
    assert [(w["dropped"], w["dropped_stale"]) for w in stats["workers"]] == [(0, 0), (1, 1), (0, 0)]
    assert 3 not in map(int, stats["workers"][1]["staleness_hist"])  # it is not counted as applied
    # It goes on from the newest weights; its next gradient is taken.
    h.pull(1)
    assert h.workers[1].version == h.engine.training.decided_version
    h.push(1, e(1, 4), request_id=6, clock=h.window.clock(1))
    assert not h.workers[1].results[-1].dropped and h.policy.dropped == 1


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_a_push_from_before_a_reconnect_within_the_bound_is_applied(ahead):
    """The others started at most ``s`` iterations beyond the gradient's: the promise holds."""
    s = 2
    h = Harness(workers=2, numel=2, sync="ssp", staleness=s)
    h.join_all()
    version, clock = away_while_the_others_train(h, 1, s + ahead)  # rank 0 released up to clock + s + ahead
    assert h.window.released_max == clock + s + ahead
    h.push(1, e(1, 2), version=version, request_id=5, clock=clock)
    assert h.workers[1].results[-1].dropped == (ahead > 0)
    assert h.policy.dropped_stale == (ahead > 0)


@pytest.mark.parametrize("sync", [{"sync": "asp"}, {"sync": "softsync", "softsync_n": 1}], ids=["asp", "softsync"])
def test_without_a_bound_a_push_from_before_a_reconnect_is_applied(sync):
    h = Harness(workers=2, numel=2, **sync)
    h.join_all()
    version, clock = away_while_the_others_train(h, 1, 50)
    h.push(1, e(1, 2), version=version, request_id=5, clock=clock)
    result = h.workers[1].results[-1]
    assert not result.dropped and result.staleness == 50 and h.policy.dropped_stale == 0


def test_bsp_keeps_its_own_rule():
    h = Harness(workers=2, numel=2, sync="bsp")
    h.join_all()
    version, clock = h.workers[1].version, h.window.clock(1)
    h.leave(1)
    h.push(0, e(0, 2), then_pull=True)  # the round closes without rank 1
    h.join(1, rejoin=True)
    h.push(1, e(1, 2), version=version, request_id=5, clock=clock)  # for a closed round
    assert h.workers[1].results[-1].dropped
    assert (h.policy.dropped, h.policy.dropped_stale) == (1, 0)
    assert h.engine.stats_snapshot()["workers"][1]["dropped_stale"] == 0


def test_the_header_clock_is_read_only_on_a_connection_that_rejoined():
    """A new connection's pushes are at its clock at the server, whatever the header says
    (a client that always sends 0, say); on a rejoined one, a claim above the server's clock
    is taken at the server's clock."""
    h = Harness(workers=2, numel=2, sync="ssp", staleness=1)
    h.join_all()
    for _ in range(5):
        for rank in range(2):
            h.push(rank, e(rank, 2), then_pull=True, request_id=0, clock=0)
    assert h.policy.dropped == 0 and h.engine.version == 10
    away_while_the_others_train(h, 1, 3)
    h.pull(1)
    h.push(1, e(1, 2), request_id=9, clock=10**6)
    assert not h.workers[1].results[-1].dropped


def test_a_stale_push_is_not_streamed():
    """The streaming path plans like the lane: a gradient the bound refuses is never begun."""
    h = Harness(workers=2, numel=2, sync="ssp", staleness=0)
    h.join_all()
    version, clock = away_while_the_others_train(h, 1, 3)
    member = h.workers[1].member
    assert h.engine.training.begin_streaming_push(member, version, 5, clock) is None
    assert h.engine.idle and h.engine.version == 3
    h.pull(1)
    stream = h.engine.training.begin_streaming_push(member, h.workers[1].version, 6, h.window.clock(1))
    assert stream is not None
    stream.abort()


def test_the_mark_and_the_stale_count_survive_a_checkpoint():
    from tests.unit.server.engine.test_resume import checkpoint_of

    h = Harness(workers=2, numel=2, sync="ssp", staleness=1)
    h.join_all()
    version, clock = away_while_the_others_train(h, 1, 4)
    h.push(1, e(1, 2), version=version, request_id=5, clock=clock)
    assert h.policy.dropped_stale == 1
    checkpoint = checkpoint_of(h)
    assert checkpoint.manifest["policy"]["released_max"] == h.window.released_max == 5
    resumed = Harness(workers=2, numel=2, sync="ssp", staleness=1)
    resumed.engine.durability.restore(checkpoint)
    assert resumed.window.released_max == 5
    assert (resumed.policy.dropped, resumed.policy.dropped_stale) == (1, 1)
    old = json.loads(json.dumps(checkpoint.manifest))
    del old["policy"]["released_max"]  # written before the mark was kept: the strictest value
    older = Harness(workers=2, numel=2, sync="ssp", staleness=1)
    older.engine.durability.restore(type(checkpoint)(checkpoint.path, old, checkpoint.weights, checkpoint.state))
    assert older.window.released_max == old["policy"]["min_clock"] + 1


def test_the_engine_is_its_parts_wired_to_the_same_records():
    engine = Harness(workers=1, sync="asp").engine
    parts = (engine.training, engine.membership, engine.loads, engine.durability)
    assert all(part.model is engine.model and part.roster is engine.roster and part.lane is engine.lane
               for part in parts)
    assert engine.membership.gate is engine.training and engine.loads.training is engine.training
    assert engine.durability.membership is engine.membership and engine.durability.loads is engine.loads
