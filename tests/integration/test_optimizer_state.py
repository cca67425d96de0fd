"""The server's optimizer state read (STATE, ``Worker.optimizer_state``) and loaded
(LOAD_STATE, ``Worker.load_optimizer_state``) against real ``aps serve`` processes: torch's
state for the same gradients, a loaded run that goes on as if never stopped, refusals that
change nothing, the no-op of loading the same state again, checkpoints, shards, asyncio."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

import aps
from aps.checkpoint import read_checkpoint
from aps.cli.checkpoint import request_checkpoint
from aps.errors import ErrorCode, InvalidState, NotInitialized
from aps.wire.protocol import HEADER_SIZE, DType, Op, decode_state_head, encode_state_head, pack_header, state_digest
from aps.testing import RawClient

N = 97
STEPS = 8
HALF = STEPS // 2
FLAGS = {
    "sgd": ["--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.01"],
    "adam": ["--optimizer", "adam", "--lr", "0.01", "--weight-decay", "0.01"],
}


def problem(seed: int = 5):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(N).astype(np.float32), rng.standard_normal((STEPS, N)).astype(np.float32)


W0, GRADS = problem()


def serve(server_process, optimizer: str = "sgd", *extra: str):
    return server_process("--workers", "1", "--sync", "asp", *FLAGS[optimizer], *extra)


def torch_state(optimizer: str, steps: int) -> dict[str, np.ndarray]:
    """torch.optim's state after ``steps`` of GRADS from W0, with the servers' options."""
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    if optimizer == "sgd":
        opt = torch.optim.SGD([param], lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.Adam([param], lr=0.01, weight_decay=0.01)
    for g in GRADS[:steps]:
        param.grad = torch.from_numpy(g.copy())
        opt.step()
    state = opt.state[param]
    return {name: state[name].numpy() for name in ("momentum_buffer", "exp_avg", "exp_avg_sq") if name in state}


def train_halves(worker) -> tuple[dict, np.ndarray, np.ndarray]:
    """From W0: the first half of GRADS, the state and weights there, then the second half's weights."""
    worker.init({"w": W0.copy()})
    for g in GRADS[:HALF]:
        worker.push_pull(g)
    state = worker.optimizer_state()
    middle = worker.flat_weights.copy()
    for g in GRADS[HALF:]:
        worker.push_pull(g)
    return state, middle, worker.flat_weights.copy()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_state_is_torchs_and_a_loaded_run_goes_on_as_if_never_stopped(server_process, transport, tmp_path,
                                                                          optimizer):
    first = serve(server_process, optimizer)
    second = serve(server_process, optimizer, "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0")
    with aps.Worker(first.address, 0, 1, transport=transport) as worker:
        state, middle, straight = train_halves(worker)
    assert (state["optimizer"], state["steps"], state["version"]) == (optimizer, HALF, HALF)
    theirs = torch_state(optimizer, HALF)
    assert list(state["arrays"]) == list(theirs)
    for name, array in state["arrays"].items():
        assert array.dtype == np.float32 and array.shape == (N,)
        if optimizer == "sgd":
            np.testing.assert_array_equal(array, theirs[name])
        else:
            np.testing.assert_allclose(array, theirs[name], rtol=1e-5, atol=1e-7)

    with aps.Worker(second.address, 0, 1, transport=transport) as worker:
        worker.init({"w": middle})
        assert worker.load_optimizer_state({**state, "version": 123}) is True  # the version is ignored
        saved = read_checkpoint(request_checkpoint(second.address)["path"])
        assert saved.manifest["optimizer"]["steps"] == HALF
        for name, array in state["arrays"].items():
            np.testing.assert_array_equal(saved.state[f"{name}/w"], array)
        for g in GRADS[HALF:]:
            worker.push_pull(g)
        np.testing.assert_array_equal(worker.flat_weights, straight)  # the same kernels: bit for bit
        assert worker.load_optimizer_state(state) is False  # loaded already: nothing changes
        assert worker.optimizer_state()["steps"] == STEPS
        np.testing.assert_array_equal(worker.push_pull(np.zeros(N, np.float32))["w"], worker.flat_weights)


def send_load(worker, optimizer: str, steps: int, arrays: dict[str, np.ndarray], *, numel: int = N,
              digest: bytes | None = None) -> bool:
    """A LOAD_STATE as built by hand (past the worker's own checks)."""
    digest = digest or state_digest(steps, arrays.values())
    head = encode_state_head(optimizer, steps, numel, list(arrays), digest=digest)
    channel = worker.shards[0] if isinstance(worker, aps.Worker) else worker  # one server's channel
    return channel._run_steps(channel._load_state(head, list(arrays.values())))


