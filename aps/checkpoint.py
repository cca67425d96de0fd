"""The on-disk checkpoint format: a directory of safetensors files and a JSON manifest.

A checkpoint directory (``aps serve --checkpoint-dir``) holds one directory per
checkpoint, named ``checkpoint-{sequence:08d}-v{version}``, each with three files:

``model.safetensors``
    The model's weights: one float32 tensor per model tensor, with its shape.
    ``safetensors.torch.load_file`` returns it as a PyTorch state dict.
``state.safetensors``
    Every other array (optimizer state such as ``exp_avg/fc.weight``, an
    accumulated gradient ...), named by the writer. It may hold no tensor.
``manifest.json``
    Everything that is not an array (version, clocks, configuration ...), plus
    the format, its version and each file's size and SHA-256 (``sha256sum``
    agrees), so a reader can tell a complete checkpoint from a torn or corrupt one.
``manifest.sha256``
    The SHA-256 of ``manifest.json`` itself, as ``sha256sum manifest.json``
    prints it (so ``sha256sum -c manifest.sha256`` checks it): the manifest
    holds the run's options, version, clocks and what each rank pushed last,
    and a flipped bit there must not change a resumed run silently. Format
    version 1 (before this file existed) is still read, with a warning that
    its manifest cannot be verified; from version 2 a missing one is refused.

A checkpoint is written into a temporary directory (``.tmp-{name}-{pid}-{random}``),
manifest (then its checksum) last, every file and the directory fsynced, then
renamed into place: a crash leaves either a complete checkpoint or a temporary
that :func:`remove_temporaries` deletes, never a torn one. Reading checks the
manifest against its checksum, each file's size and (unless asked not to) its
checksum, and the model tensors against the manifest's layout before loading
anything; :func:`find_resumable` also checks the type of every field a resume
uses (:func:`check_resumable`). Only regular files are opened (a FIFO or a
device in a checkpoint's place is refused, never waited on), and a read that
makes no progress for :data:`READ_STALL_S` seconds (a hung network file system)
is given up with a clear error.

Example::

    ckpt = aps.load_checkpoint("ckpts")  # the newest checkpoint in ckpts/
    ckpt.version, ckpt.weights["fc.weight"].shape
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from .errors import CheckpointError, LayoutMismatch
from .layout import Layout

__all__ = [
    "Checkpoint",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "MANIFEST_SUM_FILE",
    "MODEL_FILE",
    "READ_STALL_S",
    "STATE_FILE",
    "check_resumable",
    "check_writable",
    "checkpoint_name",
    "lock_directory",
    "lock_run_directory",
    "directory_bytes",
    "file_problems",
    "find_resumable",
    "is_checkpoint",
    "list_checkpoints",
    "list_temporaries",
    "load_checkpoint",
    "next_sequence",
    "prune",
    "read_checkpoint",
    "read_manifest",
    "remove_temporaries",
    "verify_checkpoint",
    "write_checkpoint",
]

FORMAT = "aps-checkpoint"
#: 2: ``manifest.sha256`` holds the manifest's checksum (1 had none).
FORMAT_VERSION = 2
MODEL_FILE, STATE_FILE, MANIFEST_FILE = "model.safetensors", "state.safetensors", "manifest.json"
MANIFEST_SUM_FILE = "manifest.sha256"
#: A checkpoint read that makes no progress (opens, chunks read) for this many seconds is given up.
READ_STALL_S = 60.0

log = logging.getLogger("aps.checkpoint")

StrPath = str | os.PathLike

_NAME = re.compile(r"checkpoint-(\d{8,})-v(\d+)")
_TEMPORARY = re.compile(r"\.tmp-(.+)-(\d+)-([0-9a-f]{8})")
_CHUNK = 8 << 20  # read and hashed without the GIL (hashlib lets go of it above 2 KiB per update)
_RESERVED = ("format", "format_version", "files")
_MANIFEST_MAX_BYTES = 64 << 20  # far beyond any manifest (a few kB, plus ~200 bytes per worker)
_SUM_LINE = re.compile(rb"([0-9a-f]{64})  " + re.escape(MANIFEST_FILE.encode()) + rb"\n?")


@dataclass
class Checkpoint:
    """One checkpoint, read from disk.

    Attributes:
        path: the checkpoint's directory.
        manifest: ``manifest.json`` as a dict (the writer's fields, plus
            ``format``, ``format_version`` and ``files``).
        weights: the model tensors (float32), in the manifest's layout order.
        state: every other array, by the names its writer gave them.
    """

    path: pathlib.Path
    manifest: dict
    weights: dict[str, np.ndarray] = field(repr=False)
    state: dict[str, np.ndarray] = field(repr=False)

    @property
    def version(self) -> int:
        """The weights' version (how many updates the server had applied)."""
        if "version" in self.manifest:
            return int(self.manifest["version"])
        return _parse_name(self.path.name, 2)

    @property
    def sequence(self) -> int:
        """The checkpoint's number in its directory (1 for the first written)."""
        if "sequence" in self.manifest:
            return int(self.manifest["sequence"])
        return _parse_name(self.path.name, 1)

    @cached_property
    def layout(self) -> Layout:
        """The model's flat layout (names and shapes, in flat order)."""
        if "layout" in self.manifest:
            return _manifest_layout(self.path, self.manifest)
        return Layout.from_arrays(self.weights)

    def flat_weights(self) -> np.ndarray:
        """The weights as one new float32 vector, in layout order (what the server holds)."""
        layout = self.layout
        flat = np.empty(layout.numel, dtype=np.float32)
        layout.flatten_into(self.weights, flat)
        return flat


