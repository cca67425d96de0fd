"""Sharded SSP and DSSP: each shard bounds staleness on its own clocks, so the bound holds
for the model as a whole.

K real engines (tests.harness), one per shard, and P workers that iterate as a
sharded worker does: once every shard has released a worker it computes a
gradient and sends each shard its piece, and the pieces arrive in an order
hypothesis chooses (one shard may have a worker's push k while another has not
yet). Checked at each moment a worker has been released by every shard: its
clock minus the slowest worker's (on the shard that has seen least of it) is
within the bound, s for SSP and s_U for DSSP. And the run never deadlocks: some
piece is always in flight or some worker is free to compute.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import Harness

settings_ = settings(max_examples=60, deadline=None)


@settings_
@given(
    workers=st.integers(2, 4),
    shards=st.integers(2, 3),
    policy=st.sampled_from(["ssp", "dssp"]),
    lower=st.integers(0, 2),
    extra=st.integers(0, 3),
    choices=st.lists(st.integers(0, 1 << 16), min_size=40, max_size=160),
)
def test_the_staleness_bound_holds_across_shards(workers, shards, policy, lower, extra, choices):
    options = {"workers": workers, "sync": policy, "staleness": lower}
    if policy == "dssp":
        options["max_staleness"] = lower + extra
    bound = lower + (extra if policy == "dssp" else 0)
    engines = [Harness(**options) for _ in range(shards)]
    for engine in engines:
        engine.join_all()
    clocks = [0] * workers  # iterations each worker has finished computing (and sent, or is sending)
    in_flight: list[tuple[int, int]] = []  # (worker, shard) pieces sent and not yet arrived
    computing = set(range(workers))  # released by every shard: free to compute its next gradient

    def released_everywhere(rank: int) -> bool:
        return all(not engine.workers[rank].waiting for engine in engines)

    for choice in choices:
        moves = [("compute", rank) for rank in sorted(computing)] + [("arrive", piece) for piece in in_flight]
        assert moves, "deadlock: nothing in flight and no worker free to compute"
        kind, what = moves[choice % len(moves)]
        if kind == "compute":
            rank = what
            computing.discard(rank)
            clocks[rank] += 1
            in_flight.extend((rank, shard) for shard in range(shards))
        else:
            rank, shard = what
            in_flight.remove(what)
            engines[shard].push(rank, np.full(workers, 0.5, np.float32), then_pull=True)
        for rank in range(workers):
            pending = any(piece[0] == rank for piece in in_flight)
            if rank not in computing and not pending and released_everywhere(rank):
                # every shard let it go on: the bound, on the clocks each shard has seen
                slowest = min(min(engine.window.clock(other) for engine in engines) for other in range(workers))
                assert clocks[rank] - slowest <= bound, (clocks, [e.window.clock(0) for e in engines])
                computing.add(rank)
        for engine in engines:
            for worker in engine.workers:
                assert not worker.errors, worker.errors
