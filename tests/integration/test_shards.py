"""A model cut across several ``aps serve --shard I --shards K`` processes: a worker given
every shard's address trains as with one server, and refuses servers that are not the
shards of one model."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import aps
from aps.cli.status import fetch_stats
from aps.errors import ConfigurationError
from aps.layout import shard_bounds
from aps.testing import ServerProcess
from aps.wire.tokens import new_token

PARAMS = {"conv": np.zeros((3, 5, 7), np.float32), "bias": np.zeros(5, np.float32), "fc": np.zeros((9, 11), np.float32)}


def shards(server_process, count: int, *args: str) -> list[ServerProcess]:
    return [server_process("--shard", str(index), "--shards", str(count), *args) for index in range(count)]


def gradient(rank: int, step: int) -> dict[str, np.ndarray]:
    """Dyadic values: their sums are exact in any order, so any arrival order gives the same update."""
    rng = np.random.default_rng(1000 * rank + step)
    return {name: rng.integers(-8, 9, value.shape).astype(np.float32) / 64 for name, value in PARAMS.items()}


def train(address: str, workers: int, steps: int) -> dict[str, np.ndarray]:
    """``workers`` threads of training under the server(s) at ``address``; rank 0's final weights."""
    clients = [aps.Worker(address, rank, workers, transport="tcp", reconnect=False) for rank in range(workers)]
    start = {name: np.linspace(-1, 1, value.size, dtype=np.float32).reshape(value.shape)
             for name, value in PARAMS.items()}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            clients[rank].init(start)
            for step in range(steps):
                clients[rank].push_pull(gradient(rank, step))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    weights = {name: np.array(value) for name, value in clients[0].weights.items()}
    for client in clients:
        client.close()
    return weights


@pytest.mark.parametrize("count", [1, 2, 3])
def test_a_sharded_bsp_run_equals_the_unsharded_one(server_process, count):
    options = ("--workers", "3", "--sync", "bsp", "--lr", "0.5", "--momentum", "0.5")
    reference = train(server_process(*options).address, 3, 5)
    servers = shards(server_process, count, *options)
    sharded = train(",".join(s.address for s in servers), 3, 5)
    for name in PARAMS:
        assert np.array_equal(sharded[name], reference[name]), name
    assert not np.array_equal(reference["fc"], np.linspace(-1, 1, 99, dtype=np.float32).reshape(9, 11))


def test_the_worker_is_one_flat_buffer_whatever_order_the_shards_are_given_in(server_process):
    servers = shards(server_process, 3, "--workers", "1", "--sync", "asp", "--lr", "1")
    addresses = [servers[2].address, servers[0].address, servers[1].address]
    with aps.Worker(addresses, 0, 1, transport="tcp", reconnect=False) as worker:
        assert type(worker) is aps.Worker and len(worker.shards) == 3
        assert [w.address for w in worker.shards] == [s.address for s in servers]  # in shard order
        weights = worker.init({name: np.ones(v.shape, np.float32) for name, v in PARAMS.items()})
        for view in (*weights.values(), *worker.grads.values()):
            assert view.base is worker.flat_weights or view.base is worker.flat_grad
        worker.grads["fc"][...] = 0.5
        worker.push_pull(worker.grads)  # the gradients written in place
        assert np.all(weights["fc"] == 0.5) and np.all(weights["conv"] == 1.0)
        worker.push_pull(np.full(worker.layout.numel, 0.25, np.float32))  # a flat gradient
        assert np.all(weights["fc"] == 0.25) and np.all(weights["bias"] == 0.75)
        assert worker.version == 2 and worker.clock == 2
        worker.timeout = 7.5
        assert worker.timeout == 7.5 and all(w.timeout == 7.5 for w in worker.shards)
        numel = worker.layout.numel
        bounds = shard_bounds(numel, 3)
        held = [fetch_stats(s.address)["server"]["parameters"] for s in servers]
        assert held == [b - a for a, b in zip(bounds, bounds[1:])] and sum(held) == numel  # each its range
    with pytest.raises(aps.APSConnectionError, match="is closed"):
        worker.push_pull(worker.grads)


def test_servers_that_are_not_the_shards_of_one_model_are_refused(server_process):
    two = shards(server_process, 2, "--workers", "1")
    lone = server_process("--workers", "1")
    with pytest.raises(ConfigurationError, match=r"is shard 0 of 2 \(--shard 0 --shards 2\), but this worker "
                                                 r"was given 3 servers"):
        aps.Worker([two[0].address, two[1].address, lone.address], 0, 1, transport="tcp")
    with pytest.raises(ConfigurationError, match="are both shard 0"):
        aps.Worker([two[0].address, two[0].address], 0, 1, transport="tcp")
    other = server_process("--shard", "1", "--shards", "2", "--workers", "1", "--lr", "0.5")
    with pytest.raises(ConfigurationError, match=r"shard 1 at .* was started with --lr 0.5, shard 0 at .* with "
                                                 r"--lr 0.01"):
        aps.Worker([two[0].address, other.address], 0, 1, transport="tcp")


