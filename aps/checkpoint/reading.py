"""Reading a checkpoint: regular files only, with a deadline; the manifest against its
checksum, each file against the manifest, the tensors against the layout."""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import pathlib
import stat
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from ..errors import CheckpointError
from .format import (
    _CHUNK,
    _MANIFEST_MAX_BYTES,
    _MAC_LINE,
    _SUM_LINE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MANIFEST_MAC_FILE,
    MANIFEST_SUM_FILE,
    MODEL_FILE,
    READ_STALL_S,
    STATE_FILE,
    Checkpoint,
    StrPath,
    _hash_fd,
    _manifest_layout,
    _problem,
    _progress,
    _reading,
    _reason,
    log,
    sign_manifest,
)


# Every read of a checkpoint: regular files only, and a deadline -----------------------------------------


class _NotRegular(OSError):
    """A checkpoint file that is not a regular file (a FIFO, a device, a symbolic link ...)."""

    def __init__(self, kind: str) -> None:
        super().__init__(errno.EINVAL, f"is {kind}, not a regular file")
        self.kind = kind


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _open_regular(path: pathlib.Path) -> int:
    """A read-only descriptor of ``path``, which must be a regular file.

    ``O_NONBLOCK`` so that opening a FIFO returns at once instead of waiting for a
    writer (it has no effect on a regular file's reads); ``O_NOFOLLOW`` so that a
    symbolic link is refused, not followed to whatever it names. The type is checked
    on the descriptor itself (``fstat``), so nothing can be swapped in between.
    """
    _progress()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _NotRegular("a symbolic link") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _NotRegular(next((kind for test, kind in _KINDS if test(mode)), "a special file"))
    except BaseException:
        os.close(fd)
        raise
    _progress()
    return fd


def _fd_path(fd: int) -> str:
    """A path that opens the file ``fd`` already has open (and was checked to be regular),
    for libraries that take a path: the same file, whatever the name now points to."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def _with_deadline(what: str, read, stall: float | None = None):
    """``read()`` on a helper thread, given up (CheckpointError) when it makes no progress
    for ``stall`` seconds (default :data:`READ_STALL_S`): a read from a hung network file
    system blocks in the kernel, where nothing can interrupt it, so the wait is what is
    bounded. The stuck thread is a daemon: it does not keep the process alive. Nested
    calls run in the outer one's thread and deadline."""
    if getattr(_reading, "tick", None) is not None:
        return read()
    stall = READ_STALL_S if stall is None else stall
    last = [time.monotonic()]
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        _reading.tick = lambda: last.__setitem__(0, time.monotonic())
        try:
            box["value"] = read()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="aps-checkpoint-read", daemon=True).start()
    while not done.wait(min(1.0, stall / 4)):
        if time.monotonic() - last[0] > stall:
            raise CheckpointError(
                f"reading {what} made no progress for {stall:g} s (a hung file system?): gave up; nothing was changed"
            )
    if "error" in box:
        raise box.pop("error")
    return box["value"]


