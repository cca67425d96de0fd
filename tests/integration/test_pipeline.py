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


@pytest.mark.parametrize("options", [("--sync", "bsp"), ("--sync", "ssp"), ("--sync", "softsync", "--staleness", "2")])
def test_policies_that_hold_a_worker_after_a_push_refuse_a_pipeline(server_process, options):
    server = server_process("--workers", "1", *options)

    async def main() -> None:
        with pytest.raises(aps.ConfigurationError, match="pipelined pushes need asp"):
            await aps.AsyncWorker.connect(server.address, 0, 1, pipeline=4)

    asyncio.run(main())


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

        tasks = [asyncio.ensure_future(pump(client_r, server_w, None)), asyncio.ensure_future(pump(server_r, client_w, cut))]
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
