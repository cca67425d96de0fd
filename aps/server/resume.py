"""Taking a run up where a checkpoint left it (``--resume``), as one server of it, and a
server restarting itself from one of its run's checkpoints (REWIND).

:class:`Resume` finds the checkpoint and takes the run's options from it, holds the
directory it came from while this server runs (one run, one live server), and once the
engine has restored it, carries the run's lineage on (its journal, a rewind's) or forks it
(``--fork-run``), and refuses to go on while the server that wrote it still serves the run
(:mod:`aps.server.twin`). The :class:`~aps.server.server.Server` holds one; the engine's
part of a resume (the state restored) is :meth:`aps.server.engine.durability.Durability.restore`.

:class:`Rewind` answers REWIND (a sharded BSP worker brings every shard back to one round):
the versions of the run's checkpoints, or the process replaced by ``aps serve --resume`` of
one of them, on the same ports, its lineage handed on (:data:`REWOUND_LINEAGE`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import sys
import uuid
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from ..checkpoint import (
    Checkpoint,
    find_resumable,
    is_checkpoint,
    list_checkpoints,
    lock_run_directory,
    read_checkpoint,
    read_lineage,
    read_manifest,
)
from ..config import RESUME_LATEST, RUN_OPTIONS, RUN_OPTIONS_SINCE, ServerConfig
from ..errors import CheckpointError, CheckpointFailed, ConfigurationError
from ..wire.protocol import encode_claim
from .twin import serving_run

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["REWOUND_LINEAGE", "Resume", "Rewind"]

log = logging.getLogger("aps.server")

#: The environment variable a rewinding server hands its lineage on in (see :meth:`Resume.carry_rewound_lineage`).
REWOUND_LINEAGE = "_APS_REWOUND_LINEAGE"
#: A rewind's reply leaves before the process restarts.
REWIND_REPLY_S = 0.1


class Resume:
    """One server's resume (see the module docstring).

    Args:
        given: the options given (the others may take the checkpoint's values); None: those
            that differ from the defaults.
        key: the key checkpoints of this run are signed with (None: unsigned).
    """

    def __init__(self, given: set[str] | None, key: bytes | None) -> None:
        self.given = given
        self.key = key
        #: The lock on the directory the run was resumed from, held while this server runs.
        self.lock: IO[Any] | None = None

    def find(self, config: ServerConfig) -> tuple[ServerConfig, Checkpoint | None]:
        """The configuration to run with, and the checkpoint ``--resume`` names (None: a new
        run), the run's options taken from it. Raises CheckpointError (the lock let go)."""
        try:
            return self._find(config)
        except BaseException:
            self.release()
            raise

    def _find(self, config: ServerConfig) -> tuple[ServerConfig, Checkpoint | None]:
        if config.resume is None:
            return config, None
        where = config.checkpoint_dir if config.resume == RESUME_LATEST else config.resume
        assert where is not None  # (RESUME_LATEST needs --checkpoint-dir: ServerConfig checks it)
        if config.checkpoint_dir is None:
            log.warning("--resume without --checkpoint-dir: this run writes no checkpoints of its own")
        if not config.fork_run:
            # One run, one live server: the directory the run is resumed from is held while this
            # server runs, and refused while a live server holds it (one writing there, or one that
            # resumed from it), before anything is read. A killed server's lock is gone with it.
            source = pathlib.Path(where)
            source = source.parent if is_checkpoint(source) else source
            self.lock = lock_run_directory(
                source,
                advice=(
                    f": a second server resuming it (--resume {where}) would make two copies of one run, under one run "
                    "id. Stop that server first (then resume from its newest checkpoint), or give --fork-run to go on "
                    "from the checkpoint as a new run with a run id of its own"
                ),
            )
        checkpoint = find_resumable(where, key=None if config.resume_unsigned else self.key)
        if checkpoint is None:
            if config.resume != RESUME_LATEST:
                raise CheckpointError(f"--resume {where}: no checkpoint there")
            log.warning("--resume: %s holds no checkpoint yet: starting a new run", where)
            return config, None
        saved = checkpoint.manifest.get("config")
        if not isinstance(saved, dict):
            raise CheckpointError(f"checkpoint {checkpoint.path} has no configuration in its manifest")
        given = self.given
        if given is None:  # the Python API: what differs from the defaults was given
            defaults = ServerConfig()
            given = {name for name in RUN_OPTIONS if getattr(config, name) != getattr(defaults, name)}
        saved = {**RUN_OPTIONS_SINCE, **saved}  # (options newer than the checkpoint: it had their former value)
        changes = {}
        for name in RUN_OPTIONS:
            if name not in saved:
                raise CheckpointError(f"checkpoint {checkpoint.path} does not say its --{name.replace('_', '-')}")
            value = tuple(saved[name]) if isinstance(saved[name], list) else saved[name]
            if name in given and getattr(config, name) != value:
                flag = "--" + name.replace("_", "-")
                raise CheckpointError(
                    f"{flag} {_show(getattr(config, name))} conflicts with checkpoint {checkpoint.path}, whose run "
                    f"has {flag} {_show(value)}: leave {flag} out to go on with the run's value (or start a new run "
                    "without --resume)"
                )
            changes[name] = value
        try:
            return config.replace(**changes), checkpoint
        except ConfigurationError as exc:
            raise CheckpointError(f"checkpoint {checkpoint.path} holds an invalid configuration: {exc}") from None

    def holds(self, directory: str) -> bool:
        """Whether the lock this resume holds is on ``directory`` (the checkpointer takes it then)."""
        return self.lock is not None and _same_directory(self.lock.name, directory)

    def release(self) -> None:
        """Let go of the run's directory."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    async def take_up(self, engine: Engine, checkpoint: Checkpoint, config: ServerConfig, token: bytes | None) -> None:
        """After the engine restored ``checkpoint``: fork the run (``--fork-run``), or carry
        its lineage on and refuse to go on while its server still serves it."""
        if config.fork_run:
            self.fork(engine, checkpoint)
            return
        self.carry_journal(engine, checkpoint)
        self.carry_rewound_lineage(engine)
        await self.refuse_a_live_twin(engine, checkpoint, config, token)

    async def refuse_a_live_twin(
        self, engine: Engine, checkpoint: Checkpoint, config: ServerConfig, token: bytes | None
    ) -> None:
        """Refuse to resume a run that a live server still serves: the one that wrote the
        checkpoint, asked where it served (aps.server.twin). A copy of a live run's checkpoints
        resumed elsewhere would be a second server of one run, under one run id."""
        served_at = checkpoint.manifest.get("served_at")
        # (this server's token is proved only to an address a checkpoint signed with it gave)
        signed = self.key is not None and not config.resume_unsigned
        run_id = engine.durability.run_id
        claim = encode_claim(run_id, config.shard, config.shards)
        info = await asyncio.to_thread(serving_run, served_at, token if signed else None, claim)
        if info is not None and info.run_id == run_id:
            raise CheckpointError(
                f"run {run_id} is still served at {served_at} (incarnation "
                f"{info.incarnations[-1] if info.incarnations else '?'}), by the server whose checkpoint "
                f"{checkpoint.path} is: resuming it here would make two servers of one run. Stop that server first "
                "(then resume from its newest checkpoint), or give --fork-run to go on from the checkpoint as a new "
                "run with a run id of its own"
            )

    def carry_journal(self, engine: Engine, checkpoint: Checkpoint) -> None:
        """The incarnations that served the run from the checkpoint's directory after it was
        written (they died before a checkpoint of their own) are ancestors too: their workers
        follow this server (aps.checkpoint.read_lineage)."""
        durability = engine.durability
        saved = durability.lineage[:-1]
        journal = read_lineage(checkpoint.path.parent, key=self.key, run_id=durability.run_id)
        if saved and saved[-1] in journal:
            incarnation = durability.incarnation
            later = [i for i in journal[journal.index(saved[-1]) + 1 :] if i not in saved and i != incarnation]
            durability.carry_lineage([*saved, *later])

    @staticmethod
    def carry_rewound_lineage(engine: Engine) -> None:
        """A server that rewound (REWIND: the same process, started again from an older
        checkpoint of its own) goes on from its own lineage, not the older checkpoint's: its
        workers were last served by it."""
        saved = os.environ.pop(REWOUND_LINEAGE, None)
        if saved:
            engine.durability.carry_lineage(saved.split(","))

    @staticmethod
    def fork(engine: Engine, checkpoint: Checkpoint) -> None:
        """``--fork-run``: the resumed state goes on under a new run id, so that workers of the
        original run (whose server may be live) are refused here (RunChanged), and this
        run's checkpoints are its own. Shards record their runs again as workers join."""
        durability = engine.durability
        original, durability.run_id, durability.shard_runs = durability.run_id, uuid.uuid4().hex, None
        durability.lineage = [durability.incarnation]
        log.warning(
            "--fork-run: checkpoint %s of run %s goes on as a new run, %s (workers of the original run "
            "are not served here)",
            checkpoint.path,
            original,
            durability.run_id,
        )


def _same_directory(lock_file: str, directory: str) -> bool:
    """Whether ``lock_file`` (``DIR/.lock``) is the lock file of ``directory``."""
    try:
        return os.path.samefile(os.path.dirname(lock_file), directory)
    except OSError:
        return os.path.abspath(os.path.dirname(lock_file)) == os.path.abspath(directory)


def _show(value: Any) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, tuple) else str(value)


