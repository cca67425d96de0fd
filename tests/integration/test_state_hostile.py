"""STATE and LOAD_STATE against hostile or careless peers, on real ``aps serve`` processes:
readers that do not read, states that would stop every later update, step counts at
the limit."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import aps
from aps.errors import ErrorCode, InvalidState
from aps.wire.protocol import (
    DType,
    Op,
    decode_error,
    encode_state_head,
    pack_header,
    state_digest,
)
from aps.testing import RawClient

N = 97


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def send_load(raw: RawClient, optimizer: str, steps: int, arrays: dict[str, np.ndarray], request_id: int = 7):
    head = encode_state_head(optimizer, steps, N, list(arrays), digest=state_digest(steps, arrays.values()))
    payload = head + b"".join(array.tobytes() for array in arrays.values())
    raw.send(pack_header(Op.LOAD_STATE, 0, DType.FLOAT32, request_id, 0, 0, len(payload)), payload)
    return raw.reply()


def test_readers_of_one_moment_share_one_copy_while_their_replies_are_on_their_way(server_process):
    """Workers that ask for the state at the same moment and read slowly (or not at all)
    hold one copy of it in the server between them, not one each."""
    readers, numel = 3, 8 << 20  # a 32 MiB momentum buffer
    server = server_process("--workers", str(readers), "--sync", "asp", "--heartbeat-timeout", "0",
                            "--optimizer", "sgd", "--momentum", "0.9")
    raws = [RawClient(server.port) for _ in range(readers)]
    try:
        for rank, raw in enumerate(raws):
            raw.init(rank, readers, {"w": np.zeros(numel, np.float32)}, request_id=1)
        joins = [threading.Thread(target=raw.reply) for raw in raws]
        for thread in joins:
            thread.start()
        for thread in joins:
            thread.join(30)
        time.sleep(0.3)
        before = rss_mib(server.proc.pid)
        for raw in raws:  # none of them reads its reply
            raw.frame(Op.STATE, request_id=5)
            time.sleep(0.2)
        grown = rss_mib(server.proc.pid) - before
        state_mib = numel * 4 / (1 << 20)
        assert grown < 1.5 * state_mib, f"{grown:.0f} MiB for {readers} readers of a {state_mib:.0f} MiB state"
        assert server.alive()
    finally:
        for raw in raws:
            raw.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_negative_second_moment_is_refused_and_training_goes_on(server_process, transport):
    """A negative exp_avg_sq would make every later update NaN (every push refused, and no
    other state loadable once steps were taken): refused, nothing changed."""
    server = server_process("--workers", "1", "--sync", "asp", "--optimizer", "adam", "--lr", "0.01")
    raw = RawClient.to(server, transport)
    try:
        raw.init(0, 1, {"w": np.zeros(N, np.float32)})
        raw.reply()
        second = np.full(N, 0.5, np.float32)
        second[40] = -1e-3
        header, payload = send_load(raw, "adam", 3, {"exp_avg": np.zeros(N, np.float32), "exp_avg_sq": second})
        assert header.op == Op.ERROR
        code, message = decode_error(payload)
        assert code == ErrorCode.INVALID_STATE and "exp_avg_sq[40]" in message
        raw.push(np.ones(N, np.float32), request_id=8)  # the run is as it was: pushes apply
        header, _ = raw.reply()
        assert header.op == Op.PUSH_REPLY and header.version == 1
    finally:
        raw.close()
    with aps.Worker(server.address, 0, 1, transport=transport) as worker:
        worker.init({"w": np.zeros(N, np.float32)})
        state = worker.optimizer_state()
        assert state["steps"] == 1 and (state["arrays"]["exp_avg_sq"] > 0).all()


def test_a_sharded_load_with_a_negative_second_moment_on_one_shard_is_taken_by_none(server_process):
    """The shards check heads alone first; a value only one shard would refuse must not
    leave the others loaded (with steps taken, they could take no other state)."""
    shards = [server_process("--workers", "1", "--sync", "asp", "--optimizer", "adam", "--shard", str(index),
                             "--shards", "2").address for index in range(2)]
    with aps.Worker(",".join(shards), 0, 1, transport="tcp") as worker:
        worker.init({"w": np.zeros(N, np.float32)})
        second = np.full(N, 0.5, np.float32)
        second[-1] = -0.5  # in the last shard's range
        arrays = {"exp_avg": np.zeros(N, np.float32), "exp_avg_sq": second}
        with pytest.raises(InvalidState, match=f"exp_avg_sq\\[{N - 1}\\]"):
            worker.load_optimizer_state({"optimizer": "adam", "steps": 4, "arrays": arrays})
        assert [shard.optimizer_state()["steps"] for shard in worker.shards] == [0, 0]
        second[-1] = 0.5
        assert worker.load_optimizer_state({"optimizer": "adam", "steps": 4, "arrays": arrays}) is True
        assert worker.optimizer_state()["steps"] == 4


def test_a_run_loaded_at_the_largest_step_count_still_reads_its_state(server_process):
    """steps may be 2**53 in a load; the run counts on from there, and reading its state
    still works (loading such a state again is refused clearly, by the worker)."""
    server = server_process("--workers", "1", "--sync", "asp", "--optimizer", "adam", "--lr", "0.01")
    with aps.Worker(server.address, 0, 1, transport="tcp") as worker:
        worker.init({"w": np.zeros(N, np.float32)})
        arrays = {"exp_avg": np.full(N, 0.1, np.float32), "exp_avg_sq": np.full(N, 0.2, np.float32)}
        assert worker.load_optimizer_state({"optimizer": "adam", "steps": 1 << 53, "arrays": arrays}) is True
        worker.push_pull(np.ones(N, np.float32))
        state = worker.optimizer_state()
        assert (state["steps"], state["version"]) == ((1 << 53) + 1, 1)
        assert worker.load_optimizer_state({"optimizer": "adam", "steps": 1 << 53, "arrays": arrays}) is False
        with pytest.raises(InvalidState, match="2\\*\\*53"):
            worker.load_optimizer_state(state)
