"""The HTTP side's application, driven by aiohttp's test client: every endpoint, the token,
the dashboard's WebSocket (hello, frames, refusals), its history, and what it does to
clients that misbehave (too many, never reading)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import threading
import time
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import WSCloseCode, WSMsgType
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from aps.server import http as _http
from aps.server import metrics as _metrics
from aps.server.http import HttpSide
from aps.server.engine.scalars import Drawn, Scalars
from aps.wire.scalars import LogReport
from aps.config import ServerConfig


def snapshot(version: int = 7, *, padding: str = "") -> dict:
    """A statistics snapshot shaped as ``ServerStats.snapshot`` makes them (two ranks)."""
    worker = {
        "rank": 0, "live": True, "clock": 4, "gap": 1, "held": False, "credit": 0, "pushes": 4, "dropped": 0,
        "rejected": 1, "staleness_mean": 0.5, "staleness_hist": {"0": 2, "1": 2}, "pulls": 4, "waits": 1,
        "wait_s_total": 0.02, "wait_s_mean": 0.005, "wait_s_max": 0.02, "wait_buckets": [3, 0, 1] + [0] * 7,
        "r_star_hist": {}, "release_gap_hist": {"0": 4}, "max_release_gap": 0, "last_interval_s": 0.01,
    }
    return {
        "server": {
            "address": "tcp://127.0.0.1:7450" + padding, "sync": "ssp s=3", "optimizer": "sgd lr=0.1",
            "workers": 2, "live": 2, "started": True, "uptime_s": 3.0, "version": version, "updates_per_s": 2.0,
            "updates_per_s_mean": 2.0, "pushes": 7, "dropped": 0, "rejected": 1, "duplicates": 0,
            "run_id": "run-1", "resumed_from": None, "checkpoint": None, "bytes_in": 100, "bytes_out": 200,
            "transports": {"tcp": {"bytes_in": 100, "bytes_out": 200}, "shm": {"bytes_in": 0, "bytes_out": 0}},
            "process": {"pid": 1, "rss_bytes": 1 << 20, "cpu_s": 0.5, "threads": 3}, "parameters": 8,
            "membership_events": {"joined": 2, "rejoined": 0, "left": 0, "disconnected": 0, "timed out": 0},
        },
        "workers": [worker, {**worker, "rank": 1, "clock": 3, "gap": 0, "pushes": 3, "rejected": 0}],
        "events": [],
    }


EVENTS = [{"seq": 1, "t": 1.0, "rank": 0, "event": "joined", "clock": 0, "live": 1},
          {"seq": 2, "t": 2.0, "rank": 1, "event": "joined", "clock": 0, "live": 2}]


def side(token: bytes | None = None, snap=snapshot, events=EVENTS) -> HttpSide:
    return HttpSide(ServerConfig(workers=2, sync="ssp", staleness=3, token=token), snap, token,
                    events_after=lambda seq: [e for e in events if e["seq"] > seq])


def drive(http: HttpSide, scenario) -> None:
    async def main():
        async with TestClient(TestServer(http.app())) as client:
            await scenario(client)

    asyncio.run(main())


async def receive_json(ws, timeout: float = 5.0) -> dict:
    message = await ws.receive(timeout)
    assert message.type == WSMsgType.TEXT, message
    return json.loads(message.data)


def test_every_endpoint_answers():
    async def scenario(client):
        page = await client.get("/")
        html = await page.text()
        assert page.status == 200 and "static/dashboard.js" in html and "static/dashboard.css" in html
        for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "text/css")):
            asset = await client.get(f"/static/{name}")
            assert asset.status == 200 and kind in asset.headers["Content-Type"]
        metrics = await client.get("/metrics")
        families = {f.name: f for f in text_string_to_metric_families(await metrics.text())}
        assert families["aps_version"].samples[0].value == 7
        assert {s.labels["event"]: s.value for s in families["aps_membership_events"].samples} == {
            "joined": 2, "rejoined": 0, "left": 0, "finished": 0, "disconnected": 0, "timed_out": 0}
        stats = await client.get("/api/stats")
        assert await stats.json() == snapshot()
        config = await (await client.get("/api/config")).json()
        assert config["sync"] == "ssp" and config["staleness"] == 3 and "token" not in config
        history = await (await client.get("/api/history")).json()
        assert history == {"every_s": 1, "points": []}
        assert (await client.get("/nowhere")).status == 404
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]

    drive(side(), scenario)


def test_probes_answer_without_the_token_and_readiness_says_why_not():
    """/healthz (the loop answers) and /readyz (the server accepts workers) are for an
    orchestrator's probes: no token, no data; a server that is stopping is not ready."""
    why = []

    async def scenario(client):
        for path, text in (("/healthz", "ok\n"), ("/readyz", "ready\n")):
            answer = await client.get(path)
            assert answer.status == 200 and await answer.text() == text
        why.append("the server is stopping")
        answer = await client.get("/readyz")
        assert answer.status == 503 and await answer.text() == "not ready: the server is stopping\n"
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/api/stats")).status == 401  # (the data still asks for the token)

    token = b"Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"
    http = HttpSide(ServerConfig(workers=2, token=token), snapshot, token,
                    ready=lambda: why[0] if why else None)
    drive(http, scenario)


