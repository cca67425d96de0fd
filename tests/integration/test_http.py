"""The HTTP side (``aps serve --http-port``): Prometheus metrics and the JSON API, against a
real server process, read with aiohttp's client and parsed back with prometheus_client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import aiohttp
import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

import aps
from aps.server import http as _http
from aps.cli.status import fetch_stats

from aps.wire.protocol import Op

from aps.testing import RawClient, ServerProcess


#: The dashboards' addresses of servers that made their own token, and that token: what
#: their user's requests carry (a server's HTTP side needs its token, made or given).
_MADE_TOKENS: dict[str, str] = {}


def http_address(server: ServerProcess) -> str:
    line = server.proc.stdout.readline()
    assert line.startswith("aps: dashboard on http://127.0.0.1:"), line
    base = line.split(" on ", 1)[1].strip()
    if server.token_made:
        _MADE_TOKENS[base] = server.token.decode()
    return base


def made_token(url: str) -> str:
    """The token of the server at ``url`` when it made it itself, else "" (a server given
    one, or none: the test says what it sends)."""
    return next((token for base, token in _MADE_TOKENS.items() if url.startswith(base)), "")


def _bearer(url: str) -> dict[str, str]:
    token = made_token(url)
    return {"Authorization": f"Bearer {token}"} if token else {}


async def get(url: str, **headers) -> tuple[int, str, dict]:
    """GET ``url``; with the token of a server that made its own unless ``Authorization`` is given."""
    if "Authorization" not in headers:
        headers.update(_bearer(url))
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
    workers[1].set_hyperparameters([{"stop": 4, "lr": 0.5}, {"lr": 0.25}])
    status, text, headers = asyncio.run(get(base + "metrics"))
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=")
    metrics = samples(text)
    assert metrics[("aps_updates_total", ())] == metrics[("aps_version", ())] == 5
    assert metrics[("aps_pushes_total", (("rank", "0"),))] == 3
    assert metrics[("aps_pushes_total", (("rank", "1"),))] == 2
    assert metrics[("aps_workers_live", ())] == 2 and metrics[("aps_workers", ())] == 2
    assert metrics[("aps_worker_clock", (("rank", "0"),))] == 3
    assert metrics[("aps_worker_gap", (("rank", "0"),))] == 1
    rates = {labels: value for (name, labels), value in metrics.items() if name == "aps_worker_learning_rate"}
    assert rates == {(("group", "0"), ("rank", "0")): 0.01,  # the server's --lr
                     (("group", "0"), ("rank", "1")): 0.5, (("group", "1"), ("rank", "1")): 0.25}  # its own
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
    api = json.loads(text)
    assert status == 200 and api["server"]["version"] == stats["server"]["version"] == 5
    assert [w["pushes"] for w in api["workers"]] == [w["pushes"] for w in stats["workers"]] == [3, 2]
    status, text, _ = asyncio.run(get(base + "api/config"))
    config = json.loads(text)
    assert status == 200 and config["workers"] == 2 and config["sync"] == "ssp" and "token" not in config
    status, _, _ = asyncio.run(get(base + "nowhere"))
    assert status == 404
    status, _, _ = asyncio.run(get(base + "metrics", **{"X-Junk": "x" * (1 << 16)}))
    assert status in (400, 431)  # a huge header is refused
    workers[0].push_pull({"w": np.ones(8, np.float32)})  # and training goes on
    for worker in workers:
        worker.close()


def test_with_a_token_every_request_needs_it(server_process):
    server = server_process("--workers", "1", "--http-port", "0", "--token", "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw")
    base = http_address(server)
    for path in ("metrics", "api/stats", "api/config"):
        status, _, headers = asyncio.run(get(base + path))
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        status, _, _ = asyncio.run(get(base + path, Authorization="Bearer wrong"))
        assert status == 401
        status, _, _ = asyncio.run(get(base + path, Authorization="Bearer Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"))
        assert status == 200


def test_the_http_port_must_be_free(server_process):
    first = server_process("--workers", "1", "--http-port", "0")
    port = http_address(first).rsplit(":", 1)[1].strip("/")
    with pytest.raises(RuntimeError, match="--http-port"):
        ServerProcess("--workers", "1", "--http-port", port)


def test_membership_events_say_who_joined_left_was_disconnected_or_timed_out(server_process):
    server = server_process("--workers", "3", "--sync", "asp", "--heartbeat-timeout", "1", "--http-port", "0")
    base = http_address(server)
    params = {"w": np.zeros(4, np.float32)}
    steady = aps.Worker(server.address, 0, 3, transport="tcp", heartbeat=0.2)
    leaving = aps.Worker(server.address, 1, 3, transport="tcp", heartbeat=0.2)
    silent = RawClient(server.port)  # joins, then never sends a heartbeat
    joins = [threading.Thread(target=w.init, args=(params,)) for w in (steady, leaving)]
    for thread in joins:
        thread.start()
    silent.init(2, 3, params)
    for thread in joins:
        thread.join(10)
    assert silent.reply()[0].op == Op.INIT_REPLY
    leaving.close()  # says goodbye: left
    steady.shards[0]._conn.sock.shutdown(socket.SHUT_RDWR)  # its connection breaks: disconnected
    deadline = time.monotonic() + 10

    def events() -> list[tuple[int, str]]:
        status, text, _ = asyncio.run(get(base + "api/stats"))
        return [(e["rank"], e["event"]) for e in json.loads(text)["events"]]

    while (2, "timed out") not in events() or (0, "disconnected") not in events():
        assert time.monotonic() < deadline, events()
        time.sleep(0.1)
    steady.reconnect()  # the same process comes back: rejoined
    while (0, "rejoined") not in (seen := events()):  # (the statistics are at most half a second old)
        assert time.monotonic() < deadline + 5, seen
        time.sleep(0.1)
    assert sorted(seen[:3]) == [(0, "joined"), (1, "joined"), (2, "joined")]
    assert set(seen[3:]) == {(1, "left"), (0, "disconnected"), (2, "timed out"), (0, "rejoined")}
    assert seen.index((0, "disconnected")) < seen.index((0, "rejoined"))
    metrics = samples(asyncio.run(get(base + "metrics"))[1])
    counts = {event: metrics[("aps_membership_events_total", (("event", event),))]
              for event in ("joined", "rejoined", "left", "disconnected", "timed_out")}
    assert counts == {"joined": 3, "rejoined": 1, "left": 1, "disconnected": 1, "timed_out": 1}
    steady.close()
    silent.sock.close()


def test_hostile_http_clients_do_not_touch_training(server_process):
    """Connections beyond the cap, dashboards beyond theirs that never read, huge headers,
    a request dribbled byte by byte, unknown paths: training goes on at its pace, and the
    HTTP side serves again once they are gone."""
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "2", "--http-port", "0")
    base = http_address(server)
    port = int(base.rsplit(":", 1)[1].strip("/"))
    size = 1 << 18  # 1 MiB of float32
    workers = [aps.Worker(server.address, rank, 2, transport="tcp", reconnect=False) for rank in range(2)]
    joining = threading.Thread(target=workers[1].init, args=({"w": np.zeros(size, np.float32)},))
    joining.start()
    workers[0].init({"w": np.zeros(size, np.float32)})
    joining.join(10)
    stop = threading.Event()
    slowest = [0.0, 0.0]
    calls = [0, 0]

    def train(rank: int) -> None:
        grad = {"w": np.full(size, 1e-3, np.float32)}
        while not stop.is_set():
            began = time.monotonic()
            workers[rank].push_pull(grad)
            slowest[rank] = max(slowest[rank], time.monotonic() - began)
            calls[rank] += 1
        # Leave, so that the other worker, up to 2 iterations ahead under SSP, is not held at the gate
        # waiting for this one's next push once both were told to stop.
        workers[rank].close()

    trainers = [threading.Thread(target=train, args=(rank,)) for rank in range(2)]
    for thread in trainers:
        thread.start()
    held: list[socket.socket] = []
    try:
        upgrade = (f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
        hello = json.dumps({"token": made_token(base)}).encode()
        masked = bytes([0x81, 0x80 | len(hello)]) + b"\0\0\0\0" + hello  # a zero mask leaves it as it is
        dribble = socket.create_connection(("127.0.0.1", port))
        held.append(dribble)
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":  # a request dribbled, never finished
            dribble.send(bytes([byte]))
            time.sleep(0.01)
        for _ in range(40):  # more dashboards than allowed, none of them ever reads
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(upgrade + masked)
            held.append(sock)
        for _ in range(150):  # more connections than allowed, idle
            held.append(socket.create_connection(("127.0.0.1", port)))
        for garbage in (b"GET /\x01 HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x02\x00" + bytes(512), b"PUT /ws HTTP/9\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port)) as sock:  # malformed: a 400, one log line
                sock.sendall(garbage)
        for path in ("nowhere", "api/../../etc/passwd", "static/%2e%2e/_http.py", "metrics?" + "x" * 10_000):
            try:
                asyncio.run(get(base + path, **{"X-Junk": "x" * (1 << 20)}))
            except aiohttp.ClientError:
                pass  # refused or cut: what matters is the training
        time.sleep(2.0)
        during = list(calls)
        time.sleep(2.0)
        assert all(calls[rank] > during[rank] for rank in range(2)), "training stalled under the attack"
    finally:
        for sock in held:
            sock.close()
        stop.set()
        for thread in trainers:
            thread.join(30)
    assert max(slowest) < 5.0, slowest  # no worker was ever held up for long
    deadline = time.monotonic() + 10
    while True:  # the HTTP side serves again (a scrape is at most a second old)
        try:
            status, text, _ = asyncio.run(get(base + "metrics"))
            if status == 200 and samples(text)[("aps_updates_total", ())] == sum(calls):
                break
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert "Traceback" not in server.log()


async def scrape(base: str, deadline: float) -> tuple[int, float]:
    """One scrape on a connection of its own, as Prometheus's first one is: (status, seconds)."""
    began = time.monotonic()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=deadline)) as session, \
                session.get(base + "metrics", headers={"Connection": "close", **_bearer(base)}) as response:
            await response.read()
            return response.status, time.monotonic() - began
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return -1 if not isinstance(exc, aiohttp.ClientResponseError) else exc.status, time.monotonic() - began