def _read_small(fd: int, limit: int) -> bytes | None:
    """All of file ``fd`` if it holds at most ``limit`` bytes, else None."""
    if os.fstat(fd).st_size > limit:
        return None
    chunks, total = [], 0
    while chunk := os.read(fd, min(_CHUNK, limit + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        _progress()
        if total > limit:
            return None
    return b"".join(chunks)


_warned_unchecked: set[str] = set()


def read_manifest(path: StrPath, *, key: bytes | None = None) -> dict:
    """The manifest of the checkpoint at ``path``, checked against its checksum
    (``manifest.sha256``) and for form and format version.

    Raises:
        CheckpointError: ``path`` is not a directory, or its manifest is missing,
            not a regular file, does not match its checksum, is not a JSON object,
            or is of another format or a newer format version.
    """
    path = pathlib.Path(path)
    return _with_deadline(f"checkpoint {path}", lambda: _read_manifest(path, key))


def _read_manifest(path: pathlib.Path, key: bytes | None = None) -> dict:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {_reason(exc)}") from exc
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"checkpoint {path} is not a directory")
    data = _read_file(path, MANIFEST_FILE, _MANIFEST_MAX_BYTES, "incomplete")
    if data is None:
        raise _problem(
            path, "corrupt", f"{MANIFEST_FILE} is larger than {_MANIFEST_MAX_BYTES >> 20} MiB: not a manifest"
        )
    line = _read_file(path, MANIFEST_SUM_FILE, 4096, None)
    if line is not None:
        match = _SUM_LINE.fullmatch(line)
        if match is None:
            raise _problem(path, "corrupt", f"{MANIFEST_SUM_FILE} does not hold a SHA-256 line for {MANIFEST_FILE}")
        if hashlib.sha256(data).hexdigest() != match.group(1).decode():
            raise _problem(path, "corrupt", f"checksum mismatch in {MANIFEST_FILE}")
    if key is not None:
        _check_signature(path, data, key)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} is not UTF-8 text") from None
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not an aps checkpoint: {MANIFEST_FILE} has format {manifest.get('format')!r}, not {FORMAT!r}"
        )
    format_version = manifest.get("format_version")
    if not isinstance(format_version, int) or isinstance(format_version, bool) or format_version < 1:
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} has no valid format_version ({format_version!r})")
    if format_version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {format_version}; this aps reads "
            f"up to version {FORMAT_VERSION}: upgrade aps to read it"
        )
    if line is None:
        if format_version >= 2:
            raise _problem(path, "incomplete", f"{MANIFEST_SUM_FILE} is missing")
        if str(path) not in _warned_unchecked:  # once per checkpoint, not at every look
            _warned_unchecked.add(str(path))
            log.warning(
                "checkpoint %s has format version 1, whose manifest has no checksum: %s is checked "
                "for form only (the checkpoints written from now on have one)",
                path,
                MANIFEST_FILE,
            )
    files = manifest.get("files")
    if not isinstance(files, dict) or any(f not in files for f in (MODEL_FILE, STATE_FILE)):
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} does not list {MODEL_FILE} and {STATE_FILE}")
    for name, entry in files.items():
        if (
            not isinstance(name, str)
            or not name
            or "/" in name
            or "\\" in name
            or name.startswith(".")
            or name in (MANIFEST_FILE, MANIFEST_SUM_FILE)
        ):
            raise _problem(path, "corrupt", f"{MANIFEST_FILE} lists a file named {name!r}")
        if not isinstance(entry, dict) or not _is_count(entry.get("bytes")) or not isinstance(entry.get("sha256"), str):
            raise _problem(path, "corrupt", f"{MANIFEST_FILE} gives no size and sha256 for {name}")
    if "layout" in manifest:
        _manifest_layout(path, manifest)
    return manifest


def _check_signature(path: pathlib.Path, data: bytes, key: bytes) -> None:
    """Raise CheckpointError unless ``manifest.hmac`` holds the HMAC of ``data`` (the manifest's
    bytes) under ``key`` (:func:`checkpoint_key` of the run's token)."""
    line = _read_file(path, MANIFEST_MAC_FILE, 4096, None)
    if line is None:
        raise CheckpointError(
            f"checkpoint {path} is not signed: it was written by a server without a token of its operator's "
            f"(--token, --token-file), so nothing shows it was not altered or forged; resume it with "
            f"--resume-unsigned if you know where it comes from"
        )
    match = _MAC_LINE.fullmatch(line)
    if match is None or not hmac.compare_digest(match.group(1).decode(), sign_manifest(data, key)):
        raise CheckpointError(
            f"checkpoint {path} is not signed with this server's token: it was written by a server with another "
            f"token, or altered since (its {MANIFEST_MAC_FILE} does not match {MANIFEST_FILE}): refused"
        )


