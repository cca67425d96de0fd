"""Random interleavings of push, pull, leave and join for every policy.

Two engines run every step in lockstep, one on the native module and one on
its plain-Python twin; after each step their whole state must agree. Checked
at every release: the policy's bound (SSP and softsync gap <= s, DSSP gap <=
s_U, BSP lockstep), that a worker sees its own updates and gets the newest
weights. Checked after every step: every accepted gradient applied exactly
once (with its staleness-aware scale), a held worker is always one beyond
the lower bound, DSSP's r* within [0, r_max], and no lost wake-up or
deadlock (a waiting worker is one the policy holds, and some live worker can
always push).

Workers also lose their connection in the middle of an iteration and come
back (a rejoin) with the gradient they were computing, sent with the clock it
was computed at. Checked for every gradient taken, across any leaves and
rejoins (docs/algorithms.md, "The bound across a reconnect"): a bounded
policy (SSP, DSSP, softsync with --staleness) takes a gradient of iteration
``c`` only while no worker has started an iteration beyond ``c + s``
(``s_U`` for DSSP), and drops it otherwise; and, for a gradient computed on
the weights of its own iteration while no rank was replaced by a new
process, its staleness is at most ``(P - 1)(2s + 1)`` versions.
"""

import numpy as np
import pytest
from hypothesis import settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from aps import _core, _reference
from tests.harness import Harness

workers = st.integers(1, 4)
lr_staleness = st.sampled_from(["none", "inverse"])

configs = st.one_of(
    st.builds(
        lambda P, k: {"workers": P, "sync": "bsp", "backup_workers": min(k, P - 1)}, workers, st.integers(0, 2)
    ),
    st.builds(
        lambda P, lr, mean: {"workers": P, "sync": "asp", "lr_staleness": lr, "async_scale": mean},
        workers, lr_staleness, st.sampled_from(["sum", "mean"]),
    ),
    st.builds(
        lambda P, s, lr: {"workers": P, "sync": "ssp", "staleness": s, "lr_staleness": lr},
        workers, st.integers(0, 3), lr_staleness,
    ),
    st.builds(
        lambda P, lo, extra, lr: {"workers": P, "sync": "dssp", "staleness": lo, "max_staleness": lo + extra,
                                  "lr_staleness": lr},
        workers, st.integers(0, 2), st.integers(0, 4), lr_staleness,
    ),
    st.builds(
        lambda P, n, s, lr: {"workers": P, "sync": "softsync", "softsync_n": min(n, P), "staleness": s,
                             "lr_staleness": lr},
        workers, st.integers(1, 4), st.one_of(st.none(), st.integers(0, 2)), lr_staleness,
    ),
)
ranks = st.integers(0, 3)


