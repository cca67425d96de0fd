"""Elastic membership with real processes (docs/algorithms.md, "Elastic membership"):
``aps serve --workers 2:6`` starts with 2 workers, 4 more join one by one while it trains,
then 3 go (two leave, one is killed with SIGKILL), under every sync policy. Every worker
asks for any rank. The ledger (SGD, lr 1, one-hot gradients in a slot per push) shows
every gradient taken applied exactly once, and each BSP round's mean over the workers live
when it began."""

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from aps.checkpoint.directory import load_checkpoint
from aps.cli.checkpoint import request_checkpoint
from aps.cli.status import fetch_stats

SCRIPT = Path(__file__).parents[1] / "scripts" / "elastic_worker.py"
ROWS, SLOTS = 6, 4000
HEARTBEAT_TIMEOUT = 2.0


class Run:
    def __init__(self, tmp_path: Path, address: str) -> None:
        self.dir, self.address = tmp_path, address
        self.procs: dict[int, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        self.env["APS_ADDRESS"] = address

    def start(self, row: int, pause: float = 0.02) -> None:
        with open(self.dir / f"worker-{row}.err", "wb") as err:
            self.procs[row] = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(row), str(ROWS), str(SLOTS), str(self.dir), str(pause)],
                env=self.env, stdout=subprocess.DEVNULL, stderr=err)

    def log(self, row: int) -> list[dict]:
        path = self.dir / f"worker-{row}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] \
            if path.exists() else []

    def pushes(self, row: int) -> int:
        return sum("i" in entry for entry in self.log(row))

    def wait_pushes(self, row: int, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.pushes(row) < count:
            proc = self.procs[row]
            assert proc.poll() is None, (self.dir / f"worker-{row}.err").read_text()[-2000:]
            assert time.monotonic() < deadline, f"worker {row} made {self.pushes(row)} pushes, not {count}"
            time.sleep(0.05)

    def stop_all(self) -> list[int]:
        """Stop every worker; returns the rows still running once the others are gone: the last
        ones, held because fewer than MIN are live (their last push taken, its reply held)."""
        (self.dir / "STOP").touch()
        quiet = None
        while True:
            running = [row for row, proc in self.procs.items() if proc.poll() is None]
            counts = [self.pushes(row) for row in range(ROWS)]
            if not running:
                return []
            if quiet is not None and quiet[0] == (running, counts) and time.monotonic() - quiet[1] > 3:
                return running
            if quiet is None or quiet[0] != (running, counts):
                quiet = ((running, counts), time.monotonic())
            time.sleep(0.1)

    def kill(self, rows: list[int]) -> None:
        for row in rows:
            self.procs[row].kill()
            self.procs[row].wait()


@pytest.mark.slow  # (seven processes, a kill, a checkpoint: about 8 s each)
@pytest.mark.parametrize("sync", ["bsp", "asp", "ssp", "dssp", "softsync"])
def test_workers_join_and_leave_a_running_model_and_every_gradient_counts_once(sync, tmp_path, server_process):
    options = {"bsp": [], "asp": [], "ssp": ["--staleness", "2"], "dssp": ["--staleness", "1", "--max-staleness", "4"],
               "softsync": ["--softsync-n", "2"]}[sync]
    server = server_process("--workers", "2:6", "--sync", sync, *options, "--lr", "1", "--momentum", "0",
                            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--checkpoint-dir", str(tmp_path / "ck"))
    run = Run(tmp_path, server.address)
    for row in (0, 1):
        run.start(row)
    run.wait_pushes(0, 5)
    for row in range(2, 6):  # four more, one by one, while it trains
        run.start(row)
        run.wait_pushes(row, 3)
    for row in range(6):
        run.wait_pushes(row, run.pushes(row) + 2)
    (tmp_path / "LEAVE-2").touch()  # three go: two leave for good, one is killed
    run.procs[3].send_signal(signal.SIGKILL)
    (tmp_path / "LEAVE-4").touch()
    for row in (2, 4):
        assert run.procs[row].wait(30) == 0
    run.procs[3].wait()
    killed_at = time.monotonic()
    before = {row: run.pushes(row) for row in (0, 1, 5)}
    for row in (0, 1, 5):  # the others go on: nobody waits past the heartbeat timeout for the killed one
        run.wait_pushes(row, before[row] + 5, timeout=HEARTBEAT_TIMEOUT + 20)
    slowest_after = max(entry["s"] for row in (0, 1, 5) for entry in run.log(row)[-5:])
    assert slowest_after < HEARTBEAT_TIMEOUT + 3, slowest_after
    assert time.monotonic() - killed_at < 60
    # The ledger, read from a checkpoint once every worker stopped (nothing is in flight).
    held = run.stop_all()
    assert len(held) <= 1, held  # (below MIN=2: the last one waits for a second)
    checkpoint = load_checkpoint(request_checkpoint(server.address)["path"])
    run.kill(held)
    weights = checkpoint.flat_weights().reshape(ROWS, SLOTS).astype(np.float64)
    logs = {row: run.log(row) for row in range(ROWS)}
    ranks = {row: logs[row][0]["joined"] for row in range(ROWS)}
    assert logs[0][0]["range"] == [2, 6] and all(0 <= rank < 6 for rank in ranks.values())
    assert len({ranks[row] for row in (0, 1, 2, 3, 4, 5)}) == 6  # six live at once: six ranks
    assert max(entry.get("live", 0) for row in range(ROWS) for entry in logs[row]) == 6
    assert any(entry["live"] == 3 for entry in logs[0][-5:])  # the count follows the leaves
    taken = {(row, entry["i"]): entry for row in range(ROWS) for entry in logs[row] if "i" in entry}
    for (row, i), entry in taken.items():
        if entry["dropped"]:
            assert weights[row, i] == 0, f"a dropped gradient was applied: row {row} push {i}"
    # Every slot no push of the logs names is 0, but the killed worker's last (its reply was lost).
    named = np.zeros_like(weights, bool)
    for row, i in taken:
        named[row, i] = True
    unnamed = np.argwhere((weights != 0) & ~named)
    unlogged = {3, *held}  # the killed worker's last push, a held worker's: taken, their replies never read
    assert all(row in unlogged and i == run.pushes(row) for row, i in unnamed), unnamed
    applied = {(int(row), int(i)): -weights[row, i] for row, i in np.argwhere(weights != 0)}
    if sync in ("asp", "ssp", "dssp"):  # each applied alone: exactly 1
        for key, value in applied.items():
            assert value == 1.0, f"slot {key} holds {value} applications"
        logged = sum(not entry["dropped"] for entry in taken.values())
        assert logged <= len(applied) <= logged + len(unlogged)
        return
    # BSP and softsync: each update is the mean of its gradients, 1/c each; a gradient taken
    # and not yet applied waits in the open aggregate (the checkpoint keeps it apart).
    shares = collections.Counter(Fraction(float(value)).limit_denominator(64) for value in applied.values())
    for share, count in shares.items():
        assert share.numerator == 1 and 1 <= share.denominator <= 6, f"a gradient applied as {share}"
        assert count % share.denominator == 0, f"{count} gradients applied as {share}: not whole updates"
    assert sum(count // share.denominator for share, count in shares.items()) == checkpoint.version
    waiting = int(np.count_nonzero(checkpoint.state.get("aggregate", np.zeros(1))))
    logged = sum(not entry["dropped"] for entry in taken.values())
    assert logged <= len(applied) + waiting <= logged + len(unlogged)
    if sync == "bsp":  # a round's gradients share its version, and its size follows the live set
        rounds = collections.defaultdict(list)
        for (row, i), entry in taken.items():
            if (row, i) in applied:
                rounds[entry["version"]].append(applied[row, i])
        short = 0  # rounds holding a push whose reply was never read (not in the logs)
        for version, values in rounds.items():
            size = round(1 / values[0])
            assert all(abs(v - 1 / size) < 1e-6 for v in values) and len(values) <= size, (version, values)
            short += len(values) < size
        assert short <= len(unlogged)
        sizes = [round(1 / rounds[v][0]) for v in sorted(rounds)]
        six = sizes.index(6)  # 2 at the start, all 6 once they joined, 3 after the three left
        assert sizes[0] == 2 and 3 in sizes[six:], sizes


def test_ranks_are_assigned_and_the_live_count_follows_joins_and_leaves(server_process, transport):
    import aps

    server = server_process("--workers", "1:3", "--sync", "asp", "--lr", "1")
    model = {"w": np.zeros(4, np.float32)}
    first = aps.Worker(server.address, transport=transport)
    second = aps.Worker(server.address, transport=transport)
    try:
        assert first.rank is None and first.num_workers is None
        first.init(model)
        assert (first.rank, first.num_workers, first.workers_range, first.elastic) == (0, 1, (1, 3), True)
        second.init(model)
        assert second.rank == 1 and second.num_workers == 2
        first.push_pull(np.ones(4, np.float32))
        assert first.num_workers == 2
        second.leave()
        first.push_pull(np.ones(4, np.float32))
        assert first.num_workers == 1
        with aps.Worker(server.address, transport=transport) as third:
            third.init(model)
            assert third.rank == 2  # a rank never seated before the one just freed
            np.testing.assert_array_equal(third.weights["w"], -2 * np.ones(4))
    finally:
        first.close()
        second.close()


def test_a_sharded_worker_is_seated_under_one_rank_on_every_shard(server_process):
    import aps

    shards = [server_process("--workers", "1:3", "--sync", "asp", "--shard", str(i), "--shards", "2")
              for i in range(2)]
    address = ",".join(s.address for s in shards)
    model = {"a": np.zeros(600, np.float32), "b": np.zeros(600, np.float32)}
    with aps.Worker(address) as first, aps.Worker(address) as second:
        first.init(model)
        second.init(model)
        assert [c.rank for c in first.shards] == [0, 0] and [c.rank for c in second.shards] == [1, 1]
        second.push_pull(np.ones(1200, np.float32))
        assert second.num_workers == 2


def test_below_min_the_run_holds_checkpoints_after_the_deadline_and_goes_on_when_a_worker_joins(
        server_process, tmp_path):
    import threading

    import aps
    from aps.checkpoint.directory import list_checkpoints

    server = server_process("--workers", "2:3", "--sync", "asp", "--quorum-timeout", "1", "--checkpoint-dir",
                            str(tmp_path), "--http-port", "0")
    model = {"w": np.zeros(4, np.float32)}
    with aps.Worker(server.address) as stays, aps.Worker(server.address) as goes:
        threading.Thread(target=goes.init, args=(model,)).start()
        stays.init(model)
        stays.push_pull(np.ones(4, np.float32))
        goes.leave()
        returned = threading.Event()
        pulling = threading.Thread(target=lambda: (stays.push_pull(np.ones(4, np.float32)), returned.set()))
        pulling.start()
        deadline = time.monotonic() + 20
        while not list_checkpoints(tmp_path):  # held past --quorum-timeout: a checkpoint, then still waiting
            assert time.monotonic() < deadline, "no checkpoint while training held"
            time.sleep(0.1)
        assert not returned.is_set()
        assert fetch_stats(server.address)["server"]["quorum_held_s"] > 0
        checkpoint = load_checkpoint(list_checkpoints(tmp_path)[-1])
        assert checkpoint.manifest["reason"] == "quorum" and checkpoint.version == 2  # the held push is in
        with aps.Worker(server.address) as back:
            back.init(model)
            assert returned.wait(10), "the held pull did not go on when MIN workers were live again"
            assert stays.num_workers == 2
        pulling.join()


def test_scale_lr_follows_the_live_workers(server_process):
    torch = pytest.importorskip("torch")
    import aps
    import aps.torch

    server = server_process("--workers", "1:4", "--sync", "asp", "--lr", "0.5")
    with aps.Worker(server.address) as other:
        param = torch.nn.Parameter(torch.zeros(4))
        optimizer = aps.torch.Optimizer([("p", param)], address=server.address, scale_lr="linear")
        other.init({"p": np.zeros(4, np.float32)})
        for expected_scale in (1.0, 2.0):  # the first step knew one worker; the second, two
            before = param.detach().clone()
            param.grad = torch.ones(4)
            optimizer.step()
            torch.testing.assert_close(param.detach(), before - 0.5 * expected_scale)
            assert optimizer.lr_scale == expected_scale
        assert optimizer.param_groups[0]["lr"] == 0.5  # the group keeps the lr for MIN workers
        optimizer.worker.close()
    with pytest.raises(aps.ConfigurationError, match="scale_lr"):
        aps.torch.Optimizer([("p", torch.nn.Parameter(torch.zeros(4)))], address=server.address, scale_lr="cubic")


def test_the_live_count_is_said_to_workers_only(server_process):
    import socket as sockets

    from aps.wire.protocol import HEADER_SIZE, Op, encode_hello, pack_header, unpack_header

    server = server_process("--workers", "1:3", "--sync", "asp")
    import aps

    with aps.Worker(server.address) as member:
        member.init({"w": np.zeros(4, np.float32)})
        host, port = server.address.rsplit("//", 1)[1].rsplit(":", 1)
        with sockets.create_connection((host, int(port)), timeout=10) as stranger:
            hello = encode_hello("stranger", "")
            stranger.sendall(pack_header(Op.HELLO, request_id=1, length=len(hello)) + hello)
            reply = b""
            while len(reply) < HEADER_SIZE:
                reply += stranger.recv(HEADER_SIZE - len(reply))
            header = unpack_header(reply)
        assert header.op == Op.HELLO_REPLY and header.live == 0  # (one worker is live)
        member.push_pull(np.ones(4, np.float32))
        assert member.num_workers == 1


def test_a_worker_joining_a_model_the_server_has_sends_no_values(server_process, transport):
    import aps

    server = server_process("--workers", "1:3", "--sync", "asp")
    model = {"w": np.zeros(1 << 22, np.float32)}  # 16 MiB
    with aps.Worker(server.address, transport=transport) as first:
        first.init(model)
        before = fetch_stats(server.address)["server"]["bytes_in"]
        with aps.Worker(server.address, transport=transport) as second:
            second.init(model)
            assert second.rank == 1 and second.shards[0]._core.joined_running
        joined = fetch_stats(server.address)["server"]["bytes_in"] - before
        assert joined < 1 << 20, joined  # the layout, not 16 MiB of values read and dropped

def test_an_init_without_values_is_refused_while_there_is_no_model(server_process):
    from aps.errors import ErrorCode
    from aps.layout import Layout
    from aps.testing import RawClient
    from aps.wire.protocol import DType, Op, encode_init

    server = server_process("--workers", "1", "--sync", "asp")
    raw = RawClient.to(server, "tcp")
    try:
        block = encode_init(0, 1, Layout.from_arrays({"w": np.zeros(4, np.float32)}))
        raw.frame(Op.INIT, block, dtype=DType.FLOAT32, version=len(block))
        code, message = raw.error()
        assert code == ErrorCode.NOT_INITIALIZED and "no initial values" in message
        raw.init(0, 1, {"w": np.zeros(4, np.float32)})  # the same connection then joins with values
        header, _ = raw.reply()
        assert header.op == Op.INIT_REPLY
    finally:
        raw.close()


def test_a_worker_whose_assigned_rank_was_taken_while_it_reconnected_takes_another(server_process, caplog):
    """rank=None: the server chose the rank, so a worker that finds it taken when it comes back
    asks for any; the gradient in flight is not sent again under the new rank (the old rank's
    record of it is not the new seat's), and every other gradient counts once."""
    import threading

    import aps

    server = server_process("--workers", "1:3", "--sync", "asp", "--lr", "1", "--heartbeat-timeout", "2")
    model = {"w": np.zeros(4, np.float32)}
    a, b, d = (aps.Worker(server.address, transport="tcp", heartbeat=0.3) for _ in range(3))
    for worker in (a, b, d):
        worker.init(model)
    assert (a.rank, b.rank, d.rank) == (0, 1, 2)
    a.push_pull(np.ones(4, np.float32))
    a.shards[0]._conn.sock.shutdown(socket.SHUT_RDWR)  # the network drops a's connection
    deadline = time.monotonic() + 10
    while b.push_pull(np.zeros(4, np.float32)) is not None and b.num_workers != 2:
        assert time.monotonic() < deadline, "the server never saw rank 0 go"
        time.sleep(0.05)
    with aps.Worker(server.address, transport="tcp", heartbeat=0.3) as c:
        c.init(model)
        assert c.rank == 0  # the only free rank: a's
        c.push_pull(np.full(4, 2, np.float32))
        leaving = threading.Timer(0.5, d.leave)  # rank 2 frees while a retries
        leaving.start()
        with caplog.at_level("WARNING", logger="aps.worker"):
            weights = a.push_pull(np.full(4, 100, np.float32))
        leaving.join()
        assert a.rank == 2 and a.num_workers == 3 and a.last_push_dropped  # (not sent again: not known to count)
        assert "was given to another worker" in caplog.text and "not sent again" in caplog.text
        np.testing.assert_array_equal(weights["w"], -3 * np.ones(4))  # a's 1 and c's 2; not a's 100
        a.push_pull(np.full(4, 4, np.float32))  # a trains on under rank 2
        np.testing.assert_array_equal(a.weights["w"], -7 * np.ones(4))
    for worker in (a, b, d):
        worker.close()


@pytest.mark.parametrize("how", ["reconnect", "lost"])
def test_a_worker_whose_old_connection_still_holds_its_rank_gets_it_back(server_process, how):
    """rank=None: a worker comes back while the server still counts its old connection (the
    network dropped it without a word): RankTaken, from its own old connection, until the
    server drops that one after --heartbeat-timeout. It waits for its rank, as a worker of a
    given rank does, rather than taking another; its push in flight counts once."""
    import aps

    server = server_process("--workers", "1:3", "--sync", "asp", "--lr", "1", "--heartbeat-timeout", "2")
    with aps.Worker(server.address, transport="tcp", heartbeat=0.3) as a:
        a.init({"w": np.zeros(4, np.float32)})
        a.push_pull(np.ones(4, np.float32))
        sock = a.shards[0]._conn.sock
        kept = os.dup(sock.fileno())  # the old connection stays open at the server: no FIN
        try:
            if how == "reconnect":
                a.reconnect()
            else:
                sock.shutdown(socket.SHUT_RD)  # this end reads nothing more: the push's reply is lost
                a.push_pull(np.full(4, 2, np.float32))
        finally:
            os.close(kept)
        assert a.rank == 0 and not a.last_push_dropped
        weights = a.pull()
        np.testing.assert_array_equal(weights["w"], np.full(4, -1.0 if how == "reconnect" else -3.0))
        assert fetch_stats(server.address)["server"]["pushes"] == (1 if how == "reconnect" else 2)


def test_a_worker_that_finished_lets_the_others_end_below_min(server_process):
    """leave(finished=True): the run is ending, so the workers still training are not held
    below MIN (a plain leave holds them: the test above); the server counts it as finished."""
    import threading

    import aps

    server = server_process("--workers", "2:3", "--sync", "asp", "--lr", "1", "--http-port", "0")
    model = {"w": np.zeros(4, np.float32)}
    with aps.Worker(server.address) as stays, aps.Worker(server.address) as done:
        joining = threading.Thread(target=done.init, args=(model,))
        joining.start()
        stays.init(model)
        joining.join()
        done.push_pull(np.ones(4, np.float32))
        assert fetch_stats(server.address)["server"]["draining"] is False
        done.leave(finished=True)
        results: list = []
        steps = threading.Thread(target=lambda: results.extend(stays.push_pull(np.ones(4, np.float32))["w"]
                                                               for _ in range(3)))
        steps.start()  # one live worker of MIN 2, not held
        steps.join(20)
        assert not steps.is_alive(), "a worker was held below MIN after another finished"
        np.testing.assert_array_equal(results[-1], -4 * np.ones(4))
        stats = fetch_stats(server.address)
        assert stats["server"]["draining"] is True and stats["server"]["quorum_held_s"] is None
        events = stats["server"]["membership_events"]
        assert events["finished"] == 1 and events["left"] == 0
        assert stays.num_workers == 1
