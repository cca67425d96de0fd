"""The server's part of a resume (:class:`aps.server.resume.Resume`), at its seams:

- ``find(config)``: the configuration and the checkpoint ``--resume`` names, read with
  :func:`aps.checkpoint.find_resumable` (the run's options taken from its manifest, those
  given checked against it; with a key, only a checkpoint signed with it), and the lock on
  the directory it came from (:func:`aps.checkpoint.lock_run_directory`), let go on refusal;
- ``holds(directory)`` and ``release()``: the server's question before its checkpointer takes
  the same directory, and its letting go;
- ``take_up(engine, checkpoint, config, token)``, on a real :class:`~aps.server.engine.Engine`
  that restored the checkpoint: ``carry_journal`` (the directory's journal,
  :func:`aps.checkpoint.read_lineage`), ``carry_rewound_lineage`` (the environment a
  rewinding server hands its lineage on in), the question to :mod:`aps.server.twin`
  (``serving_run``, replaced here: asking a live server is the integration tests'), and
  ``fork`` (``--fork-run``).

The checkpoints are real: written by the server's :class:`~aps.server.checkpointer.Checkpointer`
from a real engine that workers joined and pushed to (no sockets, no processes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib

import numpy as np
import pytest

from aps.checkpoint import checkpoint_key, lock_directory, read_lineage, record_incarnation
from aps.config import RESUME_LATEST, ServerConfig
from aps.errors import CheckpointError
from aps.server import resume as resume_module
from aps.server.checkpointer import Checkpointer
from aps.server.engine import Engine
from aps.server.resume import REWOUND_LINEAGE, Resume
from aps.wire.protocol import ServerInfo, decode_claim

from tests.harness import Harness

KEY = checkpoint_key(b"the operator's token")
RUN = {"workers": 2, "sync": "ssp", "staleness": 2, "lr": 0.5}


def written_run(
    directory: pathlib.Path, count: int = 1, *, key: bytes | None = None, served_at: str = "", **options
) -> tuple[Harness, list[pathlib.Path]]:
    """A run whose checkpointer wrote ``count`` checkpoints into ``directory`` (a push before
    each), then stopped without one more: its engine, and the checkpoints, oldest first."""
    harness = Harness(**{**RUN, **options, "checkpoint_dir": str(directory), "checkpoint_every": 0})
    harness.engine.durability.address = served_at
    harness.join_all(np.linspace(-1, 1, harness.numel, dtype=np.float32))

    async def write() -> list[pathlib.Path]:
        checkpointer = Checkpointer(harness.config, harness.engine, key=key)
        checkpointer.start()
        paths = []
        try:
            for _ in range(count):
                harness.push(0, np.ones(harness.numel, np.float32), then_pull=True)
                paths.append(pathlib.Path((await checkpointer.request("periodic"))["path"]))
        finally:
            await checkpointer.close_without_checkpoint()
        return paths

    return harness, asyncio.run(write())


def resumed(config: ServerConfig, resume: Resume, token: bytes | None = None) -> Engine:
    """A new engine that restored what ``resume`` found and took the run up (as Server.start)."""
    config, checkpoint = resume.find(config)
    assert checkpoint is not None
    engine = Engine(config)
    try:
        engine.durability.restore(checkpoint)
        asyncio.run(resume.take_up(engine, checkpoint, config, token))
    except BaseException:
        resume.release()  # (as the server does when its start fails)
        raise
    return engine


def found(resume: Resume, config: ServerConfig) -> pathlib.Path | None:
    """The checkpoint ``resume`` finds for ``config`` (the directory let go again)."""
    try:
        return None if (checkpoint := resume.find(config)[1]) is None else checkpoint.path
    finally:
        resume.release()


@pytest.fixture
def resumes():
    """Resumes made by a test, let go of at its end (their locks are the process's)."""
    made: list[Resume] = []

    def make(given: set[str] | None = None, key: bytes | None = None) -> Resume:
        made.append(Resume(given, key))
        return made[-1]

    yield make
    for resume in made:
        resume.release()


@pytest.fixture
def no_twin(monkeypatch):
    """The twin question, recorded: ``(address, token, claim)`` each time; no server answers."""
    asked: list[tuple[object, bytes | None, dict[str, str]]] = []

    def serving_run(address, token, claim=b""):
        asked.append((address, token, decode_claim(claim)))
        return None

    monkeypatch.setattr(resume_module, "serving_run", serving_run)
    return asked


# find: the configuration, the checkpoint, the lock ------------------------------------------------------


def test_without_resume_the_config_is_as_given_and_nothing_is_held(tmp_path, resumes):
    resume = resumes()
    config = ServerConfig(**RUN, checkpoint_dir=str(tmp_path))
    assert resume.find(config) == (config, None)
    assert resume.lock is None and not resume.holds(str(tmp_path))


def test_the_runs_options_come_from_the_newest_checkpoint_and_its_directory_is_held(tmp_path, resumes):
    _, (older, newer) = written_run(tmp_path, 2)
    resume = resumes(given=set())
    config, checkpoint = resume.find(ServerConfig(checkpoint_dir=str(tmp_path), resume=RESUME_LATEST))
    assert checkpoint is not None and checkpoint.path == newer and checkpoint.version == 2
    assert (config.workers, config.sync, config.staleness, config.lr) == (2, "ssp", 2, 0.5)
    assert resume.holds(str(tmp_path)) and resume.holds(f"{tmp_path}/./")  # (the same directory, spelt otherwise)
    assert not resume.holds(str(tmp_path / "elsewhere"))
    # a checkpoint named: the directory it lies in is held
    other = resumes(given=set())
    with pytest.raises(CheckpointError, match=r"is held by a live aps server .*two copies of one run.*--fork-run"):
        other.find(ServerConfig(resume=str(older)))
    assert other.lock is None
    resume.release()
    assert not resume.holds(str(tmp_path))
    config, checkpoint = other.find(ServerConfig(resume=str(older)))
    assert checkpoint is not None and checkpoint.path == older and other.holds(str(tmp_path))
    resume.release()  # (twice: nothing more)


def test_a_given_option_must_agree_with_the_runs_and_a_refusal_lets_go(tmp_path, resumes):
    written_run(tmp_path)
    resume = resumes(given={"sync", "staleness", "lr"})
    config = ServerConfig(sync="ssp", staleness=2, lr=0.5, resume=str(tmp_path))
    assert resume.find(config)[0].workers == 2  # agrees: taken up
    resume.release()
    with pytest.raises(CheckpointError, match=r"--staleness 3 conflicts with checkpoint .* has --staleness 2"):
        resume.find(ServerConfig(sync="ssp", staleness=3, resume=str(tmp_path)))
    assert resume.lock is None


def test_without_a_list_of_given_options_those_off_their_default_were_given(tmp_path, resumes):
    """The Python API: Server(**options) with a config object tells nothing else."""
    written_run(tmp_path)
    with pytest.raises(CheckpointError, match="--optimizer adam conflicts"):
        resumes(given=None).find(ServerConfig(optimizer="adam", resume=str(tmp_path)))
    config, _ = resumes(given=None).find(ServerConfig(resume=str(tmp_path)))
    assert config.optimizer == "sgd" and config.lr == 0.5


def test_latest_in_an_empty_directory_is_a_new_run_holding_it(tmp_path, resumes, caplog):
    resume = resumes()
    config = ServerConfig(checkpoint_dir=str(tmp_path), resume=RESUME_LATEST)
    with caplog.at_level(logging.WARNING, "aps.server"):
        assert resume.find(config) == (config, None)
    assert "holds no checkpoint yet: starting a new run" in caplog.text
    assert resume.holds(str(tmp_path))  # (the server hands it to its checkpointer)


def test_a_named_path_without_a_checkpoint_is_refused(tmp_path, resumes):
    resume = resumes()
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        resume.find(ServerConfig(resume=str(tmp_path)))
    assert resume.lock is None


def test_a_directory_a_live_server_writes_into_is_refused(tmp_path, resumes):
    """Its checkpointer's lock (lock_directory); once let go, the run is resumed."""
    written_run(tmp_path)
    lock = lock_directory(tmp_path)
    try:
        with pytest.raises(CheckpointError, match=rf"held by a live aps server \(pid {os.getpid()}\)"):
            resumes().find(ServerConfig(resume=str(tmp_path)))
    finally:
        lock.close()
    assert found(resumes(), ServerConfig(resume=str(tmp_path))) is not None


def test_a_fork_takes_no_lock(tmp_path, resumes):
    written_run(tmp_path)
    first = resumes()
    first.find(ServerConfig(resume=str(tmp_path)))
    fork = resumes()
    _, checkpoint = fork.find(ServerConfig(resume=str(tmp_path), fork_run=True))
    assert checkpoint is not None and fork.lock is None


def test_with_a_key_only_a_checkpoint_signed_with_it_is_found(tmp_path, resumes):
    signed, unsigned = tmp_path / "signed", tmp_path / "unsigned"
    written_run(signed, key=KEY)
    written_run(unsigned)
    assert found(resumes(key=KEY), ServerConfig(resume=str(signed))) is not None
    with pytest.raises(CheckpointError, match=r"is not signed: .*--resume-unsigned"):
        resumes(key=KEY).find(ServerConfig(resume=str(unsigned)))
    with pytest.raises(CheckpointError, match="is not signed with this server's token"):
        resumes(key=checkpoint_key(b"another token")).find(ServerConfig(resume=str(signed)))
    assert found(resumes(key=KEY), ServerConfig(resume=str(unsigned), resume_unsigned=True)) is not None


# take_up: the lineage carried on, the twin asked, or a fork ------------------------------------------------


def test_the_run_goes_on_with_its_lineage_and_the_servers_that_died_before_a_checkpoint(tmp_path, resumes, no_twin):
    """The journal's incarnations after the checkpoint's writer (servers resumed from it that
    died before a checkpoint of their own) are ancestors too; this server is the last."""
    original, _ = written_run(tmp_path)
    writer = original.engine.durability
    died = ["a1" * 8, "b2" * 8]
    for incarnation in died:
        record_incarnation(tmp_path, incarnation, run_id=writer.run_id)
    engine = resumed(ServerConfig(resume=str(tmp_path)), resumes())
    durability = engine.durability
    assert durability.run_id == writer.run_id and engine.version == original.engine.version
    assert durability.lineage == [writer.incarnation, *died, durability.incarnation]
    assert no_twin == [(None, None, {"run": writer.run_id, "shard": "0/1"})]  # (it served nowhere: asked of nothing)


def test_a_journal_that_does_not_follow_the_checkpoint_adds_nothing(tmp_path, resumes, no_twin):
    original, _ = written_run(tmp_path)
    record_incarnation(tmp_path, "c3" * 8, new_run=True)  # a journal begun afresh: the writer is not in it
    engine = resumed(ServerConfig(resume=str(tmp_path)), resumes())
    assert engine.durability.lineage == [original.engine.durability.incarnation, engine.durability.incarnation]


def test_with_a_key_only_the_journals_signed_lines_count(tmp_path, resumes, no_twin):
    original, _ = written_run(tmp_path, key=KEY)
    run_id = original.engine.durability.run_id
    assert read_lineage(tmp_path, key=KEY, run_id=run_id) == [original.engine.durability.incarnation]
    journal = tmp_path / "lineage"
    journal.write_text(journal.read_text() + "d4" * 8 + "\n")  # appended unsigned: not the run's
    record_incarnation(tmp_path, "e5" * 8, key=KEY, run_id=run_id)
    engine = resumed(ServerConfig(resume=str(tmp_path)), resumes(key=KEY))
    assert engine.durability.lineage == [
        original.engine.durability.incarnation,
        "e5" * 8,
        engine.durability.incarnation,
    ]


def test_a_rewound_server_goes_on_from_its_own_lineage(tmp_path, resumes, no_twin, monkeypatch):
    """REWIND restarts the process from an older checkpoint of its own: the lineage it had
    comes through the environment (once: the variable is gone after)."""
    written_run(tmp_path)
    before = ["f6" * 8, "a7" * 8]
    monkeypatch.setenv(REWOUND_LINEAGE, ",".join(before))
    engine = resumed(ServerConfig(resume=str(tmp_path)), resumes())
    assert engine.durability.lineage == [*before, engine.durability.incarnation]
    assert REWOUND_LINEAGE not in os.environ


def test_a_run_still_served_where_its_checkpoint_says_is_refused(tmp_path, resumes, monkeypatch):
    """The twin question goes to the checkpoint's ``served_at``, with this server's token only
    when the checkpoint is signed with it, bound to the run and shard; a server there that
    serves the run is a refusal, one that serves another run is not."""
    original, _ = written_run(tmp_path, key=KEY, served_at="tcp://127.0.0.1:7001", shard=1, shards=2)
    run_id = original.engine.durability.run_id
    asked = []
    answer = ServerInfo("host", "", run_id, lineage="0123456789abcdef")

    def serving_run(address, token, claim=b""):
        asked.append((address, token, decode_claim(claim)))
        return answer

    monkeypatch.setattr(resume_module, "serving_run", serving_run)
    config = ServerConfig(resume=str(tmp_path), shard=1, shards=2)
    with pytest.raises(
        CheckpointError,
        match=rf"run {run_id} is still served at tcp://127.0.0.1:7001 "
        r"\(incarnation 0123456789abcdef\).*--fork-run",
    ):
        resumed(config, resumes(key=KEY), token=b"the operator's token")
    assert asked == [("tcp://127.0.0.1:7001", b"the operator's token", {"run": run_id, "shard": "1/2"})]
    answer = ServerInfo("host", "", "another-run")
    taken = resumes(key=KEY)
    resumed(config, taken, token=b"the operator's token")
    taken.release()
    # unsigned (--resume-unsigned): the token is not proved to an address nothing vouches for
    resumed(config.replace(resume_unsigned=True), resumes(key=KEY), token=b"the operator's token")
    assert asked[-1][1] is None


def test_a_fork_is_a_new_run_from_the_checkpoints_state_and_asks_no_twin(tmp_path, resumes, no_twin, caplog):
    original, _ = written_run(tmp_path, served_at="tcp://127.0.0.1:7001")
    record_incarnation(tmp_path, "b8" * 8, run_id=original.engine.durability.run_id)
    with caplog.at_level(logging.WARNING, "aps.server"):
        engine = resumed(ServerConfig(resume=str(tmp_path), fork_run=True), resumes())
    durability = engine.durability
    assert durability.run_id != original.engine.durability.run_id
    assert durability.lineage == [durability.incarnation] and durability.shard_runs is None
    assert engine.version == original.engine.version
    np.testing.assert_array_equal(engine.model.table.current_array(), original.engine.model.table.current_array())
    assert no_twin == []
    assert f"goes on as a new run, {durability.run_id}" in caplog.text
