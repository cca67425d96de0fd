"""Failure discipline of the update lane: a job that fails at any step (prepare, kernel,
adoption) leaves nothing behind, its worker hears why, and nobody waits forever."""

import numpy as np
import pytest

from aps.errors import InternalServerError
from aps.layout import Layout
from tests.harness import Harness

P = 3
N = 4
POLICIES = [{"sync": "bsp"}, {"sync": "asp"}, {"sync": "ssp", "staleness": 1}, {"sync": "dssp", "staleness": 1,
            "max_staleness": 3}, {"sync": "softsync"}]
STEPS = ["prepare", "kernel", "adopt"]


class Injected(RuntimeError):
    """The failure the test injects."""


class Faults:
    """Makes the ``n``-th call of one step of the update jobs raise, and remembers the
    server's state at that moment (before the failing job could change anything)."""

    def __init__(self, h: Harness, step: str, n: int, job: str) -> None:
        self.h, self.step, self.n, self.job = h, step, n, job
        self.calls = 0
        self.fired = 0
        self.before = None
        engine = h.engine
        self._saved = (engine.training.kernels, engine.model.aggregate)
        self._wrapped = []
        table, optimizer = engine.model.table, engine.model.table.optimizer
        if step == "prepare":
            self._wrap(table, "begin_update")
            self._wrap(engine.policy, "plan")
        elif step == "kernel":
            self._wrap(optimizer, "step")
            engine.training.kernels = _Proxy(engine.training.kernels, self, "accumulate")
        else:
            self._wrap(table, "publish")
            if engine.model.aggregate is not None:
                engine.model.aggregate = _Proxy(engine.model.aggregate, self, "adopt")

    def _wrap(self, obj, name):
        original = getattr(obj, name)

        def call(*args, **kwargs):
            self.trip(name)
            return original(*args, **kwargs)

        setattr(obj, name, call)
        self._wrapped.append((obj, name))

    def remove(self) -> None:
        for obj, name in self._wrapped:
            del obj.__dict__[name]
        self.h.engine.training.kernels, self.h.engine.model.aggregate = self._saved

    def trip(self, name: str) -> None:
        # Only the job kind under test: aggregate jobs call publish/begin_update/step with the running sum.
        aggregate_call = self.h.engine.training._pending_aggregates > 0 and name not in ("adopt", "plan", "accumulate")
        if (self.job == "aggregate") != aggregate_call:
            return
        self.calls += 1
        if self.calls % self.n == 0:
            engine = self.h.engine
            buffer = engine.model.table.optimizer.momentum_buffer
            self.before = (engine.version, engine.weights.copy(), None if buffer is None else buffer.copy())
            self.fired += 1
            raise Injected(f"{self.step} #{self.calls}")


class _Proxy:
    """``target`` with its method ``name`` failing on cue (for objects that cannot be patched)."""

    def __init__(self, target, faults: Faults, name: str) -> None:
        self._target, self._faults, self._name = target, faults, name

    def __getattr__(self, attr):
        value = getattr(self._target, attr)
        if attr != self._name:
            return value

        def call(*args, **kwargs):
            self._faults.trip(attr)
            return value(*args, **kwargs)

        return call


def grad(rank: int, step: int) -> np.ndarray:
    return np.full(N, float((rank + 1) * (step % 7 + 1)), np.float32)


def drive(h: Harness, steps: int, faults: Faults | None = None):
    """Each worker, in turn, pushes then pulls; a refused push is followed by a pull, as a
    real worker would retry. Returns the gradients accepted, in commit order."""
    accepted = []
    for step in range(steps):
        for rank in range(P):
            w = h.workers[rank]
            if w.waiting:
                continue
            errors = len(w.errors)
            results = len(w.results)
            h.push(rank, grad(rank, step), then_pull=True)
            if len(w.errors) > errors:
                assert isinstance(w.errors[-1], InternalServerError) and "Injected" in str(w.errors[-1])
                if faults is not None and faults.before is not None:  # nothing of the failed job remains
                    version, weights, buffer = faults.before
                    assert h.engine.version == version
                    np.testing.assert_array_equal(h.engine.weights, weights)
                    if buffer is not None:
                        np.testing.assert_array_equal(h.engine.model.table.optimizer.momentum_buffer, buffer)
                    faults.before = None
                h.pull(rank)
            elif len(w.results) > results and not w.results[-1].dropped:
                accepted.append(grad(rank, step) * w.results[-1].scale)
    return accepted


