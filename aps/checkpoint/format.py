"""The checkpoint format: its names and constants, :class:`Checkpoint`, and writing one
atomically (:func:`write_checkpoint`)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pathlib
import re
import secrets
import shutil
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from ..errors import CheckpointError, ConfigurationError, LayoutMismatch
from ..layout import Layout
from ..tables import Table


FORMAT = "aps-checkpoint"
#: 2: ``manifest.sha256`` holds the manifest's checksum (1 had none).
FORMAT_VERSION = 2
MODEL_FILE, STATE_FILE, MANIFEST_FILE = "model.safetensors", "state.safetensors", "manifest.json"
MANIFEST_SUM_FILE = "manifest.sha256"
#: The manifest's HMAC-SHA256 under the run's key (:func:`checkpoint_key`), when its writer
#: had a token of its operator's: what shows the checkpoint was neither altered nor forged.
MANIFEST_MAC_FILE = "manifest.hmac"
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
_MAC_LINE = _SUM_LINE  # (the same form: 64 hexadecimal digits, two spaces, the manifest's name)


def checkpoint_key(token: bytes) -> bytes:
    """The key a server with ``token`` signs its checkpoints with (derived from the token,
    so that the token itself keys nothing but the handshake)."""
    return hmac.new(token, b"aps/1 checkpoint manifest", hashlib.sha256).digest()


def sign_manifest(manifest: bytes, key: bytes) -> str:
    """The HMAC-SHA256 of a manifest's bytes under ``key``, in hexadecimal."""
    return hmac.new(key, manifest, hashlib.sha256).hexdigest()


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

    @property
    def tables(self) -> dict[str, dict[str, np.ndarray]]:
        """The rows of each embedding table the checkpoint holds, by table name: ``ids``
        (int64), ``rows`` (float32, one row an id, in the same order) and the optimizer's
        state of each row (``sum``, ``exp_avg``, ``exp_avg_sq``); rows never touched are not
        there. ``{}`` for a model without tables."""
        out: dict[str, dict[str, np.ndarray]] = {name: {} for name, _ in self.layout.tables}
        for key, value in self.state.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "tables" and parts[1] in out:
                out[parts[1]][parts[2]] = value
        return out

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
        raise CheckpointError(
            f"{name!r} is not a checkpoint name (checkpoint-SEQUENCE-vVERSION) and its manifest does not say"
        )
    return int(match.group(group))


# Writing --------------------------------------------------------------------------------------------


def write_checkpoint(
    directory: StrPath,
    name: str,
    manifest: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    state: Mapping[str, np.ndarray],
    *,
    key: bytes | None = None,
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
        key: sign the manifest with this key (:func:`checkpoint_key`), in
            ``manifest.hmac``.

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
    for array_name, value in extra.items():
        if value.dtype.kind not in "biuf":
            raise TypeError(f"state array {array_name!r} has dtype {value.dtype}; checkpoints hold numeric arrays only")
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
    tables = expected.tables if "layout" in fields else ()
    fields["layout"] = layout_json(Layout(actual.names, actual.shapes, tables))
    fields = json.loads(json.dumps(fields, default=_json_default))  # plain JSON values; a TypeError now

    target = directory / name
    temporary = directory / f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            raise CheckpointError(f"cannot write checkpoint {target}: it already exists")
        os.mkdir(temporary, 0o700)  # the run's weights, id and lineage: its user's alone
        files = {
            MODEL_FILE: _write_tensors(temporary / MODEL_FILE, model, {"format": "pt"}),
            STATE_FILE: _write_tensors(temporary / STATE_FILE, extra, None),
        }
        written = {"format": FORMAT, "format_version": FORMAT_VERSION, **fields, "files": files}
        text = (_pretty(written) + "\n").encode("utf-8")
        _write_small(temporary / MANIFEST_FILE, text)
        if key is not None:
            _write_small(temporary / MANIFEST_MAC_FILE, f"{sign_manifest(text, key)}  {MANIFEST_FILE}\n".encode())
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


_reading = threading.local()  # .tick: the running read's progress callback (on its helper thread)


def _progress() -> None:
    tick = getattr(_reading, "tick", None)
    if tick is not None:
        tick()


def layout_json(layout: Layout) -> dict[str, Any]:
    """A layout as a manifest keeps it: ``{"names", "shapes"}``, and ``"tables"`` (each
    table's description, in order) when the model has any."""
    out: dict[str, Any] = {"names": list(layout.names), "shapes": [list(shape) for shape in layout.shapes]}
    if layout.tables:
        out["tables"] = {name: table.describe() for name, table in layout.tables}
    return out


def _coerce_layout(value: Any) -> Layout:
    """A Layout from an aps Layout or ``{"names": [...], "shapes": [[...], ...]}`` (with
    ``"tables": {name: description}`` for a model with embedding tables)."""
    if isinstance(value, Layout):
        return value
    if not isinstance(value, dict):
        raise TypeError("it is not an object")
    tables = value.get("tables", {})
    if not isinstance(tables, dict):
        raise TypeError("its tables are not an object")
    try:
        declared = tuple((str(name), Table.from_description(described)) for name, described in tables.items())
    except ConfigurationError as exc:
        raise ValueError(f"a table cannot be read: {exc}") from None
    names, shapes = value["names"], value["shapes"]
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError("its names are not strings")
    if isinstance(shapes, str) or not all(
        not isinstance(s, str) and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in s)
        for s in shapes
    ):
        raise TypeError("its shapes are not lists of whole numbers")
    return Layout(tuple(names), tuple(tuple(int(d) for d in s) for s in shapes), declared)


def _manifest_layout(path: pathlib.Path, manifest: Mapping[str, Any]) -> Layout:
    try:
        return _coerce_layout(manifest.get("layout"))
    except (TypeError, KeyError, ValueError) as exc:  # LayoutMismatch is a ValueError
        detail = f": {exc}" if isinstance(exc, (TypeError, ValueError)) and str(exc) else ""
        raise _problem(path, "corrupt", f"{MANIFEST_FILE} has no valid layout{detail}") from None


def _problem(path: pathlib.Path, what: str, detail: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is {what}: {detail}")