class Rewind:
    """REWIND for one started server with checkpoints (see the module docstring).

    Args:
        engine: the server's engine.
        directory: its checkpoint directory.
        command: the command that started this process (None: an embedded server, which
            cannot restart itself and refuses).
        stop_listening: no new connection reaches this process; False when it is stopping.
        listen_again: the options that keep the restarted process on the same ports.
    """

    def __init__(
        self,
        engine: Engine,
        directory: str,
        command: Callable[[], list[str] | None],
        stop_listening: Callable[[], bool],
        listen_again: Callable[[], list[str]],
    ) -> None:
        self.engine = engine
        self.directory = directory
        self._command = command
        self._stop_listening = stop_listening
        self._listen_again = listen_again
        #: (version, path): what this process restarts from, once a rewind is decided.
        self.rewinding: tuple[int, str] | None = None

    def request(self, version: int | None) -> asyncio.Task[dict]:
        """The engine's ``request_rewind``: the answer, as a task."""
        return asyncio.get_running_loop().create_task(self.rewind(version))

    async def rewind(self, version: int | None) -> dict:
        """With ``version`` None: the versions of this run's checkpoints. Else restart this
        process from the checkpoint of this run at ``version`` (after the reply has gone):
        every worker loses its connection and rejoins, as after a crash and ``--resume``."""
        engine, directory = self.engine, self.directory
        found = await asyncio.to_thread(run_checkpoints, directory, engine.durability.run_id)
        if version is None:
            return {"versions": sorted(found), "version": engine.version}
        if self.rewinding is not None:  # another worker asked first
            if self.rewinding[0] != version:
                raise CheckpointFailed(f"this server is restarting from version {self.rewinding[0]} already")
            return {"rewound": True, "version": version, "path": self.rewinding[1]}
        if version == engine.version:
            return {"rewound": False, "version": version}
        if version > engine.version:
            raise CheckpointFailed(f"cannot rewind to version {version}: this server is at {engine.version}")
        if version not in found:
            raise CheckpointFailed(f"no checkpoint of this run at version {version} in {directory}")
        command = self._command()
        if command is None:
            raise CheckpointFailed("this server cannot rewind: only an `aps serve` process restarts itself")
        path = found[version]
        try:
            await asyncio.to_thread(read_checkpoint, path)  # intact, or the process would not come back
        except CheckpointError as exc:
            raise CheckpointFailed(f"cannot rewind to version {version}: {exc}") from None
        if self.rewinding is not None:  # another worker's request won meanwhile
            return await self.rewind(version)
        # No new connection reaches this process: the next ones reach the restarted one.
        if not self._stop_listening():
            raise CheckpointFailed(f"cannot rewind to version {version}: the server is stopping")
        self.rewinding = (version, path)
        log.warning("rewinding to version %d (from %d): restarting from %s", version, engine.version, path)
        asyncio.get_running_loop().call_later(
            REWIND_REPLY_S, self._restart, [*command, *self._listen_again(), "--resume", path]
        )
        return {"rewound": True, "version": version, "path": path}

    def _restart(self, command: list[str]) -> None:
        """Replace this process with ``command`` (the descriptors close on exec; so does the
        checkpoint directory's lock), its lineage handed on."""
        os.environ[REWOUND_LINEAGE] = self.engine.durability.lineage_text
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(command[0], command)


def run_checkpoints(directory: str, run_id: str) -> dict[int, str]:
    """The complete checkpoints of run ``run_id`` in ``directory``, by version (the newest
    of a version when there are several)."""
    found: dict[int, str] = {}
    for path in reversed(list_checkpoints(directory)):  # oldest first: the newest of a version wins
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        version = manifest.get("version")
        if manifest.get("run_id") == run_id and isinstance(version, int) and not isinstance(version, bool):
            found[version] = str(path)
    return found
