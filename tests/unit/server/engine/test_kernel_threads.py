"""A large update cut across threads (aps serve --kernel-threads): bit for bit one thread's."""

import threading
import time

import numpy as np
import pytest

from aps import _core
from aps.config import ServerConfig
from aps.errors import ConfigurationError
from aps.server.engine.optim import HyperGroup, KernelThreads, default_kernel_threads, make_optimizer
from tests.harness import Harness

N = 100_003  # odd: the parts end with a remainder


@pytest.fixture
def threads():
    made = []

    def make(count: int, min_elements: int = 1000) -> KernelThreads:
        pool = KernelThreads(count)
        pool.MIN_ELEMENTS = min_elements  # (cut small vectors too: fast tests)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def run(optimizer, w0, grads, groups=None, refuse_at=None):
    w = w0.copy()
    results = []
    for i, g in enumerate(grads):
        out = np.empty_like(w)
        if refuse_at is not None and i == refuse_at:
            bad = g.copy()
            bad[-1] = np.inf  # in the last part
            assert optimizer.step(out, w, bad, groups=groups) is False
            continue  # not committed
        assert optimizer.step(out, w, g, 0.5, groups=groups) is True
        optimizer.commit()
        w = out
        results.append(w)
    return results, [a.copy() for a in optimizer.state_arrays().values()]


@pytest.mark.parametrize("name, options", [
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    ("adam", {"lr": 1e-3}),
    ("adamw", {"lr": 1e-3, "weight_decay": 0.01}),
])
@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("grouped", [False, True], ids=["one group", "groups"])
def test_steps_on_several_threads_equal_one_thread_bit_for_bit(threads, name, options, count, grouped):
    rng = np.random.default_rng(count)
    w0 = rng.standard_normal(N).astype(np.float32)
    grads = rng.standard_normal((4, N)).astype(np.float32)
    runs = []
    for pool in (threads(1), threads(count)):
        optimizer = make_optimizer(name, N, threads=pool, **options)
        groups = None
        if grouped:  # two groups, the cut between them inside a thread's part
            second = (0.01, 0.0, 0.5, 0.0) if name == "sgd" else (2e-3, 0.0, 0.8, 0.99)
            groups = optimizer.check_groups([HyperGroup(N // 3, optimizer.lr, optimizer.defaults.weight_decay,
                                                        optimizer.defaults.momentum, optimizer.defaults.dampening),
                                             HyperGroup(N, *second)])
        runs.append(run(optimizer, w0, grads, groups, refuse_at=2))
    (weights1, state1), (weights_n, state_n) = runs
    assert len(weights1) == 3
    for a, b in zip(weights1 + state1, weights_n + state_n):
        np.testing.assert_array_equal(a, b)


def test_the_round_sum_on_several_threads_equals_one_thread(threads):
    """BSP's running sum of a round's gradients is cut across the threads too."""
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(N).astype(np.float32)
    grads = rng.standard_normal((3, N)).astype(np.float32)
    finals = []
    for count in (1, 3):
        h = Harness(workers=3, sync="bsp", numel=N, lr=0.1, kernel_threads=count)
        h.join_all(w0)
        threads_used = h.engine.model.table.optimizer.threads
        assert threads_used.count == count
        threads_used.MIN_ELEMENTS = 1000
        for r in range(3):
            h.push(r, grads[r], then_pull=True)
        assert h.engine.version == 1
        finals.append(h.engine.weights.copy())
        h.engine.model.table.close()
    np.testing.assert_array_equal(finals[0], finals[1])


def test_a_part_that_raises_is_reported_after_every_part_is_done(threads):
    pool = threads(3)
    done = []
    lock = threading.Lock()

    def kernel(lo, hi):
        if lo == 0:
            raise RuntimeError("boom")
        time.sleep(0.05)
        with lock:
            done.append(lo)
        return True

    with pytest.raises(RuntimeError, match="boom"):
        pool.run(kernel, 0, 10_000)
    assert len(done) == 2  # the other parts had finished writing before run returned


def test_parts_are_whole_cache_lines_and_cover_the_range(threads):
    pool = threads(3)
    seen = []
    lock = threading.Lock()

    def kernel(lo, hi):
        with lock:
            seen.append((lo, hi))
        return True

    assert pool.run(kernel, 5, 5 + 10_007) is True
    seen.sort()
    assert seen[0][0] == 5 and seen[-1][1] == 5 + 10_007 and len(seen) == 3
    assert all(a[1] == b[0] for a, b in zip(seen, seen[1:]))
    assert all((hi - lo) % 16 == 0 for lo, hi in seen[:-1])
    seen.clear()
    assert pool.run(kernel, 0, 999) is True and seen == [(0, 999)]  # short: the calling thread alone


def test_kernel_threads_option():
    assert ServerConfig().kernel_threads == 0
    assert 1 <= default_kernel_threads() <= 8
    for bad in (-1, 65):
        with pytest.raises(ConfigurationError, match="--kernel-threads"):
            ServerConfig(kernel_threads=bad).validate()
    with pytest.raises(ConfigurationError):
        KernelThreads(0)
    assert _core.STREAM_MIN < KernelThreads.MIN_ELEMENTS  # (each part of a cut update still streams)
