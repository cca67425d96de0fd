"""The HTTP side of ``aps serve --http-port``: Prometheus metrics and a JSON API.

Served by aiohttp's web server on the server's own event loop. Each request
reads one statistics snapshot (what ``aps status`` shows) and nothing else:
it never waits for the update lane, and holds the loop no longer than the
snapshot takes. ``/metrics`` is produced by the official ``prometheus_client``
library from a collector that reads the snapshot at scrape time
(docs/metrics.md lists the metrics). With a token (``--token``), every
request must carry it as a bearer token (``Authorization: Bearer TOKEN``).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .config import ServerConfig
from .stats import WAIT_BUCKETS_S

__all__ = ["HttpSide", "StatsCollector", "STALENESS_BUCKETS"]

log = logging.getLogger("aps.server")

#: The ``le`` bounds of the staleness histograms (in versions).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 255)
#: Requests larger than this are refused (there is nothing to post).
MAX_REQUEST_BYTES = 64 << 10


class StatsCollector:
    """A ``prometheus_client`` collector over the server's statistics snapshot."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator:
        stats = self._snapshot()
        server, workers = stats["server"], stats["workers"]
        yield GaugeMetricFamily("aps_version", "Version of the weights: updates published so far.",
                                value=server["version"])
        yield CounterMetricFamily("aps_updates", "Updates applied to the weights.", value=server["version"])
        yield GaugeMetricFamily("aps_workers", "Workers the server was started for (--workers).",
                                value=server["workers"])
        yield GaugeMetricFamily("aps_workers_live", "Workers connected and counted by the sync policy.",
                                value=server["live"])
        yield GaugeMetricFamily("aps_training_started", "1 once every worker joined and training runs.",
                                value=float(server["started"]))
        yield GaugeMetricFamily("aps_updates_per_second", "Updates per second over the last 10 seconds.",
                                value=server["updates_per_s"])
        by_rank = {
            "pushes": ("aps_pushes", "Gradients taken from each rank (applied, accumulated or dropped)."),
            "pulls": ("aps_pulls", "Weights sent to each rank after the sync policy released it."),
        }
        for key, (name, text) in by_rank.items():
            family = CounterMetricFamily(name, text, labels=["rank"])
            for w in workers:
                family.add_metric([str(w["rank"])], w[key])
            yield family
        refused = CounterMetricFamily("aps_gradients_not_applied", "Gradients not applied, by rank and reason: "
                                      "closed_round (BSP, dropped) or non_finite (NaN or infinity, rejected).",
                                      labels=["rank", "reason"])
        for w in workers:
            refused.add_metric([str(w["rank"]), "closed_round"], w["dropped"])
            refused.add_metric([str(w["rank"]), "non_finite"], w["rejected"])
        yield refused
        yield CounterMetricFamily("aps_duplicate_pushes", "Pushes sent again after a lost reply, recognised and "
                                  "not applied twice.", value=server.get("duplicates", 0))
        for direction, key, text in (("received", "bytes_in", "Bytes received"), ("sent", "bytes_out", "Bytes sent")):
            family = CounterMetricFamily(f"aps_{direction}_bytes", f"{text}, by transport (shared memory: the "
                                         "gradients read in place and the weights copied out).",
                                         labels=["transport"])
            for name, traffic in server["transports"].items():
                family.add_metric([name], traffic[key])
            yield family
        for key, name, text in (("clock", "aps_worker_clock", "Each rank's clock: gradients it has pushed."),
                                ("gap", "aps_worker_gap", "Each live rank's clock minus the slowest live one's.")):
            family = GaugeMetricFamily(name, text, labels=["rank"])
            for w in workers:
                if w[key] is not None:
                    family.add_metric([str(w["rank"])], w[key])
            yield family
        held = GaugeMetricFamily("aps_worker_held", "1 while the rank is held at the gate.", labels=["rank"])
        for w in workers:
            held.add_metric([str(w["rank"])], float(w["held"]))
        yield held
        staleness = HistogramMetricFamily("aps_gradient_staleness", "Staleness of each gradient taken, in "
                                          "versions (server version minus the version it was computed on).",
                                          labels=["rank"])
        waits = HistogramMetricFamily("aps_gate_wait_seconds", "Time each pull waited at the sync policy's gate.",
                                      labels=["rank"])
        for w in workers:
            rank = str(w["rank"])
            counts = {int(k): v for k, v in w["staleness_hist"].items()}
            buckets = [(repr(float(bound)), sum(v for k, v in counts.items() if k <= bound))
                       for bound in STALENESS_BUCKETS]
            buckets.append(("+Inf", sum(counts.values())))
            staleness.add_metric([rank], buckets, sum_value=sum(k * v for k, v in counts.items()))
            cumulative, rows = 0, []
            for bound, n in zip(WAIT_BUCKETS_S, w["wait_buckets"]):
                cumulative += n
                rows.append((repr(float(bound)), cumulative))
            rows.append(("+Inf", w["pulls"]))
            waits.add_metric([rank], rows, sum_value=w["wait_s_total"])
        yield staleness
        yield waits
        checkpoint = server.get("checkpoint")
        if checkpoint:
            yield GaugeMetricFamily("aps_checkpoint_age_seconds", "Seconds since the last checkpoint was written.",
                                    value=max(0.0, time.time() - checkpoint["written_unix"]))
            yield GaugeMetricFamily("aps_checkpoint_version", "Version of the last checkpoint written.",
                                    value=checkpoint["version"])
            yield CounterMetricFamily("aps_checkpoints_written", "Checkpoints written.", value=checkpoint["written"])
            yield CounterMetricFamily("aps_checkpoints_failed", "Checkpoints that failed.", value=checkpoint["failed"])
        process = server["process"]
        yield GaugeMetricFamily("aps_server_resident_memory_bytes", "Resident memory of the server process.",
                                value=process["rss_bytes"])
        yield CounterMetricFamily("aps_server_cpu_seconds", "CPU time of the server process (user and system).",
                                  value=process["cpu_s"])


class HttpSide:
    """The HTTP listener of one server (``--http-port``).

    Args:
        config: the server's options (``host``, ``http_port``).
        snapshot: returns a statistics snapshot (``Engine.stats_snapshot``).
        token: the server's token, if it has one: required as a bearer token.
    """

    def __init__(self, config: ServerConfig, snapshot: Callable[[], dict], token: bytes | None) -> None:
        self.config = config
        self._snapshot = snapshot
        self._token = token
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(StatsCollector(snapshot))
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def app(self) -> web.Application:
        """The aiohttp application (also what the tests drive with aiohttp's test client)."""
        app = web.Application(middlewares=[self._authorize], client_max_size=MAX_REQUEST_BYTES)
        app.router.add_get("/", self._index)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/api/stats", self._stats)
        app.router.add_get("/api/config", self._config)
        return app

    async def start(self) -> None:
        """Listen on ``host:http_port`` (port 0: a free one, in :attr:`port`)."""
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.http_port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _authorize(self, request: web.Request, handler):
        if self._token is not None:
            given = request.headers.get("Authorization", "")
            scheme, _, credential = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(credential.strip().encode(), self._token):
                return web.json_response({"error": "this server needs its token: Authorization: Bearer TOKEN"},
                                         status=401, headers={"WWW-Authenticate": 'Bearer realm="aps"'})
        return await handler(request)

    async def _index(self, request: web.Request) -> web.Response:
        return web.json_response({"endpoints": ["/metrics", "/api/stats", "/api/config"]})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self._snapshot())

    async def _config(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(self.config.public()), content_type="application/json")
