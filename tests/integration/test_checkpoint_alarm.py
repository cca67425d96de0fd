"""A checkpoint directory on a disk that fills up: the failures show at once in ``/metrics``,
``aps status --json`` and the human ``aps status`` (an alarm), from the first one on.

The disk is real: a small tmpfs mounted by the test as the ``--checkpoint-dir`` (which needs
root and a mount the sandbox allows: skipped, saying why, elsewhere), filled by a file until
writes fail with ENOSPC, then emptied again.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import aps

from aps.testing import wait_for
from .test_http import get, http_address, samples

#: The test's disk: room for a few checkpoints of the model below (each about 260 KB).
DISK_BYTES = 4 << 20
NUMEL = 1 << 16


class SmallDisk:
    """A tmpfs of ``size`` bytes mounted at ``path`` (unmounted by :meth:`close`)."""

    def __init__(self, path: pathlib.Path, size: int) -> None:
        self.path = path
        path.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "aps-test", str(path)],
                                 capture_output=True, text=True, timeout=30)
        if mounted.returncode != 0:
            path.rmdir()
            pytest.skip(f"cannot mount a tmpfs for the full disk ({mounted.stderr.strip() or mounted.returncode}): "
                        "this test needs root and a mount the sandbox allows")
        self.filler = path / "filler"

    def fill(self) -> int:
        """Take every free byte (writes then fail with ENOSPC); returns the bytes taken."""
        taken = 0
        with open(self.filler, "ab", buffering=0) as fh:
            for chunk in (1 << 16, 4096, 512, 1):
                block = b"\0" * chunk
                while True:
                    try:
                        fh.write(block)
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC, exc
                        break
                    taken += chunk
        assert shutil.disk_usage(self.path).free == 0
        return taken

    def empty(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)  # still in use: lazily
        try:
            self.path.rmdir()
        except OSError:
            pass


@pytest.fixture
def small_disk(tmp_path):
    """A small tmpfs (DISK_BYTES), mounted for the test and unmounted after it."""
    disk = SmallDisk(tmp_path / "disk", DISK_BYTES)
    try:
        yield disk
    finally:
        disk.close()


def metrics(base: str) -> dict:
    status, text, _ = asyncio.run(get(base + "metrics"))
    assert status == 200
    return samples(text)


def status_cli(address: str, *args: str) -> str:
    """``aps status ADDRESS ARGS`` in a process of its own, as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "aps", "status", address, *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    return done.stdout


def failure_info(m: dict) -> dict:
    """The labels of aps_checkpoint_last_failure_info (its one sample)."""
    infos = [dict(labels) for (name, labels), value in m.items() if name == "aps_checkpoint_last_failure_info"]
    assert len(infos) == 1 and m[("aps_checkpoint_last_failure_info", tuple(sorted(infos[0].items())))] == 1
    return infos[0]


def start(server_process, disk: SmallDisk):
    # Nothing is pruned while the test runs: a prune frees one checkpoint's room, the next one
    # fits in it, and a disk filled just before a prune would never stay full.
    server = server_process("--workers", "1", "--sync", "asp", "--checkpoint-dir", str(disk.path),
                            "--checkpoint-every", "0.2", "--checkpoint-keep", "1000", "--http-port", "0")
    return server, http_address(server)


