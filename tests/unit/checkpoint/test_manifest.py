"""A checkpoint's manifest is checked before a resume takes anything from it: its checksum
(``manifest.sha256``), the type and range of every field a resume uses, and only regular
files are opened, with a deadline.

The manifest is a real one, written by a real ``aps serve`` process after real workers
trained; the sweeps load it (no server start per case), as ``aps serve --resume`` does.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time

import numpy as np
import pytest

from aps import checkpoint as ckpt
from aps.checkpoint import format as ckpt_format
from aps.checkpoint import reading as ckpt_reading
from aps.server.engine import Engine
from aps.cli import main
from aps.cli.checkpoint import request_checkpoint
from aps.cli.status import fetch_stats
from aps.config import RUN_OPTIONS, ServerConfig
from aps.errors import CheckpointError

from aps.testing import ServerProcess

WORKERS = 3


def _train(address: str, rank: int, steps: int) -> None:
    import aps

    with aps.Worker(address, rank, WORKERS, transport="tcp", reconnect=False) as worker:
        worker.init({"fc.weight": np.zeros((4, 3), np.float32), "fc.bias": np.zeros(4, np.float32)})
        for _ in range(steps):
            worker.push_pull({"fc.weight": np.full((4, 3), 0.5, np.float32), "fc.bias": np.ones(4, np.float32)})


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Two checkpoints of one run, written by ``aps serve`` (SSP s=2, lr 1, 3 workers)."""
    directory = tmp_path_factory.mktemp("written")
    server = ServerProcess("--workers", str(WORKERS), "--sync", "ssp", "--staleness", "2", "--lr", "1",
                           "--momentum", "0.5", "--checkpoint-dir", str(directory), "--checkpoint-every", "0")
    try:
        paths = []
        for steps in (4, 8):
            threads = [threading.Thread(target=_train, args=(server.address, r, steps)) for r in range(WORKERS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            paths.append(request_checkpoint(server.address)["path"])
    finally:
        server.stop()
    return directory, [ckpt.find_resumable(p).path for p in paths]


@pytest.fixture
def run_copy(written, tmp_path):
    """A copy of the written directory, newest checkpoint last in the returned list."""
    directory, paths = written
    target = tmp_path / "ckpts"
    target.mkdir()
    for path in paths:
        shutil.copytree(path, target / path.name)
    return target, [target / p.name for p in paths]


def reseal(path, data: bytes) -> None:
    """Write ``data`` as the manifest together with its checksum, as a writer would have."""
    (path / ckpt.MANIFEST_FILE).write_bytes(data)
    (path / ckpt.MANIFEST_SUM_FILE).write_text(f"{hashlib.sha256(data).hexdigest()}  manifest.json\n")


def edited(path, change) -> None:
    manifest = json.loads((path / ckpt.MANIFEST_FILE).read_text())
    change(manifest)
    reseal(path, json.dumps(manifest, indent=1).encode())


def restored_engine(checkpoint) -> Engine:
    """What aps serve --resume builds from ``checkpoint``: its options, then its state."""
    options = {name: checkpoint.manifest["config"][name] for name in RUN_OPTIONS}
    options["betas"] = tuple(options["betas"])
    engine = Engine(ServerConfig(**options))
    engine.durability.restore(checkpoint)
    return engine


def engine_state(engine: Engine) -> tuple:
    manifest, arrays = engine.durability.checkpoint_state()
    return (json.dumps(manifest, sort_keys=True), engine.model.table.current_array().tobytes(),
            {k: v.tobytes() for k, v in arrays.items()})


# The checksum ----------------------------------------------------------------------------------------------


def test_the_real_manifest_is_checksummed_and_resumes(run_copy):
    directory, paths = run_copy
    newest = paths[-1]
    data = (newest / ckpt.MANIFEST_FILE).read_bytes()
    assert (newest / ckpt.MANIFEST_SUM_FILE).read_text() == f"{hashlib.sha256(data).hexdigest()}  manifest.json\n"
    checkpoint = ckpt.find_resumable(directory)
    assert checkpoint.path == newest and checkpoint.manifest["format_version"] == 2
    engine = restored_engine(checkpoint)  # well-typed all through: the engine takes it up
    assert engine.version == checkpoint.version > 0 and engine.durability.run_id == checkpoint.manifest["run_id"]


def test_every_flipped_bit_of_a_real_manifest_is_refused_or_changes_nothing(run_copy):
    """One bit flipped in each byte of the manifest (bit i % 8 of byte i, so every bit position
    is hit), one byte at a time: each is refused at load, or (a flip that leaves the parsed
    content as it was) resumes exactly the same. (Alone in its directory, so that a refusal
    does not verify the older one each time: that it is named is checked below.)"""
    directory, (older, newest) = run_copy
    shutil.rmtree(older)
    original = (newest / ckpt.MANIFEST_FILE).read_bytes()
    expected = ckpt.find_resumable(directory).manifest
    refused = same = 0
    changed = []
    for i in range(len(original)):
        data = bytearray(original)
        data[i] ^= 1 << (i % 8)
        (newest / ckpt.MANIFEST_FILE).write_bytes(bytes(data))
        try:
            found = ckpt.find_resumable(directory)
        except CheckpointError as exc:
            refused += 1
            assert str(exc).startswith(f"checkpoint {newest} "), exc
            continue
        if found.manifest == expected:
            same += 1
        else:
            changed.append((i, bytes(original[max(0, i - 20):i + 20])))
    assert not changed, f"{len(changed)} flips changed the resumed state, e.g. {changed[:3]}"
    assert refused + same == len(original) and refused > 0.99 * len(original)
    # the checksum file itself
    (newest / ckpt.MANIFEST_FILE).write_bytes(original)
    line = (newest / ckpt.MANIFEST_SUM_FILE).read_bytes()
    for i in range(len(line)):
        flipped = bytearray(line)
        flipped[i] ^= 1 << (i % 8)
        (newest / ckpt.MANIFEST_SUM_FILE).write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match=f"{newest} is corrupt: .*manifest"):
            ckpt.find_resumable(directory)


def test_a_changed_value_with_the_old_checksum_is_refused(run_copy):
    """The flips the issue found: lr 1 -> 3, staleness 2 -> 3, version +1, a rank's push id."""
    directory, (older, newest) = run_copy
    original = (newest / ckpt.MANIFEST_FILE).read_text()
    manifest = json.loads(original)
    for change in (lambda m: m["config"].update(lr=3.0), lambda m: m["config"].update(staleness=3),
                   lambda m: m.update(version=m["version"] + 1), lambda m: m["seats"]["1"].update(push_id=0)):
        changed = copy.deepcopy(manifest)
        change(changed)
        (newest / ckpt.MANIFEST_FILE).write_text(json.dumps(changed, indent=1))  # the checksum left as it was
        with pytest.raises(CheckpointError) as info:
            ckpt.find_resumable(directory)
        assert str(info.value) == (f"checkpoint {newest} is corrupt: checksum mismatch in manifest.json; the next "
                                   f"older one, {older}, is intact: resume from it with --resume {older}")
    (newest / ckpt.MANIFEST_FILE).write_text(original)
    assert ckpt.find_resumable(directory).path == newest


def test_a_format_1_checkpoint_still_resumes_with_a_warning(run_copy, caplog):
    """Checkpoints written before manifests had checksums: read and checked for form, with a
    warning; a format 2 one without its checksum is incomplete."""
    directory, (older, newest) = run_copy
    (newest / ckpt.MANIFEST_SUM_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"{newest} is incomplete: manifest.sha256 is missing; the next older"):
        ckpt.find_resumable(directory)
    manifest = json.loads((newest / ckpt.MANIFEST_FILE).read_text())
    manifest["format_version"] = 1
    (newest / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="aps.checkpoint"):
        found = ckpt.find_resumable(directory)
    assert found.path == newest and restored_engine(found).version == found.version
    assert "format version 1, whose manifest has no checksum" in caplog.text
    manifest["policy"] = []  # its fields are still checked
    (newest / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot be resumed: policy: is a list"):
        ckpt.find_resumable(newest)


# The fields a resume takes up -------------------------------------------------------------------------------


def _set(path, value):
    def change(manifest):
        *parents, last = path
        target = manifest
        for key in parents:
            target = target[key]
        if value is DELETE:
            del target[last]
        else:
            target[last] = value
    return change


class _Delete:
    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()  # the field is removed

WRONG = [
    (("policy",), [], "policy: is a list ([]), not an object"),
    (("seats",), [1], "seats: is a list ([1]), not an object"),
    (("run_id",), 7, "run_id: is a number (7), not a run id"),
    (("run_id",), "", "run_id: is a string (\"\"), not a run id"),
    (("version",), "61", "version: is a string (\"61\"), not a whole number"),
    (("version",), 60.5, "version: is a number (60.5), not a whole number"),
    (("version",), True, "version: is true (true/false), not a whole number"),
    (("version",), -1, "version: is -1, out of range"),
    (("pushes",), DELETE, "pushes: is missing"),
    (("layout",), DELETE, "layout: is missing"),
    (("config",), None, "config: is null, not an object"),
    (("config", "lr"), "1", "config.lr: is a string (\"1\"), not a number"),
    (("config", "workers"), 3.0, "config.workers: is a number (3.0), not a whole number"),
    (("config", "staleness"), [2], "config.staleness: is a list ([2]), not a whole number"),
    (("config", "nesterov"), 0, "config.nesterov: is a number (0), not true or false"),
    (("config", "betas"), [0.9], "config.betas: is a list ([0.9]), not a list of 2"),
    (("config", "sync"), "nope", "config: unknown sync"),
    (("config", "workers"), 0, "config: --workers must be at least 1"),
    (("config", "shards"), DELETE, "config.shards: is missing"),
    (("optimizer",), "sgd", "optimizer: is a string (\"sgd\"), not an object"),
    (("optimizer", "name"), "adam", "optimizer.name: is a string (\"adam\"), but the run's optimizer is 'sgd'"),
    (("optimizer", "steps"), None, "optimizer.steps: is null, not a whole number"),
    (("optimizer", "loaded_state"), "xyz", "optimizer.loaded_state: is a string (\"xyz\"), not a hexadecimal"),
    (("policy", "name"), "asp", "policy.name: is a string (\"asp\"), but the run's sync policy is 'ssp'"),
    (("policy", "min_clock"), -1, "policy.min_clock: is -1, out of range"),
    (("policy", "min_clock"), 1 << 70, "policy.min_clock: is 1180591620717411303424, out of range"),
    (("policy", "clocks"), [1], "policy.clocks: has 1 entries, the run has 3 workers"),
    (("policy", "clocks"), {"0": 1}, "policy.clocks: is an object ({\"0\": 1}), not a list"),
    (("policy", "live"), [1, 1, 1], "policy.live[0]: is a number (1), not true or false"),
    (("policy", "credits"), [0, 0, -2], "policy.credits[2]: is -2, out of range"),
    (("seats", "0"), [], "seats.0: is a list ([]), not an object"),
    (("seats", "9"), {"clock": 0, "push_id": 1, "push_clock": 0}, "seats: has a seat '9', not a rank of the run's"),
    (("seats", "01"), {"clock": 0, "push_id": 1, "push_clock": 0}, "seats: has a seat '01'"),
    (("seats", "1", "push_id"), "31", "seats.1.push_id: is a string (\"31\"), not a whole number"),
    (("seats", "1", "push_clock"), DELETE, "seats.1.push_clock: is missing"),
    (("seats", "1", "held"), "no", "seats.1.held: is a string (\"no\"), not true or false"),
    (("seats", "1", "push_result"), [1], "seats.1.push_result: is a list ([1]), not [version, clock"),
    (("seats", "1", "push_result"), [1, 1, "x", 0, 1.0], "seats.1.push_result[2]: is a string"),
    (("counters",), [], "counters: is a list ([]), not an object"),
    (("counters", "duplicates"), -3, "counters.duplicates: is -3, out of range"),
    (("shard_runs",), "abc", "shard_runs: is a string (\"abc\"), not a list of the 1 shards' run ids"),
    (("shard_runs",), [5], "shard_runs[0]: is a number (5), not a run id"),
    (("table_steps",), [1], "table_steps: is a list ([1]), not an object"),
    (("table_steps",), {"t": 1}, "table_steps.t: names no declared table"),
    (("draining",), "yes", "draining: is a string (\"yes\"), not true or false"),
]


@pytest.mark.parametrize("path, value, message", WRONG, ids=[f"{'.'.join(p)}={v!r}"[:40] for p, v, _ in WRONG])
def test_a_manifest_of_the_wrong_shape_cannot_be_resumed(run_copy, path, value, message):
    """Valid JSON with its checksum, but a field of the wrong type or range: a CheckpointError
    naming the field (never a traceback from deep inside the restore), and the next older one."""
    directory, (older, newest) = run_copy
    edited(newest, _set(path, value))
    with pytest.raises(CheckpointError) as info:
        ckpt.find_resumable(newest)
    said = str(info.value)
    assert said.startswith(f"checkpoint {newest} cannot be resumed: {message}"), said
    assert said.endswith(f"the next older one, {older}, is intact: resume from it with --resume {older}"), said
    with pytest.raises(CheckpointError, match=f"cannot be resumed: .*the next older one, {older}"):
        ckpt.find_resumable(directory)
    ckpt.load_checkpoint(newest)  # the arrays and the layout are fine: it still loads, to look at


@pytest.mark.parametrize("layout", [
    None, [], {"names": ["w"], "shapes": [[4]], "tables": []},
    {"names": ["w"], "shapes": [[4]], "tables": {"t": {"rows": 1, "dim": 1, "lr": float("inf")}}},
    {"names": ["w"], "shapes": [[4]], "tables": {"t": {"rows": True, "dim": 1}}},
    {"names": ["w"], "shapes": [[4]], "tables": {"a/b": {"rows": 1, "dim": 1}}},
])
def test_a_layout_that_is_not_an_object_or_holds_bad_tables_is_refused_clearly(run_copy, layout):
    """(A checkpoint whose layout is not an object was an AttributeError from deep inside.)"""
    directory, (older, newest) = run_copy
    edited(newest, _set(("layout",), layout))
    with pytest.raises(CheckpointError, match="no valid layout"):
        ckpt.find_resumable(newest)
    with pytest.raises(CheckpointError, match=f"the next older one, {older}"):
        ckpt.find_resumable(directory)


def test_bsp_and_softsync_fields_are_checked_too(tmp_path):
    from .test_checkpoint import server_fields, write

    for sync, key, value, message in (("bsp", "contributed", [0, 7], "policy.contributed[1]: is 7, out of range"),
                                      ("bsp", "round_held", None, "policy.round_held: is null, not a list"),
                                      ("softsync", "count", "2", "policy.count: is a string")):
        fields = server_fields(sync=sync, staleness=None) if sync == "bsp" else server_fields(
            sync=sync, softsync_n=1, staleness=None)
        fields["policy"][key] = value
        path = write(tmp_path / sync / key, 1, 1, **fields)
        with pytest.raises(CheckpointError, match=re.escape(f"cannot be resumed: {message}")):
            ckpt.find_resumable(path)


def test_aps_checkpoint_verify_and_inspect_report_a_bad_manifest(run_copy, capsys):
    directory, (older, newest) = run_copy
    assert main(["checkpoint", "verify", str(directory)]) == 0
    assert f"checkpoint {newest}: intact and resumable: run " in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(newest)]) == 0
    assert "ok (manifest.sha256)" in capsys.readouterr().out
    edited(newest, _set(("seats",), [1]))
    with pytest.raises(SystemExit) as exited:
        main(["checkpoint", "verify", str(newest)])
    assert exited.value.code == 1
    assert f"cannot be resumed: seats: is a list ([1]), not an object; the next older one, {older}" in \
        capsys.readouterr().err
    data = bytearray((newest / ckpt.MANIFEST_FILE).read_bytes())
    data[100] ^= 4
    (newest / ckpt.MANIFEST_FILE).write_bytes(bytes(data))
    for action in ("verify", "inspect"):
        with pytest.raises(SystemExit) as exited:
            main(["checkpoint", action, str(newest)])
        assert exited.value.code == 1
        assert "corrupt: checksum mismatch in manifest.json" in capsys.readouterr().err