def checkpoint_name(sequence: int, version: int) -> str:
    """The directory name of checkpoint number ``sequence`` at weights version ``version``.

    Example: ``checkpoint_name(7, 70) == "checkpoint-00000007-v70"``.
    """
    if sequence < 0 or version < 0:
        raise ValueError(f"sequence and version must be >= 0, got {sequence} and {version}")
    return f"checkpoint-{int(sequence):08d}-v{int(version)}"


def _parse_name(name: str, group: int) -> int:
    match = _NAME.fullmatch(name)
    if match is None:
        raise CheckpointError(f"{name!r} is not a checkpoint name (checkpoint-SEQUENCE-vVERSION) and its "
                              "manifest does not say")
    return int(match.group(group))


# Writing --------------------------------------------------------------------------------------------


def write_checkpoint(
    directory: StrPath,
    name: str,
    manifest: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    state: Mapping[str, np.ndarray],
) -> pathlib.Path:
    """Write a checkpoint atomically: ``directory/name`` appears complete, or not at all.

    Meant for a helper thread: the file writes and checksums run without the GIL.

    Args:
        directory: the checkpoint directory (created if missing).
        name: the checkpoint's name, normally :func:`checkpoint_name`.
        manifest: JSON-serializable fields (numpy scalars are converted). A
            ``"layout": {"names": [...], "shapes": [...]}`` entry, if present,
            must match ``weights``; if absent, one is added in ``weights``' order.
            ``format``, ``format_version`` and ``files`` are set here.
        weights: the model tensors, float32 (others are converted), C-contiguous
            for a write without a copy.
        state: every other array (any numeric dtype); may be empty.

    Returns:
        The path of the new checkpoint.

    Raises:
        CheckpointError: ``directory/name`` exists, the weights do not match the
            manifest's layout, or the directory cannot be written (read-only, full,
            ...): the message names the directory and the OS's reason. Nothing is
            left behind.
        TypeError: the manifest is not JSON-serializable, or a state array is
            not numeric.
    """
    directory = pathlib.Path(directory)
    if not name or "/" in name or os.sep in name or name.startswith("."):
        raise ValueError(f"a checkpoint name is a plain directory name not starting with '.', got {name!r}")
    model = {str(k): np.asarray(v, dtype=np.float32, order="C") for k, v in weights.items()}
    extra = {str(k): np.asarray(v, order="C") for k, v in state.items()}
    for key, value in extra.items():
        if value.dtype.kind not in "biuf":
            raise TypeError(f"state array {key!r} has dtype {value.dtype}; checkpoints hold numeric arrays only")
    fields = {k: v for k, v in manifest.items() if k not in _RESERVED}
    try:
        if "layout" in fields:
            try:
                expected = _coerce_layout(fields["layout"])
            except (TypeError, KeyError, ValueError) as exc:  # LayoutMismatch too
                raise CheckpointError(f"the manifest's layout is not valid: {exc}") from None
            if set(expected.names) == set(model):
                model = {name: model[name] for name in expected.names}
            if (difference := expected.difference(Layout.from_arrays(model))) is not None:
                raise CheckpointError(f"the weights do not match the manifest's layout: {difference}")
        actual = Layout.from_arrays(model)
    except LayoutMismatch as exc:  # an empty, overlong or repeated name, a negative dimension
        raise CheckpointError(f"cannot write these weights: {exc}") from None
    fields["layout"] = {"names": list(actual.names), "shapes": [list(shape) for shape in actual.shapes]}
    fields = json.loads(json.dumps(fields, default=_json_default))  # plain JSON values; a TypeError now

    target = directory / name
    temporary = directory / f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            raise CheckpointError(f"cannot write checkpoint {target}: it already exists")
        os.mkdir(temporary)
        files = {
            MODEL_FILE: _write_tensors(temporary / MODEL_FILE, model, {"format": "pt"}),
            STATE_FILE: _write_tensors(temporary / STATE_FILE, extra, None),
        }
        written = {"format": FORMAT, "format_version": FORMAT_VERSION, **fields, "files": files}
        text = (_pretty(written) + "\n").encode("utf-8")
        _write_small(temporary / MANIFEST_FILE, text)
        # Last, so that a manifest is never taken for checked without its checksum.
        _write_small(temporary / MANIFEST_SUM_FILE, _sum_line(text))
        _fsync_directory(temporary)
        os.rename(temporary, target)
        _fsync_directory(directory)
    except BaseException as exc:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write checkpoint to {directory}: {_reason(exc)}") from exc
        if isinstance(exc, safetensors.SafetensorError):
            raise CheckpointError(f"cannot write checkpoint to {directory}: {_reason(exc)}") from exc
        raise
    return target


