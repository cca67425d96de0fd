"""Pipelined pushes (``AsyncWorker.connect(pipeline=N)``) against real server processes: the
same weights as pushes one by one, a refused push raised at the next call with the rest
applied, the policies that cannot take them refused, and a connection lost with pushes in
flight: every push applied exactly once."""

import asyncio

import numpy as np
import pytest

import aps

N = 64


def _gradients(count: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(N).astype(np.float32) for _ in range(count)]


async def _train(address: str, depth: int, grads: list[np.ndarray]) -> tuple[np.ndarray, int]:
    async with await aps.AsyncWorker.connect(address, 0, 1, pipeline=depth) as worker:
        await worker.init({"w": np.linspace(-1, 1, N, dtype=np.float32)})
        for grad in grads:
            await worker.push(grad)
        assert depth == 1 or worker.in_flight > 0  # (they were in flight, not answered one by one)
        weights = await worker.pull()  # (waits for every answer first)
        return weights["w"].copy(), worker.version


def test_pipelined_pushes_give_the_weights_of_pushes_one_by_one(server_process):
    """Momentum makes the order matter: the server applies them one by one, in order."""
    options = ("--workers", "1", "--sync", "asp", "--lr", "0.05", "--momentum", "0.9")
    one_by_one, pipelined = server_process(*options), server_process(*options)
    grads = _gradients()
    expected, version = asyncio.run(_train(one_by_one.address, 1, grads))
    got, got_version = asyncio.run(_train(pipelined.address, 16, grads))
    assert version == got_version == len(grads)
    np.testing.assert_array_equal(got, expected)


def test_a_refused_push_is_raised_at_the_next_call_and_the_others_are_applied(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1.0")

    async def main() -> None:
        async with await aps.AsyncWorker.connect(server.address, 0, 1, pipeline=8) as worker:
            await worker.init({"w": np.zeros(N, np.float32)})
            ones, bad = np.ones(N, np.float32), np.ones(N, np.float32)
            bad[3] = np.nan
            for grad in (ones, bad, ones, ones):
                await worker.push(grad)
            with pytest.raises(aps.NonFiniteGradient, match="pipelined push"):
                await worker.flush()
            await worker.flush()  # (raised once)
            weights = await worker.pull()
            assert worker.version == 3
            np.testing.assert_array_equal(weights["w"], np.full(N, -3.0, np.float32))

    asyncio.run(main())


def test_bsp_refuses_a_pipeline(server_process):
    """A BSP round takes one gradient per worker, computed on the round's weights."""
    server = server_process("--workers", "1", "--sync", "bsp")

    async def main() -> None:
        with pytest.raises(aps.ConfigurationError, match="pipelined pushes need asp, ssp, dssp or softsync"):
            await aps.AsyncWorker.connect(server.address, 0, 1, pipeline=4)

    asyncio.run(main())


async def _fast_and_slow(address: str, depth: int) -> tuple[aps.AsyncWorker, aps.AsyncWorker]:
    """Rank 0 pipelining ``depth`` pushes, rank 1 one at a time, both joined to a 2-worker run."""
    fast = await aps.AsyncWorker.connect(address, 0, 2, pipeline=depth)
    slow = await aps.AsyncWorker.connect(address, 1, 2)
    params = {"w": np.zeros(N, np.float32)}
    await asyncio.gather(fast.init(params), slow.init(params))
    return fast, slow


@pytest.mark.parametrize("sync", ["ssp", "dssp"])
def test_under_ssp_a_pipelining_worker_runs_at_most_the_bound_ahead(server_process, sync):
    """Its push that finds it held at the gate waits there (Flag.GATE) instead of being refused:
    it gets ahead of the slow worker by the bound and no further, and every push is applied."""
    bound, pushes = 2, 30
    server = server_process("--workers", "2", "--sync", sync, "--staleness", str(bound), "--lr", "1")

    async def main() -> None:
        fast, slow = await _fast_and_slow(server.address, 16)
        ones = np.ones(N, np.float32)

        async def run_ahead() -> None:
            for _ in range(pushes):
                await fast.push(ones)
            await fast.flush()

        task = asyncio.ensure_future(run_ahead())
        ahead = []
        for done in range(pushes):
            await asyncio.sleep(0.02)
            ahead.append(fast.clock - done)  # (its pushes answered, beyond the slow worker's)
            await slow.push_pull(ones)
        await task
        weights = await fast.pull()
        await asyncio.gather(fast.close(), slow.close())
        upper = bound if sync == "ssp" else 15  # (DSSP: up to its upper bound, default 15)
        assert max(ahead) <= upper + 1, ahead
        assert max(ahead) >= bound, ahead  # (it did run ahead: the bound was met, not missed)
        np.testing.assert_array_equal(weights["w"], np.full(N, -2.0 * pushes, np.float32))

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("depth", [0, -1, 1025, 2.5, True])
def test_a_pipeline_depth_out_of_range_is_refused(depth):
    with pytest.raises(aps.ConfigurationError, match="pipeline must be"):
        asyncio.run(aps.AsyncWorker.connect("tcp://127.0.0.1:9", 0, 1, pipeline=depth))


class _CuttingRelay:
    """A TCP relay to the server that, on its first connection, stops passing the server's
    answers after ``answers`` bytes and a moment later closes both sides: pushes the server
    took are then unanswered, and the worker sends them again on its next connection."""

    def __init__(self, target_port: int, answers: int) -> None:
        self.target_port, self.answers = target_port, answers
        self.connections = 0
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, client_r, client_w) -> None:
        self.connections += 1
        cut = self.answers if self.connections == 1 else None
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(reader, writer, limit):
            passed = 0
            try:
                while data := await reader.read(1 << 16):
                    if limit is not None and passed + len(data) > limit:
                        writer.write(data[: limit - passed])
                        await asyncio.sleep(0.3)  # (the server takes the pushes still coming)
                        break
                    passed += len(data)
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                for w in (client_w, server_w):
                    w.close()

        tasks = [
            asyncio.ensure_future(pump(client_r, server_w, None)),
            asyncio.ensure_future(pump(server_r, client_w, cut)),
        ]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.wait_closed()