def test_every_refusal_changes_nothing_and_the_connection_serves_on(server_process, transport):
    server = serve(server_process, "sgd")
    buffer = np.linspace(-1, 1, N, dtype=np.float32)
    nan = buffer.copy()
    nan[3] = np.nan
    with aps.Worker(server.address, 0, 1, transport=transport) as worker:
        with pytest.raises(NotInitialized):
            worker.optimizer_state()
        worker.init({"w": W0.copy()})
        refusals = [
            (lambda: worker.load_optimizer_state({"optimizer": "adam", "steps": 2, "arrays": {
                "exp_avg": buffer, "exp_avg_sq": buffer}}), "the state is adam's; this server runs sgd"),
            (lambda: worker.load_optimizer_state({"optimizer": "sgd", "steps": 2, "arrays": {"exp_avg": buffer}}),
             "the sgd state holds the arrays ['momentum_buffer'], in that order"),
            (lambda: worker.load_optimizer_state({"optimizer": "sgd", "steps": 2, "arrays": {}}),
             "holds the arrays ['momentum_buffer']"),
            (lambda: send_load(worker, "sgd", 2, {"momentum_buffer": np.zeros(N + 1, np.float32)}, numel=N + 1),
             f"have {N + 1} elements each; the model has {N}"),
            (lambda: send_load(worker, "sgd", 2, {"momentum_buffer": nan}), "momentum_buffer[3] is nan"),
            (lambda: send_load(worker, "sgd", 2, {"momentum_buffer": buffer}, digest=state_digest(3, [buffer])),
             "do not match the state's digest"),
            (lambda: worker.load_optimizer_state({"optimizer": "sgd", "steps": 0, "arrays": {"momentum_buffer":
                                                                                           buffer}}),
             "steps is 0 but the momentum buffer is not zero"),
        ]
        for attempt, message in refusals:
            with pytest.raises(InvalidState) as info:
                attempt()
            assert message in str(info.value) and info.value.code == ErrorCode.INVALID_STATE
            state = worker.optimizer_state()  # nothing changed, the connection serves on
            assert state["steps"] == 0 and not state["arrays"]["momentum_buffer"].any()
        good = {"optimizer": "sgd", "steps": 5, "arrays": {"momentum_buffer": buffer}}
        assert worker.load_optimizer_state(good) is True
        assert worker.load_optimizer_state(good) is False
        with pytest.raises(InvalidState, match=r"another optimizer state \(5 steps\) was loaded"):
            worker.load_optimizer_state({**good, "arrays": {"momentum_buffer": buffer * 2}})
        worker.push_pull(GRADS[0])
        after = worker.optimizer_state()
        assert worker.load_optimizer_state(good) is False  # the same state, after an update: a no-op
        with pytest.raises(InvalidState, match="the server has applied 1 updates: optimizer state can only be "
                                               "loaded into a run that has not started"):
            worker.load_optimizer_state({**good, "steps": 6})
        assert worker.optimizer_state()["steps"] == after["steps"] == 6
        np.testing.assert_array_equal(worker.optimizer_state()["arrays"]["momentum_buffer"],
                                      after["arrays"]["momentum_buffer"])
        # the loaded buffer was used (steps 5: not a first step): 0.9 * buffer + (g + 0.01 w)
        g = GRADS[0] + np.float32(0.01) * W0
        np.testing.assert_allclose(after["arrays"]["momentum_buffer"], np.float32(0.9) * buffer + g, rtol=1e-6)


def raw_state(raw: RawClient) -> tuple:
    raw.frame(Op.STATE)
    header, payload = raw.reply()
    return header, payload


def test_raw_frames_are_checked_before_the_arrays_are_read(server_process):
    server = serve(server_process, "adam")
    raw = RawClient(server.port)
    try:
        raw.frame(Op.STATE)
        assert raw.error()[0] == ErrorCode.NOT_INITIALIZED
        raw.frame(Op.LOAD_STATE, bytes(1 << 20), dtype=DType.FLOAT32)  # read and dropped
        code, message = raw.error()
        assert code == ErrorCode.NOT_INITIALIZED and "LOAD_STATE before a successful INIT" in message
        raw.init(0, 1, {"w": W0})
        assert raw.reply()[0].op == Op.INIT_REPLY
        arrays = {"exp_avg": np.ones(N, np.float32), "exp_avg_sq": np.ones(N, np.float32)}
        head = encode_state_head("adam", 1, N, list(arrays), digest=state_digest(1, arrays.values()))
        body = b"".join(a.tobytes() for a in arrays.values())
        raw.frame(Op.LOAD_STATE, head + body[:-4], dtype=DType.FLOAT32)
        code, message = raw.error()
        assert code == ErrorCode.PAYLOAD_SIZE_MISMATCH and "2 arrays of 97 float32" in message
        huge = encode_state_head("adam", 1, 1 << 28, list(arrays), digest=bytes(16))
        raw.send(pack_header(Op.LOAD_STATE, dtype=DType.FLOAT32, length=len(huge) + (1 << 20)), huge, bytes(1 << 20))
        code, message = raw.error()  # refused from its head alone: the rest is read and dropped, never kept
        assert code == ErrorCode.INVALID_STATE and "have 268435456 elements each; the model has 97" in message
        raw.frame(Op.LOAD_STATE, head + body, dtype=DType.FLOAT32)
        assert raw.reply()[0].op == Op.LOAD_STATE_REPLY  # the connection serves on
        header, payload = raw_state(raw)
        assert header.op == Op.STATE_REPLY and decode_state_head(payload).steps == 1
    finally:
        raw.close()


