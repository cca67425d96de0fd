"""Real ``aps serve`` processes and real worker processes on 127.0.0.1."""

import numpy as np

from aps.testing import workers as _workers
from aps.testing import run_processes


def test_bsp_equals_single_process_large_batch_sgd(server_process, transport):
    P, steps, batch, lr = 3, 25, 10, 0.1
    server = server_process("--workers", str(P), "--sync", "bsp", "--lr", str(lr))
    results = run_processes(
        _workers.bsp_regression_worker, [(server.address, r, P, steps, batch, transport) for r in range(P)]
    )

    # The same training in one process, with the P batches of a step as one batch of P * b.
    x, y = _workers.regression_data()
    w, b = np.zeros(x.shape[1], np.float32), np.zeros(1, np.float32)
    for step in range(steps):
        idx = np.concatenate([_workers.batch_indices(r, P, step, batch, len(y)) for r in range(P)])
        gw, gb = _workers.regression_gradient(w, b, x[idx], y[idx])
        w, b = w - np.float32(lr) * gw, b - np.float32(lr) * gb

    for rank, version, w_worker, b_worker in results:
        assert version == steps
        np.testing.assert_allclose(w_worker, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b_worker, b, rtol=1e-5, atol=1e-6)
    assert np.abs(w).sum() > 0.1  # it really trained


def test_asp_pulls_are_consistent_snapshots_under_concurrent_updates(server_process, transport):
    """Gradients are constant vectors, so a torn read would show two values. Three
    pullers read while two pushers update."""
    numel = 2 << 20  # 8 MiB: updates run on the helper thread while replies drain
    P = 5
    server = server_process("--workers", str(P), "--sync", "asp", "--lr", "1.0")
    args = [(server.address, r, P, numel, 40, transport) for r in range(2)]
    checkers = [(server.address, r, P, numel, 3.0, transport) for r in range(2, P)]
    jobs = [("push", a) for a in args] + [("check", c) for c in checkers]
    results = run_processes(_workers.run_role, jobs, timeout=120)
    pushes = [r for r in results if len(r) == 2]
    pulls = [r for r in results if len(r) == 4]
    assert sorted(clock for _, clock in pushes) == [40, 40]
    assert len(pulls) == 3
    for rank, count, versions, torn in pulls:
        assert torn == 0, f"rank {rank}: {torn} of {count} pulls were torn"
        assert count >= 5 and versions >= 2

