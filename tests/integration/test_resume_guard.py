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
import shutil
import time

import numpy as np
import pytest

import aps
from aps.checkpoint import (
    LINEAGE_FILE,
    MANIFEST_FILE,
    MANIFEST_MAC_FILE,
    MANIFEST_SUM_FILE,
    MODEL_FILE,
    list_checkpoints,
    read_checkpoint,
)
from aps.cli.checkpoint import request_checkpoint
from aps.cli.status import fetch_stats
from aps.errors import RunChanged
from aps.testing import TOKEN, ServerProcess
from aps.wire.tokens import new_token


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


# A copy of a live run's checkpoint -------------------------------------------------------------------------


def test_a_copy_of_a_live_runs_checkpoint_is_not_resumed_elsewhere(tmp_path):
    """``cp -r DIR/checkpoint-... OTHER/`` then ``aps serve --checkpoint-dir OTHER --resume``:
    the directory's lock is not in the copy, but the run's server is asked where the
    checkpoint says it served, and it is live: refused, naming it and --fork-run. Once it is
    gone, the copy resumes the run."""
    server, (path, _) = run_with_checkpoints(tmp_path / "run")
    try:
        other = tmp_path / "copy"
        other.mkdir()
        shutil.copytree(path, other / pathlib.Path(path).name)
        said = refused_to_start("--checkpoint-dir", str(other), "--resume")
        assert f"run {run_id(server)} is still served at {server.address}" in said and "--fork-run" in said, said
        server.proc.kill()
        server.proc.wait(10)
    finally:
        server.stop()
    resumed = ServerProcess("--checkpoint-dir", str(other), "--resume")
    try:
        assert "version 1," in resumed.wait_for_log("resumed from")
    finally:
        resumed.stop()


def test_a_worker_refuses_a_server_of_its_run_that_its_last_server_did_not_lead_to(tmp_path):
    """Each start of a server draws an incarnation; a resumed one carries on its checkpoint's
    lineage. A worker served by one resumed from a copy (the run's first server gone) goes on
    with it; when a server resumed from the original checkpoints then takes the address, it
    lacks what the worker's last server applied: the worker refuses it (RunChanged)."""
    first, (path, _) = run_with_checkpoints(tmp_path / "run")
    port = first.port
    try:
        worker = aps.Worker(first.address, 0, 1, transport="tcp", reconnect_timeout=60, heartbeat=0.5)
        worker.init({"w": np.zeros(4, np.float32)})
        first.proc.kill()
        first.proc.wait(10)
    finally:
        first.stop()
    other = tmp_path / "copy"
    other.mkdir()
    shutil.copytree(path, other / pathlib.Path(path).name)
    copy = ServerProcess("--checkpoint-dir", str(other), "--resume", "--port", str(port))
    try:
        worker.push_pull({"w": np.ones(4, np.float32)})  # reconnected: the copy's lineage holds the first server
        lineage = read_checkpoint(request_checkpoint(copy.address)["path"]).manifest["lineage"]
        assert len(lineage) == 2 and len(set(lineage)) == 2
    finally:
        copy.proc.kill()
        copy.proc.wait(10)
        copy.stop()
    original = ServerProcess("--checkpoint-dir", str(tmp_path / "run"), "--resume", "--port", str(port))
    try:
        with pytest.raises(RunChanged, match="does not descend from the server that served this worker last"):
            worker.push_pull({"w": np.ones(4, np.float32)})
    finally:
        worker.close()
        original.stop()


# Signed checkpoints ------------------------------------------------------------------------------------------


def signed_run(directory, token: str) -> tuple[ServerProcess, str]:
    """A server with ``token`` that wrote one checkpoint into ``directory``, killed."""
    server = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "1", "--checkpoint-dir", str(directory),
                           "--checkpoint-every", "0", "--token", token)
    with aps.Worker(server.address, 0, 1, transport="tcp", token=token, reconnect=False) as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull({"w": np.ones(4, np.float32)})
        path = request_checkpoint(server.address, token=token)["path"]
    server.proc.kill()
    server.proc.wait(10)
    server.stop()
    return server, path


def test_a_checkpoint_is_signed_with_the_runs_token_and_a_forged_one_is_refused(tmp_path):
    """With a token of the operator's, each checkpoint's manifest is signed (HMAC-SHA256 under
    a key derived from the token, in manifest.hmac). A manifest altered and given a matching
    SHA-256, as anyone can compute one, is refused; so is a checkpoint signed with another
    token, or not signed; --resume-unsigned takes the unsigned one when asked."""
    token, other = TOKEN, new_token()
    _, path = signed_run(tmp_path / "run", token)
    assert (pathlib.Path(path) / MANIFEST_MAC_FILE).exists()
    resumed = ServerProcess("--checkpoint-dir", str(tmp_path / "run"), "--resume", "--token", token)
    resumed.stop()
    # a forgery: lr 1 -> 1000, with the SHA-256 line recomputed
    manifest = pathlib.Path(path, MANIFEST_FILE)
    forged = manifest.read_bytes().replace(b'"lr": 1.0', b'"lr": 1000.0', 1)
    manifest.write_bytes(forged)
    pathlib.Path(path, MANIFEST_SUM_FILE).write_text(f"{hashlib.sha256(forged).hexdigest()}  {MANIFEST_FILE}\n")
    said = refused_to_start("--checkpoint-dir", str(tmp_path / "run"), "--resume", path, "--token", token)
    assert "is not signed with this server's token" in said and "altered" in said, said
    # signed with another token
    _, elsewhere = signed_run(tmp_path / "other", other)
    said = refused_to_start("--resume", elsewhere, "--token", token)
    assert "is not signed with this server's token" in said, said
    # not signed at all (its server had no token of the operator's), taken when asked
    unsigned, paths = run_with_checkpoints(tmp_path / "unsigned", count=1)
    unsigned.stop()
    assert not (pathlib.Path(paths[0]) / MANIFEST_MAC_FILE).exists()
    said = refused_to_start("--resume", paths[0], "--token", token)
    assert "is not signed" in said and "--resume-unsigned" in said, said
    taken = ServerProcess("--resume", paths[0], "--token", token, "--resume-unsigned")
    try:
        assert "version 1," in taken.wait_for_log("resumed from")
    finally:
        taken.stop()


def test_a_server_killed_before_its_first_checkpoint_still_leads_to_the_next(tmp_path):
    """The directory keeps a journal of the incarnations that served from it: a server
    resumed there, killed before it wrote a checkpoint of its own, is an ancestor of the
    next one resumed there (from the same, older checkpoint), and its workers follow."""
    directory = tmp_path / "run"
    options = ("--checkpoint-dir", str(directory), "--checkpoint-every", "0")
    first = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "1", *options)
    port = str(first.port)
    worker = aps.Worker(first.address, 0, 1, transport="tcp", reconnect_timeout=60, heartbeat=0.5)
    servers = [first]
    try:
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull({"w": np.ones(4, np.float32)})
        request_checkpoint(first.address)
        for _ in range(2):
            servers[-1].proc.kill()
            servers[-1].proc.wait(10)
            servers.append(ServerProcess(*options, "--resume", "--port", port))
            worker.push_pull({"w": np.ones(4, np.float32)})  # it follows each, none wrote a checkpoint
        lineage = read_checkpoint(request_checkpoint(servers[-1].address)["path"]).manifest["lineage"]
        assert len(lineage) == 3 and len(set(lineage)) == 3, lineage
        assert (directory / LINEAGE_FILE).read_text().split() == lineage
    finally:
        worker.close()
        for server in servers:
            server.stop()