class PolicyMachine(RuleBasedStateMachine):
    @initialize(config=configs, spare=st.integers(0, 3))
    def setup(self, config, spare):
        """``spare`` > 0: elastic, ``--workers MIN:P`` with ``MIN = P - spare`` (at least 1)."""
        if spare and config["workers"] > 1:
            low = max(1, config["workers"] - spare)
            config = {**config, "min_workers": low}
            if "backup_workers" in config:
                config["backup_workers"] = min(config["backup_workers"], low - 1)
            if "softsync_n" in config:
                config["softsync_n"] = min(config["softsync_n"], low)
        self.config = config
        self.P = config["workers"]
        self.sync = config["sync"]
        self.aggregating = self.sync in ("bsp", "softsync")
        self.expected = np.zeros(self.P)
        self.aggregate: list[tuple[int, float]] = []  # (rank, scale) in the open round / buffer
        self.updates = 0
        self.own_version = [0] * self.P  # version that includes each worker's last applied push
        self.pulled = [True] * self.P  # pulled since its last push
        # The bound across reconnects: the highest clock any worker was answered at (started),
        # a gradient in flight per rank whose connection went mid-iteration (version, clock),
        # how many new processes have joined, and that count when each rank got its weights.
        self.started_max = 0
        self.in_flight: dict[int, tuple[int, int]] = {}
        self.fresh_joins = 0
        self.answered_in = [0] * self.P
        self.request_ids = 0
        self.nearest = 0.0  # the largest staleness / (P - 1)(2s + 1) seen
        self.native = Harness(_core, on_release=self.check_release, **config)
        self.reference = Harness(_reference, **config)
        bounds = self.native.engine.config.staleness_bounds()
        self.lower, self.upper = bounds if bounds else (None, None)
        self.engines = (self.native, self.reference)
        for h in self.engines:
            h.join_all()

    # Helpers -------------------------------------------------------------
    def both(self, method, *args, **kwargs):
        for h in self.engines:
            getattr(h, method)(*args, **kwargs)

    def gradient(self, rank):
        g = np.zeros(self.P, np.float32)
        g[rank] = 1.0
        return g

    def account(self):
        """Update the expected weights from what the native engine reports."""
        if self.aggregating and self.native.engine.version > self.updates:
            assert self.native.engine.version == self.updates + 1
            for rank, scale in self.aggregate:
                self.expected[rank] -= scale / len(self.aggregate)
            self.aggregate = []
            self.updates += 1

    def check_release(self, h, rank, version):
        window = h.window
        if not h.held(rank):  # (a rejoin's INIT is answered even while it is held: it starts nothing)
            self.started_max = max(self.started_max, window.clock(rank))
            self.answered_in[rank] = self.fresh_joins
        if self.upper is not None:
            assert window.gap(rank) <= self.upper, f"gap {window.gap(rank)} > {self.upper} at a release"
        if self.sync == "bsp" and self.config["backup_workers"] == 0:
            # Lockstep: nobody is released while ahead of a live worker.
            assert window.gap(rank) == 0, f"BSP not in lockstep: rank {rank} released at gap {window.gap(rank)}"
        assert version == h.engine.version, "a released worker must get the newest weights"
        assert version >= self.own_version[rank], "a worker must see its own updates"

    def live(self, rank):
        return rank < self.P and self.native.live(rank)

    # Rules ----------------------------------------------------------------
    @rule(rank=ranks, then_pull=st.booleans(), dt=st.sampled_from([0.0, 0.3, 1.0, 2.5]))
    def push(self, rank, then_pull, dt):
        if not self.live(rank) or self.native.held(rank) or self.native.workers[rank].waiting:
            return
        if self.sync == "bsp" and self.config["backup_workers"] == 0 and not self.pulled[rank]:
            return  # lockstep assumes well-behaved workers: pull before the next push
        self.both("tick", dt)
        clock, honest = self.native.window.clock(rank), self.pulled[rank]
        marks = (self.started_max, self.native.window.released_max)
        self.both("push", rank, self.gradient(rank), then_pull=then_pull)
        self.after_push(rank, clock, marks, honest and self.answered_in[rank] == self.fresh_joins, then_pull)

    def after_push(self, rank, clock, marks, counted, then_pull):
        """Account for ``rank``'s push of a gradient of iteration ``clock``; ``marks``: the highest
        clock a worker was answered at and the window's highest released clock, when it was
        pushed; ``counted``: the version bound applies to it (computed on the weights of its
        own iteration, and no rank was replaced by a new process since)."""
        result = self.native.workers[rank].results[-1]
        assert not self.native.workers[rank].errors, self.native.workers[rank].errors
        started, mark = marks
        if self.upper is not None:
            # The promise: taken only while nobody started an iteration beyond clock + s
            # (nor was released into one); dropped exactly when someone was.
            assert result.dropped == (clock + self.upper < mark), (
                f"gradient of iteration {clock} {'dropped' if result.dropped else 'taken'} with iteration {mark} "
                f"released (bound {self.upper})")
            assert result.dropped or clock + self.upper >= started
            if not result.dropped and counted:
                worst = (self.P - 1) * (2 * self.upper + 1)
                assert result.staleness <= worst, f"staleness {result.staleness} > (P - 1)(2s + 1) = {worst}"
                if worst:
                    self.nearest = max(self.nearest, result.staleness / worst)
        elif self.sync != "bsp":
            assert not result.dropped  # no bound: nothing is dropped for its age
        if result.dropped and self.sync != "bsp":
            assert self.native.policy.dropped_stale == self.native.policy.dropped
        expected_scale = 1.0
        if self.config.get("lr_staleness") == "inverse" and result.staleness >= 1 and self.sync != "bsp":
            expected_scale = 1.0 / result.staleness
        if self.config.get("async_scale") == "mean":
            expected_scale /= self.native.window.num_live
        assert result.scale == (1.0 if result.dropped else expected_scale)
        if self.aggregating:
            if not result.dropped:
                self.aggregate.append((rank, result.scale))
        elif not result.dropped:
            self.expected[rank] -= result.scale
            self.own_version[rank] = result.version
        self.pulled[rank] = False
        self.account()
        if then_pull and not self.native.workers[rank].waiting:
            self.pulled[rank] = True

    @rule(rank=ranks, count=st.integers(2, 6), dt=st.sampled_from([0.2, 1.0]))
    def burst(self, rank, count, dt):
        """A fast worker: several iterations in a row, for as long as the gate lets it."""
        for _ in range(count):
            if not self.live(rank) or self.native.held(rank) or self.native.workers[rank].waiting:
                return
            self.push(rank, True, dt)

    @rule(rank=ranks)
    def pull(self, rank):
        if not self.live(rank) or self.native.workers[rank].waiting:
            return
        self.both("pull", rank)
        self.pulled[rank] = True
        if self.native.engine.roster.below_quorum:  # elastic, fewer than MIN live: every pull waits
            assert self.native.workers[rank].waiting

    @rule(rank=ranks)
    def leave(self, rank):
        if not self.live(rank):
            return
        self.both("leave", rank)
        self.account()

    @rule(rank=ranks)
    def join(self, rank):
        """A new process for the rank: it starts afresh (and has no gradient in flight)."""
        if rank >= self.P or self.native.workers[rank].member is not None:
            return
        self.fresh_joins += 1
        self.in_flight.pop(rank, None)
        self.both("join", rank)
        self.pulled[rank] = True
        self.own_version[rank] = 0

    @rule(rank=ranks)
    def lose_connection_mid_iteration(self, rank):
        """It holds the weights of its iteration and is computing when its connection goes."""
        if not self.live(rank) or self.native.held(rank) or self.native.workers[rank].waiting or not self.pulled[rank]:
            return
        self.in_flight[rank] = (self.native.workers[rank].version, self.native.window.clock(rank),
                                self.answered_in[rank])
        self.both("leave", rank)
        self.account()

    @rule(rank=ranks, dt=st.sampled_from([0.0, 1.0]))
    def come_back_and_send_it(self, rank, dt):
        """It reconnects (a rejoin) and sends the gradient it computed before, with its clock then."""
        if rank not in self.in_flight or self.native.workers[rank].member is not None:
            return
        version, clock, answered_in = self.in_flight.pop(rank)
        self.both("join", rank, rejoin=True)
        self.pulled[rank] = True
        if self.native.held(rank) or (self.sync == "bsp" and self.config["backup_workers"] == 0):
            return  # seated at the gate: its gradient was sent before it left (not ours); BSP: lockstep
        self.request_ids += 1
        self.both("tick", dt)
        marks = (self.started_max, self.native.window.released_max)
        for h in self.engines:
            h.push(rank, self.gradient(rank), version=version, request_id=self.request_ids, clock=clock)
        self.after_push(rank, clock, marks, answered_in == self.fresh_joins, False)
        self.pulled[rank] = False

    @rule(dt=st.sampled_from([0.1, 0.5, 3.0]))
    def time_passes(self, dt):
        self.both("tick", dt)

    def teardown(self):
        if hasattr(self, "nearest"):  # steer the search towards the edge of the bound
            target(self.nearest, label="staleness / (P - 1)(2s + 1)")

    # Invariants -------------------------------------------------------------
    @invariant()
    def native_equals_reference(self):
        if not hasattr(self, "native"):
            return
        assert self.native.state() == self.reference.state()
        np.testing.assert_array_equal(self.native.engine.weights, self.reference.engine.weights)

    @invariant()
    def every_accepted_gradient_applied_once(self):
        if not hasattr(self, "native"):
            return
        np.testing.assert_allclose(self.native.engine.weights, self.expected, rtol=1e-5, atol=1e-5)
        assert self.native.engine.training.pushes == sum(len(w.results) for w in self.native.workers)

    @invariant()
    def bounds_hold(self):
        if not hasattr(self, "native") or self.lower is None:
            return
        window = self.native.window
        assert window.released_max >= self.started_max  # the window knows every start
        if window.num_live:
            assert window.released_max <= window.min_clock + self.upper
        for rank in range(self.P):
            if window.is_live(rank) and window.is_held(rank):
                assert window.gap(rank) > self.lower, f"rank {rank} held at gap {window.gap(rank)} <= {self.lower}"
        if self.sync == "dssp":
            assert -1 <= window.last_r_star <= self.upper - self.lower
            assert window.last_r_star >= 0 or window.controller_calls == 0

    @invariant()
    def no_lost_wakeup_and_no_deadlock(self):
        if not hasattr(self, "native"):
            return
        h = self.native
        if not h.engine.roster.started:
            return
        live = [r for r in range(self.P) if h.live(r)]
        quorum = h.engine.config.quorum
        assert h.engine.roster.below_quorum == (len(live) < quorum and h.engine.config.elastic)
        if h.engine.roster.below_quorum:
            return  # every pull waits for MIN workers (checked in pull)
        for r in live:
            if h.workers[r].waiting:
                assert h.held(r), f"rank {r} waits but the policy does not hold it"
        if live:
            assert any(not h.held(r) for r in live), "every live worker is held: deadlock"


PolicyMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestPolicies = PolicyMachine.TestCase
TestPolicies = pytest.mark.slow(TestPolicies)  # (300 programs of 60 steps: about 50 s)
