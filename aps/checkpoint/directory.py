"""A directory of checkpoints: listing, pruning, locking, temporaries, and finding the
one to resume from or load."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pathlib
import secrets
import shutil


from ..errors import CheckpointError
from .format import _NAME, _TEMPORARY, MANIFEST_FILE, Checkpoint, StrPath, _reason
from .reading import _read, _verify, _with_deadline, read_manifest
from .resume import _check_resumable


def is_checkpoint(path: StrPath) -> bool:
    """Whether ``path`` names a checkpoint itself (not a directory of them): it holds a
    manifest, or its name has the ``checkpoint-SEQUENCE-vVERSION`` form."""
    path = pathlib.Path(path)
    return _NAME.fullmatch(path.name) is not None or (path / MANIFEST_FILE).is_file()


def _entries(directory: pathlib.Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint directory {directory}: {_reason(exc)}") from exc


#: The incarnations of the run that served from a directory, oldest first (one a line): what
#: a server resumed from there descends from, checkpoints or not (aps.server.twin).
LINEAGE_FILE = "lineage"
#: The lines it keeps (the newest).
LINEAGE_KEPT = 64


def read_lineage(directory: StrPath, *, key: bytes | None = None, run_id: str = "") -> list[str]:
    """The incarnations :func:`record_incarnation` wrote in ``directory``, oldest first (none
    when there is no journal, or it cannot be read: it is a record, not state). With ``key``
    (:func:`checkpoint_key`), only those signed with it for run ``run_id``."""
    try:
        with open(pathlib.Path(directory) / LINEAGE_FILE, encoding="ascii") as journal:
            lines = journal.read(LINEAGE_KEPT * 128).splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for line in lines:
        incarnation, _, mac = line.strip().partition(" ")
        if len(incarnation) != 16 or any(c not in "0123456789abcdef" for c in incarnation):
            continue
        if key is not None and not hmac.compare_digest(mac, _journal_mac(key, run_id, incarnation)):
            continue
        out.append(incarnation)
    return out


def _journal_mac(key: bytes, run_id: str, incarnation: str) -> str:
    return hmac.new(key, f"aps/1 lineage {run_id} {incarnation}".encode(), hashlib.sha256).hexdigest()


def record_incarnation(
    directory: StrPath, incarnation: str, *, new_run: bool = False, key: bytes | None = None, run_id: str = ""
) -> None:
    """Add ``incarnation`` to ``directory``'s journal (``new_run``: start it afresh; signed with
    ``key`` for run ``run_id`` when given; written whole and renamed into place; the caller
    holds the directory's lock). A server records itself when it takes the directory, before
    it serves: a server that dies before its first checkpoint is still an ancestor of the one
    resumed after it."""
    directory = pathlib.Path(directory)
    before = [] if new_run else [i for i in read_lineage(directory, key=key, run_id=run_id) if i != incarnation]
    kept = [*before, incarnation][-LINEAGE_KEPT:]
    lines = [f"{i} {_journal_mac(key, run_id, i)}" if key is not None else i for i in kept]
    partial = directory / f".{LINEAGE_FILE}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="ascii") as journal:
            journal.write("\n".join(lines) + "\n")
            journal.flush()
            os.fsync(journal.fileno())
        os.replace(partial, directory / LINEAGE_FILE)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise CheckpointError(f"cannot write {directory / LINEAGE_FILE}: {_reason(exc)}") from exc


def list_checkpoints(directory: StrPath) -> list[pathlib.Path]:
    """The complete checkpoints in ``directory`` (a manifest written), newest (highest sequence) first.

    A missing directory has none. Contents are not checked: see :func:`read_checkpoint`
    (a manifest that is there but not a regular file counts, so that reading it says so).
    """
    directory = pathlib.Path(directory)
    found = []
    for entry in _entries(directory):
        match = _NAME.fullmatch(entry.name)
        if match and entry.is_dir() and os.path.lexists(os.path.join(entry.path, MANIFEST_FILE)):
            found.append(((int(match.group(1)), int(match.group(2))), directory / entry.name))
    return [path for _, path in sorted(found, reverse=True)]


def next_sequence(directory: StrPath) -> int:
    """The sequence number for the next checkpoint in ``directory``: one more than the
    highest taken by any checkpoint name there (complete or not), 1 in a new directory."""
    taken = [int(m.group(1)) for e in _entries(pathlib.Path(directory)) if (m := _NAME.fullmatch(e.name))]
    return max(taken, default=0) + 1


def prune(directory: StrPath, keep: int, run_id: str | None = None) -> list[pathlib.Path]:
    """Delete all but the newest ``keep`` complete checkpoints in ``directory`` (with
    ``run_id``: of that run; other runs' checkpoints are left alone).

    Each is first renamed to a temporary name, so a crash part-way never leaves
    a checkpoint that looks complete and is not (:func:`remove_temporaries`
    finishes the job).

    Returns:
        The checkpoints removed, newest first.

    Raises:
        ValueError: ``keep`` is negative.
        CheckpointError: a checkpoint cannot be removed.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    directory = pathlib.Path(directory)
    removed = []
    found = list_checkpoints(directory)
    if run_id is not None:
        found = [path for path in found if _run_of(path) == run_id]
    for path in found[keep:]:
        doomed = directory / f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        except OSError as exc:
            raise CheckpointError(f"cannot remove old checkpoint {path}: {_reason(exc)}") from exc
        removed.append(path)
    return removed


def _run_of(path: pathlib.Path) -> str | None:
    try:
        return read_manifest(path).get("run_id")
    except CheckpointError:
        return None


def lock_directory(directory: StrPath):
    """Take ``directory`` for this process alone (an exclusive ``flock`` on its ``.lock``
    file, held until the returned file is closed or the process ends, even by kill -9).

    Raises:
        CheckpointError: another process holds it.
    """
    import fcntl

    path = pathlib.Path(directory) / ".lock"
    try:
        handle = open(path, "a+")
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints to {directory}: {_reason(exc)}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _lock_holder(handle)
        handle.close()
        raise CheckpointError(
            f"another process (pid {holder}) is writing checkpoints into {directory}: "
            "give each server a --checkpoint-dir of its own"
        ) from None
    _claim(handle)
    return handle


def lock_run_directory(directory: StrPath, *, advice: str = ""):
    """Hold ``directory``, the directory a run is resumed from, for as long as this process
    goes on with the run: the same exclusive ``flock`` as :func:`lock_directory`, so that
    while a server runs (from it, or writing into it) no second one resumes the same run
    beside it. A lock left by a process that is gone does not count (the kernel dropped it).

    Args:
        directory: the checkpoint directory.
        advice: appended to the refusal (how to go on).

    Returns:
        The lock file (close it to let go), or None: the directory holds no lock file
        and none can be made there (read-only), so no server ever held it.

    Raises:
        CheckpointError: a live process holds it; the message names its pid.
    """
    import fcntl

    path = pathlib.Path(directory) / ".lock"
    try:
        handle, writable = open(path, "a+"), True
    except OSError:
        try:
            handle, writable = open(path), False  # flock needs no write access
        except OSError:
            return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _lock_holder(handle)
        handle.close()
        raise CheckpointError(
            f"{directory} is held by a live aps server (pid {holder}), which goes on with the run "
            f"whose checkpoints are there{advice}"
        ) from None
    if writable:
        _claim(handle)
    return handle


def _claim(handle) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()


def _lock_holder(handle) -> str:
    """The pid of the process holding the ``flock`` on ``handle``'s file: from the kernel's
    table (``/proc/locks``) when it says, else the pid its holder wrote into the file."""
    try:
        info = os.fstat(handle.fileno())
        with open("/proc/locks") as table:
            for line in table:
                fields = line.split()
                if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
                    continue  # a waiter, or another kind of lock
                major, minor, inode = fields[5].split(":")
                if (
                    int(inode) == info.st_ino
                    and int(major, 16) == os.major(info.st_dev)
                    and int(minor, 16) == os.minor(info.st_dev)
                    and fields[4] != "0"
                ):
                    return fields[4]
    except (OSError, ValueError):
        pass
    try:
        handle.seek(0)
        return handle.read().strip() or "?"
    except OSError:
        return "?"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def list_temporaries(directory: StrPath) -> list[pathlib.Path]:
    """The temporary directories in ``directory`` that checkpoint writers left behind
    (or are still writing), sorted by name."""
    directory = pathlib.Path(directory)
    return sorted(
        directory / e.name
        for e in _entries(directory)
        if _TEMPORARY.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    )


def remove_temporaries(directory: StrPath, *, every: bool = False) -> list[pathlib.Path]:
    """Delete the temporary directories a crashed checkpoint writer left in ``directory``.

    Temporaries whose writer (the process id in their name) is still running on
    this host are kept: it may be writing them now. With ``every`` (the caller
    holds :func:`lock_directory`, so no one else writes there), all are removed.

    Returns:
        The directories removed.
    """
    removed = []
    for path in list_temporaries(directory):
        match = _TEMPORARY.fullmatch(path.name)
        if match is None or (not every and _pid_alive(int(match.group(2)))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def _readable_or_older(
    path: pathlib.Path,
    older: list[pathlib.Path],
    directory: pathlib.Path,
    hint: str,
    resumable: bool,
    key: bytes | None = None,
) -> Checkpoint:
    """Checkpoint ``path``, read (and with ``resumable``, checked for a resume); if it does
    not read, a CheckpointError naming the first of ``older`` that does, with ``hint``
    (formatted with its path) on how to use it."""
    try:
        checkpoint = _read(path, True, key)
        if resumable:
            _check_resumable(checkpoint.path, checkpoint.manifest)
        return checkpoint
    except CheckpointError as exc:
        failure = str(exc)
    for candidate in older:
        try:
            manifest = _verify(candidate, True, key)
            if resumable:
                _check_resumable(candidate, manifest)
        except CheckpointError:
            continue
        raise CheckpointError(f"{failure}; the next older one, {candidate}, is intact: {hint.format(path=candidate)}")
    if older:
        raise CheckpointError(f"{failure}; no older checkpoint in {directory} is intact either")
    raise CheckpointError(f"{failure}; there is no older checkpoint in {directory}")


def _newest_readable(
    directory: pathlib.Path, hint: str, resumable: bool = False, key: bytes | None = None
) -> Checkpoint | None:
    """The newest complete checkpoint in ``directory`` (None: there is none); see
    :func:`_readable_or_older`."""
    candidates = list_checkpoints(directory)
    if not candidates:
        return None
    return _readable_or_older(candidates[0], candidates[1:], directory, hint, resumable, key)


def _named(path: pathlib.Path, hint: str, resumable: bool, key: bytes | None = None) -> Checkpoint:
    """Checkpoint ``path`` itself, named by the caller; if it does not read, the message also
    names the next older intact one in its directory, when its directory holds older ones."""
    match = _NAME.fullmatch(path.name)
    older = []
    if match is not None:
        older = [
            c
            for c in list_checkpoints(path.parent)
            if (m := _NAME.fullmatch(c.name)) is not None and int(m.group(1)) < int(match.group(1))
        ]
    if not older:
        checkpoint = _read(path, True, key)
        if resumable:
            _check_resumable(checkpoint.path, checkpoint.manifest)
        return checkpoint
    return _readable_or_older(path, older, path.parent, hint, resumable, key)


def find_resumable(path: StrPath, *, stall: float | None = None, key: bytes | None = None) -> Checkpoint | None:
    """The checkpoint ``aps serve --resume PATH`` resumes from.

    Args:
        path: a checkpoint (read as is), or a checkpoint directory (its newest
            complete checkpoint).
        stall: give up when the read makes no progress for this many seconds
            (default :data:`READ_STALL_S`).
        key: the run's signing key (:func:`checkpoint_key` of its token): the
            checkpoint must be signed with it (``manifest.hmac``).

    Returns:
        The checkpoint, verified, and its manifest checked for a resume
        (:func:`check_resumable`); None if ``path`` is a directory that holds no
        complete checkpoint, or does not exist (a new run starts).

    Raises:
        CheckpointError: the checkpoint does not read (missing, corrupt, a
            manifest that does not match its checksum or holds a field of the
            wrong type ...), or its read hung; the message also names the next
            older intact checkpoint, if there is one, and how to resume from it.
    """
    path = pathlib.Path(path)
    hint = "resume from it with --resume {path}"

    def find() -> Checkpoint | None:
        if is_checkpoint(path):
            return _named(path, hint, resumable=True, key=key)
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"cannot resume from {path}: it is neither a checkpoint nor a directory of them")
        return _newest_readable(path, hint, resumable=True, key=key)

    return _with_deadline(f"checkpoints at {path}", find, stall)


def load_checkpoint(path: StrPath) -> Checkpoint:
    """Read a checkpoint, to evaluate or fine-tune a model without a server.

    Args:
        path: a checkpoint (``.../checkpoint-00000007-v70``), or a checkpoint
            directory (its newest complete checkpoint is read).

    Returns:
        The checkpoint, checksums verified: ``.weights`` maps each model
        tensor's name to a float32 array, ``.state`` holds the optimizer state,
        ``.manifest`` everything else.

    Raises:
        CheckpointError: there is no checkpoint at ``path``, or it is
            incomplete, truncated or corrupt (the message names an older
            intact one if there is).

    Example::

        ckpt = aps.load_checkpoint("ckpts")
        model.load_state_dict({k: torch.from_numpy(v) for k, v in ckpt.weights.items()})
    """
    path = pathlib.Path(path)

    def load() -> Checkpoint:
        if is_checkpoint(path):
            return _named(path, "load it by its path", resumable=False)
        if not path.exists():
            raise CheckpointError(f"no checkpoint at {path}: it does not exist")
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint at {path}: it is not a directory")
        found = _newest_readable(path, "load it by its path")
        if found is None:
            raise CheckpointError(f"no checkpoint in {path}")
        return found

    return _with_deadline(f"checkpoints at {path}", load)


def directory_bytes(path: StrPath) -> int:
    """The total size of the files directly in ``path`` (a checkpoint's size on disk)."""
    total = 0
    for entry in _entries(pathlib.Path(path)):
        try:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            pass
    return total
