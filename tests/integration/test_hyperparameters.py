"""Per-group optimizer values set by a worker (HYPER, ``Worker.set_hyperparameters``), against
embedded servers: the same numbers as torch.optim with the same param groups, one worker's
values for its own pushes only, clear refusals that change nothing, and shards."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading

import numpy as np
import pytest

import aps
from aps.server.engine.jobs import updates as _updates
from aps.errors import ErrorCode, InvalidHyperparameters, NotInitialized
from aps.wire.protocol import MAX_HYPER_GROUPS, HyperGroup, Op, encode_hyper
from aps.testing import RawClient

N = 40
CUT = 17  # where the second group begins


@contextlib.contextmanager
def serving(**options):
    """An embedded server (one ASP worker, SGD with lr 1, unless ``options`` say otherwise)."""
    options = {"workers": 1, "sync": "asp", "lr": 1.0, "port": 0, "log_level": "error", **options}
    with aps.Server(**options).run_in_background() as background:
        yield background


def model(w0: np.ndarray, cut: int = CUT) -> dict[str, np.ndarray]:
    """Two tensors, one per group."""
    return {"a": w0[:cut].copy(), "b": w0[cut:].copy()}


def problem(numel: int = N, steps: int = 4, seed: int = 3):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(numel).astype(np.float32),
            [rng.standard_normal(numel).astype(np.float32) for _ in range(steps)])


def torch_run(cls_name: str, w0, grads, options_by_step, cut: int = CUT, **common) -> np.ndarray:
    """torch.optim over two parameters (``w0[:cut]``, ``w0[cut:]``), one param group each, the
    groups' options set before each step as a scheduler sets them."""
    torch = pytest.importorskip("torch")
    first = torch.nn.Parameter(torch.from_numpy(w0[:cut].copy()))
    second = torch.nn.Parameter(torch.from_numpy(w0[cut:].copy()))
    opt = getattr(torch.optim, cls_name)(
        [{"params": [first], **options_by_step[0][0]}, {"params": [second], **options_by_step[0][1]}], **common)
    for g, options in zip(grads, options_by_step):
        for group, values in zip(opt.param_groups, options):
            group.update(values)
        opt.zero_grad()
        first.grad, second.grad = torch.from_numpy(g[:cut].copy()), torch.from_numpy(g[cut:].copy())
        opt.step()
    return np.concatenate([first.detach().numpy(), second.detach().numpy()])


def sgd_groups(first: dict, second: dict, cut: int = CUT) -> list[dict]:
    return [{"stop": cut, **first}, dict(second)]


