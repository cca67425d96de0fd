"""The HTTP side of ``aps serve --http-port``: Prometheus metrics, a JSON API
and a live dashboard.

Served by aiohttp's web server on the server's own event loop. Each request
reads one statistics snapshot (what ``aps status`` shows) and nothing else:
it never waits for the update lane, and holds the loop no longer than the
snapshot takes. ``/metrics`` is produced by the official ``prometheus_client``
library from a collector that reads the snapshot at scrape time
(docs/metrics.md lists the metrics).

The dashboard (``/``, its files under ``/static/``, shipped in ``aps/server/web``)
gets its data over a WebSocket (``/ws``): a hello with the configuration and
the last ten minutes of history, then at most two frames a second, built
from one snapshot shared by every viewer. With a token (``--token``),
``/metrics`` and ``/api`` need it as a bearer token (``Authorization: Bearer
TOKEN``) and the WebSocket as its first message; the page and its files hold
no data and need none.

Nothing a client does reaches training, and strangers cannot lock the
scrapers out: connections are capped (MAX_CONNECTIONS), those that have not
yet made a request (with the token, when there is one) have a few places of
their own (MAX_UNPROVEN) and a deadline for their headers (HEADER_TIMEOUT_S),
headers have a budget (MAX_HEADER_BYTES; see _Connections), viewers are
capped (MAX_VIEWERS), requests and
WebSocket messages are small, a viewer that does not read is cut off after
SEND_TIMEOUT_S (its unsent frames are bounded by the transport's
high-water mark, as aiohttp waits for the drain), and a slow one skips frames
rather than queueing them.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hmac
import ipaddress
import json
import logging
import math
import os
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Literal, cast
from urllib.parse import urlsplit

from aiohttp import WSCloseCode, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .._version import __version__
from ..config import ServerConfig, is_loopback
from .admission import AuthThrottle, RateLimitedLog
from .metrics import StatsCollector
from .peers import principal
from .engine.scalars import Drawn, Scalars
from .engine.stats import RATE_WINDOW_S, RowRates, lr_range

__all__ = ["HttpSide"]

log = logging.getLogger("aps.server")
#: Wrong tokens, logged at most five a minute whoever sends them.
_failures = RateLimitedLog(logger=log)

#: Requests larger than this are refused (there is nothing to post).
MAX_REQUEST_BYTES = 64 << 10
#: Open HTTP connections (viewers included): one more closes the oldest between requests, or
#: is refused (503) when every one is in a request.
MAX_CONNECTIONS = 128
#: Connections that have not yet had a request let through (with the token, when there is
#: one): one more closes the oldest of them. Strangers never hold more of the cap than this.
MAX_UNPROVEN = 16
#: What a connection beyond those places has to make its request before it may be closed for them.
UNPROVEN_GRACE_S = 0.25
#: A request's headers must be complete within this (from the connection's start, or from the
#: previous answer for a connection not yet proven, or from the first byte), else it is closed.
HEADER_TIMEOUT_S = 5.0
#: What the headers of one request may take, all lines together (then 431, and closed).
MAX_HEADER_BYTES = 32 << 10
#: aiohttp's own limits: bytes of a request line or a header line, and header lines.
MAX_LINE_BYTES, MAX_HEADERS = 8190, 64
#: How often late headers are looked for.
SWEEP_S = 0.25
#: Once connections that took this many header bytes are closed, the memory freed is handed
#: back to the system (at most once every TRIM_EVERY_S).
TRIM_AFTER_BYTES, TRIM_EVERY_S = 1 << 20, 1.0
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
#: Where the dashboard's files are (inside the package).
WEB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web")
#: WebSocket close codes: no or wrong token; too many dashboards open.
CLOSE_UNAUTHORIZED, CLOSE_TOO_MANY = 4401, 4429
#: What a viewer gets of each worker (the per-gradient histograms stay out of the frames; its
#: groups of optimizer values too: the frames carry their learning rates' ``lr_range``).
_VIEWER_WORKER_KEYS = (
    "rank",
    "live",
    "clock",
    "gap",
    "held",
    "credit",
    "pushes",
    "dropped",
    "rejected",
    "staleness_mean",
    "pulls",
    "waits",
    "wait_s_total",
    "wait_s_mean",
    "wait_s_max",
    "r_star_hist",
    "max_release_gap",
    "last_interval_s",
    "hyperparameters_own",
    "reported",
)


class HttpSide:
    """The HTTP listener of one server (``--http-port``).

    Args:
        config: the server's options (``host``, ``http_port``).
        snapshot: returns a statistics snapshot (``Engine.stats_snapshot``).
        token: the server's token, if it has one: required as a bearer token.
        totals: returns a few running totals (``Engine.stats_totals``), sampled once a
            second for the dashboard's history; None: no history.
        events_after: returns the membership events after a sequence number
            (``ServerStats.events_after``); None: no events.
        ready: None while the server accepts workers, else why not (``/readyz``).
        scalars: what the workers' training loops report (``Engine.scalars``), drawn as
            curves; None: nothing.
    """

    def __init__(
        self,
        config: ServerConfig,
        snapshot: Callable[[], dict],
        token: bytes | None,
        *,
        totals: Callable[[], dict] | None = None,
        events_after: Callable[[int], list[dict]] | None = None,
        tls: ssl.SSLContext | None = None,
        ready: Callable[[], str | None] = lambda: None,
        scalars: Scalars | None = None,
        throttle: AuthThrottle | None = None,
        auth_counts: dict[str, int] | None = None,
    ) -> None:
        self.config = config
        # Wrong tokens are throttled as the TCP side's failed handshakes are, by the same
        # principals, in the same table and counters (the server's, when it hands them over).
        self._throttle = throttle if throttle is not None else AuthThrottle()
        self._auth_counts = auth_counts if auth_counts is not None else {"failures": 0, "throttled": 0, "refused": 0}
        self._read_snapshot = snapshot
        self._token = token
        self._tls = tls
        self._loopback = is_loopback(config.host)
        self._totals = totals
        self._events_after = events_after or (lambda seq: [])
        self._ready = ready
        self._scalars = scalars if scalars is not None else Scalars()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(StatsCollector(self._snapshot))
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._ticker: asyncio.Task | None = None
        self._viewers: set[_Viewer] = set()  # admitted: from before their hello is sent
        self._history: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self._point_seq = 0
        self._last_totals: tuple[float, dict] | None = None
        # (monotonic time, version) of the samples of the last RATE_WINDOW_S seconds: a point's
        # updates/s is over the same window as the statistics' (the page's header and aps status)
        self._versions: deque[tuple[float, int]] = deque()
        self._row_rates = RowRates()  # the page's rows/s, over the window of its updates/s
        self._frame: dict | None = None  # the newest frame's shared part
        self._cached: tuple[float, dict] | None = None  # (monotonic time, snapshot)
        self._exposition: tuple[float, bytes] | None = None
        self._drawn: tuple[int, int, list[bytes]] | None = None  # the curves written last: (seq, changes, pieces)
        self._drawing: asyncio.Task | None = None  # the curves being written, on a thread
        self._connections: _Connections | None = None  # once listening (start)
        self.port: int | None = None

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    def token_hint(self, url: str, token_file: str | None = None) -> str | None:
        """What ``aps serve`` prints under the dashboard's address when the page will ask
        for the token: how to open it with the token in the link. The token itself is
        never printed (output goes to logs others may read): it was given with --token or
        --token-file, or it is in ``token_file``, the file the server made it in."""
        if self._token is None:
            return None
        where = (
            f"the first line of {token_file}"
            if token_file is not None
            else "the value of --token (or of the --token-file's first line)"
        )
        return (
            f"aps: the dashboard asks for the server's token: enter it on the page, or open "
            f"{url}#token=TOKEN with {where}; the page takes it out of the address bar"
        )

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
        app.router.add_get("/api/scalars", self._scalars_api)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
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
        self._runner = web.AppRunner(
            self.app(),
            access_log=None,
            handle_signals=False,
            logger=quiet,
            keepalive_timeout=KEEPALIVE_S,
            lingering_time=0,
            shutdown_timeout=1.0,
            max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_LINE_BYTES,
            max_headers=MAX_HEADERS,
        )
        await self._runner.setup()
        assert self._runner.server is not None, "aiohttp's runner has its server once set up"
        try:
            self._connections = _Connections(self._runner.server, MAX_CONNECTIONS)
            self._listener = await asyncio.get_running_loop().create_server(
                self._connections,
                self.config.host,
                self.config.http_port,
                reuse_address=True,
                ssl=self._tls,
                ssl_handshake_timeout=self.config.handshake_timeout if self._tls is not None else None,
            )
        except BaseException:
            self._connections = None
            await self._runner.cleanup()
            self._runner = None
            raise
        self._connections.start()
        self.port = self._listener.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._connections is not None:
            self._connections.stop()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _connection(self, request: web.Request) -> _Connection | None:
        """The doorman's record of ``request``'s connection (None under aiohttp's test server)."""
        if self._connections is None or request.transport is None:
            return None
        return self._connections.by_transport.get(request.transport)

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        conn = self._connection(request)
        if conn is None:
            return await self._checked(request, handler, None)
        conn.began()
        try:
            return await self._checked(request, handler, conn)
        finally:
            conn.ended()

    async def _checked(self, request: web.Request, handler, conn: _Connection | None):
        if request.body_exists:  # nothing here takes a body: refused unread, and the connection closed
            response = web.json_response({"error": "requests here have no body"}, status=413)
            response.force_close()
            return response
        if self._token is None and self._loopback and not _local_name(request.host):
            # Listening on loopback without a token: a page of another site that had its name
            # resolve to 127.0.0.1 (DNS rebinding) would otherwise read the run.
            return web.json_response(
                {"error": f"unknown Host {request.host!r}: use an address, or localhost"}, status=403
            )
        # The page and its files hold no data; the WebSocket proves the token itself.
        if self._token is not None and not _is_public(request.path):
            given = request.headers.get("Authorization", "")
            scheme, _, credential = given.partition(" ")
            if scheme.lower() != "bearer" or not await self._proved(credential.strip(), request.transport):
                return web.json_response(
                    {"error": "this server needs its token: Authorization: Bearer TOKEN"},
                    status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="aps"'},
                )
        if conn is not None and self._connections is not None and (self._token is None or not _is_public(request.path)):
            self._connections.proved(conn)  # (a dashboard proves itself with its token message)
        response = await handler(request)
        if not response.prepared:  # (a WebSocket's answer went out already)
            response.headers.update(_SECURITY_HEADERS)
        return response

    def _token_ok(self, given: str) -> bool:
        return self._token is None or hmac.compare_digest(given.encode("utf-8", "replace"), self._token)

    async def _proved(self, given: str, transport) -> bool:
        """Whether ``given`` is the token, checked once the principal of the request
        (:func:`aps.server.peers.principal`) has waited its turn after failures
        (:class:`aps.server.admission.AuthThrottle`): False too when its turn would come
        too late, or the peer is gone."""
        if self._token is None:
            return True
        extra = transport.get_extra_info if transport is not None else (lambda name: None)
        key = principal(extra("peername"), extra("sockname"))
        if key is None:
            return False
        loop = asyncio.get_running_loop()
        wait = self._throttle.wait(key, loop.time())
        if wait is None:
            self._auth_counts["refused"] += 1
            return False
        if wait > 0:
            self._auth_counts["throttled"] += 1
            try:
                await asyncio.sleep(wait)
            finally:
                self._throttle.checked(key)
        else:
            self._throttle.checked(key)
        if self._token_ok(given):
            self._throttle.succeeded(key)
            return True
        self._throttle.failed(key, loop.time())
        self._auth_counts["failures"] += 1
        _failures.warning(loop.time(), "%s: a wrong token over HTTP (from %s)", extra("peername"), key)
        return False

    # plain requests -------------------------------------------------------
    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(os.path.join(WEB_DIR, "index.html"), headers={"Cache-Control": "no-cache"})

    async def _healthz(self, request: web.Request) -> web.Response:
        """Liveness: the server's loop answers (a probe needs no token)."""
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        """Readiness: 200 while the server accepts workers, else 503 saying why."""
        reason = self._ready()
        return web.Response(
            text="ready\n" if reason is None else f"not ready: {reason}\n", status=200 if reason is None else 503
        )

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

    async def _scalars_api(self, request: web.Request) -> web.StreamResponse:
        _, pieces = await self._curves_json()
        head, tail = b'{"curves": {', f'}}, "newest": {_dumps(self._scalars.newest())}}}'.encode()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(head) + sum(map(len, pieces)) + 2 * max(0, len(pieces) - 1) + len(tail)
        await response.prepare(request)
        await response.write(head)
        for at, piece in enumerate(pieces):  # a rank at a time: the loop serves the workers in between
            await response.write(b", " + piece if at else piece)
        await response.write(tail)
        await response.write_eof()
        return response

    async def _curves_json(self) -> tuple[int, list[bytes]]:
        """(seq, the curves' JSON a rank a piece: :meth:`Drawn.pieces`), as of this call or
        later. The curves are copied on the loop and written as JSON on a thread: at the bound
        (a million points) the writing takes about a second, which the loop must not stop for.
        One copy is written at a time, shared by every request that waits for it; it is kept
        while the curves stay the same."""
        asked = self._scalars.changes
        while True:
            if self._drawn is not None and self._drawn[1] >= asked:
                return self._drawn[0], self._drawn[2]
            if self._drawing is None:
                self._drawing = asyncio.create_task(self._draw(self._scalars.drawn()))
            await asyncio.shield(self._drawing)  # (a request that goes away cancels nobody else's wait)

    async def _draw(self, drawn: Drawn) -> None:
        try:
            pieces = await asyncio.to_thread(drawn.pieces)
            if self._drawn is None or drawn.changes > self._drawn[1]:
                self._drawn = (drawn.seq, drawn.changes, pieces)
        finally:
            self._drawing = None

    # the dashboard's WebSocket ----------------------------------------------
    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc != request.host:
            # A page of another site in the viewer's browser may not read the run.
            return web.json_response({"error": "cross-origin WebSocket refused"}, status=403)
        ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=4096)
        conn = self._connection(request)
        await ws.prepare(request)
        if conn is not None:
            conn.upgraded = True  # what comes now are messages (of at most 4 KiB), not headers
        viewer = await self._admit(ws, request.transport, conn)
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

    async def _admit(
        self, ws: web.WebSocketResponse, transport: asyncio.Transport | None, conn: _Connection | None = None
    ) -> _Viewer | None:
        """Read the token message; send the hello and return the new viewer, or refuse (None)."""
        try:
            message = await asyncio.wait_for(ws.receive(), HELLO_TIMEOUT_S)
            data = message.data if message.type == web.WSMsgType.TEXT else ""
            said = json.loads(data) if data.lstrip().startswith("{") else None  # no deep nesting to parse
            token = said.get("token", "") if isinstance(said, dict) else None
        except (TimeoutError, ValueError, RecursionError):
            token = None
        if not isinstance(token, str) or not await self._proved(token, transport):
            what = "this server needs its token" if self._token is not None else 'send {"token": ""} first'
            await _refuse(ws, CLOSE_UNAUTHORIZED, what)
            return None
        if conn is not None and self._connections is not None:
            self._connections.proved(conn)
        if len(self._viewers) >= MAX_VIEWERS:
            await _refuse(ws, CLOSE_TOO_MANY, f"too many dashboards open (at most {MAX_VIEWERS})")
            return None
        viewer = _Viewer(ws, transport)
        self._viewers.add(viewer)  # counted from now: hellos under way included
        try:
            # what the hello holds, the frames go on from: the curves (written on a thread) as of
            # their seq, the rest as of the moment they are written
            viewer.scalar_seq, pieces = await self._curves_json()
            curves = await asyncio.to_thread(lambda: "{" + b", ".join(pieces).decode() + "}")
            history, events = list(self._history), self._events_after(0)
            viewer.point_seq = history[-1]["seq"] if history else self._point_seq
            viewer.event_seq = events[-1]["seq"] if events else 0
            # The current statistics too, so that the page's first paint is complete (not "no
            # workers yet" beside a version of 192 until the first frame, half a second later).
            frame = self._build_frame()
            hello = {
                "type": "hello",
                "run_id": frame["server"].get("run_id"),
                "aps_version": __version__,
                "config": self.config.public(),
                "history": history,
                "events": events,
                "history_every_s": 1,
                "rate_window_s": RATE_WINDOW_S,
                "server": frame["server"],
                "workers": frame["workers"],
                "warnings": frame["warnings"],
            }
            await asyncio.wait_for(ws.send_str(f'{_dumps(hello)[:-1]}, "curves": {curves}}}'), SEND_TIMEOUT_S)
        except (TimeoutError, ConnectionError, RuntimeError):
            self._viewers.discard(viewer)
            viewer.transport_abort()
            return None
        except BaseException:
            self._viewers.discard(viewer)
            viewer.transport_abort()
            raise
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
                scalars = self._scalars.points_after(viewer.scalar_seq)  # [seq, rank, name, step, value]
                if scalars:
                    viewer.scalar_seq = scalars[-1][0]
                if points:
                    viewer.point_seq = points[-1]["seq"]
                if events:
                    viewer.event_seq = events[-1]["seq"]
                text = (
                    frame["text"][:-1] + f', "points": {_dumps(points)}, "events": {_dumps(events)}, '
                    f'"scalars": {_dumps(scalars)}}}'
                )
                await asyncio.wait_for(viewer.ws.send_str(text), SEND_TIMEOUT_S)
        except TimeoutError:
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
        if server.get("tables"):
            server = {**server, "tables": self._row_rates.rated(server)}  # (the shared snapshot stays as it is)
        workers = [
            {**{key: w.get(key) for key in _VIEWER_WORKER_KEYS}, "lr_range": lr_range(w.get("hyperparameters"))}
            for w in stats["workers"]
        ]
        warnings = stats.get("warnings", [])
        text = _dumps({"type": "stats", "server": server, "workers": workers, "warnings": warnings})
        return {"server": server, "workers": workers, "warnings": warnings, "text": text}

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
                await asyncio.wait_for(viewer.ws.close(code=WSCloseCode.GOING_AWAY, message=b"the server stopped"), 1.0)
            except (TimeoutError, ConnectionError, RuntimeError):
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
        versions = self._versions
        versions.append((now, totals["version"]))
        while len(versions) > 2 and versions[1][0] <= now - RATE_WINDOW_S:
            versions.popleft()  # the oldest kept is RATE_WINDOW_S old (or the first sample)
        if previous is None:
            return
        before = previous[1]
        since, version_then = versions[0]
        staleness_n = totals["staleness_n"] - before["staleness_n"]
        pulls = totals["pulls"] - before["pulls"]
        self._point_seq += 1
        self._history.append(
            {
                "seq": self._point_seq,
                "t": time.time(),
                "version": totals["version"],
                # over the last RATE_WINDOW_S seconds, as the statistics' updates_per_s: a chart and a
                # header beside it showing 0.0 and 1.2 at one moment tell a reader nothing
                "updates_per_s": max(0, totals["version"] - version_then) / max(now - since, 1e-6),
                "staleness_mean": (totals["staleness_sum"] - before["staleness_sum"]) / staleness_n
                if staleness_n
                else None,
                "gate_wait_ms": 1e3 * (totals["wait_s"] - before["wait_s"]) / pulls if pulls else None,
                "live": totals["live"],
            }
        )


