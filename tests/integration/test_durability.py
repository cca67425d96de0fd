"""Durable training: a server killed with SIGKILL resumes from its newest checkpoint, and its
workers get back to it by themselves and finish their run, with no gradient applied twice.

Real ``aps serve`` processes and real worker processes, on 127.0.0.1.
"""

from __future__ import annotations

import random
import re
import threading
import time

import numpy as np
import pytest

import aps
import aps.cli
from aps.checkpoint import list_checkpoints, read_checkpoint
from aps.cli.checkpoint import request_checkpoint
from aps.cli.status import fetch_stats
from aps.wire.protocol import DType, Flag, Op, pack_header

from aps.testing.workers import resilient_worker, stepped_gradient
from aps.testing import RawClient, ServerProcess, run_processes, wait_for


def newest(directory) -> int:
    """The version of the newest complete checkpoint in ``directory`` (-1: none)."""
    found = list_checkpoints(directory)
    return read_checkpoint(found[0], verify=False).version if found else -1


def refused_to_start(*flags: str) -> str:
    """``aps serve FLAGS`` must refuse to start: returns what it said."""
    try:
        server = ServerProcess(*flags)
    except RuntimeError as exc:
        return str(exc)
    server.stop()
    pytest.fail(f"aps serve {' '.join(flags)} started")


class Workers:
    """Worker processes training in the background (``run_processes`` on a thread)."""

    def __init__(self, target, args_list, timeout: float) -> None:
        self.results: list | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(target, args_list, timeout), daemon=True)
        self.thread.start()

    def _run(self, target, args_list, timeout) -> None:
        try:
            self.results = run_processes(target, args_list, timeout=timeout)
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self, timeout: float) -> list:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the workers did not finish"
        if self.error is not None:
            raise self.error
        return self.results


def kill(server: ServerProcess) -> None:
    server.proc.kill()
    server.proc.wait(10)
    server.stop()


@pytest.mark.slow  # (many processes, a long run: the slow call of .ci/run)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("sync", ["bsp", "ssp", "asp"])
def test_kill_9_mid_training_then_resume_the_workers_finish_by_themselves(tmp_path, sync, transport):
    workers, steps, numel = 3, 60, 1000
    flags = ["--workers", str(workers), "--sync", sync, "--checkpoint-dir", str(tmp_path),
             "--checkpoint-every", "0.1"]
    server = ServerProcess(*flags)
    port = str(server.port)
    runner = Workers(resilient_worker,
                     [(server.address, r, workers, numel, steps, 0.01, transport) for r in range(workers)], 150)
    try:
        wait_for(lambda: newest(tmp_path) >= 20, what="a checkpoint past version 20")
        kill(server)
        saved = newest(tmp_path)
        time.sleep(0.3)  # the workers find the server gone
        server = ServerProcess("--port", port, "--checkpoint-dir", str(tmp_path), "--resume")
        log = server.wait_for_log("resumed from")
        assert f"version {saved}," in log.split("resumed from", 1)[1].splitlines()[0]
        results = runner.join(150)
    finally:
        server.stop()
    assert sorted(r[0] for r in results) == list(range(workers))
    assert all(clock == steps for _, clock, _, _, _ in results)
    final = read_checkpoint(list_checkpoints(tmp_path)[0])  # written at the clean shutdown
    # One update per round under BSP, one per push otherwise: a gradient applied twice
    # (or lost without its worker being told) would show in the version.
    assert final.version == (steps if sync == "bsp" else workers * steps)
    assert final.version > saved