def _read_file(path: pathlib.Path, name: str, limit: int, missing: str | None) -> bytes | None:
    """File ``name`` of checkpoint ``path`` (at most ``limit`` bytes, else None). A missing
    one is None if ``missing`` is None, else a CheckpointError saying the checkpoint is that."""
    try:
        fd = _open_regular(path / name)
    except FileNotFoundError:
        if missing is None:
            return None
        raise _problem(path, missing, f"{name} is missing") from None
    except _NotRegular as exc:
        raise _problem(path, "corrupt", f"{name} {exc.strerror}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {name}: {_reason(exc)}") from exc
    try:
        return _read_small(fd, limit)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {name}: {_reason(exc)}") from exc
    finally:
        os.close(fd)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _file_problem(
    path: pathlib.Path, name: str, entry: Mapping[str, Any], *, verify: bool, held: dict[str, int] | None = None
) -> tuple[str, str] | None:
    """What is wrong with file ``name`` given its manifest ``entry``, as ``(what, detail)``
    (``("corrupt", "checksum mismatch in model.safetensors")``), or None. With ``held``, an
    intact file's descriptor stays open there, for what is loaded to be what was checked."""
    try:
        fd = _open_regular(path / name)
    except FileNotFoundError:
        return "incomplete", f"{name} is missing"
    except _NotRegular as exc:
        return "corrupt", f"{name} {exc.strerror}"
    except OSError as exc:
        return "unreadable", f"{name}: {_reason(exc)}"
    problem = None
    try:
        size = os.fstat(fd).st_size
        expected = entry["bytes"]
        if size < expected:
            problem = "truncated", f"{name} has {size} bytes, the manifest says {expected}"
        elif size > expected:
            problem = "corrupt", f"{name} has {size} bytes, the manifest says {expected}"
        elif verify and _hash_fd(fd)[1] != str(entry["sha256"]).lower():
            problem = "corrupt", f"checksum mismatch in {name}"
    except OSError as exc:
        problem = "unreadable", f"{name}: {_reason(exc)}"
    if problem is not None or held is None or name in held:
        os.close(fd)
    else:
        held[name] = fd
    return problem


_DTYPE_NAMES = {"F32": "float32", "F64": "float64", "F16": "float16", "BF16": "bfloat16"}


def _tensor_problem(path: pathlib.Path, manifest: Mapping[str, Any], fd: int | None = None) -> tuple[str, str] | None:
    """What is wrong with the model tensors against the manifest's layout (names, shapes,
    float32), from the file's header alone (``fd``: the file, open already); None if nothing is."""
    owned = fd is None
    if fd is None:
        try:
            fd = _open_regular(path / MODEL_FILE)
        except _NotRegular as exc:
            return "corrupt", f"{MODEL_FILE} {exc.strerror}"
        except OSError as exc:
            return "corrupt", f"{MODEL_FILE} cannot be read: {_reason(exc)}"
    try:
        with safetensors.safe_open(_fd_path(fd), framework="np") as f:
            found = {key: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype()) for key in f.keys()}
    except (safetensors.SafetensorError, OSError) as exc:
        return "corrupt", f"{MODEL_FILE} cannot be read: {_reason(exc)}"
    finally:
        if owned:
            os.close(fd)
    for key, (_, dtype) in found.items():
        if dtype != "F32":
            return "corrupt", f"model tensor {key!r} in {MODEL_FILE} is {_DTYPE_NAMES.get(dtype, dtype)}, not float32"
    if "layout" not in manifest:
        return None
    layout = _manifest_layout(path, manifest)
    for name, shape in zip(layout.names, layout.shapes):
        if name not in found:
            return "corrupt", f"{MODEL_FILE} lacks tensor {name!r} of the manifest's layout"
        if found[name][0] != shape:
            return "corrupt", (
                f"tensor {name!r} in {MODEL_FILE} has shape {found[name][0]}, the manifest's layout says {shape}"
            )
    listed = set(layout.names)
    unexpected = [key for key in found if key not in listed]
    if unexpected:
        return "corrupt", f"{MODEL_FILE} holds tensors the manifest's layout does not list: {unexpected[:5]}"
    return None


