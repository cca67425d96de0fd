"""What ``aps serve --resume`` refuses, with real server processes: a damaged or ill-typed
manifest (naming the next older intact checkpoint), a FIFO in a file's place (at once, not
for ever), and a second server for a run that a live server goes on with (naming its pid),
until that server is stopped or killed; ``--fork-run`` goes on from it as a new run.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import time

import numpy as np
import pytest

import aps
from aps.checkpoint import MANIFEST_FILE, MODEL_FILE, list_checkpoints, read_checkpoint
from aps.cli.checkpoint import request_checkpoint
from aps.cli.status import fetch_stats

from aps.testing import ServerProcess


def refused_to_start(*flags: str, timeout: float = 30.0) -> str:
    """``aps serve FLAGS`` must refuse to start: returns what it said."""
    try:
        server = ServerProcess(*flags, timeout=timeout)
    except RuntimeError as exc:
        return str(exc)
    server.stop()
    pytest.fail(f"aps serve {' '.join(flags)} started")


def run_with_checkpoints(directory, count: int = 2) -> tuple[ServerProcess, list]:
    """A live server owning ``directory``, with ``count`` checkpoints written there."""
    server = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "1", "--checkpoint-dir", str(directory),
                           "--checkpoint-every", "0")
    worker = aps.Worker(server.address, 0, 1, transport="tcp", reconnect=False)
    worker.init({"w": np.zeros(4, np.float32)})
    paths = []
    for _ in range(count):
        worker.push_pull({"w": np.ones(4, np.float32)})
        paths.append(request_checkpoint(server.address)["path"])
    worker.close()
    return server, paths


def run_id(server: ServerProcess) -> str:
    return fetch_stats(server.address)["server"]["run_id"]


# A damaged manifest --------------------------------------------------------------------------------------


def test_a_flipped_bit_in_the_manifest_is_refused_naming_the_next_older_intact_one(tmp_path):
    """The issue's flip: lr 1 -> 3 in the newest checkpoint's manifest. aps serve --resume refuses
    it, names the older intact checkpoint, and resumes from that one when asked."""
    server, (older, newer) = run_with_checkpoints(tmp_path)
    server.proc.kill()  # no shutdown checkpoint: `newer` stays the newest
    server.proc.wait(10)
    server.stop()
    manifest = pathlib.Path(newer, MANIFEST_FILE)
    data = bytearray(manifest.read_bytes())
    at = data.index(b'"lr": 1.0')
    data[at + 6] ^= 0x02  # "1.0" -> "3.0": still valid JSON, another run
    manifest.write_bytes(bytes(data))
    said = refused_to_start("--checkpoint-dir", str(tmp_path), "--resume")
    assert (f"checkpoint {newer} is corrupt: checksum mismatch in manifest.json; the next older one, {older}, "
            f"is intact: resume from it with --resume {older}") in said, said
    assert "Traceback" not in said
    resumed = ServerProcess("--checkpoint-dir", str(tmp_path), "--resume", older)
    try:
        assert "version 1," in resumed.wait_for_log("resumed from")
        assert fetch_stats(resumed.address)["server"]["version"] == 1
    finally:
        resumed.stop()


def test_a_manifest_of_the_wrong_shape_says_it_cannot_be_resumed(tmp_path):
    server, (older, newer) = run_with_checkpoints(tmp_path)
    server.proc.kill()
    server.proc.wait(10)
    server.stop()
    path = pathlib.Path(newer, MANIFEST_FILE)
    manifest = json.loads(path.read_text())
    manifest["policy"] = []  # valid JSON, with a checksum that matches: a writer's bug, not a flip
    data = json.dumps(manifest).encode()
    path.write_bytes(data)
    pathlib.Path(newer, "manifest.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  manifest.json\n")
    said = refused_to_start("--resume", newer)
    assert (f"checkpoint {newer} cannot be resumed: policy: is a list ([]), not an object; the next older one, "
            f"{older}, is intact") in said, said
    assert "Traceback" not in said


@pytest.mark.parametrize("name", [MODEL_FILE, MANIFEST_FILE])
def test_a_fifo_in_a_files_place_is_refused_at_once(tmp_path, name):
    """A FIFO named model.safetensors (or manifest.json) used to hang --resume for ever."""
    server, (older, newer) = run_with_checkpoints(tmp_path)
    server.proc.kill()
    server.proc.wait(10)
    server.stop()
    os.unlink(os.path.join(newer, name))
    os.mkfifo(os.path.join(newer, name))
    started = time.monotonic()
    said = refused_to_start("--checkpoint-dir", str(tmp_path), "--resume", timeout=20)
    assert time.monotonic() - started < 20
    assert f"{name} is a FIFO, not a regular file; the next older one, {older}, is intact" in said, said


# One run, one live server -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["sigterm", "kill-9"])
def test_a_live_runs_checkpoint_is_not_resumed_beside_it(tmp_path, stop):
    """The issue's case: --checkpoint-dir OTHER --resume DIR/checkpoint-N beside the live server
    owning DIR is refused, naming its pid; once that server is stopped (or killed: a dead
    process's lock does not count), the resume works, and holds DIR in its turn."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    server, (first, _) = run_with_checkpoints(run_dir)
    try:
        original = run_id(server)
        for flags in (["--checkpoint-dir", str(other), "--resume", first],  # beside it, writing elsewhere
                      ["--resume", first],  # writing nowhere
                      ["--checkpoint-dir", str(other), "--resume", str(run_dir)],  # its directory
                      ["--checkpoint-dir", str(run_dir), "--resume"]):  # in its directory
            said = refused_to_start(*flags)
            assert f"{run_dir} is held by a live aps server (pid {server.proc.pid})" in said, said
            assert "two copies of one run" in said and "--fork-run" in said, said
        assert not other.exists()  # nothing was started or written
        assert server.alive() and run_id(server) == original
    finally:
        if stop == "kill-9":
            server.proc.kill()
            server.proc.wait(10)
        server.stop()
    assert (run_dir / ".lock").read_text().strip() == str(server.proc.pid)  # left behind, stale
    copy = ServerProcess("--checkpoint-dir", str(other), "--resume", first)
    try:
        assert run_id(copy) == original and "resumed from" in copy.wait_for_log("resumed from")
        # the original directory is the copy's now: the run is not resumed there a second time
        said = refused_to_start("--checkpoint-dir", str(run_dir), "--resume")
        assert f"{run_dir} is held by a live aps server (pid {copy.proc.pid})" in said, said
        said = refused_to_start("--checkpoint-dir", str(tmp_path / "third"), "--resume", str(other))
        assert f"(pid {copy.proc.pid})" in said, said
    finally:
        copy.stop()
    again = ServerProcess("--checkpoint-dir", str(run_dir), "--resume")
    try:
        assert run_id(again) == original
    finally:
        again.stop()


def test_fork_run_goes_on_from_a_live_runs_checkpoint_as_a_new_run(tmp_path):
    run_dir, other = tmp_path / "run", tmp_path / "other"
    server, (first, _) = run_with_checkpoints(run_dir)
    try:
        original = run_id(server)
        fork = ServerProcess("--checkpoint-dir", str(other), "--resume", first, "--fork-run")
        try:
            forked = run_id(fork)
            assert forked != original
            assert f"goes on as a new run, {forked}" in fork.wait_for_log("--fork-run")
            worker = aps.Worker(fork.address, 0, 1, transport="tcp", reconnect=False)
            weights = worker.init({"w": np.zeros(4, np.float32)})
            np.testing.assert_array_equal(weights["w"], np.full(4, -1.0, np.float32))  # the checkpoint's
            worker.push_pull({"w": np.ones(4, np.float32)})
            written = request_checkpoint(fork.address)["path"]
            worker.close()
            assert read_checkpoint(written).manifest["run_id"] == forked
        finally:
            fork.stop()
        assert server.alive() and run_id(server) == original
        assert all(read_checkpoint(p).manifest["run_id"] == original for p in list_checkpoints(run_dir))
    finally:
        server.stop()
    said = refused_to_start("--fork-run")
    assert re.search(r"--fork-run starts a new run from a checkpoint: give --resume PATH", said), said