def init_all(workers: list, params: dict) -> None:
    """Init every worker at once (an INIT returns once all have joined)."""
    threads = [threading.Thread(target=w.init, args=(params,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)


FIRST = {"lr": 0.05, "weight_decay": 1e-2, "momentum": 0.9}
SECOND = {"lr": 0.2, "weight_decay": 0.0, "momentum": 0.5}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_sgd_groups_equal_torch_param_groups(transport, streamed, monkeypatch):
    """SGD with momentum and weight decay, two groups: bit for bit torch.optim.SGD. Streamed: a
    TCP gradient over --stream-min-bytes is applied piece by piece as it arrives."""
    numel, cut = (200_000, 99_991) if streamed else (N, CUT)
    w0, grads = problem(numel)
    pieces = []  # (start, stop) of each piece applied while it arrived (the server is in this process)
    feed = _updates.StreamingPush.feed
    monkeypatch.setattr(_updates.StreamingPush, "feed",
                        lambda stream, stop: (pieces.append((stream.filled, stop)), feed(stream, stop))[1])
    options = {"momentum": 0.9, "stream_min_bytes": 1024} if streamed else {"momentum": 0.9}
    with serving(**options) as server, aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init(model(w0, cut))
        worker.set_hyperparameters(sgd_groups(FIRST, SECOND, cut))
        for g in grads:
            worker.push_pull(g)
        ours = worker.flat_weights.copy()
    if streamed and transport == "tcp":
        assert len(pieces) > len(grads), pieces  # pushes were applied in several pieces each
    theirs = torch_run("SGD", w0, grads, [(FIRST, SECOND)] * len(grads), cut, lr=1.0)
    np.testing.assert_array_equal(ours, theirs)


def test_changing_the_learning_rate_between_pushes_is_a_schedule(transport):
    w0, grads = problem(steps=6)
    schedule = [({**FIRST, "lr": 0.1 * 0.5 ** step}, {**SECOND, "lr": 0.02 * (step + 1)}) for step in range(6)]
    with serving(momentum=0.9) as server, aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init(model(w0))
        for g, (first, second) in zip(grads, schedule):
            worker.set_hyperparameters(sgd_groups(first, second))
            worker.push_pull(g)
        ours = worker.flat_weights.copy()
    np.testing.assert_array_equal(ours, torch_run("SGD", w0, grads, schedule, lr=1.0))


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_groups_equal_torch_param_groups(transport, name):
    w0, grads = problem()
    first = {"lr": 1e-3, "weight_decay": 1e-2, "betas": (0.9, 0.999)}
    second = {"lr": 5e-3, "weight_decay": 0.0, "betas": (0.5, 0.9)}
    groups = [{"stop": CUT, "lr": 1e-3, "weight_decay": 1e-2, "momentum": 0.9, "dampening": 0.999},
              {"lr": 5e-3, "weight_decay": 0.0, "momentum": 0.5, "dampening": 0.9}]
    with serving(optimizer=name.lower(), lr=1e-3) as server, \
            aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init(model(w0))
        worker.set_hyperparameters(groups)
        with pytest.raises(InvalidHyperparameters, match=r"group 1: beta1 is 1.0; it must be in \[0, 1\)"):
            worker.set_hyperparameters([groups[0], {**groups[1], "momentum": 1.0}])
        for g in grads:
            worker.push_pull(g)
        ours = worker.flat_weights.copy()
    theirs = torch_run(name, w0, grads, [(first, second)] * len(grads), lr=1.0)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_missing_values_are_the_servers(transport):
    """Only ``lr`` given: momentum and weight decay are the server's (--momentum, --weight-decay)."""
    w0, grads = problem()
    with serving(lr=0.1, momentum=0.9, weight_decay=1e-3) as server, \
            aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init(model(w0))
        worker.set_hyperparameters([{"stop": CUT, "lr": 0.3}, {}])
        for g in grads:
            worker.push_pull(g)
        ours = worker.flat_weights.copy()
    defaults = {"momentum": 0.9, "weight_decay": 1e-3}
    theirs = torch_run("SGD", w0, grads, [({"lr": 0.3}, {"lr": 0.1})] * len(grads), lr=1.0, **defaults)
    np.testing.assert_array_equal(ours, theirs)


def test_asp_applies_each_gradient_with_its_own_workers_values(transport):
    ones = np.ones(N, np.float32)
    with serving(workers=2) as server:
        workers = [aps.Worker(server.address, rank, 2, transport=transport) for rank in range(2)]
        init_all(workers, {"w": np.zeros(N, np.float32)})
        workers[1].push(ones / 8)  # no HYPER yet: the server's lr 1
        assert server.server.weights()[1].tolist() == [-0.125] * N
        workers[0].set_hyperparameters([{"lr": 0.5, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0}])
        workers[1].set_hyperparameters([{"lr": 0.25}])
        workers[0].push(ones)
        assert server.server.weights()[1].tolist() == [-0.625] * N  # 0.5 * 1
        workers[1].push(ones * 2)
        assert server.server.weights()[1].tolist() == [-1.125] * N  # 0.25 * 2
        for worker in workers:
            worker.close()


@pytest.mark.parametrize("sync", [{"sync": "bsp"}, {"sync": "softsync", "softsync_n": 1}], ids=["bsp", "softsync"])
def test_an_aggregate_is_applied_with_the_values_of_the_push_that_closed_it(transport, sync):
    """A BSP round, a softsync group of c = 2 gradients: one update, the closing push's lr."""
    with serving(workers=2, **sync) as server:
        workers = [aps.Worker(server.address, rank, 2, transport=transport) for rank in range(2)]
        init_all(workers, {"w": np.zeros(N, np.float32)})
        workers[0].set_hyperparameters([{"lr": 0.5}])
        workers[1].set_hyperparameters([{"lr": 0.25}])
        workers[0].push(np.ones(N, np.float32))  # added to the round
        workers[1].push(np.full(N, 3.0, np.float32))  # closes it: the mean 2, times rank 1's lr
        for worker in workers:
            assert worker.pull()["w"].tolist() == [-0.5] * N
        for worker in workers:
            worker.close()


def test_the_values_are_sent_again_after_a_reconnect(transport):
    with serving() as server, aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init({"w": np.zeros(N, np.float32)})
        worker.set_hyperparameters([{"lr": 0.5}])
        worker.reconnect()
        assert worker.push_pull(np.ones(N, np.float32))["w"].tolist() == [-0.5] * N
        worker.shards[0]._conn.shutdown()  # the connection breaks: the next call reconnects by itself
        assert worker.push_pull(np.ones(N, np.float32))["w"].tolist() == [-1.0] * N


def test_the_async_worker_sets_them_too():
    async def run(address: str) -> list[float]:
        worker = await aps.AsyncWorker.connect(address, 0, 1)
        try:
            await worker.init({"w": np.zeros(N, np.float32)})
            await worker.set_hyperparameters([{"lr": 0.25}])
            await worker.reconnect()
            return (await worker.push_pull(np.ones(N, np.float32)))["w"].tolist()
        finally:
            await worker.close()

    with serving() as server:
        assert asyncio.run(run(server.address)) == [-0.25] * N


def good(lr: float = 0.5) -> list[dict]:
    return [{"stop": CUT, "lr": lr, "weight_decay": 0.0, "momentum": 0.9, "dampening": 0.0},
            {"lr": lr / 2, "weight_decay": 1e-2, "momentum": 0.9, "dampening": 0.0}]


@pytest.mark.parametrize("groups, message", [
    ([{"stop": CUT, "lr": math.nan}, {}], "group 0: lr is nan; it must be finite"),
    ([{"stop": CUT}, {"weight_decay": -0.5}], "group 1: weight_decay is -0.5; it must be >= 0"),
    ([{"stop": CUT}, {"stop": CUT}], "group 1: stop 17 is not after the previous group's stop (17)"),
    ([{"stop": CUT}, {"stop": 12}], "group 1: stop 12 is not after"),
    ([{"stop": CUT}, {"stop": N - 1}], f"the last group stops at {N - 1}, but the model has {N} parameters"),
    ([{"stop": CUT}, {"stop": N + 5}], f"group 1: stop {N + 5} is beyond the model's {N} parameters"),
    ([{"stop": k + 1} for k in range(MAX_HYPER_GROUPS)] + [{}], f"at most {MAX_HYPER_GROUPS} groups"),
    ([{"stop": CUT, "lr": 1e39}, {}], "group 0: lr is 1e+39; it must be finite in float32"),
], ids=["nan-lr", "negative-weight-decay", "equal-stops", "decreasing-stops", "short", "long", "too-many",
        "beyond-float32"])
def test_bad_values_are_refused_and_change_nothing(transport, groups, message):
    numel = 5000 if len(groups) > MAX_HYPER_GROUPS else N
    w0, grads = problem(numel, steps=2)
    with serving(momentum=0.9) as server, aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init(model(w0))
        worker.set_hyperparameters(good())
        worker.push_pull(grads[0])
        with pytest.raises(InvalidHyperparameters) as info:
            worker.set_hyperparameters(groups)
        assert message in str(info.value) and info.value.code == ErrorCode.INVALID_HYPERPARAMETERS
        assert isinstance(info.value, ValueError)
        worker.push_pull(grads[1])  # the connection serves on, with the values set before
        ours = worker.flat_weights.copy()
    first, second = ({k: v for k, v in g.items() if k != "stop"} for g in good())
    np.testing.assert_array_equal(ours, torch_run("SGD", w0, grads, [(first, second)] * 2, lr=1.0))


def test_hyper_before_init_is_refused(transport):
    with serving() as server:
        with aps.Worker(server.address, 0, 1, transport=transport) as worker:
            with pytest.raises(NotInitialized, match="init"):
                worker.set_hyperparameters([{"lr": 0.1}])  # refused here: no model to cut
        raw = RawClient(int(server.address.rsplit(":", 1)[1]))
        try:
            raw.frame(Op.HYPER, encode_hyper([HyperGroup(N, 0.1, 0.0, 0.0, 0.0)]))
            code, message = raw.error()
            assert code == ErrorCode.NOT_INITIALIZED and "HYPER before a successful INIT" in message
            raw.frame(Op.PING)
            assert raw.reply()[0].op == Op.PING_REPLY  # the connection serves on
        finally:
            raw.close()


def test_a_sharded_worker_sends_each_shard_its_own_ranges(transport):
    """Two shards ([0, 16) and [16, 40)), three groups: one boundary inside each shard, and
    the middle group spans both. Bit for bit torch.optim.SGD with the same groups."""
    torch = pytest.importorskip("torch")
    w0, grads = problem()
    stops = [7, 25, N]
    values = [{"lr": 0.05, "weight_decay": 1e-2, "momentum": 0.9},
              {"lr": 0.2, "weight_decay": 0.0, "momentum": 0.5},
              {"lr": 0.1, "weight_decay": 1e-3, "momentum": 0.0}]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serving(momentum=0.9, shard=index, shards=2)) for index in range(2)]
        with aps.Worker([s.address for s in servers], 0, 1, transport=transport) as worker:
            worker.init({"w": w0.copy()})
            worker.set_hyperparameters([{"stop": stop, **v} for stop, v in zip(stops, values)])
            for g in grads:
                worker.push_pull(g)
            ours = worker.flat_weights.copy()
    params = [torch.nn.Parameter(torch.from_numpy(w0[lo:hi].copy())) for lo, hi in zip([0, *stops], stops)]
    opt = torch.optim.SGD([{"params": [p], **v} for p, v in zip(params, values)], lr=1.0)
    for g in grads:
        opt.zero_grad()
        for p, lo, hi in zip(params, [0, *stops], stops):
            p.grad = torch.from_numpy(g[lo:hi].copy())
        opt.step()
    np.testing.assert_array_equal(ours, np.concatenate([p.detach().numpy() for p in params]))


def test_a_sharded_request_refused_by_one_shard_changes_no_shard(transport):
    """Two shards ([0, 16) and [16, 40)); a bad value in a group only the second holds. Every
    shard checks its part before any takes it, so the first keeps its values too, and the
    message numbers the group as the caller did (the second shard calls it its group 1)."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serving(shard=index, shards=2)) for index in range(2)]
        with aps.Worker([s.address for s in servers], 0, 1, transport=transport) as worker:
            worker.init({"w": np.zeros(N, np.float32)})
            worker.set_hyperparameters([{"stop": 8, "lr": 0.5}, {"lr": 0.25}])
            with pytest.raises(InvalidHyperparameters, match=r"^group 2: lr is -1.0"):
                worker.set_hyperparameters([{"stop": 8, "lr": 2.0}, {"stop": 20, "lr": 2.0}, {"lr": -1.0}])
            after = worker.push_pull(np.ones(N, np.float32))["w"]
    assert after[:8].tolist() == [-0.5] * 8 and after[8:].tolist() == [-0.25] * (N - 8)