def one_worker_run(tmp_path, optimizer_flags, steps, interrupt_at=None, lose=3):
    """A deterministic one-worker run; with ``interrupt_at``, a checkpoint is taken at that clock,
    and ``lose`` updates later the server is killed (kill -9); a new one resumes from the
    checkpoint, and the worker redoes the lost steps from the server's weights and clock."""
    flags = ["--workers", "1", "--sync", "asp", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0",
             *optimizer_flags]
    server = ServerProcess(*flags)
    port = str(server.port)
    restarted: list = []
    try:
        worker = aps.Worker(server.address, 0, 1, transport="tcp", reconnect_timeout=30)
        weights = worker.init({"w": np.linspace(-1, 1, 257, dtype=np.float32)})
        while worker.clock < steps:
            if worker.clock == interrupt_at and not restarted:
                request_checkpoint(server.address)
            if interrupt_at is not None and worker.clock == interrupt_at + lose and not restarted:
                kill(server)
                # the next push finds the server gone, and gets back once it has resumed
                threading.Timer(0.4, lambda: restarted.append(ServerProcess(
                    "--port", port, "--checkpoint-dir", str(tmp_path), "--resume"))).start()
                restarted.append(None)
            weights = worker.push_pull({"w": stepped_gradient(weights["w"], worker.clock)})
        live = restarted[-1] if restarted else server
        state = read_checkpoint(request_checkpoint(live.address)["path"]).state  # the state the run ends with
        result = weights["w"].copy(), worker.version, state
        worker.close()
        if interrupt_at is not None:  # it went back to the checkpoint, and said so
            assert f"version {interrupt_at}, clocks [{interrupt_at}]" in restarted[-1].log()
        return result
    finally:
        server.stop()
        for other in restarted:
            if other is not None:
                assert "resumed from" in other.log()
                other.stop()


@pytest.mark.parametrize("optimizer_flags", [
    ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"],
    ["--optimizer", "adam", "--lr", "0.01"],
    ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--compensation", "dc-adaptive:0.5"],
    ["--optimizer", "adam", "--lr", "0.01", "--compensation", "gap"],
    # (a period of 5: the checkpoint at clock 12 is mid-period, its sum of pushes not empty)
    ["--optimizer", "delayed-nesterov", "--lr", "0.05", "--momentum", "0.9", "--momentum-period", "5",
     "--momentum-activation", "0.1"],
], ids=["sgd-momentum", "adam", "dc-adaptive", "gap", "delayed-nesterov"])
def test_interrupted_and_resumed_equals_uninterrupted_bit_for_bit(tmp_path, optimizer_flags):
    """(Compensated: the running mean square or step scale the run ends with, too.)"""
    straight, version, state = one_worker_run(tmp_path / "a", optimizer_flags, 30)
    resumed, version_resumed, state_resumed = one_worker_run(tmp_path / "b", optimizer_flags, 30, interrupt_at=12)
    assert version == version_resumed == 30
    assert np.array_equal(straight, resumed)  # the optimizer's state was restored, not reset
    assert sorted(state) == sorted(state_resumed)
    for key, value in state.items():
        assert np.array_equal(value, state_resumed[key]), key
    if "--compensation" in optimizer_flags:
        assert any(key.startswith("compensation_") and value.any() for key, value in state.items())


def test_a_push_sent_again_after_a_lost_reply_is_not_applied_twice(tmp_path):
    """The duplicate rule on the wire: the push is applied, the server dies before the worker
    reads the reply, and the same push (request id and clock) comes again after the resume."""
    flags = ["--workers", "1", "--sync", "asp", "--lr", "1", "--checkpoint-dir", str(tmp_path),
             "--checkpoint-every", "0"]
    server = ServerProcess(*flags)
    port = str(server.port)
    w0 = np.zeros(8, np.float32)
    grad = np.full(8, 0.25, np.float32)
    try:
        raw = RawClient(server.port)
        raw.init(0, 1, {"w": w0})
        assert raw.reply()[0].op == Op.INIT_REPLY
        raw.frame(Op.PULL, request_id=2)
        assert raw.reply()[0].op == Op.PULL_REPLY
        raw.send(pack_header(Op.PUSH, 0, DType.FLOAT32, 77, 0, 0, grad.nbytes), grad.tobytes())
        wait_for(lambda: fetch_stats(server.address)["server"]["version"] == 1, what="the push")
        request_checkpoint(server.address)
        kill(server)  # the reply was never read
        raw.close()
        server = ServerProcess("--port", port, "--checkpoint-dir", str(tmp_path), "--resume")
        again = RawClient(server.port)
        again.init(0, 1, {"w": w0}, flags=Flag.REJOIN, clock=0)
        header, _ = again.reply()
        assert header.op == Op.INIT_REPLY and header.version == 1 and header.clock == 1
        again.send(pack_header(Op.PUSH, 0, DType.FLOAT32, 77, 0, 0, grad.nbytes), grad.tobytes())
        header, _ = again.reply()
        assert header.op == Op.PUSH_REPLY and header.version == 1 and header.clock == 1  # answered, not applied
        again.frame(Op.PULL, request_id=78, clock=1, version=1)
        header, payload = again.reply()
        assert np.array_equal(np.frombuffer(payload, np.float32), w0 - grad)  # once, not twice
        # a new push (another request id) is applied as usual
        again.send(pack_header(Op.PUSH, 0, DType.FLOAT32, 79, 1, 1, grad.nbytes), grad.tobytes())
        header, _ = again.reply()
        assert header.op == Op.PUSH_REPLY and header.version == 2 and header.clock == 2
        stats = fetch_stats(server.address)["server"]
        assert stats["duplicates"] == 1 and stats["version"] == 2
        again.close()
    finally:
        server.stop()