def test_the_token_guards_the_data_not_the_page(monkeypatch):
    monkeypatch.setattr(_http, "HELLO_TIMEOUT_S", 0.5)

    async def scenario(client):
        for path in ("/metrics", "/api/stats", "/api/config", "/api/history"):
            assert (await client.get(path)).status == 401
            assert (await client.get(path, headers={"Authorization": "Bearer wrong"})).status == 401
            assert (await client.get(path, headers={"Authorization": "Bearer Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"})).status == 200
        assert (await client.get("/")).status == 200  # the page holds no data
        assert (await client.get("/static/dashboard.js")).status == 200
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(json.dumps({"token": "wrong"}))
            refusal = await receive_json(ws)
            assert refusal == {"type": "error", "code": 4401, "error": "this server needs its token"}
            assert (await ws.receive(5)).type in (WSMsgType.CLOSE, WSMsgType.CLOSED)
            assert ws.close_code == 4401
        async with client.ws_connect("/ws") as ws:  # a stranger that says nothing
            assert (await receive_json(ws, timeout=_http.HELLO_TIMEOUT_S + 5))["code"] == 4401
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(json.dumps({"token": "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"}))
            hello = await receive_json(ws)
            assert hello["type"] == "hello" and hello["run_id"] == "run-1" and "token" not in hello["config"]

    drive(side(token=b"Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"), scenario)


def test_the_websocket_says_hello_then_sends_frames_with_only_what_is_new():
    versions = iter(range(10, 10_000))
    events = list(EVENTS)
    http = side(snap=lambda: snapshot(next(versions)), events=events)

    async def scenario(client):
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(json.dumps({"token": ""}))
            hello = await receive_json(ws)
            assert hello["type"] == "hello" and hello["config"]["workers"] == 2
            assert [e["seq"] for e in hello["events"]] == [1, 2] and hello["history"] == []
            began = time.monotonic()
            frames = [await receive_json(ws) for _ in range(3)]
            events.append({"seq": 3, "t": 3.0, "rank": 1, "event": "left", "clock": 3, "live": 1})
            frames += [await receive_json(ws) for _ in range(2)]
            elapsed = time.monotonic() - began
        assert all(f["type"] == "stats" for f in frames)
        versions_seen = [f["server"]["version"] for f in frames]
        assert versions_seen == sorted(versions_seen) and versions_seen[0] < versions_seen[-1]
        assert [w["rank"] for w in frames[0]["workers"]] == [0, 1]
        assert "staleness_hist" not in frames[0]["workers"][0]  # the frames stay small
        new_events = [e["seq"] for f in frames for e in f["events"]]
        assert new_events == [3]  # each event once, and none the hello had
        assert elapsed > (5 - 1) / _http.FRAMES_PER_S * 0.9  # no more than FRAMES_PER_S a second

    drive(http, scenario)


def test_history_points_are_rates_between_samples(monkeypatch):
    totals = {"version": 0, "live": 2, "staleness_sum": 0, "staleness_n": 0, "wait_s": 0.0, "pulls": 0}
    http = HttpSide(ServerConfig(workers=2), snapshot, None, totals=lambda: dict(totals))
    monotonic, wall = iter([100.0, 102.0, 103.0]), iter([5000.0, 1000.0])  # the wall clock steps back an hour
    monkeypatch.setattr(_http, "time", SimpleNamespace(monotonic=lambda: next(monotonic), time=lambda: next(wall)))
    http._sample()  # the first sample only sets the origin
    totals.update(version=10, staleness_sum=6, staleness_n=4, wait_s=0.5, pulls=5)
    http._sample()
    http._sample()  # nothing happened in between
    first, second = http._history
    assert first == {"seq": 1, "t": 5000.0, "version": 10, "updates_per_s": 5.0, "staleness_mean": 1.5,
                     "gate_wait_ms": 100.0, "live": 2}
    assert second["seq"] == 2 and second["t"] == 1000.0  # rates come from the monotonic clock alone
    # updates/s is over the statistics' window (RATE_WINDOW_S), the others between samples
    assert second["updates_per_s"] == pytest.approx(10 / 3)
    assert second["staleness_mean"] is None and second["gate_wait_ms"] is None