class _Viewer:
    """One dashboard's WebSocket: woken for each frame; where its points and events are."""

    __slots__ = ("ws", "transport", "wake", "point_seq", "event_seq", "scalar_seq")

    def __init__(self, ws: web.WebSocketResponse, transport: asyncio.Transport | None) -> None:
        self.ws = ws
        self.transport = transport
        self.wake = asyncio.Event()
        self.point_seq = 0
        self.event_seq = 0
        self.scalar_seq = 0

    def transport_abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


#: On every answer: no framing by other sites, no content sniffing, nothing loaded from elsewhere.
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
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
        self._limit.warning(
            time.monotonic(),
            "HTTP side: %s%s",
            record.getMessage(),
            f": {type(error).__name__}: {str(error)[:200]}" if error is not None else "",
        )
        return False


async def _refuse(ws: web.WebSocketResponse, code: int, error: str) -> None:
    try:
        await asyncio.wait_for(ws.send_str(json.dumps({"type": "error", "code": code, "error": error})), 1.0)
        await asyncio.wait_for(ws.close(code=code, message=error.encode()[:120]), 1.0)
    except (TimeoutError, ConnectionError, RuntimeError):
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
    return path in ("/", "/ws", "/favicon.ico", "/healthz", "/readyz") or path.startswith("/static/")