def test_status_shows_every_shard(server_process):
    import subprocess
    import sys

    servers = shards(server_process, 2, "--workers", "1")
    done = subprocess.run([sys.executable, "-m", "aps", "status", ",".join(s.address for s in servers)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert f"aps {servers[0].address}  shard 0 of 2" in done.stdout
    assert f"aps {servers[1].address}  shard 1 of 2" in done.stdout


async def train_async(address: str, workers: int, steps: int) -> dict[str, np.ndarray]:
    """``train``, with one ``aps.AsyncWorker`` per rank on one event loop."""
    clients = await asyncio.gather(*(aps.AsyncWorker.connect(address, rank, workers, reconnect=False)
                                     for rank in range(workers)))
    start = {name: np.linspace(-1, 1, value.size, dtype=np.float32).reshape(value.shape)
             for name, value in PARAMS.items()}

    async def run(rank: int) -> None:
        await clients[rank].init(start)
        for step in range(steps):
            await clients[rank].push_pull(gradient(rank, step))

    try:
        await asyncio.wait_for(asyncio.gather(*(run(rank) for rank in range(workers))), 60)
        return {name: np.array(value) for name, value in clients[0].weights.items()}
    finally:
        await asyncio.gather(*(client.close() for client in clients))


def test_an_asyncio_sharded_bsp_run_equals_the_unsharded_one(server_process):
    options = ("--workers", "3", "--sync", "bsp", "--lr", "0.5", "--momentum", "0.5")
    reference = train(server_process(*options).address, 3, 4)
    servers = shards(server_process, 3, *options)
    sharded = asyncio.run(train_async(",".join(s.address for s in servers), 3, 4))
    for name in PARAMS:
        assert np.array_equal(sharded[name], reference[name]), name


def test_the_asyncio_sharded_worker_is_one_flat_buffer(server_process):
    servers = shards(server_process, 2, "--workers", "1", "--sync", "asp", "--lr", "1")

    async def main() -> None:
        worker = await aps.AsyncWorker.connect([servers[1].address, servers[0].address], 0, 1, reconnect=False,
                                               compression="bf16")
        async with worker:
            assert type(worker) is aps.AsyncWorker and len(worker.shards) == 2
            assert [w.address for w in worker.shards] == [s.address for s in servers]
            weights = await worker.init({name: np.ones(v.shape, np.float32) for name, v in PARAMS.items()})
            for view in (*weights.values(), *worker.grads.values()):
                assert view.base is worker.flat_weights or view.base is worker.flat_grad
            worker.grads["fc"][...] = 0.5
            await worker.push_pull(worker.grads)
            assert np.all(weights["fc"] == 0.5) and np.all(weights["conv"] == 1.0)
            await worker.push(np.full(worker.layout.numel, 0.25, np.float32))
            assert worker.version == 1 and worker.clock == 2 and await worker.ping() == 2
            await worker.pull()
            assert worker.version == 2 and np.all(weights["fc"] == 0.25) and np.all(weights["bias"] == 0.75)
            assert worker.compression == "bf16"
        with pytest.raises(aps.APSConnectionError, match="is closed"):
            await worker.pull()
        with pytest.raises(ConfigurationError, match="are both shard 0"):
            await aps.AsyncWorker.connect([servers[0].address, servers[0].address], 0, 1)

    asyncio.run(main())


def test_shards_resumed_from_different_runs_are_told_apart(server_process, tmp_path):
    """Each shard keeps every shard's run id in its checkpoints: resumed side by side with
    a shard of another run (or a fresh one), they are refused, naming the odd one."""
    from aps.checkpoint import list_checkpoints, read_checkpoint

    common = ("--workers", "1", "--sync", "asp", "--lr", "1", "--shards", "2")
    dirs = [tmp_path / "s0", tmp_path / "s1"]
    first = [server_process(*common, "--shard", str(i), "--checkpoint-dir", str(dirs[i])) for i in range(2)]
    with aps.Worker([s.address for s in first], 0, 1, transport="tcp", reconnect=False) as worker:
        worker.init({name: np.zeros(v.shape, np.float32) for name, v in PARAMS.items()})
        worker.push_pull(np.ones(worker.layout.numel, np.float32))
        runs = [w.server_info.run_id for w in worker.shards]
    for server in first:
        server.stop()  # a checkpoint at shutdown
    for i in range(2):
        manifest = read_checkpoint(list_checkpoints(str(dirs[i]))[-1]).manifest
        assert manifest["shard_runs"] == runs and manifest["run_id"] == runs[i]

    def resumed(i: int, *extra: str) -> ServerProcess:
        return server_process(*common, "--shard", str(i), "--checkpoint-dir", str(dirs[i]), *extra)

    both = [resumed(0, "--resume"), resumed(1, "--resume")]
    with aps.Worker([s.address for s in both], 0, 1, transport="tcp", reconnect=False) as worker:
        weights = worker.init({name: np.zeros(v.shape, np.float32) for name, v in PARAMS.items()})
        assert all(np.all(w == -1.0) for w in weights.values())  # the resumed weights, from both shards
    for server in both:
        server.stop()
    odd = [resumed(0, "--resume"), server_process(*common, "--shard", "1")]  # shard 1 starts a new run
    with pytest.raises(ConfigurationError, match=rf"shard 1 at {odd[1].address} holds run \w+, but shard 0 at "
                                                 rf"{odd[0].address} was trained beside run {runs[1]} there"):
        aps.Worker([s.address for s in odd], 0, 1, transport="tcp", reconnect=False)


def test_a_worker_given_one_shard_only_is_refused(server_process):
    servers = shards(server_process, 2, "--workers", "1")
    with pytest.raises(ConfigurationError, match=r"is shard 1 of 2 \(--shard 1 --shards 2\): give the worker every "
                                                 r"shard's address"):
        aps.Worker(servers[1].address, 0, 1, transport="tcp")
    with pytest.raises(ConfigurationError, match="is shard 0 of 2"):
        asyncio.run(aps.AsyncWorker.connect(servers[0].address, 0, 1))


def test_the_shards_record_is_checked_and_kept(server_process):
    from aps.client.channel import run
    from aps.errors import LayoutMismatch, MalformedFrame
    from aps.testing import RawClient
    from aps.wire.protocol import Op

    servers = shards(server_process, 2, "--workers", "1")
    with aps.Worker([s.address for s in servers], 0, 1, transport="tcp", reconnect=False) as worker:
        worker.init({name: np.zeros(v.shape, np.float32) for name, v in PARAMS.items()})
        runs = [w.server_info.run_id for w in worker.shards]
        first = worker.shards[0]
        run(first._record_shard_runs(runs))  # the same record again: fine
        with pytest.raises(LayoutMismatch, match=rf"shard 1 now holds run {'f' * 32}: it was started without"):
            run(first._record_shard_runs([runs[0], "f" * 32]))
        with pytest.raises(MalformedFrame, match="SHARDS gives shard 0 run"):
            run(first._record_shard_runs(["e" * 32, runs[1]]))
        with pytest.raises(MalformedFrame, match="a JSON list of the 2 shards' run ids"):
            run(first._record_shard_runs([runs[0]]))
        worker.push_pull(np.ones(worker.layout.numel, np.float32))  # and the shard goes on serving
        assert worker.version == 1
    stranger = RawClient(int(servers[0].address.rsplit(":", 1)[1]))
    stranger.frame(Op.SHARDS, b'["a", "b"]', request_id=1)
    code, message = stranger.error()
    assert "before a successful INIT" in message, (code, message)
    stranger.sock.close()
    lone = server_process("--workers", "1")
    with aps.Worker(lone.address, 0, 1, transport="tcp", reconnect=False) as plain:
        plain.init({"w": np.zeros(4, np.float32)})
        with pytest.raises(MalformedFrame, match="SHARDS is for a model sharded across servers"):
            run(plain.shards[0]._record_shard_runs([plain.server_info.run_id]))


def test_an_asyncio_connect_given_up_on_closes_the_shards_that_answered(server_process):
    """Shard 1 is not up yet and the caller stops waiting (a timeout, a cancel): shard 0's
    connection, already made, is closed with its heartbeat, not left open on the loop."""
    import gc
    import socket

    import psutil

    first = server_process("--workers", "1", "--sync", "asp", "--shard", "0", "--shards", "2")
    port = int(first.address.rsplit(":", 1)[1])

    def to_first() -> int:
        return sum(1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port)

    with socket.socket() as idle:
        idle.bind(("127.0.0.1", 0))  # bound, not listening: shard 1 is still starting
        missing = f"tcp://127.0.0.1:{idle.getsockname()[1]}"

        async def main() -> None:
            connecting = aps.AsyncWorker.connect([first.address, missing], 0, 1)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(connecting, 1.5)
            assert to_first() == 0
            assert [task for task in asyncio.all_tasks() if task is not asyncio.current_task()] == []

        asyncio.run(main())
    gc.collect()  # a socket left open would warn here (warnings are errors)


class _HoldingProxy:
    """A TCP relay to ``target`` on loopback whose client-to-server bytes wait while ``hold`` is set."""

    def __init__(self, target: str) -> None:
        import socket

        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.hold = threading.Event()
        self.released = threading.Event()
        self.released.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._relay, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client, False), daemon=True).start()

    def _relay(self, source, sink, held: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if held:
                    self.released.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(2)
                except OSError:
                    pass

    def pause(self) -> None:
        self.released.clear()

    def go_on(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.go_on()
        self.listener.close()


def test_a_new_bsp_worker_seated_a_round_apart_on_two_shards_skips_one_and_the_run_equals_the_unsharded_one(
    server_process,
):
    """docs/algorithms.md, "Sharded BSP: a worker that joins". Rank 2's process ends after round
    0; rank 0 pushes round 1; a new process for rank 2 starts, and its INIT reaches shard A at
    once (A seats it in round 1, under way) and shard B only after rank 1's gradient of round 1
    has closed that round there (B seats it at clock 2): its bytes to B go through a relay
    held meanwhile. The worker sees its clocks one apart and skips A's round 1 (Flag.SKIP), which
    then closes on ranks 0 and 1 as B's did. The run equals the unsharded one, where the new
    process joins after round 1, bit for bit."""
    import time

    
    token = new_token()  # (never starting with "-", which --token would take for an option)
    options = ("--workers", "3", "--sync", "bsp", "--lr", "1", "--momentum", "0.5", "--token", token)
    start = {name: np.linspace(-1, 1, value.size, dtype=np.float32).reshape(value.shape)
             for name, value in PARAMS.items()}

    def each(ranks, call):
        errors: list[BaseException] = []

        def one(rank):
            try:
                call(rank)
            except BaseException as exc:  # reported by joined()
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(rank,)) for rank in ranks]
        for thread in threads:
            thread.start()
        return threads, errors

    def joined(threads, errors):
        for thread in threads:
            thread.join(60)
        assert not errors and not any(t.is_alive() for t in threads), errors

    def wait_for(condition):
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def run(address: str, new_address: str, proxy: _HoldingProxy | None = None) -> dict[str, np.ndarray]:
        clients = [aps.Worker(address, rank, 3, transport="tcp", reconnect=False, token=token) for rank in range(3)]
        joined(*each(range(3), lambda rank: (clients[rank].init(start), clients[rank].push_pull(gradient(rank, 0)))))
        clients[2].close()  # its process ends
        round_1 = [each((0,), lambda rank: clients[0].push_pull(gradient(0, 1)))]
        first = address.split(",")[0]
        rank_0_in = lambda: fetch_stats(first, token=token)["workers"][0]["clock"] == 2  # noqa: E731
        wait_for(rank_0_in)
        clients[2] = aps.Worker(new_address, 2, 3, transport="tcp", reconnect=False, token=token)
        if proxy is not None:
            proxy.pause()
        new = each((2,), lambda rank: clients[2].init(start))
        # Seated on A in round 1 (nothing else can close it now); one server holds it for
        # round 1's close, and seats it in round 2.
        wait_for(lambda: fetch_stats(first, token=token)["workers"][2]["live"])
        round_1.append(each((1,), lambda rank: clients[1].push_pull(gradient(1, 1))))
        if proxy is not None:
            wait_for(lambda: fetch_stats(address.split(",")[1], token=token)["server"]["version"] == 2)
            proxy.go_on()  # B closed round 1 without it: its INIT there now
        for threads in round_1:
            joined(*threads)
        joined(*new)
        if proxy is not None:
            assert [channel.clock for channel in clients[2].shards] == [2, 2]  # it skipped A's round 1
            assert clients[2].clock == 2
        joined(*each(range(3), lambda rank: clients[rank].push_pull(gradient(rank, 2))))
        weights = {name: np.array(value) for name, value in clients[0].weights.items()}
        for client in clients:
            client.close()
        return weights

    one = server_process(*options).address
    reference = run(one, one)
    servers = shards(server_process, 2, *options)
    proxy = _HoldingProxy(servers[1].address)
    try:
        address = ",".join(s.address for s in servers)
        sharded = run(address, f"{servers[0].address},{proxy.address}", proxy)
    finally:
        proxy.close()
    assert "takes no part in this shard's round at clock 1" in servers[0].log()
    for name in PARAMS:
        assert np.array_equal(sharded[name], reference[name]), name