def test_cross_origin_pages_and_one_dashboard_too_many_are_refused(monkeypatch):
    monkeypatch.setattr(_http, "MAX_VIEWERS", 2)

    async def scenario(client):
        response = await client.get("/ws", headers={"Origin": "http://evil.example", "Connection": "Upgrade",
                                                     "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                                                     "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert response.status == 403
        same = f"http://{client.server.host}:{client.server.port}"
        viewers = [await client.ws_connect("/ws", headers={"Origin": same}) for _ in range(2)]
        for ws in viewers:
            await ws.send_str(json.dumps({"token": ""}))
            assert (await receive_json(ws))["type"] == "hello"
        async with client.ws_connect("/ws") as extra:
            await extra.send_str(json.dumps({"token": ""}))
            assert (await receive_json(extra))["code"] == _http.CLOSE_TOO_MANY
        await viewers[0].close()
        await asyncio.sleep(0.1)
        async with client.ws_connect("/ws") as again:  # room again
            await again.send_str(json.dumps({"token": ""}))
            assert (await receive_json(again))["type"] == "hello"
        await viewers[1].close()

    drive(side(), scenario)


def test_a_viewer_that_never_reads_is_cut_off_and_the_others_go_on(monkeypatch):
    monkeypatch.setattr(_http, "SEND_TIMEOUT_S", 0.5)
    http = side(snap=lambda: snapshot(padding="x" * (1 << 20)))  # 1 MiB frames

    async def scenario(client):
        host, port = client.server.host, client.server.port
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect((host, port))
        stuck.sendall(f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        # one masked text frame: the token message, then never a read
        payload, mask = b'{"token": ""}', b"\x01\x02\x03\x04"
        stuck.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        async with client.ws_connect("/ws", max_msg_size=0) as good:
            await good.send_str(json.dumps({"token": ""}))
            assert (await receive_json(good))["type"] == "hello"
            deadline = time.monotonic() + 20
            while len(http._viewers) > 1 and time.monotonic() < deadline:
                await receive_json(good)  # the reading one keeps getting frames meanwhile
            assert len(http._viewers) == 1, "the viewer that never reads is still served"
            for _ in range(2):
                assert (await receive_json(good))["type"] == "stats"
        stuck.close()

    drive(http, scenario)


def test_at_the_cap_a_stranger_makes_room_and_only_connections_all_in_requests_refuse_one_more(monkeypatch):
    monkeypatch.setattr(_http, "MAX_CONNECTIONS", 3)
    http = HttpSide(ServerConfig(workers=2, http_port=0), snapshot, None)

    async def main():
        await http.start()
        try:
            idle = [socket.create_connection(("127.0.0.1", http.port)) for _ in range(3)]
            await asyncio.sleep(0.2)
            answer = await raw_request("127.0.0.1", http.port,
                                       b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200 ")
            idle[0].settimeout(2)
            assert idle[0].recv(1) == b""  # the oldest stranger made room
            for sock in idle:
                sock.close()
            await asyncio.sleep(0.2)
            async with aiohttp.ClientSession() as session:
                viewers = [await session.ws_connect(f"http://127.0.0.1:{http.port}/ws") for _ in range(3)]
                for ws in viewers:
                    await ws.send_str('{"token": ""}')
                    assert (await receive_json(ws))["type"] == "hello"
                # every connection is a dashboard (in a request, for its whole life): one more is refused
                answer = await raw_request("127.0.0.1", http.port,
                                           b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert answer.startswith(b"HTTP/1.1 503 ")
                await viewers.pop().close()
                await asyncio.sleep(0.2)
                answer = await raw_request("127.0.0.1", http.port,
                                           b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                assert answer.startswith(b"HTTP/1.1 200 ")  # room came back
                for ws in viewers:
                    await ws.close()
        finally:
            await http.close()

    asyncio.run(main())


def test_strangers_hold_a_few_places_and_a_kept_alive_scraper_keeps_its_own(monkeypatch):
    monkeypatch.setattr(_http, "MAX_UNPROVEN", 4)
    http = HttpSide(ServerConfig(workers=2, http_port=0), snapshot, None)

    async def main():
        await http.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", http.port)  # proven by its request
            writer.write(b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200 ")
            strangers = [await asyncio.open_connection("127.0.0.1", http.port) for _ in range(10)]
            await asyncio.sleep(_http.UNPROVEN_GRACE_S + 0.5)
            closed = [r.at_eof() or await _closed_soon(r) for r, _ in strangers]
            assert closed == [True] * 6 + [False] * 4, closed  # the oldest beyond the 4 places
            assert not reader.at_eof()
            for _, w in strangers:
                w.close()
            writer.close()
        finally:
            await http.close()

    asyncio.run(main())


async def _closed_soon(reader, within: float = 0.2) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), within) == b""
    except asyncio.TimeoutError:
        return False


def test_late_headers_are_cut_and_too_many_of_them_refused(monkeypatch):
    monkeypatch.setattr(_http, "HEADER_TIMEOUT_S", 0.5)
    http = HttpSide(ServerConfig(workers=2, http_port=0), snapshot, None)

    async def main():
        await http.start()
        try:
            began = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
            writer.write(b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert time.monotonic() - began < 0.5 + 2 * _http.SWEEP_S + 0.3
            writer.close()
            # a kept-alive proven connection may stay idle (aiohttp's keep-alive timeout closes it),
            # but its next request's headers have the same deadline from their first byte
            reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
            writer.write(b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert not await _closed_soon(reader, 1.0)
            writer.write(b"GET /api/config HTTP/1.1\r\n")
            began = time.monotonic()
            while await asyncio.wait_for(reader.read(1 << 16), 5):
                pass  # the rest of the first answer
            assert time.monotonic() - began < 0.5 + 2 * _http.SWEEP_S + 0.3
            writer.close()
            head, line = b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-A: " + b"a" * 8000 + b"\r\n"
            answer = await raw_request("127.0.0.1", http.port, head + line * 5 + b"\r\n")
            assert answer.startswith(b"HTTP/1.1 431 ")  # 40 KB of headers: over the budget
            answer = await raw_request("127.0.0.1", http.port, head + line * 3 + b"Connection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200 ")  # 24 KB: within it
        finally:
            await http.close()

    asyncio.run(main())


def test_memory_a_wave_of_large_requests_took_is_handed_back(monkeypatch):
    trimmed = []
    monkeypatch.setattr(_http, "_give_memory_back", lambda: trimmed.append(time.monotonic()))
    # the wave comes all at once: more than the places strangers have would see the excess cut (reset)
    monkeypatch.setattr(_http, "MAX_UNPROVEN", 64)
    http = HttpSide(ServerConfig(workers=2, http_port=0), snapshot, None)

    async def main():
        await http.start()
        try:
            head, line = b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-A: " + b"a" * 8000 + b"\r\n"
            request = head + line * 3 + b"Connection: close\r\n\r\n"  # 24 KB of headers: within the budget
            answers = await asyncio.gather(*(raw_request("127.0.0.1", http.port, request) for _ in range(48)))
            assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers)
            deadline = time.monotonic() + 10  # (a loaded machine closes the wave's connections late)
            while not trimmed and time.monotonic() < deadline:
                await asyncio.sleep(_http.SWEEP_S)
            await asyncio.sleep(3 * _http.SWEEP_S)
            assert len(trimmed) == 1  # once for the wave, not once a connection
        finally:
            await http.close()

    asyncio.run(main())


@pytest.mark.parametrize("message", ["not json", "[1, 2]", '{"token": 5}'])
def test_a_malformed_hello_is_refused(message):
    async def scenario(client):
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(message)
            assert (await receive_json(ws))["code"] == 4401
            assert (await ws.receive(5)).type in (WSMsgType.CLOSE, WSMsgType.CLOSED)
            assert ws.close_code not in (None, WSCloseCode.OK)

    drive(side(), scenario)


def test_on_loopback_without_a_token_only_local_names_are_served():
    """A page of another site whose name resolves to 127.0.0.1 (DNS rebinding) reads nothing."""
    async def scenario(client):
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
            response = await client.get("/api/stats", headers={"Host": host})
            assert response.status == 403 and "unknown Host" in (await response.json())["error"]
        for host in ("localhost", "127.0.0.1:1234", "[::1]:80", "app.localhost"):
            assert (await client.get("/api/config", headers={"Host": host})).status == 200

    drive(side(), scenario)
    beyond = HttpSide(ServerConfig(workers=2, host="0.0.0.0", insecure=True), snapshot, None)

    async def anywhere(client):  # listening beyond loopback (--insecure): names are how hosts are reached
        assert (await client.get("/api/config", headers={"Host": "gpu-node-3:8080"})).status == 200

    drive(beyond, anywhere)


async def raw_request(host: str, port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send ``request`` as it is (no client normalises it) and read the answer until closed."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def listening(http: HttpSide, scenario) -> None:
    """Run ``scenario(host, port)`` against ``http`` listening as a server runs it."""
    async def main():
        await http.start()
        try:
            await scenario("127.0.0.1", http.port)
        finally:
            await http.close()

    asyncio.run(main())


def test_paths_out_of_the_static_directory_and_bodies_are_refused():
    async def scenario(host, port):
        for path in ("/static/../_http.py", "/static/%2e%2e/_http.py", "/static/..%2f_http.py", "/static//etc/passwd"):
            answer = await raw_request(host, port, f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close"
                                       "\r\n\r\n".encode())
            status = int(answer.split(b" ", 2)[1])
            assert status in (403, 404) and b"StatsCollector" not in answer, (path, answer[:200])
        began = time.monotonic()  # a body announced as 100 GB is not read: 413, and the connection closed
        answer = await raw_request(host, port, f"GET /api/config HTTP/1.1\r\nHost: {host}\r\n"
                                   "Content-Length: 100000000000\r\n\r\n".encode() + b"x" * 65536)
        assert answer.startswith(b"HTTP/1.1 413 ") and time.monotonic() - began < 4

    listening(HttpSide(ServerConfig(workers=2, http_port=0), snapshot, None), scenario)


def test_non_finite_options_are_valid_json():
    http = HttpSide(ServerConfig(workers=2, heartbeat_timeout=math.inf), snapshot, None)

    async def scenario(client):
        config = json.loads(await (await client.get("/api/config")).text())  # strict: no Infinity
        assert config["heartbeat_timeout"] is None
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(json.dumps({"token": ""}))
            message = await ws.receive(5)
            hello = json.loads(message.data, parse_constant=lambda name: pytest.fail(f"{name} in the hello"))
            assert hello["config"]["heartbeat_timeout"] is None

    drive(http, scenario)


@pytest.mark.parametrize("message", ["[" * 4000, "{" * 2000])
def test_a_deeply_nested_hello_is_refused_like_any_bad_one(message):
    async def scenario(client):
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(message)
            assert (await receive_json(ws))["code"] == 4401

    drive(side(), scenario)


def test_a_dashboard_that_talks_after_its_hello_is_closed():
    http = side()

    async def scenario(client):
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(json.dumps({"token": ""}))
            assert (await receive_json(ws))["type"] == "hello"
            await ws.send_str("x" * 4000)
            while (message := await ws.receive(5)).type == WSMsgType.TEXT:
                assert json.loads(message.data)["type"] in ("stats", "error")
            assert message.type in (WSMsgType.CLOSE, WSMsgType.CLOSED)
        await asyncio.sleep(0.1)
        assert not http._viewers

    drive(http, scenario)


def test_viewers_arriving_together_are_held_to_the_cap(monkeypatch):
    """Hellos under way count: a burst of dashboards, each with a long hello, gets no more
    than the cap between them."""
    monkeypatch.setattr(_http, "MAX_VIEWERS", 2)
    http = side()
    http._history.extend({"seq": i, "t": float(i), "version": i, "updates_per_s": 1.0, "staleness_mean": 0.5,
                          "gate_wait_ms": 1.0, "live": 2} for i in range(1, _http.HISTORY_POINTS + 1))

    async def scenario(client):
        async def one():
            async with client.ws_connect("/ws", compress=15) as ws:
                await ws.send_str(json.dumps({"token": ""}))
                first = await receive_json(ws)
                if first["type"] == "hello":
                    await asyncio.sleep(1.0)  # stay while the others arrive
                return first["type"]

        kinds = await asyncio.gather(*(one() for _ in range(10)))
        assert kinds.count("hello") == 2 and kinds.count("error") == 8

    drive(http, scenario)


def test_a_burst_of_connections_is_held_to_the_cap(monkeypatch):
    monkeypatch.setattr(_http, "MAX_CONNECTIONS", 8)
    http = HttpSide(ServerConfig(workers=2, http_port=0), snapshot, None)

    async def scenario(host, port):
        opened = await asyncio.gather(*(asyncio.open_connection(host, port) for _ in range(100)))
        assert len(http._connections.open) <= 8
        request = f"GET /api/config HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        for _, writer in opened:
            writer.write(request)
        answers = await asyncio.gather(*(asyncio.wait_for(reader.read(), 10) for reader, _ in opened))
        served = sum(a.startswith(b"HTTP/1.1 200 ") for a in answers)
        closed = sum(a == b"" for a in answers)  # made room for a newer one before they said a word
        refused = sum(a.startswith(b"HTTP/1.1 503 ") for a in answers)
        assert 1 <= served <= 8 and served + closed + refused == 100, (served, closed, refused)
        for _, writer in opened:
            writer.close()

    listening(http, scenario)


def test_bad_requests_do_not_flood_the_log(caplog):
    quiet = logging.getLogger("aps.http")
    for old in list(quiet.filters):  # a fresh allowance: earlier tests in this process used theirs
        quiet.removeFilter(old)

    async def scenario(host, port):
        for _ in range(200):
            await raw_request(host, port, b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n")

    with caplog.at_level(logging.DEBUG):
        listening(HttpSide(ServerConfig(workers=2, http_port=0), snapshot, None), scenario)
    lines = [r for r in caplog.records if r.name.startswith(("aps", "aiohttp"))]
    assert 1 <= len(lines) <= 10 and not any(r.exc_info for r in lines), [r.getMessage() for r in lines][:12]


def test_each_shard_says_which_it_is():
    def sharded() -> dict:
        stats = snapshot()
        stats["server"].update(shard=1, shards=3)
        return stats

    async def scenario(client):
        families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        assert families["aps_shard"].samples[0].value == 1 and families["aps_shards"].samples[0].value == 3

    drive(side(snap=sharded), scenario)


def test_each_connected_rank_exports_its_learning_rates_with_the_groups_bounded():
    own = [{"stop": 10 * (i + 1), "lr": 0.1 / (i + 1), "weight_decay": 0.0, "momentum": 0.9, "dampening": 0.0}
           for i in range(_metrics.MAX_EXPORTED_GROUPS + 4)]

    def with_rates() -> dict:
        stats = snapshot()
        first, second = stats["workers"]
        first.update(hyperparameters=own, hyperparameters_own=True)
        second.update(hyperparameters=[{**own[0], "stop": 200, "lr": 0.05}], hyperparameters_own=False)
        stats["workers"].append({**second, "rank": 2, "live": False, "hyperparameters": None,
                                 "hyperparameters_own": None})
        return stats

    async def scenario(client):
        families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        rates = {(s.labels["rank"], s.labels["group"]): s.value for s in families["aps_worker_learning_rate"].samples}
        assert rates == {**{("0", str(i)): own[i]["lr"] for i in range(_metrics.MAX_EXPORTED_GROUPS)}, ("1", "0"): 0.05}

    drive(side(snap=with_rates), scenario)
    frame = json.loads(side(snap=with_rates)._build_frame()["text"])  # the dashboard gets the range, not the groups
    assert [(w["lr_range"], w["hyperparameters_own"]) for w in frame["workers"]] == [
        ([own[-1]["lr"], 0.1], True), ([0.05, 0.05], False), (None, None)]
    assert all("hyperparameters" not in w for w in frame["workers"])


def test_checkpoint_metrics_are_there_from_the_start_and_a_failure_is_an_alarm():
    from aps.server.metrics import StatsCollector

    def exported(checkpoints, **counters) -> dict:
        snap = snapshot()
        snap["server"].update(checkpoints=checkpoints, counters={"updates": 3, "duplicates": 1, "since_unix": 5.0,
                                                                 **counters})
        out = {}
        for family in StatsCollector(lambda: snap).collect():
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    now = time.time()
    fresh = {"directory": "/ck", "written": 0, "failed": 0, "skipped": 0, "failing": False, "failed_in_a_row": 0,
             "last_error": None, "last_written_unix": None, "last_written_version": None, "since_unix": now - 30}
    m = exported(fresh)
    assert m[("aps_checkpoints_failed_total", ())] == 0 and m[("aps_checkpoints_written_total", ())] == 0
    assert m[("aps_checkpoint_failing", ())] == 0 and ("aps_checkpoint_version", ()) not in m
    assert 29 <= m[("aps_checkpoint_age_seconds", ())] <= 60  # since the server began keeping them
    # the process's counters, the run's version as a gauge
    assert m[("aps_updates_total", ())] == 3 and m[("aps_version", ())] == 7
    assert m[("aps_duplicate_pushes_total", ())] == 1 and m[("aps_server_start_time_seconds", ())] == 5.0
    error = {"error": "the checkpoint failed: OSError: [Errno 28] No space left on device" + "!" * 500,
             "unix": now - 2, "version": 41, "reason": "periodic"}
    failing = {**fresh, "written": 3, "failed": 2, "failing": True, "failed_in_a_row": 2, "last_error": error,
               "last_written_unix": now - 10, "last_written_version": 36}
    m = exported(failing)
    assert m[("aps_checkpoint_failing", ())] == 1 and m[("aps_checkpoint_failures_in_a_row", ())] == 2
    assert m[("aps_checkpoint_version", ())] == 36 and 9 <= m[("aps_checkpoint_age_seconds", ())] <= 40
    assert m[("aps_checkpoint_last_failure_timestamp_seconds", ())] == now - 2
    (labels,) = [dict(l) for (name, l) in m if name == "aps_checkpoint_last_failure_info"]
    assert labels["version"] == "41" and labels["reason"] == "periodic" and len(labels["error"]) == 200
    assert "No space left on device" in labels["error"]
    assert not any(name.startswith("aps_checkpoint") for name, _ in exported(None))  # no --checkpoint-dir

    from aps.cli.status import checkpoint_alarm, format_stats

    assert checkpoint_alarm({"checkpoints": fresh}) is None and checkpoint_alarm({"checkpoints": None}) is None
    alarm = checkpoint_alarm({"checkpoints": failing}, now=now)
    assert alarm.startswith("CHECKPOINTS FAILING: 2 failed in a row") and "of version 41, 2s ago" in alarm
    assert "No space left on device" in alarm and "10s old (version 36)" in alarm
    assert "none written in the 30s since" in checkpoint_alarm(
        {"checkpoints": {**failing, "last_written_unix": None}}, now=now)
    snap = snapshot()
    snap["server"]["checkpoints"] = failing
    assert format_stats(snap).splitlines()[1].startswith("!! CHECKPOINTS FAILING")


def test_the_hello_carries_the_current_statistics():
    """The page's first paint is complete: not "no workers yet" beside a version of 192
    until the first frame comes, half a second later."""
    http = side()

    async def scenario(client):
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(json.dumps({"token": ""}))
            hello = await receive_json(ws)
            assert hello["type"] == "hello" and hello["server"]["version"] == 7
            assert [w["rank"] for w in hello["workers"]] == [0, 1] and hello["workers"][0]["last_interval_s"] == 0.01
            assert hello["rate_window_s"] == _http.RATE_WINDOW_S == 10

    drive(http, scenario)


def test_a_history_point_counts_updates_over_the_statistics_window(monkeypatch):
    """The chart's updates/s and the header's (the statistics', aps status') are over the
    same RATE_WINDOW_S: 10 updates in the first second, none since, is 10 updates over the
    window, not 0.0/s beside a header's 1.0."""
    clock = [100.0]
    monkeypatch.setattr(_http, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    version = [0]
    totals = lambda: {"version": version[0], "staleness_n": 0, "staleness_sum": 0.0, "pulls": 0,  # noqa: E731
                      "wait_s": 0.0, "live": 1}
    http = HttpSide(ServerConfig(workers=1), snapshot, None, totals=totals)
    http._sample()  # the first sample: no point yet
    for second, v in [(1, 10), (2, 10), (3, 10)]:
        clock[0], version[0] = 100.0 + second, v
        http._sample()
    rates = [p["updates_per_s"] for p in http._history]
    assert rates == [pytest.approx(10.0), pytest.approx(5.0), pytest.approx(10 / 3)]
    for second in range(4, 30):  # nothing more: the rate falls to 0 once the window holds no update
        clock[0] = 100.0 + second
        http._sample()
    assert http._history[-1]["updates_per_s"] == 0.0
    by_second = {round(p["t"] - 100.0): p["updates_per_s"] for p in http._history}
    assert by_second[10] == pytest.approx(10 / 10) and by_second[11] == 0.0  # the 10 updates at 1 s left at 11 s


def test_the_token_hint_says_how_to_open_the_page_and_never_the_token():
    token = b"Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"
    assert side().token_hint("http://127.0.0.1:9/") is None  # no token: nothing to say
    hint = side(token=token).token_hint("http://127.0.0.1:9/")
    assert "http://127.0.0.1:9/#token=TOKEN" in hint and token.decode() not in hint


def with_tables(uptime: float = 3.0, pulled: int = 40, pushed: int = 30) -> dict:
    stats = snapshot()
    stats["server"].update(uptime_s=uptime, tables={
        "items": {"dim": 8, "optimizer": "sgd", "rows": 25, "bytes": 4096, "rows_pulled": pulled,
                  "rows_pushed": pushed, "rows_evicted": 2},
        "users": {"dim": 4, "optimizer": "adagrad", "rows": 0, "bytes": 0, "rows_pulled": 0, "rows_pushed": 0,
                  "rows_evicted": 0},
    })
    return stats


def test_each_table_exports_its_rows_and_bytes_as_gauges_and_its_rows_moved_as_counters():
    async def scenario(client):
        families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        by_table = {name: {s.labels["table"]: (s.name, s.value) for s in families[name].samples}
                    for name in ("aps_table_rows", "aps_table_bytes", "aps_table_rows_pulled", "aps_table_rows_pushed",
                                 "aps_table_rows_evicted")}
        assert families["aps_table_rows"].type == families["aps_table_bytes"].type == "gauge"
        assert by_table["aps_table_rows"] == {"items": ("aps_table_rows", 25), "users": ("aps_table_rows", 0)}
        assert by_table["aps_table_bytes"]["items"] == ("aps_table_bytes", 4096)
        for name, count in (("pulled", 40), ("pushed", 30), ("evicted", 2)):
            family = families[f"aps_table_rows_{name}"]
            assert family.type == "counter"  # rate() gives rows per second
            assert by_table[family.name] == {"items": (f"aps_table_rows_{name}_total", count),
                                            "users": (f"aps_table_rows_{name}_total", 0)}

    drive(side(snap=with_tables), scenario)

    async def none(client):  # a model without tables: no table families at all (not even their HELP)
        assert "aps_table" not in await (await client.get("/metrics")).text()

    drive(side(), none)


def test_the_dashboard_gets_each_tables_rows_per_second_and_the_api_its_counts():
    moments = iter([with_tables(3.0, 40, 30), with_tables(5.0, 240, 130), with_tables(5.0, 240, 130)])
    http = side(snap=lambda: next(moments))
    http._cached = None
    first = json.loads(http._build_frame()["text"])["server"]["tables"]
    assert first["items"]["rows_pulled_per_s"] is None and first["items"]["rows_pulled"] == 40  # one snapshot yet
    http._cached = None  # (the next snapshot, as half a second later)
    frame = json.loads(http._build_frame()["text"])["server"]["tables"]
    assert list(frame) == ["items", "users"]
    assert frame["items"]["rows_pulled_per_s"] == pytest.approx(100.0)  # 200 rows in 2 s
    assert frame["items"]["rows_pushed_per_s"] == pytest.approx(50.0)
    assert frame["users"]["rows_pulled_per_s"] == 0.0 and frame["items"]["rows"] == 25
    http._cached = None
    api = http._snapshot()["server"]["tables"]  # the JSON API: the counts alone, as aps status --json
    assert api["items"]["rows_pulled"] == 240 and "rows_pulled_per_s" not in api["items"]


class _HeldDrawing:
    """Drawn.pieces, held on its thread until released: what the loop does meanwhile shows."""

    def __init__(self, monkeypatch) -> None:
        self.threads: list[int] = []
        self.started = threading.Event()
        self.release = threading.Event()
        write = Drawn.pieces

        def held(drawn):
            self.threads.append(threading.get_ident())
            self.started.set()
            assert self.release.wait(10)
            return write(drawn)

        monkeypatch.setattr(Drawn, "pieces", held)

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, 10)
        self.started.clear()


def _with_scalars(scalars: Scalars) -> HttpSide:
    return HttpSide(ServerConfig(workers=2, sync="asp"), snapshot, None, scalars=scalars)


def test_the_curves_are_written_off_the_loop_once_for_all_who_wait(monkeypatch):
    """At the bound the curves' JSON takes a second: it is written on a thread while the loop
    goes on, and requests that come meanwhile share it (those asked before a change; one
    asked after gets the change)."""
    scalars = Scalars()
    scalars.record(0, LogReport(points=[(1, "loss", 2.0), (2, "loss", math.nan)]))
    held = _HeldDrawing(monkeypatch)
    http = _with_scalars(scalars)

    async def scenario(client):
        async def curves():
            answer = await client.get("/api/scalars")
            assert answer.status == 200
            return json.loads(await answer.text())

        early = [asyncio.create_task(curves()) for _ in range(5)]
        await held.wait_started()
        scalars.record(1, LogReport(points=[(3, "loss", 0.5)]))  # the loop goes on meanwhile
        later = asyncio.create_task(curves())
        await asyncio.sleep(0.1)
        assert not later.done() and not any(task.done() for task in early)
        held.release.set()
        return await asyncio.gather(*early), await later, threading.get_ident()

    early, later, loop_thread = asyncio.run(_drive_returning(http, scenario))
    assert all(answer["curves"] == {"0": {"loss": [[1, 2.0], [2, None]]}} for answer in early)
    assert later["curves"] == {"0": {"loss": [[1, 2.0], [2, None]]}, "1": {"loss": [[3, 0.5]]}}
    assert later["newest"]["1"]["scalars"]["loss"] == {"step": 3, "value": 0.5}
    assert len(held.threads) == 2, "one writing for the five that waited together, one for the change"
    assert loop_thread not in held.threads, "written on another thread than the loop's"


def test_a_point_logged_while_the_hello_is_written_comes_in_the_next_frame_once(monkeypatch):
    scalars = Scalars()
    scalars.record(0, LogReport(points=[(1, "loss", 2.0)]))
    held = _HeldDrawing(monkeypatch)
    http = _with_scalars(scalars)

    async def scenario(client):
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(json.dumps({"token": ""}))
            await held.wait_started()
            scalars.record(0, LogReport(points=[(2, "loss", 1.0)]))
            held.release.set()
            hello = await receive_json(ws)
            assert hello["type"] == "hello" and hello["curves"] == {"0": {"loss": [[1, 2.0]]}}
            assert hello["workers"] and hello["config"]["workers"] == 2
            seen = []
            for _ in range(4):
                frame = await receive_json(ws)
                seen += [point[1:] for point in frame["scalars"]]
                if frame["scalars"]:
                    scalars.record(0, LogReport(points=[(3 + len(seen), "loss", 0.5)]))
        assert seen[:2] == [[0, "loss", 2, 1.0], [0, "loss", 4, 0.5]], "each point once, in order, none lost"

    drive(http, scenario)
    assert len(held.threads) == 1


async def _drive_returning(http: HttpSide, scenario):
    async with TestClient(TestServer(http.app())) as client:
        return await scenario(client)
