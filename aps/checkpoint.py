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

A checkpoint is written into a temporary directory (``.tmp-{name}-{pid}-{random}``),
manifest last, every file and the directory fsynced, then renamed into place:
a crash leaves either a complete checkpoint or a temporary that
:func:`remove_temporaries` deletes, never a torn one. Reading checks the
manifest, each file's size and (unless asked not to) its checksum, and the
model tensors against the manifest's layout before loading anything.

Example::

    ckpt = aps.load_checkpoint("ckpts")  # the newest checkpoint in ckpts/
    ckpt.version, ckpt.weights["fc.weight"].shape
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
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
    "MODEL_FILE",
    "STATE_FILE",
    "check_writable",
    "checkpoint_name",
    "lock_directory",
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
FORMAT_VERSION = 1
MODEL_FILE, STATE_FILE, MANIFEST_FILE = "model.safetensors", "state.safetensors", "manifest.json"

StrPath = str | os.PathLike

_NAME = re.compile(r"checkpoint-(\d{8,})-v(\d+)")
_TEMPORARY = re.compile(r"\.tmp-(.+)-(\d+)-([0-9a-f]{8})")
_CHUNK = 8 << 20  # read and hashed without the GIL (hashlib lets go of it above 2 KiB per update)
_RESERVED = ("format", "format_version", "files")


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
        text = _pretty(written) + "\n"
        with open(temporary / MANIFEST_FILE, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
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


def read_manifest(path: StrPath) -> dict:
    """The manifest of the checkpoint at ``path``, checked for form and format version.

    Raises:
        CheckpointError: ``path`` is not a directory, or its manifest is missing,
            not a JSON object, or of another format or a newer format version.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    try:
        text = (path / MANIFEST_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _problem(path, "incomplete", f"{MANIFEST_FILE} is missing") from None
    except UnicodeDecodeError:
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} is not UTF-8 text") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {_reason(exc)}") from exc
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
    files = manifest.get("files")
    if not isinstance(files, dict) or any(f not in files for f in (MODEL_FILE, STATE_FILE)):
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} does not list {MODEL_FILE} and {STATE_FILE}")
    for name, entry in files.items():
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
            raise _problem(path, "corrupt", f"{MANIFEST_FILE} lists a file named {name!r}")
        if (not isinstance(entry, dict) or not _is_count(entry.get("bytes"))
                or not isinstance(entry.get("sha256"), str)):
            raise _problem(path, "corrupt", f"{MANIFEST_FILE} gives no size and sha256 for {name}")
    if "layout" in manifest:
        _manifest_layout(path, manifest)
    return manifest


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _file_problem(path: pathlib.Path, name: str, entry: Mapping[str, Any], *, verify: bool) -> tuple[str, str] | None:
    """What is wrong with file ``name`` given its manifest ``entry``, as ``(what, detail)``
    (``("corrupt", "checksum mismatch in model.safetensors")``), or None."""
    try:
        fd = os.open(path / name, os.O_RDONLY)
    except FileNotFoundError:
        return "incomplete", f"{name} is missing"
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
    file = path / MODEL_FILE
    try:
        with safetensors.safe_open(file, framework="np") as f:
            found = {key: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype()) for key in f.keys()}
    except (safetensors.SafetensorError, OSError) as exc:
        return "corrupt", f"{MODEL_FILE} cannot be read: {_reason(exc)}"
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
    manifest = read_manifest(path)
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
    manifest = verify_checkpoint(path, verify=verify)
    weights = _load(path, MODEL_FILE)
    state = _load(path, STATE_FILE)
    if "layout" in manifest:
        weights = {name: weights[name] for name in _manifest_layout(path, manifest).names}
    return Checkpoint(path, manifest, weights, state)


def _load(path: pathlib.Path, name: str) -> dict[str, np.ndarray]:
    try:
        return safetensors.numpy.load_file(path / name)
    except (safetensors.SafetensorError, OSError) as exc:
        raise _problem(path, "corrupt", f"{name} cannot be read: {_reason(exc)}") from exc


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

    A missing directory has none. Contents are not checked: see :func:`read_checkpoint`.
    """
    directory = pathlib.Path(directory)
    found = []
    for entry in _entries(directory):
        match = _NAME.fullmatch(entry.name)
        if match and entry.is_dir() and os.path.isfile(os.path.join(entry.path, MANIFEST_FILE)):
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
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise CheckpointError(f"another process (pid {holder}) is writing checkpoints into {directory}: "
                              "give each server a --checkpoint-dir of its own") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


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


def _newest_readable(directory: pathlib.Path, hint: str) -> Checkpoint | None:
    """The newest complete checkpoint in ``directory``; if it does not read, a CheckpointError
    naming the next older one that does, with ``hint`` (formatted with its path) on how to use it."""
    candidates = list_checkpoints(directory)
    if not candidates:
        return None
    try:
        return read_checkpoint(candidates[0])
    except CheckpointError as exc:
        failure = str(exc)
    for older in candidates[1:]:
        try:
            verify_checkpoint(older)
        except CheckpointError:
            continue
        raise CheckpointError(f"{failure}; the next older one, {older}, is intact: {hint.format(path=older)}")
    if len(candidates) > 1:
        raise CheckpointError(f"{failure}; no older checkpoint in {directory} is intact either")
    raise CheckpointError(f"{failure}; there is no older checkpoint in {directory}")


def find_resumable(path: StrPath) -> Checkpoint | None:
    """The checkpoint ``aps serve --resume PATH`` resumes from.

    Args:
        path: a checkpoint (read as is), or a checkpoint directory (its newest
            complete checkpoint).

    Returns:
        The checkpoint, verified; None if ``path`` is a directory that holds no
        complete checkpoint, or does not exist (a new run starts).

    Raises:
        CheckpointError: the checkpoint does not read (missing, corrupt ...);
            for a directory whose newest checkpoint does not read, the message
            also names the next older one that does and how to resume from it.
    """
    path = pathlib.Path(path)
    if is_checkpoint(path):
        return read_checkpoint(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"cannot resume from {path}: it is neither a checkpoint nor a directory of them")
    return _newest_readable(path, "resume from it with --resume {path}")


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
    if is_checkpoint(path):
        return read_checkpoint(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: it does not exist")
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: it is not a directory")
    found = _newest_readable(path, "load it by its path")
    if found is None:
        raise CheckpointError(f"no checkpoint in {path}")
    return found


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