def test_a_stranger_is_refused_before_anything_is_read(server_process):
    server = server_process("--workers", "1", "--token", "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw")
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        sock.sendall(pack_header(Op.STATE))
        data = sock.recv(HEADER_SIZE + 4)
        assert data[6] == Op.ERROR and int.from_bytes(data[HEADER_SIZE : HEADER_SIZE + 4], "little") == \
            ErrorCode.AUTHENTICATION
    finally:
        sock.close()


def shard_pair(server_process, *extra: str) -> list[str]:
    return [server_process("--workers", "1", "--sync", "asp", *FLAGS["sgd"], "--shard", str(index), "--shards", "2",
                           *extra).address for index in range(2)]


def test_a_sharded_worker_reads_the_whole_state_and_loads_each_shard_its_range(server_process, transport):
    first, second = shard_pair(server_process), shard_pair(server_process)
    with aps.Worker(first, 0, 1, transport=transport) as worker:
        state, middle, straight = train_halves(worker)
    assert (state["steps"], state["version"]) == (HALF, HALF)
    np.testing.assert_array_equal(state["arrays"]["momentum_buffer"], torch_state("sgd", HALF)["momentum_buffer"])
    with aps.Worker(second, 0, 1, transport=transport) as worker:
        worker.init({"w": middle})
        # shard 1 alone has this state already: another one is refused there, so by no shard
        lo = worker._bounds[1]
        piece = {"momentum_buffer": state["arrays"]["momentum_buffer"][lo:]}
        assert send_load(worker.shards[1], "sgd", HALF, piece, numel=N - lo) is True
        other = {**state, "arrays": {"momentum_buffer": state["arrays"]["momentum_buffer"] * 2}}
        with pytest.raises(InvalidState, match="another optimizer state"):
            worker.load_optimizer_state(other)
        assert worker.shards[0].optimizer_state()["steps"] == 0
        assert worker.load_optimizer_state(state) is True  # shard 0 loads it, shard 1 had it
        assert worker.load_optimizer_state(state) is False
        np.testing.assert_array_equal(worker.optimizer_state()["arrays"]["momentum_buffer"],
                                      state["arrays"]["momentum_buffer"])
        for g in GRADS[HALF:]:
            worker.push_pull(g)
        np.testing.assert_array_equal(worker.flat_weights, straight)


def test_the_async_workers_read_and_load_too(server_process):
    plain = serve(server_process, "adam").address
    sharded = ",".join(shard_pair(server_process))

    async def run(address: str, optimizer: str) -> None:
        worker = await aps.AsyncWorker.connect(address, 0, 1)
        try:
            await worker.init({"w": W0.copy()})
            names = ["exp_avg", "exp_avg_sq"] if optimizer == "adam" else ["momentum_buffer"]
            state = {"optimizer": optimizer, "steps": 3,
                     "arrays": {name: np.full(N, i + 1, np.float32) for i, name in enumerate(names)}}
            assert await worker.load_optimizer_state(state) is True
            read = await worker.optimizer_state()
            assert (read["steps"], read["version"]) == (3, 0)
            for name in names:
                np.testing.assert_array_equal(read["arrays"][name], state["arrays"][name])
            await worker.push_pull(GRADS[0])
            assert (await worker.optimizer_state())["steps"] == 4
            assert await worker.load_optimizer_state(state) is False
        finally:
            await worker.close()

    async def both() -> None:
        await asyncio.gather(run(plain, "adam"), run(sharded, "sgd"))

    asyncio.run(both())


def test_a_state_reply_describes_itself(server_process):
    """The reply's bytes as docs/protocol.md lays them out (a raw reader, no aps.Worker)."""
    server = serve(server_process, "sgd")
    raw = RawClient(server.port)
    try:
        raw.init(0, 1, {"w": W0})
        raw.reply()
        raw.push(GRADS[0])
        raw.reply()
        header, payload = raw_state(raw)
        assert header.op == Op.STATE_REPLY and header.version == 1 and header.dtype == DType.FLOAT32
        head = decode_state_head(payload)
        assert (head.optimizer, head.steps, head.numel, head.arrays, head.version) == \
            ("sgd", 1, N, ("momentum_buffer",), 1)
        assert head.nbytes % 8 == 0 and len(payload) == head.nbytes + 4 * N
        expected = torch_state("sgd", 1)["momentum_buffer"]  # the first step's: the gradient with weight decay
        np.testing.assert_array_equal(np.frombuffer(payload, np.float32, offset=head.nbytes), expected)
    finally:
        raw.close()