def _problems(
    path: pathlib.Path, manifest: Mapping[str, Any], verify: bool, held: dict[str, int] | None = None
) -> dict[str, tuple[str, str] | None]:
    """Per listed file, what is wrong with it as ``(what, detail)``, or None (``held``: see
    :func:`_file_problem`)."""
    found = {
        name: _file_problem(path, name, entry, verify=verify, held=held) for name, entry in manifest["files"].items()
    }
    if found[MODEL_FILE] is None:
        found[MODEL_FILE] = _tensor_problem(path, manifest, None if held is None else held.get(MODEL_FILE))
    return found


def file_problems(path: StrPath, manifest: Mapping[str, Any], *, verify: bool = True) -> dict[str, str | None]:
    """What is wrong with each file the checkpoint's ``manifest`` lists (None: intact).

    Args:
        path: the checkpoint's directory.
        manifest: its manifest, from :func:`read_manifest`.
        verify: compare checksums (sizes are checked either way).

    Returns:
        File name to a short description of its problem
        (``"checksum mismatch in model.safetensors"``), or None if it is intact.
    """
    found = _problems(pathlib.Path(path), manifest, verify)
    return {name: None if problem is None else problem[1] for name, problem in found.items()}


def verify_checkpoint(path: StrPath, *, verify: bool = True, key: bytes | None = None) -> dict:
    """Check the checkpoint at ``path`` without loading its arrays: manifest, each file's size
    and checksum (if ``verify``), and the model tensors' names, shapes and dtype.

    Returns:
        Its manifest.

    Raises:
        CheckpointError: as :func:`read_checkpoint`.
    """
    path = pathlib.Path(path)
    return _with_deadline(f"checkpoint {path}", lambda: _verify(path, verify, key))


def _verify(path: pathlib.Path, verify: bool, key: bytes | None = None, held: dict[str, int] | None = None) -> dict:
    manifest = _read_manifest(path, key)
    for problem in _problems(path, manifest, verify, held).values():
        if problem is not None:
            raise _problem(path, *problem)
    return manifest


def read_checkpoint(path: StrPath, *, verify: bool = True, key: bytes | None = None) -> Checkpoint:
    """Read and check the checkpoint at ``path`` (a ``checkpoint-*`` directory).

    Args:
        path: the checkpoint's directory.
        verify: compare each file's SHA-256 with the manifest's (sizes are
            checked either way).

    Returns:
        The checkpoint, weights in the manifest's layout order.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete, truncated or
            corrupt, of a newer format, or its model tensors do not match its
            layout or are not float32; the message says which file and what.
    """
    path = pathlib.Path(path)
    return _with_deadline(f"checkpoint {path}", lambda: _read(path, verify, key))


def _read(path: pathlib.Path, verify: bool, key: bytes | None = None) -> Checkpoint:
    # Each file is opened once: what is loaded is what was checked, whatever is renamed or
    # swapped in the directory meanwhile (its signature vouches for the checksums).
    held: dict[str, int] = {}
    try:
        manifest = _verify(path, verify, key, held)
        weights = _load(path, MODEL_FILE, held[MODEL_FILE])
        state = _load(path, STATE_FILE, held[STATE_FILE])
    finally:
        for fd in held.values():
            os.close(fd)
    if "layout" in manifest:
        weights = {name: weights[name] for name in _manifest_layout(path, manifest).names}
    return Checkpoint(path, manifest, weights, state)


def _load(path: pathlib.Path, name: str, fd: int) -> dict[str, np.ndarray]:
    try:
        return safetensors.numpy.load_file(_fd_path(fd))
    except (safetensors.SafetensorError, OSError) as exc:
        raise _problem(path, "corrupt", f"{name} cannot be read: {_reason(exc)}") from exc
    finally:
        _progress()
