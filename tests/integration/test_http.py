"""The HTTP side (``aps serve --http-port``): Prometheus metrics and the JSON API, against a
real server process, read with aiohttp's client and parsed back with prometheus_client."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import aps
from aps.cli.status import fetch_stats

from ..helpers import ServerProcess


def http_address(server: ServerProcess) -> str:
    line = server.proc.stdout.readline()
    assert line.startswith("aps: dashboard on http://127.0.0.1:"), line
    return line.split(" on ", 1)[1].strip()


async def get(url: str, **headers) -> tuple[int, str, dict]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.text(), dict(response.headers)


def samples(text: str) -> dict:
    """``{(sample name, (label pairs)): value}`` from an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_and_the_api_count_exactly_what_happened(server_process):
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "3", "--http-port", "0")
    base = http_address(server)
    workers = [aps.Worker(server.address, rank, 2, transport="tcp") for rank in range(2)]
    joining = threading.Thread(target=workers[1].init, args=({"w": np.zeros(8, np.float32)},))
    joining.start()
    workers[0].init({"w": np.zeros(8, np.float32)})
    joining.join(10)
    for _ in range(3):
        workers[0].push_pull({"w": np.ones(8, np.float32)})
    for _ in range(2):
        workers[1].push_pull({"w": np.ones(8, np.float32)})
    status, text, headers = asyncio.run(get(base + "metrics"))
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=")
    metrics = samples(text)
    assert metrics[("aps_updates_total", ())] == metrics[("aps_version", ())] == 5
    assert metrics[("aps_pushes_total", (("rank", "0"),))] == 3
    assert metrics[("aps_pushes_total", (("rank", "1"),))] == 2
    assert metrics[("aps_workers_live", ())] == 2 and metrics[("aps_workers", ())] == 2
    assert metrics[("aps_worker_clock", (("rank", "0"),))] == 3
    assert metrics[("aps_worker_gap", (("rank", "0"),))] == 1
    assert metrics[("aps_gradient_staleness_count", (("rank", "1"),))] == 2  # one per gradient
    # rank 1's first gradient was computed on version 0 with the server at 3; its second on 4, at 4
    assert metrics[("aps_gradient_staleness_sum", (("rank", "1"),))] == 3
    assert metrics[("aps_gradient_staleness_bucket", (("le", "2.0"), ("rank", "1")))] == 1
    assert metrics[("aps_gradient_staleness_bucket", (("le", "3.0"), ("rank", "1")))] == 2
    assert metrics[("aps_gate_wait_seconds_count", (("rank", "0"),))] == 3  # one per pull
    assert metrics[("aps_gradients_not_applied_total", (("rank", "0"), ("reason", "non_finite")))] == 0
    assert metrics[("aps_received_bytes_total", (("transport", "tcp"),))] > 5 * 32
    assert metrics[("aps_server_resident_memory_bytes", ())] > 0
    stats = fetch_stats(server.address)
    status, text, _ = asyncio.run(get(base + "api/stats"))
    api = __import__("json").loads(text)
    assert status == 200 and api["server"]["version"] == stats["server"]["version"] == 5
    assert [w["pushes"] for w in api["workers"]] == [w["pushes"] for w in stats["workers"]] == [3, 2]
    status, text, _ = asyncio.run(get(base + "api/config"))
    config = __import__("json").loads(text)
    assert status == 200 and config["workers"] == 2 and config["sync"] == "ssp" and "token" not in config
    status, _, _ = asyncio.run(get(base + "nowhere"))
    assert status == 404
    status, _, _ = asyncio.run(get(base + "metrics", **{"X-Junk": "x" * (1 << 16)}))
    assert status in (400, 431)  # a huge header is refused
    workers[0].push_pull({"w": np.ones(8, np.float32)})  # and training goes on
    for worker in workers:
        worker.close()


def test_with_a_token_every_request_needs_it(server_process):
    server = server_process("--workers", "1", "--http-port", "0", "--token", "s3cret")
    base = http_address(server)
    for path in ("metrics", "api/stats", "api/config"):
        status, _, headers = asyncio.run(get(base + path))
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        status, _, _ = asyncio.run(get(base + path, Authorization="Bearer wrong"))
        assert status == 401
        status, _, _ = asyncio.run(get(base + path, Authorization="Bearer s3cret"))
        assert status == 200


def test_the_http_port_must_be_free(server_process):
    first = server_process("--workers", "1", "--http-port", "0")
    port = http_address(first).rsplit(":", 1)[1].strip("/")
    with pytest.raises(RuntimeError, match="--http-port"):
        ServerProcess("--workers", "1", "--http-port", port)