def test_a_connection_lost_with_pushes_in_flight_applies_each_exactly_once(server_process):
    """The relay cuts the answers off mid-run; the worker reconnects, sends every unanswered
    push again, and the server answers those it took without applying them again: with lr 1
    and gradients of ones, the weights count the pushes applied."""
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1.0", "--heartbeat-timeout", "2")
    pushes = 300

    async def main() -> None:
        relay = _CuttingRelay(server.port, answers=2000)  # (the handshake, INIT's reply, some answers)
        port = await relay.start()
        try:
            worker = await aps.AsyncWorker.connect(
                f"tcp://127.0.0.1:{port}", 0, 1, pipeline=16, token=server.token.decode(), reconnect_timeout=30
            )
            await worker.init({"w": np.zeros(N, np.float32)})
            ones = np.ones(N, np.float32)
            for _ in range(pushes):
                await worker.push(ones)
            weights = await worker.pull()
            counts = worker._pipelines[0].counts
            await worker.close()
        finally:
            await relay.close()
        assert relay.connections >= 2 and counts["resent"] > 0, (relay.connections, counts)
        assert worker.version == pushes
        np.testing.assert_array_equal(weights["w"], np.full(N, -float(pushes), np.float32))

    asyncio.run(asyncio.wait_for(main(), 60))


def test_pushes_from_several_tasks_and_a_pull_between_them_are_each_applied_once(server_process):
    """Tasks push at once through one worker (sharded: each shard's pipeline takes its piece)
    while another pulls: the pull waits for the answers in flight and is not put off for ever;
    every push is applied once, on every shard."""
    shards = [
        server_process("--shard", str(i), "--shards", "2", "--workers", "1", "--sync", "asp", "--lr", "1")
        for i in range(2)
    ]
    tasks, each = 4, 50

    async def main() -> None:
        worker = await aps.AsyncWorker.connect([s.address for s in shards], 0, 1, pipeline=8)
        async with worker:
            await worker.init({"w": np.zeros(N, np.float32), "b": np.zeros(3, np.float32)})
            grads = {"w": np.ones(N, np.float32), "b": np.ones(3, np.float32)}
            pulled: list[int] = []

            async def pusher() -> None:
                for _ in range(each):
                    await worker.push(grads)

            async def puller() -> None:
                for _ in range(5):
                    await asyncio.sleep(0.01)
                    await worker.pull()
                    pulled.append(worker.version)

            await asyncio.gather(*(pusher() for _ in range(tasks)), puller())
            weights = await worker.pull()
            assert len(pulled) == 5
            for name in ("w", "b"):
                np.testing.assert_array_equal(weights[name], np.full_like(weights[name], -float(tasks * each)))

    asyncio.run(asyncio.wait_for(main(), 60))


def test_closing_with_a_push_held_at_the_gate_gives_it_up_and_the_others_train_on(server_process, monkeypatch):
    """SSP with bound 0 and a slow worker that does not push: the fast one's third pipelined push
    waits at the gate. close() waits for it a while (CLOSE_FLUSH_S), then gives it up and drops
    the connection (a LEAVE would wait behind it); the server serves the slow worker on."""
    from aps.client import aio

    monkeypatch.setattr(aio, "CLOSE_FLUSH_S", 0.5)
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "0", "--lr", "1",
                            "--heartbeat-timeout", "2")

    async def main() -> None:
        fast, slow = await _fast_and_slow(server.address, 8)
        ones = np.ones(N, np.float32)
        for _ in range(3):
            await fast.push(ones)
        await asyncio.sleep(0.3)
        assert fast.in_flight >= 1  # (held: the slow worker has not pushed)
        await asyncio.wait_for(fast.close(), 10)
        await slow.push_pull(ones)  # (the server goes on)
        await slow.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_push_that_would_wait_at_the_gate_is_refused_under_bsp(server_process):
    """Flag.GATE is for the policies that hold a worker after a push; a BSP round takes gradients
    of its own weights only (a raw client's GATE push is refused, and changes nothing)."""
    from aps.errors import ErrorCode
    from aps.testing import RawClient
    from aps.wire.protocol import DType, Flag, Op

    server = server_process("--workers", "1", "--sync", "bsp", "--lr", "1")
    raw = RawClient.to(server, "tcp")
    try:
        raw.init(0, 1, {"w": np.zeros(N, np.float32)})
        assert raw.reply()[0].op == Op.INIT_REPLY
        raw.frame(Op.PUSH, np.ones(N, np.float32).tobytes(), flags=int(Flag.GATE), dtype=int(DType.FLOAT32))
        code, message = raw.error()
        assert code == ErrorCode.MALFORMED_FRAME and "not bsp" in message, message
        raw.frame(Op.PULL, dtype=int(DType.FLOAT32))
        header, _ = raw.reply()
        assert header.op == Op.PULL_REPLY and header.version == 0
    finally:
        raw.close()