def _write_small(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _sum_line(manifest: bytes) -> bytes:
    """``manifest.sha256``'s content: what ``sha256sum manifest.json`` prints."""
    return f"{hashlib.sha256(manifest).hexdigest()}  {MANIFEST_FILE}\n".encode()


def _write_tensors(path: pathlib.Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None) -> dict:
    """Write one safetensors file; its size and SHA-256, read back from disk, after an fsync."""
    safetensors.numpy.save_file(tensors, path, metadata=metadata)
    fd = os.open(path, os.O_RDONLY)
    try:
        size, digest = _hash_fd(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": size, "sha256": digest}


def _hash_fd(fd: int) -> tuple[int, str]:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(fd, "rb", buffering=0, closefd=False) as raw:
        while count := raw.readinto(view):
            digest.update(view[:count])
            size += count
            _progress()
    return size, digest.hexdigest()


def _fsync_directory(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, pathlib.PurePath):
        return str(value)
    raise TypeError(f"a checkpoint manifest holds JSON values only, not {type(value).__name__}: {value!r}")


def _pretty(value: Any, level: int = 0) -> str:
    """JSON with one key per line, but each list without objects in it (a shape, the
    tensor names) on one line: a layout stays two lines, however many tensors it has."""
    pad = " " * level
    if isinstance(value, dict) and value:
        items = [f"{pad} {json.dumps(str(k))}: {_pretty(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        items = [f"{pad} {_pretty(v, level + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value)


def _reason(exc: BaseException) -> str:
    """The OS's words for why a file operation failed."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    # safetensors reports I/O errors as "... I/O error: No space left on device (os error 28) ..."
    match = re.search(r"\(os error (\d+)\)", str(exc))
    if match:
        return os.strerror(int(match.group(1)))
    return str(exc) or type(exc).__name__


def check_writable(directory: StrPath) -> None:
    """Make sure checkpoints can be written to ``directory``, creating it (and its parents) if missing.

    Raises:
        CheckpointError: the directory cannot be created, or a file cannot be
            created in it (read-only file system, no permission, full disk ...).
    """
    directory = pathlib.Path(directory)
    probe = directory / f".tmp-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"aps")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        try:
            os.unlink(probe)
        except OSError:
            pass
        raise CheckpointError(f"cannot write checkpoints to {directory}: {_reason(exc)}") from exc


# Reading --------------------------------------------------------------------------------------------


def _problem(path: pathlib.Path, what: str, detail: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is {what}: {detail}")


# Every read of a checkpoint: regular files only, and a deadline -----------------------------------------

_reading = threading.local()  # .tick: the running read's progress callback (on its helper thread)


class _NotRegular(OSError):
    """A checkpoint file that is not a regular file (a FIFO, a device, a symbolic link ...)."""

    def __init__(self, kind: str) -> None:
        super().__init__(errno.EINVAL, f"is {kind}, not a regular file")
        self.kind = kind


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _progress() -> None:
    tick = getattr(_reading, "tick", None)
    if tick is not None:
        tick()


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
            raise CheckpointError(f"reading {what} made no progress for {stall:g} s (a hung file system?): "
                                  "gave up; nothing was changed")
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


def read_manifest(path: StrPath) -> dict:
    """The manifest of the checkpoint at ``path``, checked against its checksum
    (``manifest.sha256``) and for form and format version.

    Raises:
        CheckpointError: ``path`` is not a directory, or its manifest is missing,
            not a regular file, does not match its checksum, is not a JSON object,
            or is of another format or a newer format version.
    """
    path = pathlib.Path(path)
    return _with_deadline(f"checkpoint {path}", lambda: _read_manifest(path))


def _read_manifest(path: pathlib.Path) -> dict:
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
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} is larger than {_MANIFEST_MAX_BYTES >> 20} MiB: "
                       "not a manifest")
    line = _read_file(path, MANIFEST_SUM_FILE, 4096, None)
    if line is not None:
        match = _SUM_LINE.fullmatch(line)
        if match is None:
            raise _problem(path, "corrupt", f"{MANIFEST_SUM_FILE} does not hold a SHA-256 line for {MANIFEST_FILE}")
        if hashlib.sha256(data).hexdigest() != match.group(1).decode():
            raise _problem(path, "corrupt", f"checksum mismatch in {MANIFEST_FILE}")
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
        raise CheckpointError(f"{path} is not an aps checkpoint: {MANIFEST_FILE} has format "
                              f"{manifest.get('format')!r}, not {FORMAT!r}")
    format_version = manifest.get("format_version")
    if not isinstance(format_version, int) or isinstance(format_version, bool) or format_version < 1:
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} has no valid format_version ({format_version!r})")
    if format_version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {format_version}; this aps reads "
                              f"up to version {FORMAT_VERSION}: upgrade aps to read it")
    if line is None:
        if format_version >= 2:
            raise _problem(path, "incomplete", f"{MANIFEST_SUM_FILE} is missing")
        if str(path) not in _warned_unchecked:  # once per checkpoint, not at every look
            _warned_unchecked.add(str(path))
            log.warning("checkpoint %s has format version 1, whose manifest has no checksum: %s is checked "
                        "for form only (the checkpoints written from now on have one)", path, MANIFEST_FILE)
    files = manifest.get("files")
    if not isinstance(files, dict) or any(f not in files for f in (MODEL_FILE, STATE_FILE)):
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} does not list {MODEL_FILE} and {STATE_FILE}")
    for name, entry in files.items():
        if (not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith(".")
                or name in (MANIFEST_FILE, MANIFEST_SUM_FILE)):
            raise _problem(path, "corrupt", f"{MANIFEST_FILE} lists a file named {name!r}")
        if (not isinstance(entry, dict) or not _is_count(entry.get("bytes"))
                or not isinstance(entry.get("sha256"), str)):
            raise _problem(path, "corrupt", f"{MANIFEST_FILE} gives no size and sha256 for {name}")
    if "layout" in manifest:
        _manifest_layout(path, manifest)
    return manifest


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


def _file_problem(path: pathlib.Path, name: str, entry: Mapping[str, Any], *, verify: bool) -> tuple[str, str] | None:
    """What is wrong with file ``name`` given its manifest ``entry``, as ``(what, detail)``
    (``("corrupt", "checksum mismatch in model.safetensors")``), or None."""
    try:
        fd = _open_regular(path / name)
    except FileNotFoundError:
        return "incomplete", f"{name} is missing"
    except _NotRegular as exc:
        return "corrupt", f"{name} {exc.strerror}"
    except OSError as exc:
        return "unreadable", f"{name}: {_reason(exc)}"
    try:
        size = os.fstat(fd).st_size
        expected = entry["bytes"]
        if size < expected:
            return "truncated", f"{name} has {size} bytes, the manifest says {expected}"
        if size > expected:
            return "corrupt", f"{name} has {size} bytes, the manifest says {expected}"
        if verify:
            _, digest = _hash_fd(fd)
            if digest != str(entry["sha256"]).lower():
                return "corrupt", f"checksum mismatch in {name}"
    except OSError as exc:
        return "unreadable", f"{name}: {_reason(exc)}"
    finally:
        os.close(fd)
    return None


def _coerce_layout(value: Any) -> Layout:
    """A Layout from an aps Layout or ``{"names": [...], "shapes": [[...], ...]}``."""
    if isinstance(value, Layout):
        return value
    names, shapes = value["names"], value["shapes"]
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError("its names are not strings")
    if isinstance(shapes, str) or not all(
        not isinstance(s, str) and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in s)
        for s in shapes
    ):
        raise TypeError("its shapes are not lists of whole numbers")
    return Layout(tuple(names), tuple(tuple(int(d) for d in s) for s in shapes))


def _manifest_layout(path: pathlib.Path, manifest: Mapping[str, Any]) -> Layout:
    try:
        return _coerce_layout(manifest.get("layout"))
    except (TypeError, KeyError, ValueError) as exc:  # LayoutMismatch is a ValueError
        detail = f": {exc}" if isinstance(exc, (TypeError, ValueError)) and str(exc) else ""
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} has no valid layout{detail}") from None


_DTYPE_NAMES = {"F32": "float32", "F64": "float64", "F16": "float16", "BF16": "bfloat16"}


def _tensor_problem(path: pathlib.Path, manifest: Mapping[str, Any]) -> tuple[str, str] | None:
    """What is wrong with the model tensors against the manifest's layout (names, shapes,
    float32), from the file's header alone; None if nothing is."""
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
            return "corrupt", (f"tensor {name!r} in {MODEL_FILE} has shape {found[name][0]}, "
                               f"the manifest's layout says {shape}")
    listed = set(layout.names)
    unexpected = [key for key in found if key not in listed]
    if unexpected:
        return "corrupt", f"{MODEL_FILE} holds tensors the manifest's layout does not list: {unexpected[:5]}"
    return None


def _problems(path: pathlib.Path, manifest: Mapping[str, Any], verify: bool) -> dict[str, tuple[str, str] | None]:
    """Per listed file, what is wrong with it as ``(what, detail)``, or None."""
    found = {name: _file_problem(path, name, entry, verify=verify) for name, entry in manifest["files"].items()}
    if found[MODEL_FILE] is None:
        found[MODEL_FILE] = _tensor_problem(path, manifest)
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


def verify_checkpoint(path: StrPath, *, verify: bool = True) -> dict:
    """Check the checkpoint at ``path`` without loading its arrays: manifest, each file's size
    and checksum (if ``verify``), and the model tensors' names, shapes and dtype.

    Returns:
        Its manifest.

    Raises:
        CheckpointError: as :func:`read_checkpoint`.
    """
    path = pathlib.Path(path)
    return _with_deadline(f"checkpoint {path}", lambda: _verify(path, verify))


def _verify(path: pathlib.Path, verify: bool) -> dict:
    manifest = _read_manifest(path)
    for problem in _problems(path, manifest, verify).values():
        if problem is not None:
            raise _problem(path, *problem)
    return manifest


def read_checkpoint(path: StrPath, *, verify: bool = True) -> Checkpoint:
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
    return _with_deadline(f"checkpoint {path}", lambda: _read(path, verify))


def _read(path: pathlib.Path, verify: bool) -> Checkpoint:
    manifest = _verify(path, verify)
    weights = _load(path, MODEL_FILE)
    state = _load(path, STATE_FILE)
    if "layout" in manifest:
        weights = {name: weights[name] for name in _manifest_layout(path, manifest).names}
    return Checkpoint(path, manifest, weights, state)


def _load(path: pathlib.Path, name: str) -> dict[str, np.ndarray]:
    try:
        fd = _open_regular(path / name)
    except _NotRegular as exc:
        raise _problem(path, "corrupt", f"{name} {exc.strerror}") from None
    except OSError as exc:
        raise _problem(path, "corrupt", f"{name} cannot be read: {_reason(exc)}") from exc
    try:
        return safetensors.numpy.load_file(_fd_path(fd))
    except (safetensors.SafetensorError, OSError) as exc:
        raise _problem(path, "corrupt", f"{name} cannot be read: {_reason(exc)}") from exc
    finally:
        os.close(fd)
        _progress()


# A directory of checkpoints -------------------------------------------------------------------------------


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
        raise CheckpointError(f"another process (pid {holder}) is writing checkpoints into {directory}: "
                              "give each server a --checkpoint-dir of its own") from None
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
        raise CheckpointError(f"{directory} is held by a live aps server (pid {holder}), which goes on with the run "
                              f"whose checkpoints are there{advice}") from None
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
                if (int(inode) == info.st_ino and int(major, 16) == os.major(info.st_dev)
                        and int(minor, 16) == os.minor(info.st_dev) and fields[4] != "0"):
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
    return sorted(directory / e.name for e in _entries(directory)
                  if _TEMPORARY.fullmatch(e.name) and e.is_dir(follow_symlinks=False))


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


def _readable_or_older(path: pathlib.Path, older: list[pathlib.Path], directory: pathlib.Path, hint: str,
                       resumable: bool) -> Checkpoint:
    """Checkpoint ``path``, read (and with ``resumable``, checked for a resume); if it does
    not read, a CheckpointError naming the first of ``older`` that does, with ``hint``
    (formatted with its path) on how to use it."""
    try:
        checkpoint = _read(path, True)
        if resumable:
            _check_resumable(checkpoint.path, checkpoint.manifest)
        return checkpoint
    except CheckpointError as exc:
        failure = str(exc)
    for candidate in older:
        try:
            manifest = _verify(candidate, True)
            if resumable:
                _check_resumable(candidate, manifest)
        except CheckpointError:
            continue
        raise CheckpointError(f"{failure}; the next older one, {candidate}, is intact: {hint.format(path=candidate)}")
    if older:
        raise CheckpointError(f"{failure}; no older checkpoint in {directory} is intact either")
    raise CheckpointError(f"{failure}; there is no older checkpoint in {directory}")


def _newest_readable(directory: pathlib.Path, hint: str, resumable: bool = False) -> Checkpoint | None:
    """The newest complete checkpoint in ``directory`` (None: there is none); see
    :func:`_readable_or_older`."""
    candidates = list_checkpoints(directory)
    if not candidates:
        return None
    return _readable_or_older(candidates[0], candidates[1:], directory, hint, resumable)


def _named(path: pathlib.Path, hint: str, resumable: bool) -> Checkpoint:
    """Checkpoint ``path`` itself, named by the caller; if it does not read, the message also
    names the next older intact one in its directory, when its directory holds older ones."""
    match = _NAME.fullmatch(path.name)
    older = []
    if match is not None:
        older = [c for c in list_checkpoints(path.parent) if int(_NAME.fullmatch(c.name).group(1)) < int(match.group(1))]
    if not older:
        checkpoint = _read(path, True)
        if resumable:
            _check_resumable(checkpoint.path, checkpoint.manifest)
        return checkpoint
    return _readable_or_older(path, older, path.parent, hint, resumable)


def find_resumable(path: StrPath, *, stall: float | None = None) -> Checkpoint | None:
    """The checkpoint ``aps serve --resume PATH`` resumes from.

    Args:
        path: a checkpoint (read as is), or a checkpoint directory (its newest
            complete checkpoint).
        stall: give up when the read makes no progress for this many seconds
            (default :data:`READ_STALL_S`).

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
            return _named(path, hint, resumable=True)
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"cannot resume from {path}: it is neither a checkpoint nor a directory of them")
        return _newest_readable(path, hint, resumable=True)

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


# What a resume takes from a manifest ----------------------------------------------------------------------

_INT64 = (-(1 << 63), (1 << 63) - 1)
_MISSING = object()
_RUN_ID = re.compile(r"[!-~]{1,64}")  # printable ASCII, no spaces: what workers and SHARDS carry


class _Invalid(Exception):
    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what


def _kind(value: Any) -> str:
    if value is _MISSING:
        return "missing"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{json.dumps(value)} (true/false)"
    text = json.dumps(value, default=str)
    shown = text if len(text) <= 40 else text[:37] + "..."
    names = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return f"{names.get(type(value), type(value).__name__)} ({shown})"


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise _Invalid(where, what)


def _int(value: Any, where: str, lo: int = 0, hi: int = _INT64[1]) -> int:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, int) and not isinstance(value, bool), where, f"is {_kind(value)}, not a whole number")
    _need(lo <= value <= hi, where, f"is {value}, out of range {lo}..{hi}")
    return value


def _number(value: Any, where: str) -> float:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, (int, float)) and not isinstance(value, bool), where, f"is {_kind(value)}, not a number")
    _need(math.isfinite(value), where, f"is {value}, not a finite number")
    return value


def _bool(value: Any, where: str) -> bool:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, bool), where, f"is {_kind(value)}, not true or false")
    return value


def _object(value: Any, where: str) -> dict:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, dict), where, f"is {_kind(value)}, not an object")
    return value


def _list(value: Any, where: str, length: int | None = None) -> list:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, list), where, f"is {_kind(value)}, not a list")
    if length is not None:
        _need(len(value) == length, where, f"has {len(value)} entries, the run has {length} workers")
    return value


def _run_id(value: Any, where: str) -> str:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, str) and _RUN_ID.fullmatch(value) is not None, where,
          f"is {_kind(value)}, not a run id (1 to 64 printable characters)")
    return value


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against a ServerConfig field's type (int, float, bool, str,
    ``X | None``, ``tuple[float, float]``)."""
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _typed(value, inner, where)
    if origin is tuple:
        _need(isinstance(value, list) and len(value) == len(args), where,
              f"is {_kind(value)}, not a list of {len(args)}")
        return tuple(_typed(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if hint is bool:
        return _bool(value, where)
    if hint is int:
        return _int(value, where, _INT64[0])
    if hint is float:
        return float(_number(value, where))
    if hint is str:
        _need(isinstance(value, str), where, f"is {_kind(value)}, not a string")
        return value
    raise TypeError(f"no check for a {hint} option")  # pragma: no cover - a new option type


def _run_options(saved: dict) -> dict:
    """The run's options (:data:`aps.config.RUN_OPTIONS`) from the manifest's config, typed and
    valid together (as ``aps serve`` would take them)."""
    import typing

    from .config import RUN_OPTIONS, ServerConfig
    from .errors import ConfigurationError

    hints = typing.get_type_hints(ServerConfig)
    options = {name: _typed(saved.get(name, _MISSING), hints[name], f"config.{name}") for name in RUN_OPTIONS}
    try:
        ServerConfig(**options)
    except (ConfigurationError, TypeError, ValueError) as exc:
        raise _Invalid("config", str(exc)) from None
    return options


def _resume_fields(m: dict) -> None:
    """Every field a resume takes from manifest ``m``, checked for type and range (raises _Invalid)."""
    _run_id(m.get("run_id", _MISSING), "run_id")
    _int(m.get("version", _MISSING), "version")
    _int(m.get("pushes", _MISSING), "pushes")
    if "sequence" in m:
        _int(m["sequence"], "sequence")
    _need("layout" in m, "layout", "is missing")  # its form: read_manifest
    options = _run_options(_object(m.get("config", _MISSING), "config"))
    workers = options["workers"]
    runs = m.get("shard_runs")
    if runs is not None:
        _need(isinstance(runs, list) and len(runs) == options["shards"], "shard_runs",
              f"is {_kind(runs)}, not a list of the {options['shards']} shards' run ids")
        for i, run in enumerate(runs):
            _run_id(run, f"shard_runs[{i}]")

    optimizer = _object(m.get("optimizer", _MISSING), "optimizer")
    name = optimizer.get("name", _MISSING)
    _need(name == options["optimizer"], "optimizer.name",
          f"is {_kind(name)}, but the run's optimizer is {options['optimizer']!r}")
    _int(optimizer.get("steps", _MISSING), "optimizer.steps")
    loaded = optimizer.get("loaded_state")
    if loaded is not None:
        _need(isinstance(loaded, str) and re.fullmatch(r"(?:[0-9a-f]{2})*", loaded) is not None,
              "optimizer.loaded_state", f"is {_kind(loaded)}, not a hexadecimal digest")

    policy = _object(m.get("policy", _MISSING), "policy")
    sync = policy.get("name", _MISSING)
    _need(sync == options["sync"], "policy.name", f"is {_kind(sync)}, but the run's sync policy is {options['sync']!r}")
    _int(policy.get("min_clock", _MISSING), "policy.min_clock")
    _int(policy.get("last_r_star", _MISSING), "policy.last_r_star", -1)
    _int(policy.get("controller_calls", _MISSING), "policy.controller_calls")
    if "dropped" in policy:
        _int(policy["dropped"], "policy.dropped")
    for i, clock in enumerate(_list(policy.get("clocks", _MISSING), "policy.clocks", workers)):
        _int(clock, f"policy.clocks[{i}]", -1)
    for column in ("live", "held"):
        for i, flag in enumerate(_list(policy.get(column, _MISSING), f"policy.{column}", workers)):
            _bool(flag, f"policy.{column}[{i}]")
    for i, credit in enumerate(_list(policy.get("credits", _MISSING), "policy.credits", workers)):
        _int(credit, f"policy.credits[{i}]")
    if sync == "bsp":
        for column in ("contributed", "pushed", "round_held"):
            for i, rank in enumerate(_list(policy.get(column, _MISSING), f"policy.{column}")):
                _int(rank, f"policy.{column}[{i}]", 0, workers - 1)
    if sync == "softsync":
        _int(policy.get("count", _MISSING), "policy.count")

    for key, seat in _object(m.get("seats", _MISSING), "seats").items():
        where = f"seats.{key}"
        _need(key.isascii() and key.isdigit() and str(int(key)) == key and int(key) < workers, "seats",
              f"has a seat {key!r}, not a rank of the run's {workers} workers")
        _object(seat, where)
        _int(seat.get("clock", _MISSING), f"{where}.clock", -1)
        _int(seat.get("push_id", _MISSING), f"{where}.push_id", -1, (1 << 64) - 1)
        _int(seat.get("push_clock", _MISSING), f"{where}.push_clock", -1)
        if "held" in seat:
            _bool(seat["held"], f"{where}.held")
        if "credit" in seat:
            _int(seat["credit"], f"{where}.credit")
        result = seat.get("push_result")
        if result is not None:
            _need(isinstance(result, list) and len(result) == 5, f"{where}.push_result",
                  f"is {_kind(result)}, not [version, clock, dropped, staleness, scale]")
            _int(result[0], f"{where}.push_result[0]")
            _int(result[1], f"{where}.push_result[1]", -1)
            _bool(result[2], f"{where}.push_result[2]")
            _int(result[3], f"{where}.push_result[3]", _INT64[0])
            _number(result[4], f"{where}.push_result[4]")

    if "counters" in m:
        counters = _object(m["counters"], "counters")
        for name in ("rejected", "duplicates"):
            if name in counters:
                _int(counters[name], f"counters.{name}")


def _check_resumable(path: pathlib.Path, manifest: dict) -> None:
    try:
        _resume_fields(manifest)
    except _Invalid as exc:
        raise CheckpointError(f"checkpoint {path} cannot be resumed: {exc}") from None


def check_resumable(checkpoint: Checkpoint) -> None:
    """Check every field of ``checkpoint``'s manifest that ``aps serve --resume`` takes up
    (run id, version, pushes, layout, the run's options, the optimizer's, the sync policy's
    clocks and rounds, each rank's seat, the counters, the shards' runs) for its type and
    range, so that a resume only ever sees well-formed state.

    Raises:
        CheckpointError: ``checkpoint X cannot be resumed: FIELD: what is wrong``
            (``policy: is a list ([]), not an object``).
    """
    _check_resumable(checkpoint.path, checkpoint.manifest)


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