class _Connections:
    """aiohttp's protocol factory, keeping the HTTP side open to the clients it is for.

    Connections are counted here, as they are accepted (aiohttp's own count moves only once
    a connection is under way, after a burst of accepts in one pass of the loop), and sorted
    by what they have shown: a connection is *proven* once a request on it was let through
    (with the token, when the server has one; the token message, for a dashboard). A
    stranger's connection costs little and holds no place for long:

    - unproven connections have MAX_UNPROVEN places: beyond them, the oldest are closed once
      they had UNPROVEN_GRACE_S to make their request (a burst of strangers arriving together
      does not close a scraper that arrived among them before it could say a word);
    - a request's headers must be complete HEADER_TIMEOUT_S after the connection opened (an
      unproven one: also after its previous answer; a kept-alive proven one: after the
      request's first byte), else the connection is closed;
    - a request's headers may take MAX_HEADER_BYTES, then 431 and closed;
    - at the cap (``limit``), a new connection closes the oldest unproven one that is not in
      a request, else the oldest proven one between requests (HTTP lets a server close an
      idle kept-alive connection at any time, and clients open another); only when every
      one is in a request is it refused (503).

    Memory a wave of large requests took is handed back to the system once they are gone
    (``malloc_trim`` on glibc: the allocator keeps freed pages otherwise).
    """

    def __init__(self, server: web.Server, limit: int) -> None:
        self._server = server
        self._limit = limit
        self.open: dict[_Connection, None] = {}  # oldest first (insertion order)
        self.by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        self.unproven = 0
        self.freed_bytes = 0  # header bytes of the connections closed since memory was last handed back
        self._log = RateLimitedLog(logger=log)
        self._sweeper: asyncio.Task | None = None
        self._trim: asyncio.TimerHandle | None = None

    def __call__(self) -> asyncio.BaseProtocol:
        now = time.monotonic()
        if len(self.open) >= self._limit:
            idle = next((c for c in self.open if not c.proven and not c.busy), None) or next(
                (c for c in self.open if not c.busy), None
            )
            if idle is None:
                self._log.warning(
                    now, "HTTP side: %d connections, each in a request: one more refused (503)", len(self.open)
                )
                return _Refusal()
            self._evict(idle, now, f"{self._limit} connections open: the oldest between requests was closed")
        conn = _Connection(self._server(), self, now)
        self.open[conn] = None
        self.unproven += 1
        if self.unproven > MAX_UNPROVEN and self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(UNPROVEN_GRACE_S, self._trim_unproven)
        return conn

    def _trim_unproven(self) -> None:
        """Close the oldest unproven connections beyond MAX_UNPROVEN that had their grace."""
        self._trim = None
        now = time.monotonic()
        excess = self.unproven - MAX_UNPROVEN
        if excess <= 0:
            return
        old = [c for c in self.open if not c.proven and not c.busy and now - c.opened >= UNPROVEN_GRACE_S][:excess]
        for conn in old:
            conn.shut(abort=True)
        if old:
            self._log.warning(
                now,
                "HTTP side: %d connection(s) that made no request closed: strangers have %d places",
                len(old),
                MAX_UNPROVEN,
            )
        if self.unproven > MAX_UNPROVEN:  # the younger ones get their grace, then the same
            self._trim = asyncio.get_running_loop().call_later(UNPROVEN_GRACE_S, self._trim_unproven)

    def _evict(self, conn: _Connection, now: float, why: str) -> None:
        self._log.warning(now, "HTTP side: %s", why)
        conn.shut(abort=not conn.proven)

    def left(self, conn: _Connection) -> None:
        """``conn`` is closed (or being closed): its place is free at once."""
        if self.open.pop(conn, False) is not False:
            self.unproven -= not conn.proven
            self.freed_bytes += conn.peak_bytes
        if conn.transport is not None:
            self.by_transport.pop(conn.transport, None)

    def proved(self, conn: _Connection) -> None:
        if not conn.proven and conn in self.open:
            self.unproven -= 1
        conn.proven = True

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def stop(self) -> None:
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def _sweep(self) -> None:
        """Close the connections whose headers are late; hand freed memory back."""
        last_trim = 0.0
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            late = [c for c in self.open if c.late(now)]
            for conn in late:
                conn.shut(abort=True)
            if late:
                self._log.warning(
                    now,
                    "HTTP side: %d connection(s) closed: no complete request within %g s",
                    len(late),
                    HEADER_TIMEOUT_S,
                )
            if self.freed_bytes >= TRIM_AFTER_BYTES and now - last_trim >= TRIM_EVERY_S:
                self.freed_bytes, last_trim = 0, now
                _give_memory_back()


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with what the doorman knows of it."""

    def __init__(self, inner, doors: _Connections, now: float) -> None:
        self._inner = inner
        self._doors = doors
        self.transport: asyncio.Transport | None = None
        self.opened = now
        self.proven = False
        self.busy = False  # a request of it is being handled (a dashboard's: for its whole life)
        self.upgraded = False  # a WebSocket: its bytes are messages, not headers
        self.waiting_since: float | None = now  # when the headers' deadline started (None: not running)
        self.header_bytes = 0  # received since the last request began to be handled
        self._head_ended: int | None = None  # where in those the headers ended (None: not yet)
        self._tail = b""  # the last bytes of those, for a blank line cut between two reads
        self.peak_bytes = 0
        self._shut = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self._shut:  # evicted between its accept and now
            transport.abort()
            return
        self._doors.by_transport[transport] = self
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._shut:
            return
        if not self.upgraded:
            if self.waiting_since is None and not self.busy:
                self.waiting_since = time.monotonic()
            if self._head_ended is None:
                end = (self._tail + data).find(b"\r\n\r\n")
                if end != -1:  # what follows is a body (refused by the guard) or the next request
                    self._head_ended = self.header_bytes + end - len(self._tail) + 4
                self._tail = (self._tail + data)[-3:]
            self.header_bytes += len(data)
            self.peak_bytes = max(self.peak_bytes, self.header_bytes)
            if (self.header_bytes if self._head_ended is None else self._head_ended) > MAX_HEADER_BYTES:
                self._answer(b"431 Request Header Fields Too Large")
                return
            if self.header_bytes > MAX_HEADER_BYTES + MAX_REQUEST_BYTES:
                self._answer(b"413 Request Entity Too Large")
                return
        self._inner.data_received(data)

    def _answer(self, status: bytes) -> None:
        """Refuse what it sends (aiohttp never sees it), and close."""
        assert self.transport is not None, "bytes arrive only after connection_made"
        self.transport.write(b"HTTP/1.1 " + status + b"\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        self.shut(abort=False)

    def eof_received(self):
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self._doors.left(self)
        self._inner.connection_lost(exc)

    # what the application says of it
    def began(self) -> None:
        """A request's headers are in: it is being handled."""
        self.busy = True
        self.waiting_since = None
        self.header_bytes, self._head_ended, self._tail = 0, None, b""

    def ended(self) -> None:
        """The request was answered: the next one's deadline starts (a stranger's at once)."""
        self.busy = False
        self.waiting_since = None if self.proven else time.monotonic()

    def late(self, now: float) -> bool:
        return not self.busy and self.waiting_since is not None and now - self.waiting_since > HEADER_TIMEOUT_S

    def shut(self, abort: bool) -> None:
        """Close it (``abort``: at once, dropping what it sent and what is unsent to it)."""
        if self._shut:
            return
        self._shut = True
        self._doors.left(self)
        if self.transport is not None and not self.transport.is_closing():
            if abort:
                self.transport.abort()
            else:
                self.transport.close()


def _give_memory_back() -> None:
    """Return the free pages at the top and inside the C heap to the system (glibc only):
    what a burst of large requests allocated and freed would otherwise stay resident."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        _MALLOC_TRIM = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            trim = libc.malloc_trim
            trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
            _MALLOC_TRIM = trim
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


#: glibc's malloc_trim (False: there is none; None: not looked for yet).
_MALLOC_TRIM: Callable[[int], int] | Literal[False] | None = None


class _Refusal(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (a listener's: a stream transport)
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        transport.close()