@pytest.mark.slow
def test_kill_9_while_writing_checkpoints_never_leaves_a_torn_one(tmp_path):
    """SIGKILL at random moments while 16 MiB checkpoints are written back to back: the newest
    complete checkpoint always loads with its checksums intact, and a resumed server never
    takes a temporary directory for a checkpoint."""
    rng = random.Random(11)
    numel = 4 << 20
    flags = ["--workers", "1", "--sync", "asp", "--optimizer", "adam", "--checkpoint-dir", str(tmp_path),
             "--checkpoint-every", "0.02", "--checkpoint-keep", "2"]
    server = ServerProcess(*flags)
    port = str(server.port)
    stop = tmp_path / "stop"
    runner = Workers(resilient_worker, [(server.address, 0, 1, numel, 10**9, 0.0, "tcp", str(stop))], 170)
    versions = []
    try:
        wait_for(lambda: newest(tmp_path) >= 1, what="a first checkpoint")
        for trial in range(12):
            time.sleep(rng.uniform(0.05, 0.4))
            kill(server)
            found = list_checkpoints(tmp_path)
            assert found and all(not p.name.startswith(".") for p in found)
            checkpoint = read_checkpoint(found[0])  # verifies every checksum
            assert checkpoint.weights["w"].shape == (numel,)
            versions.append(checkpoint.version)
            server = ServerProcess("--port", port, "--checkpoint-dir", str(tmp_path), "--resume", "--checkpoint-every",
                                   "0.02", "--checkpoint-keep", "2")
            line = server.wait_for_log("resumed from").split("resumed from", 1)[1].splitlines()[0]
            assert f"{found[0].name}: version {checkpoint.version}," in line
            wait_for(lambda: newest(tmp_path) > checkpoint.version, what="training to go on after the resume")
        stop.touch()
        runner.join(60)  # the worker finishes its step and leaves
    finally:
        stop.touch()
        server.stop()
    assert versions == sorted(versions)  # each resume went on from where the last left off


