"""Random interleavings of push, pull, leave and join for every policy.

Two engines run every step in lockstep, one on the native module and one on
its plain-Python twin; after each step their whole state must agree. Checked
at every release: the policy's bound (SSP gap, BSP lockstep), that a worker
sees its own updates, and (ASP/SSP) that it gets the newest weights. Checked
after every step: every accepted gradient applied exactly once, and no lost
wake-up or deadlock (a waiting worker is one the policy holds, and some live
worker can always push).
"""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aps import _core, _reference
from tests.harness import Harness

configs = st.one_of(
    st.builds(lambda P, k: {"workers": P, "sync": "bsp", "backup_workers": min(k, P - 1)}, st.integers(1, 4), st.integers(0, 2)),
    st.builds(lambda P: {"workers": P, "sync": "asp"}, st.integers(1, 4)),
    st.builds(lambda P, s: {"workers": P, "sync": "ssp", "staleness": s}, st.integers(1, 4), st.integers(0, 3)),
)
ranks = st.integers(0, 3)


class PolicyMachine(RuleBasedStateMachine):
    @initialize(config=configs)
    def setup(self, config):
        self.config = config
        self.P = config["workers"]
        self.sync = config["sync"]
        self.expected = np.zeros(self.P)
        self.open_round: list[int] = []
        self.rounds = 0
        self.own_version = [0] * self.P  # version that includes each worker's last applied push
        self.pulled = [True] * self.P  # pulled since its last push
        self.native = Harness(_core, on_release=self.check_release, **config)
        self.reference = Harness(_reference, **config)
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
        if self.sync == "bsp" and self.native.engine.version > self.rounds:
            assert self.native.engine.version == self.rounds + 1
            for r in self.open_round:
                self.expected[r] -= 1.0 / len(self.open_round)
            self.open_round = []
            self.rounds += 1

    def check_release(self, h, rank, version):
        window = h.window
        if self.sync == "ssp":
            assert window.gap(rank) <= self.config["staleness"], "SSP bound broken at a release"
        if self.sync == "bsp" and self.config["backup_workers"] == 0:
            # Lockstep: nobody is released while ahead of a live worker.
            assert window.gap(rank) == 0, f"BSP not in lockstep: rank {rank} released at gap {window.gap(rank)}"
        assert version == h.engine.version, "a released worker must get the newest weights"
        assert version >= self.own_version[rank], "a worker must see its own updates"

    def live(self, rank):
        return rank < self.P and self.native.live(rank)

    # Rules ----------------------------------------------------------------
    @rule(rank=ranks, then_pull=st.booleans())
    def push(self, rank, then_pull):
        if not self.live(rank) or self.native.held(rank) or self.native.workers[rank].waiting:
            return
        if self.sync == "bsp" and self.config["backup_workers"] == 0 and not self.pulled[rank]:
            return  # lockstep assumes well-behaved workers: pull before the next push
        self.both("push", rank, self.gradient(rank), then_pull=then_pull)
        result = self.native.workers[rank].results[-1]
        if self.sync == "bsp":
            if not result.dropped:
                self.open_round.append(rank)
        else:
            self.expected[rank] -= 1.0
            self.own_version[rank] = result.version
        self.pulled[rank] = False
        self.account()
        if then_pull and not self.native.workers[rank].waiting:
            self.pulled[rank] = True

    @rule(rank=ranks)
    def pull(self, rank):
        if not self.live(rank) or self.native.workers[rank].waiting:
            return
        self.both("pull", rank)
        self.pulled[rank] = True

    @rule(rank=ranks)
    def leave(self, rank):
        if not self.live(rank):
            return
        self.both("leave", rank)
        self.account()

    @rule(rank=ranks)
    def join(self, rank):
        if rank >= self.P or self.native.workers[rank].member is not None:
            return
        self.both("join", rank)
        self.pulled[rank] = True
        self.own_version[rank] = 0

    @rule()
    def time_passes(self):
        self.both("tick", 0.5)

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
        assert self.native.engine.pushes == sum(len(w.results) for w in self.native.workers)

    @invariant()
    def no_lost_wakeup_and_no_deadlock(self):
        if not hasattr(self, "native"):
            return
        h = self.native
        if not h.engine.started:
            return
        live = [r for r in range(self.P) if h.live(r)]
        for r in live:
            if h.workers[r].waiting:
                assert h.held(r), f"rank {r} waits but the policy does not hold it"
        if live:
            assert any(not h.held(r) for r in live), "every live worker is held: deadlock"


PolicyMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestPolicies = PolicyMachine.TestCase
