"""The worker clients against an embedded server: the tests that take ``client`` run one
body over both drivers (aps.Worker, and aps.AsyncWorker driven from a loop thread) and
every transport each speaks."""

import asyncio
import logging
import socket
import threading
import time

import numpy as np
import pytest

import aps
from aps.testing import ServerProcess


@pytest.fixture
def server():
    with aps.Server(workers=1, sync="asp", lr=1.0, port=0, log_level="warning").run_in_background() as background:
        yield background


def test_weights_are_views_updated_in_place(server, client):
    with client(server.address) as worker:
        params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)}
        weights = worker.init(params)
        assert weights["a"].shape == (2, 3) and weights["a"].base is worker.flat_weights
        a = weights["a"]
        worker.grads["a"][:] = 1.0
        worker.grads["b"][:] = 0.5
        same = worker.push_pull(worker.grads)
        assert same is weights
        np.testing.assert_array_equal(a, np.arange(6).reshape(2, 3) - 1.0)  # updated in place
        np.testing.assert_array_equal(worker.weights["b"], [0.5, 0.5])
        assert (worker.version, worker.clock) == (1, 1)


def test_push_forms(server, client):
    with client(server.address) as worker:
        worker.init({"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)})
        worker.push({"b": np.ones(3, np.float32), "a": np.ones(2, np.float32)})  # any mapping order
        worker.push(np.full(5, 2.0, np.float32))  # flat, in layout order
        strided = np.ones(6, np.float32)[::2]
        worker.push({"a": np.ones(2, np.float32), "b": strided})  # non-contiguous is copied
        weights = worker.pull()
        np.testing.assert_array_equal(weights["a"], [-4.0, -4.0])
        np.testing.assert_array_equal(weights["b"], [-4.0, -4.0, -4.0])
        assert worker.ping() == 3


def test_requests_before_init_are_refused_locally(server, client):
    worker = client(server.address)
    with pytest.raises(aps.errors.NotInitialized):
        worker.pull()
    with pytest.raises(aps.ConfigurationError):
        worker.init({})
    worker.close()


def test_configuration_errors():
    with pytest.raises(aps.ConfigurationError):
        aps.Worker("http://x:1", 0, 1)
    with pytest.raises(aps.ConfigurationError, match="transport"):
        aps.Worker("tcp://127.0.0.1:1", 0, 1, transport="carrier-pigeon")
    with pytest.raises(aps.ConfigurationError):
        aps.Worker("tcp://127.0.0.1:1", 2, 2)


def test_unreachable_server_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
        with pytest.raises(aps.APSConnectionError):
            aps.Worker(f"tcp://127.0.0.1:{port}", 0, 1, connect_timeout=0.2)


def test_async_worker_shares_the_protocol(server):
    async def main():
        async with await aps.AsyncWorker.connect(server.address, 0, 1) as worker:
            weights = await worker.init({"w": np.zeros(1000, np.float32)})
            for _ in range(3):
                weights = await worker.push_pull({"w": np.ones(1000, np.float32)})
            assert (weights["w"] == -3).all() and worker.version == 3
            await worker.push(worker.flat_grad)
            await worker.pull()
            assert await worker.ping() == 4
            with pytest.raises(aps.NonFiniteGradient):
                await worker.push({"w": np.full(1000, np.inf, np.float32)})
            assert worker.clock == 4

    asyncio.run(main())


def test_large_model_round_trip(server, client):
    n = 3 << 20  # 12 MiB: received in place, updated on the helper thread
    with client(server.address) as worker:
        worker.init({"w": np.zeros(n, np.float32)})
        worker.flat_grad[:] = np.linspace(-1, 1, n, dtype=np.float32)
        worker.push_pull(worker.grads)
        np.testing.assert_array_equal(worker.flat_weights, -worker.flat_grad)


def test_stock_asyncio_loop_serves_too():
    """Without uvloop the server runs on the stock loop (no vectored writes)."""
    server = aps.Server(workers=2, sync="asp", lr=1.0, port=0, log_level="warning")
    with server.run_in_background(loop_factory=asyncio.new_event_loop) as background:
        n = 1 << 20
        workers = [aps.Worker(background.address, r, 2) for r in range(2)]
        import threading

        threads = [threading.Thread(target=w.init, args=({"w": np.zeros(n, np.float32)},)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert "uvloop" not in type(server._loop).__module__
        for step in range(1, 4):
            for w in workers:
                w.push_pull({"w": np.ones(n, np.float32)})
        workers[0].pull()
        assert (workers[0].flat_weights == -6).all() and workers[0].version == 6
        for w in workers:
            w.close()


def test_the_server_never_imports_torch():
    import subprocess
    import sys

    code = "import sys, aps, aps.server.server, aps.cli; aps.Server(port=0); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_worker_process_starts_without_the_server():
    """`import aps` (what every worker process pays) leaves the server, its HTTP stack and the
    coordinator unloaded until `aps.Server` is named; naming it loads it."""
    import subprocess
    import sys

    code = (
        "import sys, aps\n"
        "w = aps.Worker; a = aps.AsyncWorker\n"
        "heavy = [m for m in ('aps.server.server', 'aps.server.http', 'aiohttp') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert 'Server' in dir(aps) and 'Worker' in dir(aps)\n"
        "assert aps.Server.__module__ == 'aps.server.server' and 'aps.server.server' in sys.modules\n"
        "from aps import Server\n"
        "assert Server is aps.Server\n"
        "try:\n"
        "    aps.NoSuchThing\n"
        "except AttributeError as exc:\n"
        "    assert 'NoSuchThing' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('an unknown name must raise AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_views_cannot_be_replaced(server, client):
    with client(server.address) as worker:
        worker.init({"w": np.zeros(3, np.float32)})
        with pytest.raises(TypeError):
            worker.grads["w"] = np.ones(3, np.float32)  # would be silently ignored by push(worker.grads)
        with pytest.raises(TypeError):
            worker.weights["w"] = np.ones(3, np.float32)
        worker.grads["w"][:] = 1.0  # writing into the view is the way
        worker.push(worker.grads)
        assert worker.pull()["w"].tolist() == [-1.0] * 3


def test_version_is_the_version_of_the_weights_held(server, client):
    with client(server.address) as worker:
        worker.init({"w": np.zeros(3, np.float32)})
        worker.push(worker.grads)
        worker.push(worker.grads)  # both computed on version 0
        assert (worker.version, worker.clock) == (0, 2)
        worker.pull()
        assert (worker.version, worker.clock) == (2, 2)


def test_a_pull_of_rows_keeps_the_version_of_the_weights_held_when_asked(server, client):
    """``pull_rows(keep_version=True)`` reads the rows at the model's newest version and
    leaves the worker's version (what its next push says) as the dense weights it holds."""
    with client(server.address) as worker:
        worker.init({"w": np.zeros(3, np.float32)}, tables={"items": aps.Table(rows=100, dim=2)})
        worker.push(worker.grads)  # the model is at version 1; the worker holds version 0
        rows = worker.pull_rows("items", [3, 4, 3], keep_version=True)
        assert rows.shape == (3, 2) and np.array_equal(rows[0], rows[2]) and worker.version == 0
        assert set(worker.pull_rows({"items": [5]}, keep_version=True)) == {"items"} and worker.version == 0
        worker.pull_rows("items", [3])
        assert worker.version == 1  # (by default, as a pull)


def test_a_cancelled_request_never_corrupts_the_model(server):
    """Cancelled mid-send, the worker drops its connection rather than finish the
    frame with the next request's bytes."""
    n = 4 << 20

    async def main():
        worker = await aps.AsyncWorker.connect(server.address, 0, 1, reconnect=False)
        await worker.init({"w": np.zeros(n, np.float32)})
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(worker.push({"w": np.ones(n, np.float32)}), 0.0005)
        with pytest.raises(aps.APSConnectionError):
            await worker.push({"w": np.full(n, 2.0, np.float32)})
        weights = await worker.reconnect()
        values = np.unique(weights["w"])
        assert len(values) == 1 and values[0] in (0.0, -1.0)  # all of a gradient or none of it
        await worker.push_pull({"w": np.ones(n, np.float32)})
        assert len(np.unique(worker.weights["w"])) == 1
        await worker.close()

    asyncio.run(main())


def test_float64_params_and_gradients_train_a_float32_model(server_process, client):
    """numpy's default dtype end to end: init with float64 arrays makes the float32 model,
    and float64 gradients (a mapping, a mixed mapping, a flat array) are converted by the
    worker and applied, not refused."""
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    with client(server.address) as worker:
        assert worker.transport == client.transport
        weights = worker.init({"a": np.zeros(3), "b": np.ones(2)})
        assert weights["a"].dtype == np.float32
        worker.push({"a": np.full(3, 0.5), "b": np.ones(2)})  # float64
        worker.push({"a": np.ones(3, np.float32), "b": np.ones(2, np.float16)})  # mixed
        weights = worker.push_pull(np.full(5, 0.25))  # flat float64
        np.testing.assert_array_equal(weights["a"], [-1.75] * 3)
        np.testing.assert_array_equal(weights["b"], [-1.25] * 2)
        assert worker.version == 3


def test_a_non_float_gradient_is_refused_with_the_conversion_to_make(server_process, client):
    """Integers are a bug in the caller, not a precision: refused before anything is sent,
    saying how to convert."""
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    with client(server.address) as worker:
        worker.init({"a": np.zeros(3)})
        with pytest.raises(aps.DTypeMismatch, match=r"'a' is int64.*astype\(np\.float32\)"):
            worker.push({"a": np.ones(3, np.int64)})
        with pytest.raises(aps.DTypeMismatch, match=r"flat gradient is complex128.*astype\(np\.float32\)"):
            worker.push(np.ones(3, np.complex128))
        assert worker.ping() == 0  # nothing was applied


def test_a_worker_at_the_http_port_is_told_it_is_the_dashboard_port(server_process):
    """A worker given the server's --http-port address (the dashboard's) instead of its
    worker port hears an HTTP reply: the error says so, not only a bad magic number."""
    server = server_process("--workers", "1", "--http-port", "0")
    http = server.proc.stdout.readline().split(" on ", 1)[1].strip()
    port = int(http.rstrip("/").rsplit(":", 1)[1])
    hint = r"this is an HTTP server \(the dashboard/metrics port, --http-port\?\): point the worker at"
    with pytest.raises(aps.errors.BadMagic, match=hint):
        aps.Worker(f"tcp://127.0.0.1:{port}", 0, 1, reconnect=False)

    async def connect():
        await aps.AsyncWorker.connect(f"tcp://127.0.0.1:{port}", 0, 1, reconnect=False)

    with pytest.raises(aps.errors.BadMagic, match=hint):
        asyncio.run(connect())
    assert server.alive()
    with aps.Worker(server.address, 0, 1) as worker:  # the worker port still serves
        worker.init({"w": np.zeros(2)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_later(args: tuple[str, ...], delay: float, started: list) -> threading.Thread:
    """``aps serve ARGS`` started ``delay`` seconds from now, in ``started``."""
    def start():
        time.sleep(delay)
        started.append(ServerProcess(*args))

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


def _waits(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aps.worker" and "no server at" in r.getMessage()]


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_a_worker_started_before_its_server_waits_for_it(kind, transport, caplog):
    """torchrun starts the workers and the server together: a worker that finds nothing
    listening yet waits for the server (up to connect_timeout, 30 s by default), saying
    once what it waits for, and joins it once it is up."""
    if kind == "async" and transport == "shm":
        pytest.skip("AsyncWorker speaks TCP")
    caplog.set_level(logging.INFO, logger="aps.worker")
    port, started = _free_port(), []
    address = f"tcp://127.0.0.1:{port}"
    later = _start_later(("--port", str(port), "--workers", "1", "--sync", "asp", "--lr", "1"), 1.5, started)
    begun = time.monotonic()
    try:
        if kind == "blocking":
            with aps.Worker(address, 0, 1, transport=transport) as worker:
                weights = worker.init({"w": np.zeros(2)})
                assert worker.transport == transport
                worker.push({"w": np.ones(2)})
                np.testing.assert_array_equal(worker.pull()["w"], [-1.0, -1.0])
        else:
            async def main():
                worker = await aps.AsyncWorker.connect(address, 0, 1)
                weights = await worker.init({"w": np.zeros(2)})
                await worker.close()
                return weights

            weights = asyncio.run(main())
        assert weights["w"].dtype == np.float32
        assert time.monotonic() - begun >= 1.0  # it did wait: the server was not there at first
        waits = _waits(caplog)
        assert len(waits) == 1, waits
        assert address in waits[0] and "Connection refused" in waits[0] and "up to 30 s" in waits[0]
    finally:
        later.join(30)
        for server in started:
            server.stop()


def test_a_sharded_worker_waits_for_every_shard_server(caplog):
    """Both servers of a model cut in two start after their worker: it waits for each."""
    ports, started = [_free_port(), _free_port()], []
    common = ("--workers", "1", "--sync", "asp", "--lr", "1", "--shards", "2")
    later = [_start_later(("--port", str(port), "--shard", str(i), *common), 1.0 + i, started)
             for i, port in enumerate(ports)]
    try:
        with aps.Worker(",".join(f"tcp://127.0.0.1:{p}" for p in ports), 0, 1) as worker:
            worker.init({"a": np.zeros(1000), "b": np.zeros(1000)})
            weights = worker.push_pull({"a": np.ones(1000), "b": np.ones(1000)})  # float64, converted
            assert float(weights["a"][0]) == -1.0 and float(weights["b"][-1]) == -1.0
            weights = worker.push_pull(np.ones(2000))  # a flat float64 gradient too
            assert float(weights["a"][0]) == -2.0 and float(weights["b"][-1]) == -2.0
            with pytest.raises(aps.DTypeMismatch, match=r"astype\(np\.float32\)"):
                worker.push(np.ones(2000, np.int8))
    finally:
        for thread in later:
            thread.join(30)
        for server in started:
            server.stop()


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_no_server_within_connect_timeout_says_how_long_it_waited(kind, caplog):
    """Nothing ever listens: the error comes after connect_timeout, not at once, and says
    what was refused and how long the worker waited."""
    caplog.set_level(logging.INFO, logger="aps.worker")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: refused
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        begun = time.monotonic()
        message = r"cannot connect to .*: Connection refused \(waited 1\.\d s for the server, connect_timeout=1\.5\)"
        with pytest.raises(aps.APSConnectionError, match=message):
            if kind == "blocking":
                aps.Worker(address, 0, 1, connect_timeout=1.5)
            else:
                asyncio.run(aps.AsyncWorker.connect(address, 0, 1, connect_timeout=1.5))
        assert 1.0 <= time.monotonic() - begun < 10
    waits = _waits(caplog)
    assert len(waits) == 1 and "up to 1.5 s" in waits[0], waits


def test_closing_an_asyncio_worker_ends_a_call_held_in_another_task(server_process):
    """close() from one task while another waits at the gate (here: init, for a second worker
    that never comes) ends that wait at once, as the blocking worker's close() does."""
    server = server_process("--workers", "2", "--sync", "bsp")

    async def main() -> float:
        worker = await aps.AsyncWorker.connect(server.address, 0, 2)
        held = asyncio.ensure_future(worker.init({"w": np.zeros(4, np.float32)}))
        await asyncio.sleep(0.5)
        assert not held.done()
        began = time.monotonic()
        await worker.close()
        with pytest.raises(aps.APSError):
            await held
        return time.monotonic() - began

    assert asyncio.run(main()) < 1.0