def momentum_sgd(gradients, lr, momentum):
    w = np.zeros(N, np.float32)
    buf = None
    for g in gradients:
        buf = g.copy() if buf is None else (momentum * buf + g).astype(np.float32)
        w = (w - lr * buf).astype(np.float32)
    return w


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("options", POLICIES, ids=[o["sync"] for o in POLICIES])
def test_a_failing_gradient_job_leaves_nothing_behind(options, step, every):
    h = Harness(workers=P, numel=N, lr=0.5, momentum=0.5, **options)
    h.join_all()
    faults = Faults(h, step, every, "push")
    accepted = drive(h, 12, faults)
    assert faults.fired >= 3
    engine = h.engine
    assert engine.idle and engine.training.decided_version == engine.version  # nothing stuck in the lane
    assert engine.stats.rejected == faults.fired  # each failure counted once, and answered once
    assert sum(len(w.errors) for w in h.workers) == faults.fired
    if options["sync"] in ("asp", "ssp", "dssp"):
        # the weights are exactly those of the gradients that were accepted, in commit order
        np.testing.assert_allclose(engine.weights, momentum_sgd(accepted, 0.5, 0.5), rtol=1e-6)
    # and training goes on: with the faults gone, every worker keeps being released
    faults.remove()
    released = [w.released for w in h.workers]
    version = engine.version
    drive(h, 6)
    assert all(w.released > r for w, r in zip(h.workers, released)) and engine.version > version


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("options", [{"sync": "bsp"}, {"sync": "softsync"}], ids=["bsp", "softsync"])
def test_a_failing_aggregate_update_ends_its_round_and_the_next_one_closes(options, step):
    h = Harness(workers=P, numel=N, lr=1.0, **options)
    h.join_all()
    faults = Faults(h, step if step != "adopt" else "adopt", 1, "aggregate")
    drive(h, 1, faults)  # round 1: its update fails
    assert faults.fired == 1
    engine = h.engine
    assert engine.version == 0 and (engine.weights == 0).all()  # nothing of it was applied
    assert engine.training.decided_version == 0 and engine.idle  # the round is over all the same
    assert not any(w.waiting for w in h.workers)  # nobody waits for it
    faults.n = 10 ** 9  # no more failures
    drive(h, 2)  # the next rounds close and apply
    assert engine.version == 2 and (engine.weights < 0).all()


def test_a_join_that_cannot_allocate_is_refused_and_the_rank_stays_free():
    h = Harness(workers=2, numel=N, sync="asp")
    engine = h.engine
    real = engine.model.create

    def out_of_memory(layout, values):
        raise MemoryError("no room for the model")

    engine.model.create = out_of_memory
    h.join(0)
    assert isinstance(h.workers[0].errors[0], InternalServerError)
    assert "MemoryError" in str(h.workers[0].errors[0]) and engine.model.table is None and 0 not in engine.roster.members
    engine.model.create = real
    h.join_all()  # the rank can be taken again, and training starts
    assert engine.roster.started and not h.workers[0].waiting and engine.model.layout == Layout(("w",), ((N,),))


def test_a_waiter_that_fails_does_not_keep_the_others_waiting():
    """Answering one worker raises (its connection is broken): the others released with it are answered."""
    h = Harness(workers=3, numel=N, sync="bsp")
    h.join_all()
    broken = h.workers[0]
    h.push(0, grad(0, 0), then_pull=True)
    h.workers[0].member.waiter = lambda snapshot, clock: (_ for _ in ()).throw(OSError("no descriptors left"))
    h.push(1, grad(1, 0), then_pull=True)
    h.push(2, grad(2, 0), then_pull=True)  # closes the round: all three are released
    assert h.engine.version == 1 and h.engine.idle
    assert not h.workers[1].waiting and not h.workers[2].waiting
    assert broken.waiting  # only the broken one was not answered
