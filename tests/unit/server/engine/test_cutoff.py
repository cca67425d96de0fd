"""--staleness-cutoff R: a gradient computed more than R versions before the one it would
meet is dropped, counted with its reason, and its worker goes on (docs/algorithms.md,
"Staleness cut-off")."""

import numpy as np
import pytest

from aps.config import ServerConfig
from aps.errors import ConfigurationError
from aps.lab.settings import parse_setting
from aps.server.engine.sync import CUTOFF, PlanKind, make_policy
from tests.harness import Harness


@pytest.mark.parametrize("sync, extra", [("asp", {}), ("ssp", {"staleness": 10}), ("dssp", {}),
                                         ("softsync", {"softsync_n": 2})])
def test_a_gradient_older_than_the_cutoff_is_dropped_and_counted(sync, extra):
    policy = make_policy(ServerConfig(workers=2, sync=sync, staleness_cutoff=3, **extra))
    for rank in range(2):
        policy.join(rank)
    kept = policy.plan(0, grad_version=7, version=10)  # staleness 3: kept
    assert kept.kind is not PlanKind.DROP and kept.staleness == 3
    cut = policy.plan(0, grad_version=6, version=10)  # staleness 4 > 3: dropped
    assert (cut.kind, cut.reason, cut.staleness) == (PlanKind.DROP, CUTOFF, 4)
    policy.commit(0, cut, 0.0)
    assert (policy.dropped, policy.dropped_cutoff, policy.dropped_stale) == (1, 1, 0)
    state = policy.state()
    again = make_policy(ServerConfig(workers=2, sync=sync, staleness_cutoff=3, **extra))
    again.restore(state)
    assert (again.dropped, again.dropped_cutoff) == (1, 1)


def test_without_a_cutoff_nothing_is_dropped_for_its_age():
    policy = make_policy(ServerConfig(workers=1, sync="asp"))
    policy.join(0)
    assert policy.plan(0, grad_version=0, version=10_000).kind is PlanKind.APPLY


def test_the_engine_drops_applies_nothing_and_its_worker_goes_on():
    """ASP, R=1: a worker that pulled version 0 while the other made two updates pushes a
    gradient 2 versions old: not applied, counted for it, answered (it is not held)."""
    h = Harness(workers=2, sync="asp", staleness_cutoff=1, numel=2)
    h.join_all(np.zeros(2, np.float32))
    h.push(1, np.array([0, 1], np.float32), then_pull=True)
    h.push(1, np.array([0, 1], np.float32), then_pull=True)
    assert h.engine.version == 2
    h.push(0, np.array([5, 0], np.float32), version=0, then_pull=True)  # 2 versions old
    result = h.workers[0].results[-1]
    assert result.dropped and result.staleness == 2
    assert h.engine.version == 2 and h.engine.weights.tolist() == [0, -2]
    assert h.workers[0].version == 2  # answered with the newest weights: it goes on
    h.push(0, np.array([5, 0], np.float32), then_pull=True)  # fresh: applied
    assert h.engine.weights.tolist() == [-5, -2]
    view = h.engine.view()
    assert view.dropped_cutoff == 1 and view.dropped == 1
    assert h.engine.stats.workers[0].dropped_cutoff == 1 and h.engine.stats.workers[1].dropped_cutoff == 0


def test_bad_cutoffs_are_refused():
    with pytest.raises(ConfigurationError, match="must be >= 0"):
        ServerConfig(sync="asp", staleness_cutoff=-1)
    with pytest.raises(ConfigurationError, match="BSP round"):
        ServerConfig(sync="bsp", staleness_cutoff=4)
    assert "cutoff=4" in ServerConfig(sync="asp", staleness_cutoff=4).describe_sync()


def test_settings_take_the_cutoff_as_a_suffix():
    assert parse_setting("asp+cutoff:8").options == {"sync": "asp", "staleness_cutoff": 8}
    assert parse_setting("dssp:3:15+cutoff:4+inverse").options == {
        "sync": "dssp", "staleness": 3, "max_staleness": 15, "staleness_cutoff": 4, "lr_staleness": "inverse"}
    assert parse_setting("asp+dc-adaptive:2+inverse").options == {
        "sync": "asp", "compensation": "dc-adaptive:2", "lr_staleness": "inverse"}
    assert parse_setting("dssp:3:15+gap+cutoff:4").options == {
        "sync": "dssp", "staleness": 3, "max_staleness": 15, "compensation": "gap", "staleness_cutoff": 4}
    with pytest.raises(ConfigurationError, match="finite number"):
        parse_setting("asp+dc:-2")
    for bad in ("asp+cutoff", "asp+cutoff:x", "asp+cutoff:1+cutoff:2", "asp+fast", "asp+gap+dc:1", "asp+none"):
        with pytest.raises(ConfigurationError, match="suffixes"):
            parse_setting(bad)
