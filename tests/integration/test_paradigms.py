"""Real worker processes of different speeds against a real server, per paradigm."""

import pytest

from aps.cli.status import fetch_stats
from aps.testing import workers as _workers
from aps.testing import run_processes

FAST, SLOW = 0.004, 0.04  # seconds per iteration: a cluster with one 10x slower worker


@pytest.mark.parametrize(
    "flags, lower, upper",
    [
        (["--sync", "dssp", "--staleness", "1", "--max-staleness", "4"], 1, 4),
        (["--sync", "ssp", "--staleness", "2"], 2, 2),
    ],
    ids=["dssp-1-4", "ssp-2"],
)
def test_a_fast_worker_runs_ahead_within_the_bounds(server_process, flags, lower, upper, transport):
    server = server_process("--workers", "2", *flags)
    results = run_processes(
        _workers.paced_worker,
        [(server.address, 0, 2, FAST, 2.0, transport), (server.address, 1, 2, SLOW, 2.0, transport)],
    )
    iterations = dict(results)
    assert iterations[0] > iterations[1]  # the fast worker did more, but boundedly
    stats = fetch_stats(server.address)
    fast, slow = stats["workers"]
    assert fast["max_release_gap"] <= upper and slow["max_release_gap"] <= upper
    if upper > lower:
        # DSSP: the controller let the fast worker run beyond s_L ...
        assert fast["max_release_gap"] > lower
        assert sum(int(r) * n for r, n in fast["r_star_hist"].items()) > 0
    assert fast["waits"] > 0 and fast["wait_s_total"] > 0  # ... and it did wait at the gate
    assert stats["server"]["version"] == iterations[0] + iterations[1]


def test_asp_lets_the_fast_worker_run_away(server_process):
    server = server_process("--workers", "2", "--sync", "asp")
    run_processes(_workers.paced_worker, [(server.address, 0, 2, FAST, 1.5), (server.address, 1, 2, SLOW, 1.5)])
    fast, slow = fetch_stats(server.address)["workers"]
    assert fast["max_release_gap"] > 10 and fast["waits"] == 0
    assert slow["staleness_mean"] > 1.0  # the slow worker's gradients are stale
