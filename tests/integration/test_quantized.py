"""int8 and 4-bit pushes with error feedback, between a real server and real workers over TCP:
what the server applies is exactly the decoded quantization of each gradient plus the residual
the worker kept, the residual goes to a checkpoint and back, a sharded model's is each shard's,
and the server counts a quarter and an eighth of the bytes."""

from __future__ import annotations

import numpy as np
import pytest

import aps
from aps.cli.status import fetch_stats
from aps.wire.protocol import DType
from aps.wire.quantized import quantize

N = 1000  # (four blocks of 256, the last short)
KINDS = {"int8": DType.INT8Q, "int4": DType.INT4Q}


def gradients(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(np.float32) for _ in range(count)]


def by_hand(grads, dtype, residual=None):
    """The weights (from 0, SGD of learning rate 1) and the residual error feedback makes."""
    weights = np.zeros(N, np.float32)
    residual = np.zeros(N, np.float32) if residual is None else residual.copy()
    for g in grads:
        wanted = g + residual
        _, sent = quantize(wanted, dtype)
        residual = wanted - sent
        weights = weights - sent
    return weights, residual


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_each_push_is_its_quantization_plus_the_residual_and_the_residual_goes_to_a_checkpoint(
    server_process, kind
):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    grads = gradients(6)
    with aps.Worker(server.address, 0, 1, transport="tcp", compression=kind) as worker:
        worker.init({"w": np.zeros(N, np.float32)})
        assert worker.compression == kind and worker.compression_residual is None
        for g in grads[:4]:
            weights = worker.push_pull({"w": g})["w"]
        expected, residual = by_hand(grads[:4], KINDS[kind])
        np.testing.assert_array_equal(weights, expected)
        np.testing.assert_array_equal(worker.compression_residual, residual)
        saved = worker.compression_residual
        # what error feedback buys: the weights are the exact sum but for the last residual
        np.testing.assert_allclose(weights - residual, -np.sum(grads[:4], axis=0), rtol=0, atol=1e-5)
    before = fetch_stats(server.address)["server"]["bytes_in"]
    with aps.Worker(server.address, 0, 1, transport="tcp", compression=kind) as again:  # a new process, resumed
        again.init({"w": np.zeros(N, np.float32)})
        again.load_compression_residual(saved)
        for g in grads[4:]:
            weights = again.push_pull({"w": g})["w"]
        pushed = fetch_stats(server.address)["server"]["bytes_in"] - before
    expected, _ = by_hand(grads, KINDS[kind])
    np.testing.assert_array_equal(weights, expected)
    payload = len(quantize(grads[0], KINDS[kind])[0])
    assert payload == (4 * 4 + N if kind == "int8" else 4 * 4 + N // 2)  # a quarter, an eighth of 4 N, and scales
    assert pushed >= 2 * payload and pushed < 4 * N  # (two pushes and an init, less than one float32 push)


def test_a_sharded_workers_residual_is_each_shards_in_the_models_order(server_process):
    shards = [server_process("--workers", "1", "--sync", "asp", "--lr", "1", "--shard", str(i), "--shards", "2")
              for i in range(2)]
    address = ",".join(s.address for s in shards)
    grads = gradients(3, seed=5)
    with aps.Worker(address, 0, 1, transport="tcp", compression="int8") as worker:
        worker.init({"a": np.zeros(600, np.float32), "b": np.zeros(N - 600, np.float32)})
        for g in grads:
            weights = worker.push_pull(g)
        bounds = worker._bounds
        residual = worker.compression_residual
        assert residual is not None and residual.shape == (N,)
        with pytest.raises(ValueError, match="a residual of 999 values"):
            worker.load_compression_residual(residual[:-1])
        with pytest.raises(ValueError, match="not finite"):
            worker.load_compression_residual(np.full(N, np.nan, np.float32))
    flat = np.concatenate([weights["a"], weights["b"]])
    for start, stop in zip(bounds, bounds[1:]):  # each shard quantized its own range, its blocks from its start
        expected_weights = np.zeros(stop - start, np.float32)
        expected_residual = np.zeros(stop - start, np.float32)
        for g in grads:
            wanted = g[start:stop] + expected_residual
            _, sent = quantize(wanted, DType.INT8Q)
            expected_residual = wanted - sent
            expected_weights = expected_weights - sent
        np.testing.assert_array_equal(flat[start:stop], expected_weights)
        np.testing.assert_array_equal(residual[start:stop], expected_residual)


def test_a_gradient_that_is_not_finite_is_refused_and_the_residual_stays(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1")
    with aps.Worker(server.address, 0, 1, transport="tcp", compression="int4") as worker:
        worker.init({"w": np.zeros(N, np.float32)})
        good = gradients(1)[0]
        worker.push({"w": good})
        residual = worker.compression_residual
        bad = good.copy()
        bad[300] = np.inf
        with pytest.raises(aps.NonFiniteGradient, match="scale 1 .* is inf"):
            worker.push_pull({"w": bad})
        np.testing.assert_array_equal(worker.compression_residual, residual)
        assert worker.pull()["w"].tolist() == by_hand([good], DType.INT4Q)[0].tolist()
        assert fetch_stats(server.address)["server"]["version"] == 1