def test_conflicting_flags_and_bad_checkpoints_refuse_to_start(tmp_path, capsys):
    server = ServerProcess("--workers", "1", "--lr", "0.1", "--checkpoint-dir", str(tmp_path), "--checkpoint-every",
                           "0", "--checkpoint-keep", "5")
    try:
        worker = aps.Worker(server.address, 0, 1, transport="tcp", reconnect=False)
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull({"w": np.ones(4, np.float32)})
        assert aps.cli.main(["checkpoint", "now", server.address]) == 0
        first = str(list_checkpoints(tmp_path)[0])
        assert f"checkpoint {first} (version 1)" in capsys.readouterr().out
        assert aps.cli.main(["checkpoint", server.address]) == 0  # the short form
        assert "checkpoint-00000002-v1 (version 1)" in capsys.readouterr().out
        assert aps.cli.main(["status", server.address]) == 0
        assert "checkpoint version 1 " in capsys.readouterr().out  # aps status shows the last one
        worker.push_pull({"w": np.ones(4, np.float32)})
        second = request_checkpoint(server.address)["path"]
        worker.close()
    finally:
        server.stop()
    # a flag given that differs from the run's: refused, naming the flag
    said = refused_to_start("--lr", "0.5", "--checkpoint-dir", str(tmp_path), "--resume")
    assert re.search(r"--lr 0.5 conflicts with checkpoint .* --lr 0.1", said, re.S), said
    said = refused_to_start("--workers", "2", "--checkpoint-dir", str(tmp_path), "--resume")
    assert re.search(r"--workers 2 conflicts", said, re.S), said
    # a corrupt newest checkpoint (the one written at shutdown): refused, and the intact older one offered
    newest_path = list_checkpoints(tmp_path)[0]
    assert str(newest_path) not in (first, second)
    model = newest_path / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    said = refused_to_start("--checkpoint-dir", str(tmp_path), "--resume")
    assert re.search(r"corrupt: checksum mismatch in model.safetensors.*--resume " + second, said, re.S), said
    # truncated
    model.write_bytes(bytes(data[: len(data) // 2]))
    said = refused_to_start("--resume", str(newest_path))
    assert re.search("truncated", said, re.S), said
    # the older one, named, resumes
    resumed = ServerProcess("--resume", first)
    try:
        assert "version 1," in resumed.wait_for_log("resumed from")
    finally:
        resumed.stop()


def test_a_checkpoint_directory_that_cannot_be_written_is_refused_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    said = refused_to_start("--checkpoint-dir", str(blocker / "checkpoints"))
    assert re.search("cannot", said, re.S), said


def test_a_read_only_checkpoint_directory_is_refused_at_start(tmp_path):
    import subprocess

    mount = tmp_path / "readonly"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        said = refused_to_start("--checkpoint-dir", str(mount))
        assert re.search("Read-only file system", said, re.S), said
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_checkpoint_directory_fails_the_checkpoint_not_the_training(tmp_path):
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        server = ServerProcess("--workers", "1", "--checkpoint-dir", str(mount), "--checkpoint-every", "0")
        try:
            worker = aps.Worker(server.address, 0, 1, transport="tcp", reconnect=False)
            worker.init({"w": np.zeros(1 << 18, np.float32)})  # 1 MiB: more than the directory holds
            with pytest.raises(aps.errors.CheckpointFailed, match="No space left"):
                request_checkpoint(server.address)
            assert sorted(p.name for p in mount.iterdir()) == [".lock", "lineage"]  # nothing half-written left
            before = worker.version
            worker.push_pull({"w": np.ones(1 << 18, np.float32)})  # training goes on
            assert worker.version == before + 1
            worker.close()
        finally:
            server.stop()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def restart_soon(into: list, port: str, *flags: str, delay: float = 0.4) -> None:
    """Start ``aps serve --port PORT FLAGS`` after ``delay`` seconds, on a timer: ``into``
    gets the timer, then the server."""
    timer = threading.Timer(delay, lambda: into.append(ServerProcess("--port", port, *flags)))
    into.append(timer)
    timer.start()


def stop_restarted(restarted: list) -> None:
    """Wait for ``restart_soon``'s timer, then stop the server it started."""
    if restarted:
        restarted[0].join()
        for other in restarted[1:]:
            other.stop()


def test_an_async_worker_gets_back_by_itself(tmp_path):
    import asyncio

    server = ServerProcess("--workers", "1", "--sync", "asp", "--checkpoint-dir", str(tmp_path), "--checkpoint-every",
                           "0")
    port = str(server.port)
    restarted: list = []

    async def main():
        worker = await aps.AsyncWorker.connect(server.address, 0, 1, reconnect_timeout=30)
        await worker.init({"w": np.zeros(16, np.float32)})
        for _ in range(3):
            await worker.push_pull({"w": np.ones(16, np.float32)})
        request_checkpoint(server.address)
        kill(server)
        restart_soon(restarted, port, "--checkpoint-dir", str(tmp_path), "--resume")
        weights = await worker.push_pull({"w": np.ones(16, np.float32)})  # waits for the server, then goes on
        assert worker.version == 4 and worker.clock == 4
        np.testing.assert_allclose(weights["w"], -0.04, rtol=1e-6)  # four updates, none twice (lr 0.01)
        await worker.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()
        stop_restarted(restarted)


def test_the_torch_optimizer_gets_back_by_itself_and_a_checkpoint_loads_into_a_model(tmp_path):
    torch = pytest.importorskip("torch")
    import aps.torch

    server = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "0.1", "--checkpoint-dir", str(tmp_path),
                           "--checkpoint-every", "0")
    port = str(server.port)
    restarted: list = []
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        opt = aps.torch.Optimizer(model, server.address, 0, 1, transport="tcp", reconnect_timeout=30)
        x, y = torch.randn(32, 4), torch.randn(32, 1)

        def step():
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        step()
        request_checkpoint(server.address)
        kill(server)
        restart_soon(restarted, port, "--checkpoint-dir", str(tmp_path), "--resume")
        step()  # waits for the server, then goes on
        step()
        assert opt.version == 3
        path = request_checkpoint(restarted[1].address)["path"]
        opt.close()
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        aps.torch.load_state_dict(fresh, path)  # no server needed
        for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
            assert torch.equal(a, b), name
    finally:
        server.stop()
        stop_restarted(restarted)


def test_a_server_restarted_without_its_checkpoint_is_another_run(tmp_path):
    server = ServerProcess("--workers", "1", "--sync", "asp")
    port = str(server.port)
    restarted: list = []
    try:
        worker = aps.Worker(server.address, 0, 1, transport="tcp", reconnect_timeout=30)
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull({"w": np.ones(4, np.float32)})
        kill(server)
        restart_soon(restarted, port, "--workers", "1", "--sync", "asp")  # no --resume: a new run
        with pytest.raises(aps.errors.RunChanged, match="another run.*--resume"):
            worker.push_pull({"w": np.ones(4, np.float32)})
        assert worker.version == 1  # nothing was taken from the new server
        worker.close()
    finally:
        server.stop()
        stop_restarted(restarted)


def test_one_directory_one_server_and_one_run(tmp_path):
    """A second server cannot write into a directory another one uses, and a new run does not
    start (and prune) in a directory that holds another run's checkpoints."""
    server = ServerProcess("--workers", "1", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0")
    try:
        said = refused_to_start("--checkpoint-dir", str(tmp_path))
        assert f"pid {server.proc.pid}) is writing checkpoints into {tmp_path}" in said, said
        worker = aps.Worker(server.address, 0, 1, transport="tcp", reconnect=False)
        worker.init({"w": np.zeros(4, np.float32)})
        request_checkpoint(server.address)
        worker.close()
    finally:
        server.stop()
    said = refused_to_start("--checkpoint-dir", str(tmp_path))  # forgot --resume
    assert "holds checkpoints of another run" in said and "give --resume" in said, said
    assert len(list_checkpoints(tmp_path)) == 2  # the one asked for, and the one at shutdown


def test_a_call_that_failed_leaves_nothing_to_send_again(tmp_path):
    """SSP s=1: push_pull(g1) times out at the gate (its connection is dropped, the push was
    applied); the next push(g2) reconnects and sends g2, not g1 again, and g2 is judged by
    the clock the worker had (1, the reply of g1 never came), within the bound: applied."""
    server = ServerProcess("--workers", "2", "--sync", "ssp", "--staleness", "1", "--lr", "1")
    try:
        fast = aps.Worker(server.address, 0, 2, transport="tcp", reconnect_timeout=30)
        slow = aps.Worker(server.address, 1, 2, transport="tcp", reconnect=False)
        joining = threading.Thread(target=slow.init, args=({"w": np.zeros(4, np.float32)},))
        joining.start()
        fast.init({"w": np.zeros(4, np.float32)})
        joining.join(10)
        fast.push_pull({"w": np.full(4, 1.0, np.float32)})  # iteration 0: one ahead of rank 1, released
        fast.timeout = 0.5
        with pytest.raises(aps.APSTimeoutError):
            fast.push_pull({"w": np.full(4, 2.0, np.float32)})  # g1, held: two ahead of rank 1
        fast.timeout = None
        slow.push_pull({"w": np.full(4, 10.0, np.float32)})
        fast.push({"w": np.full(4, 100.0, np.float32)})  # g2 (then held again, until rank 1 pushes)
        assert not fast.last_push_dropped
        weights = slow.pull()["w"]
        np.testing.assert_array_equal(weights, np.full(4, -113.0, np.float32))
        assert fetch_stats(server.address)["server"]["duplicates"] == 0
        fast.close()
        slow.close()
    finally:
        server.stop()


def test_close_ends_a_reconnect_in_another_thread(tmp_path):
    server = ServerProcess("--workers", "1", "--sync", "asp")
    worker = aps.Worker(server.address, 0, 1, transport="tcp", reconnect_timeout=60)
    worker.init({"w": np.zeros(4, np.float32)})
    kill(server)  # and it does not come back
    outcome: list = []

    def call():
        try:
            worker.push_pull({"w": np.ones(4, np.float32)})
            outcome.append("returned")
        except aps.APSError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)  # it is reconnecting
    start = time.monotonic()
    worker.close()
    caller.join(5)
    assert not caller.is_alive() and time.monotonic() - start < 3
    assert isinstance(outcome[0], aps.APSConnectionError) and "closed" in str(outcome[0]), outcome
    assert worker.shards[0]._conn is None
