"""Wire compression: gradients (and, asked for, weights) cross TCP as bf16 or fp16.

Real servers and workers. A compressed push is applied exactly as the float32
gradient its 16-bit values stand for (the kernels widen it as they read it), so
every expected weight here is computed with the reference kernels on the
gradient rounded the way the worker rounds it.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import aps
from aps import _core, _reference
from aps.cli.status import fetch_stats

from .test_shards import shards

DTYPES = {"bf16": _core.BFLOAT16, "fp16": _core.FLOAT16}
# Just over 2 MiB of float32: a compressed push (just over 1 MiB) is applied while it arrives
# (--stream-min-bytes 1M).
SHAPES = {"conv": (64, 3, 3, 3, 16), "fc": (1 << 19) - 64 * 27 * 16 + 1000, "bias": (999,)}


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def gradient(step: int, scale: float = 1e-2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return {name: (rng.standard_normal(shape) * scale).astype(np.float32) for name, shape in SHAPES.items()}


def flat(arrays: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([arrays[name].ravel() for name in SHAPES])


def rounded(values: np.ndarray, dtype: int) -> np.ndarray:
    """``values`` as the worker sends them: rounded to 16 bits, as float32 again."""
    words = np.empty(len(values), np.uint16)
    _reference.narrow(words, values, dtype)
    return _reference.widened(words, dtype)


@pytest.mark.parametrize("pulls", [False, True], ids=["push", "push+pull"])
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_compressed_pushes_apply_the_rounded_gradient(server_process, name, pulls):
    """SGD with momentum: the server's weights follow the 16-bit gradients exactly (in float32),
    and a compressed pull gives the worker those weights rounded to 16 bits."""
    dtype = DTYPES[name]
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.1", "--momentum", "0.9")
    start = model()
    w, buf = flat(start), np.zeros(len(flat(start)), np.float32)
    with aps.Worker(server.address, 0, 1, transport="tcp", compression=name, compress_pulls=pulls) as worker:
        assert worker.compression == name
        got = worker.init(start)
        assert np.array_equal(flat(got), w)  # INIT's weights are float32 whatever the compression
        for step in range(4):
            g = rounded(flat(gradient(step)), dtype)
            nw, nbuf = np.empty_like(w), np.empty_like(w)
            assert _reference.sgd_step(nw, w, g, nbuf, buf, 0.1, 0.9, first=step == 0)
            w, buf = nw, nbuf
            got = worker.push_pull(gradient(step)) if step % 2 == 0 else (worker.push(gradient(step)), worker.pull())[1]
            assert worker.version == step + 1
            assert np.array_equal(flat(got), rounded(w, dtype) if pulls else w)
    with aps.Worker(server.address, 0, 1, transport="tcp") as observer:  # float32 weights, straight
        assert np.array_equal(flat(observer.init(start)), w)


def test_fp16_overflow_is_refused_by_the_worker_and_nothing_is_sent(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.5")
    start = {"w": np.zeros(8, np.float32)}
    with aps.Worker(server.address, 0, 1, transport="tcp", compression="fp16") as worker:
        worker.init(start)
        with pytest.raises(aps.NonFiniteGradient, match="beyond fp16's range"):
            worker.push({"w": np.array([1, 7e4, 0, 0, 0, 0, 0, 0], np.float32)})
        assert worker.version == 0 and fetch_stats(server.address)["server"]["version"] == 0
        weights = worker.push_pull({"w": np.full(8, 2.0, np.float32)})  # and it goes on
        assert weights["w"].tolist() == [-1.0] * 8


def test_a_sharded_fp16_overflow_is_refused_before_any_shard_sends(server_process):
    """The element beyond fp16's range is in the last shard's piece, which leaves last:
    no shard applies anything, not even the ones whose pieces were fine."""
    servers = shards(server_process, 2, "--workers", "1", "--sync", "asp", "--lr", "0.5")
    addresses = ",".join(server.address for server in servers)
    with aps.Worker(addresses, 0, 1, transport="tcp", compression="fp16") as worker:
        worker.init({"w": np.zeros(64, np.float32)})
        grad = np.ones(64, np.float32)
        grad[-1] = 65520.0  # the smallest value that rounds to fp16's infinity
        with pytest.raises(aps.NonFiniteGradient, match="1 gradient element"):
            worker.push(grad)
        assert [fetch_stats(server.address)["server"]["version"] for server in servers] == [0, 0]
        grad[-1] = 65519.0  # rounds down to 65504: sent
        worker.push(grad)
        assert [fetch_stats(server.address)["server"]["version"] for server in servers] == [1, 1]


def test_the_sharded_fp16_check_counts_what_narrowing_counts():
    from aps.client.shards import check_fp16_range

    values = np.array([65504, 65519.99, 65520, -65520, 1e9, np.inf, -np.inf, np.nan, 0, -7e4], np.float32)
    words = np.empty(len(values), np.uint16)
    overflowed = _core.narrow(words, values, _core.FLOAT16)
    channel = type("Channel", (), {"_core": type("Core", (), {"compressing": True, "compression": _core.FLOAT16})})
    with pytest.raises(aps.NonFiniteGradient, match=f"^{overflowed} gradient element"):
        check_fp16_range([values[:4], values[4:]], [channel, channel])
    check_fp16_range([values[:2]], [channel])  # nothing beyond: no error


def test_shared_memory_sends_float32_whatever_the_compression(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    with aps.Worker(server.address, 0, 1, transport="shm", compression="bf16", compress_pulls=True) as worker:
        assert worker.transport == "shm" and worker.compression is None
        worker.init({"w": np.zeros(4, np.float32)})
        grad = np.full(4, 1.0 + 2**-20, np.float32)  # not a bf16 value
        assert worker.push_pull({"w": grad})["w"].tolist() == (-grad).tolist()


def test_bsp_mean_of_compressed_gradients(server_process):
    """Two compressed workers under BSP: each round applies the mean of the rounded gradients."""
    server = server_process("--workers", "2", "--sync", "bsp", "--lr", "1")
    start = {"w": np.linspace(-1, 1, 1000, dtype=np.float32)}
    workers = [aps.Worker(server.address, rank, 2, transport="tcp", compression="bf16") for rank in range(2)]
    grads = [[np.random.default_rng(10 * r + s).standard_normal(1000).astype(np.float32) for s in range(3)]
             for r in range(2)]
    results: list = [None, None]

    def run(rank: int) -> None:
        workers[rank].init(start)
        for step in range(3):
            results[rank] = np.array(workers[rank].push_pull({"w": grads[rank][step]})["w"])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    w = start["w"]
    for step in range(3):
        total = np.empty_like(w)
        _reference.accumulate(total, None, rounded(grads[0][step], _core.BFLOAT16), 0.5, first=True)
        _reference.accumulate(total, total, rounded(grads[1][step], _core.BFLOAT16), 0.5)
        nw = np.empty_like(w)
        _reference.sgd_step(nw, w, total, None, None, 1.0)
        w = nw
    assert np.array_equal(results[0], w) and np.array_equal(results[1], w)
    for worker in workers:
        worker.close()


def test_async_worker_compresses(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")

    async def main() -> list[float]:
        worker = await aps.AsyncWorker.connect(server.address, 0, 1, compression="bf16", compress_pulls=True)
        async with worker:
            assert worker.compression == "bf16"
            await worker.init({"w": np.zeros(3, np.float32)})
            weights = await worker.push_pull({"w": np.array([1 + 2**-12, -3, 0.1], np.float32)})
            return weights["w"].tolist()

    assert asyncio.run(main()) == [-1.0, 3.0, -0.10009765625]


def test_sharded_worker_compresses_every_shard(server_process):
    servers = shards(server_process, 2, "--workers", "1", "--sync", "asp", "--lr", "0.1")
    start = model()
    addresses = ",".join(server.address for server in servers)
    with aps.Worker(addresses, 0, 1, transport="tcp", compression="bf16") as worker:
        assert worker.compression == "bf16" and all(s.compression == "bf16" for s in worker.shards)
        worker.init(start)
        got = worker.push_pull(gradient(0))
    expected = np.empty_like(flat(start))
    _reference.sgd_step(expected, flat(start), rounded(flat(gradient(0)), _core.BFLOAT16), None, None, 0.1)
    assert np.array_equal(flat(got), expected)


def test_bad_compression_options():
    with pytest.raises(aps.ConfigurationError, match="unknown compression 'int16'"):
        aps.Worker("tcp://127.0.0.1:1", 0, 1, compression="int16")
    with pytest.raises(aps.ConfigurationError, match="compress_pulls needs compression"):
        aps.Worker("tcp://127.0.0.1:1", 0, 1, compress_pulls=True)
    with pytest.raises(aps.ConfigurationError, match="pulls are not quantized"):
        aps.Worker("tcp://127.0.0.1:1", 0, 1, compression="int8", compress_pulls=True)


@pytest.mark.parametrize("driver", ["blocking", "asyncio"])
def test_half_buffers_work_sharded(server_process, driver):
    """A sharded worker's 16-bit buffers are one weight and one gradient buffer for the whole
    model, each shard's channel receiving into and sending from its slice (also after the
    channels made 16-bit buffers of their own for a compressed push and pull): a push of the
    gradient buffer goes as it is, and the weights come back rounded into the weight buffer."""
    servers = shards(server_process, 2, "--workers", "1", "--sync", "asp", "--lr", "1")
    addresses = [server.address for server in servers]
    start = {"a": np.linspace(-1, 1, 27, dtype=np.float32), "b": np.linspace(3, 4, 26, dtype=np.float32)}
    step = np.linspace(0.5, -0.5, 53).astype(np.float32)
    half_step = np.empty(53, np.uint16)
    _reference.narrow(half_step, step, _core.BFLOAT16)
    expected = np.concatenate([start["a"], start["b"]]) - _reference.widened(half_step, _core.BFLOAT16)

    def check(worker, weights, grad) -> None:
        assert weights.dtype == grad.dtype == np.uint16 and weights.shape == grad.shape == (53,)
        assert np.array_equal(weights, rounded_words(np.concatenate([start["a"], start["b"]])))
        for channel in worker.shards:  # each shard's buffers are slices of the worker's
            assert np.shares_memory(channel._core._half_weights, weights)
            assert np.shares_memory(channel._core._half_grad, grad)
        grad[...] = half_step

    async def asyncio_run() -> np.ndarray:
        worker = await aps.AsyncWorker.connect(addresses, 0, 1, compression="bf16", compress_pulls=True)
        async with worker:
            await worker.init(start)
            await worker.push_pull(np.zeros(53, np.float32))  # the channels' own 16-bit buffers exist by now
            weights, grad = worker.half_buffers()
            check(worker, weights, grad)
            await worker.push_pull(grad)
            assert worker.version == 2 and worker.half_buffers()[0] is weights
            return weights.copy()

    if driver == "asyncio":
        got = asyncio.run(asyncio_run())
    else:
        with aps.Worker(addresses, 0, 1, transport="tcp", compression="bf16", compress_pulls=True) as worker:
            worker.init(start)
            worker.push_pull(np.zeros(53, np.float32))  # the channels' own 16-bit buffers exist by now
            weights, grad = worker.half_buffers()
            check(worker, weights, grad)
            worker.push_pull(grad)
            assert worker.version == 2 and worker.half_buffers()[0] is weights
            got = weights.copy()
    assert np.array_equal(got, rounded_words(expected))
    with aps.Worker(addresses, 0, 1, transport="tcp") as observer:  # the server's float32 weights
        weights = observer.init(start)
        assert np.array_equal(np.concatenate([weights["a"], weights["b"]]), expected)


def rounded_words(values: np.ndarray) -> np.ndarray:
    words = np.empty(len(values), np.uint16)
    _reference.narrow(words, values, _core.BFLOAT16)
    return words