@pytest.mark.slow
def test_a_slowloris_wave_does_not_lock_out_the_scrapers(server_process):
    """200 strangers that open connections and dribble their headers, never finishing them, and
    come back a second after theirs are cut (a new wave each second): a scraper, new connection or kept alive, keeps getting 200
    within a second, and a request whose headers do not come within the deadline is cut."""
    server = server_process("--workers", "1", "--http-port", "0")
    base = http_address(server)
    port = int(base.rsplit(":", 1)[1].strip("/"))
    strangers, seconds = 200, 5.0

    async def slow_one(stop: asyncio.Event, cut: list[int]) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(1.0)
                continue
            try:
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                while not stop.is_set() and not reader.at_eof():
                    writer.write(b"X-a: b\r\n")  # a header now and then, never the blank line
                    await writer.drain()
                    try:
                        if await asyncio.wait_for(reader.read(1 << 16), 0.5) == b"":
                            break
                    except asyncio.TimeoutError:
                        pass
            except OSError:
                pass
            finally:
                cut[0] += not stop.is_set()
                writer.close()
            await asyncio.sleep(1.0)

    async def main() -> tuple[list, list, int]:
        stop, cut = asyncio.Event(), [0]
        attack = [asyncio.create_task(slow_one(stop, cut)) for _ in range(strangers)]
        await asyncio.sleep(1.0)  # the wave is in
        fresh, kept = [], []
        async with aiohttp.ClientSession() as session:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                fresh.append(await scrape(base, 5.0))
                began = time.monotonic()
                try:
                    async with session.get(base + "metrics", timeout=aiohttp.ClientTimeout(total=5),
                                           headers=_bearer(base)) as response:
                        await response.read()
                        kept.append((response.status, time.monotonic() - began))
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    kept.append((-1, time.monotonic() - began))
                await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*attack)
        return fresh, kept, cut[0]

    fresh, kept, cut = asyncio.run(main())
    assert all(status == 200 for status, _ in fresh + kept), (fresh, kept)
    assert max(took for _, took in fresh + kept) < 1.0, (fresh, kept)
    assert cut > 0  # the strangers' connections were cut (the oldest, or past their deadline)

    # One slow stranger alone: cut once its headers are late, not by the idle timeout
    with socket.create_connection(("127.0.0.1", port)) as sock:
        began = time.monotonic()
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.settimeout(15)
        while True:
            try:
                if not sock.recv(1 << 16):
                    break
            except ConnectionResetError:
                break
        assert time.monotonic() - began < _http.HEADER_TIMEOUT_S + 1.5


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_a_header_bloat_wave_costs_little_memory_and_gives_it_back(server_process):
    """128 connections that each send 120 headers of 8 KB: the server's memory grows by a few
    MiB at most while they come and comes back once they are gone; scrapes go on."""
    server = server_process("--workers", "1", "--http-port", "0")
    base = http_address(server)
    port = int(base.rsplit(":", 1)[1].strip("/"))
    for _ in range(20):  # warm up: what a scrape allocates once is in the baseline
        assert asyncio.run(scrape(base, 5.0))[0] == 200
    time.sleep(0.5)
    baseline = rss(server.proc.pid)
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss(server.proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    request = (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               + b"".join(b"X-Bloat-%d: %s\r\n" % (i, b"x" * 8000) for i in range(120)) + b"\r\n")
    socks = []
    try:
        for _ in range(128):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setblocking(False)
            socks.append(sock)
        sent = [0] * len(socks)
        end = time.monotonic() + 10
        while time.monotonic() < end and any(n < len(request) for n in sent):
            for i, sock in enumerate(socks):
                if sent[i] < len(request):
                    try:
                        sent[i] += sock.send(request[sent[i]:sent[i] + (1 << 16)])
                    except BlockingIOError:
                        pass
                    except OSError:  # cut by the server
                        sent[i] = len(request)
        time.sleep(0.5)
        during = peak[0]
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 10
    while rss(server.proc.pid) > baseline + (8 << 20) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = rss(server.proc.pid)
    done.set()
    sampler.join()
    mib = 1 << 20
    assert during - baseline < 48 * mib, f"RSS {baseline / mib:.0f} -> {during / mib:.0f} MiB during the wave"
    assert after - baseline < 8 * mib, f"RSS {baseline / mib:.0f} -> {after / mib:.0f} MiB after it"
    assert asyncio.run(scrape(base, 5.0))[0] == 200
    assert "Traceback" not in server.log()


def test_each_table_is_watched_in_the_metrics_the_api_and_aps_status(server_process):
    """A real server holding an embedding table: /metrics, /api/stats and ``aps status`` show the
    rows it holds and their bytes, and count exactly the rows pulled and pushed (duplicates too)."""
    import subprocess
    import sys

    server = server_process("--workers", "1", "--sync", "asp", "--http-port", "0")
    base = http_address(server)

    def scrape() -> dict:
        time.sleep(_http.METRICS_MAX_AGE_S + 0.05)  # (an exposition is served for a second)
        return samples(asyncio.run(get(base + "metrics"))[1])

    with aps.Worker(server.address, 0, 1) as worker:
        worker.init({"w": np.zeros(4, np.float32)}, tables={"items": aps.Table(rows=10**9, dim=8)})
        metrics = scrape()
        assert metrics[("aps_table_rows", (("table", "items"),))] == 0
        assert metrics[("aps_table_rows_pulled_total", (("table", "items"),))] == 0
        worker.pull_rows("items", [3, 3, 10**8])  # a duplicate: three pulled, none held (a pull makes no row)
        metrics = scrape()
        assert metrics[("aps_table_rows", (("table", "items"),))] == 0
        assert metrics[("aps_table_rows_pulled_total", (("table", "items"),))] == 3
        small = metrics[("aps_table_bytes", (("table", "items"),))]
        assert small > 0
        ids = np.arange(1000, 1500)
        for _ in range(2):
            worker.push_rows("items", ids, np.full((len(ids), 8), 0.1, np.float32))
        worker.pull_rows("items", ids)
        metrics = scrape()
        assert metrics[("aps_table_rows", (("table", "items"),))] == 500
        assert metrics[("aps_table_rows_pulled_total", (("table", "items"),))] == 503
        assert metrics[("aps_table_rows_pushed_total", (("table", "items"),))] == 1000
        assert metrics[("aps_table_rows_evicted_total", (("table", "items"),))] == 0
        assert metrics[("aps_table_bytes", (("table", "items"),))] >= small + 500 * 8 * 4  # grows with the rows
        api = json.loads(asyncio.run(get(base + "api/stats"))[1])["server"]["tables"]
        assert api == fetch_stats(server.address)["server"]["tables"]
        assert (api["items"]["rows"], api["items"]["rows_pulled"], api["items"]["rows_pushed"]) == (500, 503, 1000)
        status = subprocess.run([sys.executable, "-m", "aps", "status", server.address], capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("table "))
        assert "rows held" in lines[header] and "rows pulled" in lines[header] and "rows pushed" in lines[header]
        row = lines[header + 1].split()
        assert row[:4] == ["items", "8", "sgd", "500"] and row[-3:] == ["503", "1000", "0"]


def test_a_model_without_tables_shows_no_tables(server_process):
    import subprocess
    import sys

    server = server_process("--workers", "1", "--sync", "asp", "--http-port", "0")
    base = http_address(server)
    with aps.Worker(server.address, 0, 1) as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull({"w": np.ones(4, np.float32)})
        assert "aps_table" not in asyncio.run(get(base + "metrics"))[1]
        assert fetch_stats(server.address)["server"]["tables"] == {}
        status = subprocess.run([sys.executable, "-m", "aps", "status", server.address], capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0 and not any(line.startswith("table ") for line in status.stdout.splitlines())


def test_a_gradient_beyond_the_cutoff_is_dropped_counted_and_its_worker_goes_on(server_process):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1", "--staleness-cutoff", "1",
                            "--http-port", "0")
    base = http_address(server)
    workers = [aps.Worker(server.address, rank, 2, transport="tcp") for rank in range(2)]
    joining = threading.Thread(target=workers[1].init, args=({"w": np.zeros(2, np.float32)},))
    joining.start()
    workers[0].init({"w": np.zeros(2, np.float32)})
    joining.join(10)
    for _ in range(2):
        workers[0].push_pull({"w": np.array([1, 0], np.float32)})
    old = workers[1].push_pull({"w": np.array([0, 1], np.float32)})  # computed on version 0, met at 2
    np.testing.assert_array_equal(old["w"], [-2, 0])  # not applied; the newest weights back
    fresh = workers[1].push_pull({"w": np.array([0, 1], np.float32)})  # on version 2: applied
    np.testing.assert_array_equal(fresh["w"], [-2, -1])
    metrics = samples(asyncio.run(get(base + "metrics"))[1])
    assert metrics[("aps_gradients_not_applied_total", (("rank", "1"), ("reason", "cutoff")))] == 1
    assert metrics[("aps_gradients_not_applied_total", (("rank", "0"), ("reason", "cutoff")))] == 0
    assert metrics[("aps_gradients_not_applied_total", (("rank", "1"), ("reason", "closed_round")))] == 0
    stats = fetch_stats(server.address)
    assert stats["server"]["dropped_cutoff"] == 1 and stats["workers"][1]["dropped_cutoff"] == 1
    for worker in workers:
        worker.close()
