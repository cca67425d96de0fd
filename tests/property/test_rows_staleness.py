"""The staleness bound holds for rows (docs/algorithms.md, "Rows"): random interleavings of
pushes and pulls on the real engine, under SSP and DSSP, with rows pushed beside the dense
gradient, alone, or not at all.

Each rank pushes a gradient of one to its own row (SGD, lr 1, rows starting at zero), so
the row of rank q reads minus the number of q's pushes applied. Checked at every release
of a pull of every row by rank p at clock c_p: p sees every one of its own pushes (it reads
its writes), and sees at least c_p - s pushes of every other rank q that pushed that many
(``s``: the policy's bound, ``s_U`` for DSSP): the rows a worker reads are never more than
``s`` iterations behind, as the dense weights are not. Nothing is dropped in these
interleavings (no worker reconnects), so every push counts.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aps.tables import Table
from aps.wire.rows import RowSection

from tests.harness import Harness

configs = st.one_of(
    st.builds(lambda P, s: {"workers": P, "sync": "ssp", "staleness": s}, st.integers(2, 4), st.integers(0, 3)),
    st.builds(lambda P, lo, extra: {"workers": P, "sync": "dssp", "staleness": lo, "max_staleness": lo + extra},
              st.integers(2, 4), st.integers(0, 2), st.integers(0, 3)),
)
# (rank, what): 0 a push of rows with the dense gradient, 1 rows alone, 2 the dense gradient alone;
# each push is followed by a pull of every row (in the same request or as its own).
steps = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.booleans(), st.sampled_from([0.0, 0.5, 2.0])),
                 min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(config=configs, schedule=steps)
def test_rows_read_are_within_the_staleness_bound(config, schedule):
    table = Table(rows=16, dim=1, init="zeros", optimizer="sgd", lr=1.0)
    P = config["workers"]
    upper = config.get("max_staleness", config["staleness"])
    history: list[list[bool]] = [[] for _ in range(P)]  # per rank, per iteration: it pushed its row
    failures = []  # (the engine logs what a release callback raises: kept here, asserted after each step)
    released_with_rows = 0

    def released(h, rank, version):
        nonlocal released_with_rows
        rows = h.workers[rank].rows
        if rows is None:  # (an INIT's answer)
            return
        h.workers[rank].rows = None
        released_with_rows += 1
        seen, clock = -rows[0][:, 0], h.window.clock(rank)
        if seen[rank] != sum(history[rank][:clock]):
            failures.append(f"rank {rank} does not read its own rows")
        for other in range(P):
            needed = sum(history[other][: max(0, clock - upper)])
            if seen[other] < needed:
                failures.append(f"rank {rank} at clock {clock} read {seen[other]} of rank {other}'s rows, fewer "
                                f"than the {needed} of its first {clock - upper} iterations")

    h = Harness(tables=(("rows", table),), on_release=released, **config)
    h.join_all()
    every = [RowSection(0, np.arange(P, dtype=np.int64), None)]
    for rank, what, together, dt in schedule:
        rank %= P
        worker = h.workers[rank]
        if worker.waiting:
            continue
        h.tick(dt)
        rows = None if what == 2 else [RowSection(0, np.array([rank], np.int64), np.ones((1, 1), np.float32))]
        grad = None if what == 1 else np.zeros(h.numel, np.float32)
        history[rank].append(rows is not None)
        h.push(rank, grad, then_pull=together, rows=rows, pull_rows=every)
        assert not worker.errors, worker.errors
        assert not worker.results[-1].dropped
        if not together:
            h.pull(rank, every)
        assert not failures, failures
    assert released_with_rows >= sum(len(row) for row in history) - P  # (every pull but the last few was answered)
    assert all(sum(row) == -value for row, value in
               zip(history, h.engine.model.rows["rows"].pull(np.arange(P, dtype=np.int64))[:, 0]))