# Regular files only, and a deadline ------------------------------------------------------------------------


@pytest.mark.parametrize("name", [ckpt.MODEL_FILE, ckpt.STATE_FILE, ckpt.MANIFEST_FILE, ckpt.MANIFEST_SUM_FILE])
def test_a_fifo_in_a_files_place_is_refused_at_once(run_copy, name):
    directory, (older, newest) = run_copy
    (newest / name).unlink()
    os.mkfifo(newest / name)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=f"{name} is a FIFO, not a regular file.*the next older one, {older}"):
        ckpt.find_resumable(directory)
    with pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
        ckpt.load_checkpoint(newest)
    assert time.monotonic() - started < 5


def test_a_link_or_a_directory_in_a_files_place_is_refused(run_copy):
    directory, (older, newest) = run_copy
    model = newest / ckpt.MODEL_FILE
    os.rename(model, newest / "elsewhere")
    os.symlink(newest / "elsewhere", model)  # the same bytes, through a link: not followed
    with pytest.raises(CheckpointError, match="model.safetensors is a symbolic link, not a regular file"):
        ckpt.find_resumable(newest)
    model.unlink()
    model.mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors is a directory, not a regular file"):
        ckpt.find_resumable(newest)


def test_a_read_that_hangs_is_given_up_and_one_that_goes_on_is_not(run_copy, monkeypatch):
    directory, (older, newest) = run_copy
    hashing = ckpt_format._hash_fd
    release = threading.Event()

    def hung(fd):  # what a read from a hung NFS server does: nothing, for ever
        release.wait(30)
        return hashing(fd)

    monkeypatch.setattr(ckpt_reading, "_hash_fd", hung)  # where the reader looks it up
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointError, match=r"reading checkpoints at .* made no progress for 0.5 s"):
            ckpt.find_resumable(directory, stall=0.5)
        assert time.monotonic() - started < 3
    finally:
        release.set()

    def slow(fd):  # slow, but never stalled for long: 1.2 s in all, a little at a time
        for _ in range(6):
            time.sleep(0.2)
            ckpt_format._progress()
        return hashing(fd)

    monkeypatch.setattr(ckpt_reading, "_hash_fd", slow)  # where the reader looks it up
    assert ckpt.find_resumable(newest, stall=0.5).path == newest


