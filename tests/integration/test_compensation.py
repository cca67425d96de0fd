"""Delay compensation with a real server and real workers (docs/algorithms.md, "Delay
compensation"): the weights a worker computed its gradient on are the ones the server
compensates against, whatever else the worker asked for meanwhile."""

from __future__ import annotations

import numpy as np

from aps.cli.status import fetch_stats
from aps.client.channel import run
from aps.tables import Table

F = np.float32
W0 = np.array([0.5, -1.0, 2.0, 0.25], F)
G1 = np.array([0.2, 0.1, -0.3, 0.4], F)
G0 = np.array([1.0, -2.0, 0.5, 0.3], F)


def dc(g, w, w_then, lam=0.5):
    return g + F(lam) * ((g * g) * (w - w_then))


def test_rows_pulled_alone_leave_the_weights_a_gradient_is_compensated_against(server_process):
    """aps.torch pulls an embedding's rows alone before every forward: the dense weights the
    worker holds stay those of its last dense pull, and so does what the server keeps for it."""
    import aps

    server = server_process("--workers", "2", "--sync", "asp", "--lr", "0.1", "--compensation", "dc:0.5",
                            "--http-port", "0")
    tables = {"items": Table(rows=100, dim=2)}
    with aps.Worker(server.address, 0, 2) as a, aps.Worker(server.address, 1, 2) as b:
        import threading

        joining = threading.Thread(target=a.init, args=({"w": W0},), kwargs={"tables": tables})
        joining.start()
        b.init({"w": W0}, tables=tables)
        joining.join()
        b.push_pull({"w": G1})
        b.push_pull({"w": G1})  # version 2; a holds version 0
        # rows alone, as aps.torch pulls them (not versioned: a keeps its dense weights of version 0)
        run(a._pull_rows("items", [3, 4], None, versioned=False))
        assert a.version == 0
        weights = a.push_pull({"w": G0})["w"]
        w2 = W0 - F(0.1) * G1 - F(0.1) * G1
        np.testing.assert_allclose(weights, w2 - F(0.1) * dc(G0, w2, W0), rtol=1e-6)
        stats = {w["rank"]: w for w in fetch_stats(server.address)["workers"]}
        assert (stats[0]["compensated"], stats[0]["uncompensated"]) == (1, 0)


def test_weights_loaded_after_init_are_not_taken_for_a_move(server_process):
    """``load_weights`` replaces version 0: the workers' first gradients are computed on the
    loaded weights (or on the initial ones, by a worker that has not pulled them), never
    compensated for the difference between the two."""
    import aps

    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.1", "--compensation", "gap")
    with aps.Worker(server.address, 0, 1) as worker:
        worker.init({"w": np.zeros(4, F)})
        worker.load_weights({"w": W0})
        weights = worker.push_pull({"w": G1})["w"]
        np.testing.assert_allclose(weights, W0 - F(0.1) * G1, rtol=1e-6)
