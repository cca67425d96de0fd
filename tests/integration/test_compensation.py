"""Delay compensation with a real server and real workers (docs/algorithms.md, "Delay
compensation"): the weights a worker computed its gradient on are the ones the server
compensates against, whatever else the worker asked for meanwhile."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_a_lambda_the_kernel_cannot_compute_with_is_refused_at_start(server_process):
    """--compensation dc:1e300 is finite in float64 but infinite in the kernel's float32 (and
    dc-adaptive:1e38 overflows once divided by sqrt(1e-7)): every push would be refused as a
    non-finite gradient, the worker told its gradient was at fault. The server refuses to start,
    saying why and what it takes; at the largest LAMBDA it takes, a run trains."""
    import subprocess
    import sys

    import aps

    for value, said in (("dc:1e300", "LAMBDA 1e+300 is beyond float32"),
                        ("dc-adaptive:1e38", "reaches 3.16228e+41 for a parameter whose gradients have been 0")):
        refused = subprocess.run([sys.executable, "-m", "aps", "serve", "--port", "0", "--sync", "asp",
                                  "--compensation", value], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2, refused.stderr
        assert said in refused.stderr and "give a LAMBDA of at most" in refused.stderr, refused.stderr
        assert "serving on" not in refused.stdout
        with pytest.raises(aps.ConfigurationError, match="beyond float32"):
            aps.Server(sync="asp", port=0, compensation=value).run_in_background().start()
    largest = refused.stderr.rsplit("at most ", 1)[1].strip()
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "0.1", "--compensation", f"dc-adaptive:{largest}")
    with aps.Worker(server.address, 0, 2) as a, aps.Worker(server.address, 1, 2) as b:
        import threading

        joining = threading.Thread(target=a.init, args=({"w": W0},))
        joining.start()
        b.init({"w": W0})
        joining.join()
        b.push_pull({"w": np.zeros(4, F)})  # a gradient of zeros on weights that have not moved: taken
        weights = a.push_pull({"w": G1})["w"]  # (stale by one version: compensated, and finite)
        assert np.all(np.isfinite(weights)) and a.version == 2