def test_a_checkpoint_older_than_an_option_resumes_with_the_options_former_value(run_copy):
    """A manifest written before --staleness-cutoff existed does not say it: the run had none."""
    directory, (older, newest) = run_copy
    edited(newest, lambda m: m["config"].pop("staleness_cutoff"))
    server = ServerProcess("--resume", str(newest), "--fork-run", "--checkpoint-dir", str(directory / "forked"))
    try:
        stats = fetch_stats(server.address)["server"]
        assert stats["sync"] == "ssp s=2" and stats["version"] > 0 and stats["dropped_cutoff"] == 0
    finally:
        server.stop()
    edited(newest, lambda m: m["config"].pop("sync"))  # an option every checkpoint says: refused
    with pytest.raises(RuntimeError, match="config.sync: is missing"):
        ServerProcess("--resume", str(newest), "--fork-run", "--checkpoint-dir", str(directory / "forked2"))


def test_a_run_that_was_ending_resumes_ending(run_copy):
    """A worker had finished (leave(finished=True)): the resumed run still lets the others end
    below MIN; a manifest that does not say so (written before) resumes as not ending."""
    directory, (older, newest) = run_copy
    engine = restored_engine(ckpt.find_resumable(newest))
    assert engine.roster.draining is False and "draining" not in engine.durability.checkpoint_state()[0]
    engine.roster.draining = True
    manifest, _ = engine.durability.checkpoint_state()
    assert manifest["draining"] is True
    edited(newest, lambda m: m.update(draining=True))
    assert restored_engine(ckpt.find_resumable(newest)).roster.draining is True
