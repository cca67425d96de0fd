"""The HTTP side of ``aps serve --http-port``: Prometheus metrics, a JSON API
and a live dashboard.

Served by aiohttp's web server on the server's own event loop. Each request
reads one statistics snapshot (what ``aps status`` shows) and nothing else:
it never waits for the update lane, and holds the loop no longer than the
snapshot takes. ``/metrics`` is produced by the official ``prometheus_client``
library from a collector that reads the snapshot at scrape time
(docs/metrics.md lists the metrics).

The dashboard (``/``, its files under ``/static/``, shipped in ``aps/web``)
gets its data over a WebSocket (``/ws``): a hello with the configuration and
the last ten minutes of history, then at most two frames a second, built
from one snapshot shared by every viewer. With a token (``--token``),
``/metrics`` and ``/api`` need it as a bearer token (``Authorization: Bearer
TOKEN``) and the WebSocket as its first message; the page and its files hold
no data and need none.

Nothing a client does reaches training: connections are capped
(MAX_CONNECTIONS, then refused), viewers too (MAX_VIEWERS), requests and
WebSocket messages are small, a viewer that does not read is cut off after
SEND_TIMEOUT_S (its unsent frames are bounded by the transport's
high-water mark, as aiohttp waits for the drain), and a slow one skips frames
rather than queueing them.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import ssl
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

from aiohttp import WSCloseCode, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from . import __version__
from .config import ServerConfig, is_loopback
from .transport.session import RateLimitedLog
from .stats import MEMBERSHIP_EVENTS, WAIT_BUCKETS_S, lr_range

__all__ = ["HttpSide", "StatsCollector", "STALENESS_BUCKETS"]

log = logging.getLogger("aps.server")

#: The ``le`` bounds of the staleness histograms (in versions).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 255)
#: Requests larger than this are refused (there is nothing to post).
MAX_REQUEST_BYTES = 64 << 10
#: Open HTTP connections (viewers included) beyond this are refused at once.
MAX_CONNECTIONS = 128
#: Dashboards open at once (WebSockets); one more is told so (close code 4429).
MAX_VIEWERS = 32
#: A viewer that takes longer than this to take one frame is cut off.
SEND_TIMEOUT_S = 10.0
#: A WebSocket must send the token message within this.
HELLO_TIMEOUT_S = 5.0
#: Frames to the dashboards: at most this many a second.
FRAMES_PER_S = 2
#: The history the dashboard draws: one point a second, this many kept (ten minutes).
HISTORY_POINTS = 600
#: Idle keep-alive connections are closed after this.
KEEPALIVE_S = 15.0
#: Every scrape, /api/stats request and dashboard frame within this of the last one is served
#: from the same statistics snapshot (scrapers in a loop cost one snapshot a second, not one each).
SNAPSHOT_MAX_AGE_S = 0.5
#: /metrics serves the same exposition for this long (a scrape costs ~0.4 ms per worker).
METRICS_MAX_AGE_S = 1.0
#: aps_worker_learning_rate exports at most this many groups of a rank (the first ones), so a
#: worker with many param groups cannot swell every scrape; /api/stats has them all.
MAX_EXPORTED_GROUPS = 16
#: Where the dashboard's files are (inside the package).
WEB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web")
#: WebSocket close codes: no or wrong token; too many dashboards open.
CLOSE_UNAUTHORIZED, CLOSE_TOO_MANY = 4401, 4429
#: What a viewer gets of each worker (the per-gradient histograms stay out of the frames; its
#: groups of optimizer values too: the frames carry their learning rates' ``lr_range``).
_VIEWER_WORKER_KEYS = (
    "rank", "live", "clock", "gap", "held", "credit", "pushes", "dropped", "rejected", "staleness_mean", "pulls",
    "waits", "wait_s_total", "wait_s_mean", "wait_s_max", "r_star_hist", "max_release_gap", "last_interval_s",
    "hyperparameters_own",
)


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
        yield GaugeMetricFamily("aps_shard", "This server's shard of the model (--shard; 0 when unsharded).",
                                value=server.get("shard", 0))
        yield GaugeMetricFamily("aps_shards", "Shards the model is cut into (--shards).",
                                value=server.get("shards", 1))
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
        rates = GaugeMetricFamily("aps_worker_learning_rate", "Learning rate each connected rank's gradients are "
                                  "applied with, by group of parameters (its own, or the server's as group 0; "
                                  f"the first {MAX_EXPORTED_GROUPS} groups).", labels=["rank", "group"])
        for w in workers:
            for index, group in enumerate((w.get("hyperparameters") or ())[:MAX_EXPORTED_GROUPS]):
                rates.add_metric([str(w["rank"]), str(index)], group["lr"])
        yield rates
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
        events = CounterMetricFamily("aps_membership_events", "Membership events by kind: joined, rejoined "
                                     "(reconnected), left, disconnected, timed out (dropped for silence).",
                                     labels=["event"])
        counts = server.get("membership_events", {})
        for event in MEMBERSHIP_EVENTS:
            events.add_metric([event.replace(" ", "_")], counts.get(event, 0))
        yield events
        yield from _auth_metrics(server)
        process = server["process"]
        yield GaugeMetricFamily("aps_server_resident_memory_bytes", "Resident memory of the server process.",
                                value=process["rss_bytes"])
        yield CounterMetricFamily("aps_server_cpu_seconds", "CPU time of the server process (user and system).",
                                  value=process["cpu_s"])


def _auth_metrics(server: dict) -> Iterator:
    """Failed handshakes and what the throttle did about them; INITs refused for the layout budget."""
    auth = server.get("auth", {})
    yield CounterMetricFamily("aps_auth_failures", "Handshakes failed: a wrong token, or a request before it.",
                              value=auth.get("failures", 0))
    yield CounterMetricFamily("aps_auth_throttled", "AUTH attempts held back for their turn after failures "
                              "from the same address.", value=auth.get("throttled", 0))
    yield CounterMetricFamily("aps_auth_refused", "AUTH attempts refused unchecked: their address failed too "
                              "often lately.", value=auth.get("refused", 0))
    yield CounterMetricFamily("aps_layout_budget_refusals", "INITs refused while the layout blocks being read "
                              "used up the server's budget for them.",
                              value=server.get("strangers", {}).get("layout_refused", 0))


class HttpSide:
    """The HTTP listener of one server (``--http-port``).

    Args:
        config: the server's options (``host``, ``http_port``).
        snapshot: returns a statistics snapshot (``Engine.stats_snapshot``).
        token: the server's token, if it has one: required as a bearer token.
        totals: returns a few running totals (``ServerStats.totals``), sampled once a
            second for the dashboard's history; None: no history.
        events_after: returns the membership events after a sequence number
            (``ServerStats.events_after``); None: no events.
    """

    def __init__(self, config: ServerConfig, snapshot: Callable[[], dict], token: bytes | None, *,
                 totals: Callable[[], dict] | None = None,
                 events_after: Callable[[int], list[dict]] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.config = config
        self._read_snapshot = snapshot
        self._token = token
        self._tls = tls
        self._loopback = is_loopback(config.host)
        self._totals = totals
        self._events_after = events_after or (lambda seq: [])
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(StatsCollector(self._snapshot))
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._ticker: asyncio.Task | None = None
        self._viewers: set[_Viewer] = set()  # admitted: from before their hello is sent
        self._history: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self._point_seq = 0
        self._last_totals: tuple[float, dict] | None = None
        self._frame: dict | None = None  # the newest frame's shared part
        self._cached: tuple[float, dict] | None = None  # (monotonic time, snapshot)
        self._exposition: tuple[float, bytes] | None = None
        self.port: int | None = None

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    def _snapshot(self) -> dict:
        """The statistics, read at most once per SNAPSHOT_MAX_AGE_S whoever asks."""
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] >= SNAPSHOT_MAX_AGE_S:
            self._cached = (now, self._read_snapshot())
        return self._cached[1]

    # the application ------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application (also what the tests drive with aiohttp's test client)."""
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_REQUEST_BYTES)
        app.router.add_get("/", self._index)
        app.router.add_static("/static/", WEB_DIR, append_version=False)
        app.router.add_get("/ws", self._websocket)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/api/stats", self._stats)
        app.router.add_get("/api/config", self._config)
        app.router.add_get("/api/history", self._history_api)
        app.on_startup.append(self._start_ticker)
        app.on_shutdown.append(self._close_viewers)
        app.on_cleanup.append(self._stop_ticker)
        return app

    async def start(self) -> None:
        """Listen on ``host:http_port`` (port 0: a free one, in :attr:`port`)."""
        # aiohttp logs each malformed request with a traceback: a client could flood the log.
        quiet = logging.getLogger("aps.http")
        if not any(isinstance(f, _OneLine) for f in quiet.filters):
            quiet.addFilter(_OneLine())
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, logger=quiet,
                                     keepalive_timeout=KEEPALIVE_S, lingering_time=0, shutdown_timeout=1.0)
        await self._runner.setup()
        try:
            factory = _Capped(self._runner.server, MAX_CONNECTIONS)
            self._listener = await asyncio.get_running_loop().create_server(
                factory, self.config.host, self.config.http_port, reuse_address=True, ssl=self._tls,
                ssl_handshake_timeout=self.config.handshake_timeout if self._tls is not None else None)
        except BaseException:
            await self._runner.cleanup()
            self._runner = None
            raise
        self.port = self._listener.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        if request.body_exists:  # nothing here takes a body: refused unread, and the connection closed
            response = web.json_response({"error": "requests here have no body"}, status=413)
            response.force_close()
            return response
        if self._token is None and self._loopback and not _local_name(request.host):
            # Listening on loopback without a token: a page of another site that had its name
            # resolve to 127.0.0.1 (DNS rebinding) would otherwise read the run.
            return web.json_response({"error": f"unknown Host {request.host!r}: use an address, or localhost"},
                                     status=403)
        # The page and its files hold no data; the WebSocket proves the token itself.
        if self._token is not None and not _is_public(request.path):
            given = request.headers.get("Authorization", "")
            scheme, _, credential = given.partition(" ")
            if scheme.lower() != "bearer" or not self._token_ok(credential.strip()):
                return web.json_response({"error": "this server needs its token: Authorization: Bearer TOKEN"},
                                         status=401, headers={"WWW-Authenticate": 'Bearer realm="aps"'})
        response = await handler(request)
        if not response.prepared:  # (a WebSocket's answer went out already)
            response.headers.update(_SECURITY_HEADERS)
        return response

    def _token_ok(self, given: str) -> bool:
        return self._token is None or hmac.compare_digest(given.encode("utf-8", "replace"), self._token)

    # plain requests -------------------------------------------------------
    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(os.path.join(WEB_DIR, "index.html"), headers={"Cache-Control": "no-cache"})

    async def _metrics(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        if self._exposition is None or now - self._exposition[0] >= METRICS_MAX_AGE_S:
            self._exposition = (now, generate_latest(self._registry))
        return web.Response(body=self._exposition[1], headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _stats(self, request: web.Request) -> web.Response:
        return _json_response(self._snapshot())

    async def _config(self, request: web.Request) -> web.Response:
        return _json_response(self.config.public())

    async def _history_api(self, request: web.Request) -> web.Response:
        return _json_response({"every_s": 1, "points": list(self._history)})

    # the dashboard's WebSocket ----------------------------------------------
    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc != request.host:
            # A page of another site in the viewer's browser may not read the run.
            return web.json_response({"error": "cross-origin WebSocket refused"}, status=403)
        ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=4096)
        await ws.prepare(request)
        viewer = await self._admit(ws, request.transport)
        if viewer is None:
            return ws
        sender = asyncio.create_task(self._send_frames(viewer))
        try:
            async for _ in ws:  # nothing is to be said after the token
                await _refuse(ws, WSCloseCode.POLICY_VIOLATION, "the dashboard's socket takes no messages")
                viewer.transport_abort()
                break
        finally:
            self._viewers.discard(viewer)
            sender.cancel()
        return ws

    async def _admit(self, ws: web.WebSocketResponse, transport) -> _Viewer | None:
        """Read the token message; send the hello and return the new viewer, or refuse (None)."""
        try:
            message = await asyncio.wait_for(ws.receive(), HELLO_TIMEOUT_S)
            data = message.data if message.type == web.WSMsgType.TEXT else ""
            said = json.loads(data) if data.lstrip().startswith("{") else None  # no deep nesting to parse
            token = said.get("token", "") if isinstance(said, dict) else None
        except (asyncio.TimeoutError, ValueError, RecursionError):
            token = None
        if not isinstance(token, str) or not self._token_ok(token):
            what = "this server needs its token" if self._token is not None else "send {\"token\": \"\"} first"
            await _refuse(ws, CLOSE_UNAUTHORIZED, what)
            return None
        if len(self._viewers) >= MAX_VIEWERS:
            await _refuse(ws, CLOSE_TOO_MANY, f"too many dashboards open (at most {MAX_VIEWERS})")
            return None
        viewer = _Viewer(ws, transport)
        self._viewers.add(viewer)  # counted from now: hellos under way included
        # what the hello holds: the frames go on from there
        history, events = list(self._history), self._events_after(0)
        viewer.point_seq = history[-1]["seq"] if history else self._point_seq
        viewer.event_seq = events[-1]["seq"] if events else 0
        hello = {
            "type": "hello", "run_id": self._snapshot()["server"].get("run_id"), "aps_version": __version__,
            "config": self.config.public(), "history": history, "events": events, "history_every_s": 1,
        }
        try:
            await asyncio.wait_for(ws.send_str(_dumps(hello)), SEND_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, RuntimeError):
            self._viewers.discard(viewer)
            viewer.transport_abort()
            return None
        return viewer

    async def _send_frames(self, viewer: _Viewer) -> None:
        """One viewer's frames: the newest shared frame with the points and events it
        has not had. A viewer that cannot take one within SEND_TIMEOUT_S is cut off."""
        try:
            while True:
                await viewer.wake.wait()
                viewer.wake.clear()
                frame = self._frame
                if frame is None:
                    continue
                points = [p for p in self._history if p["seq"] > viewer.point_seq]
                events = self._events_after(viewer.event_seq)
                if points:
                    viewer.point_seq = points[-1]["seq"]
                if events:
                    viewer.event_seq = events[-1]["seq"]
                text = frame["text"][:-1] + f', "points": {_dumps(points)}, "events": {_dumps(events)}}}'
                await asyncio.wait_for(viewer.ws.send_str(text), SEND_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.info("a dashboard took no frame for %g s: cut off", SEND_TIMEOUT_S)
            viewer.transport_abort()
        except (ConnectionError, RuntimeError):  # closed meanwhile
            viewer.transport_abort()
        except Exception:
            log.exception("the dashboard's frames failed")
            viewer.transport_abort()

    def _build_frame(self) -> dict:
        stats = self._snapshot()
        server = stats["server"]
        workers = [{**{key: w.get(key) for key in _VIEWER_WORKER_KEYS}, "lr_range": lr_range(w.get("hyperparameters"))}
                   for w in stats["workers"]]
        text = _dumps({"type": "stats", "server": server, "workers": workers})
        return {"server": server, "text": text}

    async def _start_ticker(self, app: web.Application) -> None:
        self._ticker = asyncio.create_task(self._tick())

    async def _stop_ticker(self, app: web.Application) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    async def _close_viewers(self, app: web.Application) -> None:
        """The server stops: each dashboard is told so (close code 1001, "going away")."""
        async def close(viewer: _Viewer) -> None:
            try:
                await asyncio.wait_for(viewer.ws.close(code=WSCloseCode.GOING_AWAY, message=b"the server stopped"),
                                       1.0)
            except (asyncio.TimeoutError, ConnectionError, RuntimeError):
                pass
            viewer.transport_abort()

        await asyncio.gather(*(close(viewer) for viewer in list(self._viewers)))

    async def _tick(self) -> None:
        """Twice a second: a frame for the viewers (if any); once a second: a history point."""
        period = 1.0 / FRAMES_PER_S
        loop = asyncio.get_running_loop()
        next_point = loop.time()
        while True:
            try:
                now = loop.time()
                if now >= next_point:
                    next_point = now + 1.0
                    self._sample()
                if self._viewers:
                    self._frame = self._build_frame()
                    for viewer in self._viewers:
                        viewer.wake.set()
            except Exception:  # a bad snapshot must not end the dashboard for good
                log.exception("the dashboard's statistics failed")
            await asyncio.sleep(period)

    def _sample(self) -> None:
        """One history point: the rates since the previous sample (over the monotonic
        clock; the wall clock only labels the point)."""
        if self._totals is None:
            return
        now, totals = time.monotonic(), self._totals()
        previous, self._last_totals = self._last_totals, (now, totals)
        if previous is None:
            return
        then, before = previous
        span = max(now - then, 1e-6)
        staleness_n = totals["staleness_n"] - before["staleness_n"]
        pulls = totals["pulls"] - before["pulls"]
        self._point_seq += 1
        self._history.append({
            "seq": self._point_seq,
            "t": time.time(),
            "version": totals["version"],
            "updates_per_s": max(0, totals["version"] - before["version"]) / span,
            "staleness_mean": (totals["staleness_sum"] - before["staleness_sum"]) / staleness_n if staleness_n else None,
            "gate_wait_ms": 1e3 * (totals["wait_s"] - before["wait_s"]) / pulls if pulls else None,
            "live": totals["live"],
        })


class _Viewer:
    """One dashboard's WebSocket: woken for each frame; where its points and events are."""

    __slots__ = ("ws", "transport", "wake", "point_seq", "event_seq")

    def __init__(self, ws: web.WebSocketResponse, transport: asyncio.BaseTransport | None) -> None:
        self.ws = ws
        self.transport = transport
        self.wake = asyncio.Event()
        self.point_seq = 0
        self.event_seq = 0

    def transport_abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


#: On every answer: no framing by other sites, no content sniffing, nothing loaded from elsewhere.
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def _finite(value):
    """``value`` with every non-finite float as None (JSON has no NaN or infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _dumps(value) -> str:
    """Strict JSON (what browsers parse): non-finite floats become null."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False)


def _json_response(value) -> web.Response:
    return web.Response(text=_dumps(value), content_type="application/json")


class _OneLine(logging.Filter):
    """aiohttp's complaints about bad requests: one line each, at most a few a minute."""

    def __init__(self) -> None:
        super().__init__()
        self._limit = RateLimitedLog(logger=log)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        self._limit.warning(time.monotonic(), "HTTP side: %s%s", record.getMessage(),
                            f": {type(error).__name__}: {str(error)[:200]}" if error is not None else "")
        return False


async def _refuse(ws: web.WebSocketResponse, code: int, error: str) -> None:
    try:
        await asyncio.wait_for(ws.send_str(json.dumps({"type": "error", "code": code, "error": error})), 1.0)
        await asyncio.wait_for(ws.close(code=code, message=error.encode()[:120]), 1.0)
    except (asyncio.TimeoutError, ConnectionError, RuntimeError):
        pass


def _local_name(host: str) -> bool:
    """Whether a Host header names this machine by address or as localhost."""
    name = urlsplit(f"//{host}").hostname or ""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_public(path: str) -> bool:
    return path in ("/", "/ws", "/favicon.ico") or path.startswith("/static/")


class _Capped:
    """aiohttp's protocol factory, refusing connections beyond ``limit`` (a 503, then closed).

    Connections are counted here, as they are made: aiohttp's own count moves only once
    a connection is under way, after a burst of accepts in one pass of the loop."""

    def __init__(self, server: web.Server, limit: int) -> None:
        self._server = server
        self._limit = limit
        # weak: a protocol whose connection never came about (a failed accept) leaves by itself
        self.open: weakref.WeakSet[_Counted] = weakref.WeakSet()

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self.open) >= self._limit:
            return _Refusal()
        protocol = _Counted(self._server(), self.open)
        self.open.add(protocol)
        return protocol


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, which leaves the count when it ends."""

    def __init__(self, inner, count: weakref.WeakSet) -> None:
        self._inner = inner
        self._count = count

    def connection_made(self, transport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self._count.discard(self)
        self._inner.connection_lost(exc)


class _Refusal(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        transport.close()