def test_a_disk_full_from_the_first_checkpoint_on_raises_the_alarm_everywhere(server_process, small_disk):
    server, base = start(server_process, small_disk)
    # Published from the start: nothing failed yet, and nothing written.
    m = metrics(base)
    assert m[("aps_checkpoints_failed_total", ())] == 0 and m[("aps_checkpoints_written_total", ())] == 0
    assert m[("aps_checkpoint_failing", ())] == 0
    assert ("aps_checkpoint_version", ()) not in m
    small_disk.fill()
    worker = aps.Worker(server.address, 0, 1, transport="tcp")
    worker.init({"w": np.zeros(NUMEL, np.float32)})
    grad = {"w": np.ones(NUMEL, np.float32)}

    def failed_twice():
        worker.push(grad)
        return metrics(base)[("aps_checkpoints_failed_total", ())] >= 2

    wait_for(failed_twice, 20, "two checkpoints to fail", every=0.1)
    m = metrics(base)
    assert m[("aps_checkpoints_written_total", ())] == 0 and m[("aps_checkpoint_failing", ())] == 1
    assert m[("aps_checkpoint_failures_in_a_row", ())] == m[("aps_checkpoints_failed_total", ())]
    info = failure_info(m)
    assert "No space left on device" in info["error"] and info["reason"] == "periodic"
    assert 1 <= int(info["version"]) <= m[("aps_version", ())]
    assert abs(m[("aps_checkpoint_last_failure_timestamp_seconds", ())] - time.time()) < 30
    assert m[("aps_checkpoint_age_seconds", ())] > 0  # counted from the server's start: no good one yet

    stats = json.loads(status_cli(server.address, "--json"))["server"]
    cp = stats["checkpoints"]
    assert cp["failing"] is True and cp["written"] == 0 and cp["failed"] >= 2 and cp["last_written_unix"] is None
    assert "No space left on device" in cp["last_error"]["error"] and cp["last_error"]["version"] >= 1
    assert cp["directory"] == str(small_disk.path) and stats["checkpoint"] is None

    human = status_cli(server.address).splitlines()
    assert human[1].startswith("!! CHECKPOINTS FAILING: ") and "No space left on device" in human[1]
    assert "none written in the" in human[1] and "since the server started" in human[1]

    # Room again: the next checkpoint is written, and the alarm is over.
    small_disk.empty()

    def written():
        worker.push(grad)
        return metrics(base)[("aps_checkpoints_written_total", ())] >= 1

    wait_for(written, 20, "a checkpoint to be written again", every=0.1)
    m = metrics(base)
    assert m[("aps_checkpoint_failing", ())] == 0 and m[("aps_checkpoint_failures_in_a_row", ())] == 0
    assert "No space left on device" in failure_info(m)["error"]  # the newest failure stays on record
    human = status_cli(server.address)
    assert "!!" not in human and "checkpoint version" in human
    worker.close()
    log = server.log()
    assert "No space left on device" in log and "checkpoints are written again" in log
    assert log.count("Traceback") <= 1  # the first failure of the run with its traceback, the others a line each


def test_a_disk_that_fills_after_some_checkpoints_says_how_old_the_last_good_one_is(server_process, small_disk):
    server, base = start(server_process, small_disk)
    worker = aps.Worker(server.address, 0, 1, transport="tcp")
    worker.init({"w": np.zeros(NUMEL, np.float32)})
    grad = {"w": np.ones(NUMEL, np.float32)}

    def written():
        worker.push(grad)
        return metrics(base)[("aps_checkpoints_written_total", ())] >= 1

    wait_for(written, 20, "a first checkpoint", every=0.1)
    good = metrics(base)[("aps_checkpoint_version", ())]
    small_disk.fill()

    def failing():
        worker.push(grad)
        return metrics(base)[("aps_checkpoint_failing", ())] == 1

    wait_for(failing, 20, "a checkpoint to fail", every=0.1)
    m = metrics(base)
    last_good = m[("aps_checkpoint_version", ())]
    assert last_good >= good and int(failure_info(m)["version"]) > last_good
    stats = json.loads(status_cli(server.address, "--json"))["server"]
    cp = stats["checkpoints"]
    assert cp["failing"] and cp["written"] >= 1 and cp["last_written_version"] == last_good
    assert stats["checkpoint"]["version"] == last_good
    human = status_cli(server.address).splitlines()
    assert human[1].startswith("!! CHECKPOINTS FAILING: ") and "No space left on device" in human[1]
    assert "the last checkpoint written is" in human[1] and f"(version {int(last_good)})" in human[1]
    worker.close()
