"""DSSP with equal bounds behaves exactly as SSP, on any schedule."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import Harness

steps = st.lists(
    st.tuples(st.sampled_from(["push", "pull", "leave", "join"]), st.integers(0, 3), st.sampled_from([0.1, 1.0, 4.0])),
    max_size=80,
)


@settings(max_examples=150)
@given(P=st.integers(1, 4), s=st.integers(0, 3), schedule=steps)
def test_dssp_with_equal_bounds_equals_ssp(P, s, schedule):
    ssp = Harness(workers=P, sync="ssp", staleness=s)
    dssp = Harness(workers=P, sync="dssp", staleness=s, max_staleness=s)
    for h in (ssp, dssp):
        h.join_all()
    for action, rank, dt in schedule:
        if rank >= P:
            continue
        live, waiting = ssp.live(rank), ssp.workers[rank].waiting
        allowed = {
            "push": live and not ssp.held(rank) and not waiting,
            "pull": live and not waiting,
            "leave": live,
            "join": ssp.workers[rank].member is None,
        }[action]
        for h in (ssp, dssp):
            h.tick(dt)
            if not allowed:
                continue
            if action == "push":
                g = np.zeros(P, np.float32)
                g[rank] = 1.0
                h.push(rank, g, then_pull=True)
            else:
                getattr(h, action)(rank)
        assert ssp.releases == dssp.releases
        assert ssp.state() == dssp.state()
        np.testing.assert_array_equal(ssp.engine.weights, dssp.engine.weights)
    assert dssp.window.controller_calls == 0 or dssp.window.last_r_star == 0
