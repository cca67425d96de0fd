"""``aps checkpoint``: look into the checkpoints ``aps serve --checkpoint-dir`` writes.

``aps checkpoint now [ADDR]`` (or ``aps checkpoint ADDR``) asks a running server
to write one at once and prints where it went; ``aps checkpoint inspect PATH`` prints what a checkpoint holds (version,
when and why it was written, the run, the sync policy and optimizer, the
model's size) and verifies its files and its manifest's checksum; ``aps
checkpoint verify PATH`` checks everything ``aps serve --resume PATH`` would
(every checksum, and the type of every field a resume takes up) without
starting a server; ``aps checkpoint list DIR`` lists the complete checkpoints
in a directory, newest first. A damaged checkpoint makes inspect and verify
exit with status 1 and a one-line reason.

Each action is a function in :data:`ACTIONS` that adds its subparser and
sets ``run``: a new one (such as asking a running server for a checkpoint
now) is one more entry.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from .. import checkpoint as ckpt
from ..errors import CheckpointError
from ..wire.scalars import check_scalar_name
from ._args import ADDRESS_DEFAULT, ArgumentParser, add_token_arguments, server_address, token_advice, token_from_args

__all__ = ["ACTIONS", "format_manifest", "register", "request_checkpoint"]


def register(commands) -> None:
    parser = commands.add_parser(
        "checkpoint",
        help="write, inspect or list checkpoints",
        description="Ask a running server for a checkpoint now, inspect a checkpoint (and verify its files), "
        "verify that a checkpoint can be resumed, or list the checkpoints in a directory.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=ArgumentParser)
    actions.required = True
    for add in ACTIONS:
        add(actions)


def _add_inspect(actions) -> None:
    parser = actions.add_parser(
        "inspect",
        help="print what a checkpoint holds and verify its files",
        description="Print a checkpoint's manifest in a readable form and verify its files (sizes, SHA-256 "
        "checksums, model tensors). Exit status 1 if the checkpoint is damaged.",
    )
    parser.add_argument(
        "path",
        type=pathlib.Path,
        metavar="PATH",
        help="a checkpoint, or a checkpoint directory (its newest checkpoint)",
    )
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.add_argument("--no-verify", action="store_true", help="check the files' sizes but not their checksums")
    parser.set_defaults(run=run_inspect)


def _add_verify(actions) -> None:
    parser = actions.add_parser(
        "verify",
        help="check that a checkpoint can be resumed, as aps serve --resume would",
        description="Check everything aps serve --resume PATH checks, without starting a server: every file's "
        "size and SHA-256 checksum, the manifest's own checksum (manifest.sha256), the model tensors, and the "
        "type and range of every field a resume takes up. Exit status 1 with the reason (and the next older "
        "intact checkpoint, if there is one) if it cannot be resumed.",
    )
    parser.add_argument(
        "path",
        type=pathlib.Path,
        metavar="PATH",
        help="a checkpoint, or a checkpoint directory (its newest checkpoint)",
    )
    parser.set_defaults(run=run_verify)


def _add_list(actions) -> None:
    parser = actions.add_parser(
        "list",
        help="list the checkpoints in a directory, newest first",
        description="List the complete checkpoints in a checkpoint directory, newest first (their files are "
        "not verified: see aps checkpoint inspect), and any temporary directories an interrupted write left.",
    )
    parser.add_argument("directory", type=pathlib.Path, metavar="DIR", help="the checkpoint directory")
    parser.set_defaults(run=run_list)


def _add_now(actions) -> None:
    parser = actions.add_parser(
        "now",
        help="ask a running server to write a checkpoint now",
        description="Ask a running server (started with --checkpoint-dir) to write a checkpoint at once; "
        "prints its path when it is on disk. Training goes on meanwhile.",
    )
    parser.add_argument(
        "address", nargs="?", default=None, metavar="ADDR", help=f"the server, tcp://HOST:PORT ({ADDRESS_DEFAULT})"
    )
    add_token_arguments(parser)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the checkpoint (default 120)")
    parser.set_defaults(run=run_now)


def shorthand(argv: list[str]) -> list[str]:
    """``aps checkpoint ADDR`` is ``aps checkpoint now ADDR``."""
    if len(argv) >= 2 and argv[0] == "checkpoint" and "://" in argv[1]:
        return [argv[0], "now", *argv[1:]]
    return argv


#: The actions of ``aps checkpoint``, in the order its help lists them.
ACTIONS: tuple[Callable[[Any], None], ...] = (_add_now, _add_inspect, _add_verify, _add_list)


# now ------------------------------------------------------------------------------------------------


def request_checkpoint(address: str, token: str | None = None, timeout: float = 120.0) -> dict:
    """Ask the server at ``address`` to write a checkpoint now; returns ``{"path", "version"}``
    once it is on disk. Raises CheckpointFailed (no ``--checkpoint-dir``, no model yet,
    a full or read-only directory) or APSConnectionError."""
    from ..wire.protocol import Op
    from ..client.tcp import control_request

    return json.loads(control_request(address, Op.CHECKPOINT, token, timeout))


def run_now(args: argparse.Namespace) -> int:
    from ..errors import ConfigurationError

    address = server_address(args.address)
    if not args.timeout > 0:
        raise ConfigurationError(f"--timeout must be > 0 seconds, got {args.timeout}")
    with token_advice(args):
        info = request_checkpoint(address, token_from_args(args), args.timeout)
    print(f"checkpoint {info['path']} (version {info['version']})")
    return 0


# inspect --------------------------------------------------------------------------------------------


def run_inspect(args: argparse.Namespace) -> int:
    path = args.path
    if not ckpt.is_checkpoint(path):
        if not path.is_dir():
            raise CheckpointError(
                f"no checkpoint at {path}: it does not exist"
                if not path.exists()
                else f"{path} is neither a checkpoint nor a directory of them"
            )
        found = ckpt.list_checkpoints(path)
        if not found:
            raise CheckpointError(f"no checkpoint in {path}")
        path = found[0]
    manifest = ckpt.read_manifest(path)  # checked against its checksum: a bad one is the reason, exit 1
    problems = ckpt.file_problems(path, manifest, verify=not args.no_verify)
    if args.json:
        print(json.dumps(manifest, indent=2), flush=True)
    else:
        print(
            format_manifest(path, manifest, problems, verified=not args.no_verify, manifest_file=_manifest_entry(path)),
            flush=True,
        )
    # The one-line reason on stderr, with the exit status, comes from the full check.
    if any(problem is not None for problem in problems.values()):
        ckpt.verify_checkpoint(path, verify=not args.no_verify)
    return 0


def _manifest_entry(path: pathlib.Path) -> tuple[int, str, str]:
    """The manifest's size, SHA-256 and status line (it was read, so it matched its checksum if it has one)."""
    data = (path / ckpt.MANIFEST_FILE).read_bytes()
    checked = (path / ckpt.MANIFEST_SUM_FILE).is_file()
    status = f"ok ({ckpt.MANIFEST_SUM_FILE})" if checked else "no checksum (format version 1): checked for form only"
    status += (
        f"; signed ({ckpt.MANIFEST_MAC_FILE}: a resume with the run's token checks it)"
        if (path / ckpt.MANIFEST_MAC_FILE).is_file()
        else "; not signed (its server had no token of its operator's)"
    )
    return len(data), hashlib.sha256(data).hexdigest(), status


# verify ---------------------------------------------------------------------------------------------


def run_verify(args: argparse.Namespace) -> int:
    path = args.path
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: it does not exist")
    found = ckpt.find_resumable(path)
    if found is None:
        raise CheckpointError(f"no checkpoint in {path}")
    manifest = found.manifest
    checked = "" if (found.path / ckpt.MANIFEST_SUM_FILE).is_file() else " (format version 1: no manifest checksum)"
    print(
        f"checkpoint {found.path}: intact and resumable{checked}: run {manifest['run_id']}, version "
        f"{manifest['version']}, {manifest['config']['workers']} workers, {manifest['config']['sync']}",
        flush=True,
    )
    return 0


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt_time(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(value)).strip()
    return "-" if value is None else str(value)


def _fmt_setting(value: Any) -> str:
    """``ssp staleness=3``, from a string or a mapping with a name (``name``, ``sync``, ``kind``)."""
    if not isinstance(value, Mapping):
        return str(value)
    rest = dict(value)
    head = next((str(rest.pop(k)) for k in ("name", "sync", "optimizer", "kind") if k in rest), "")
    args = " ".join(f"{k}={json.dumps(v) if isinstance(v, (Mapping, list)) else v}" for k, v in rest.items())
    return " ".join(part for part in (head, args) if part) or "-"


_SYNC_OPTIONS = ("staleness", "max_staleness", "softsync_n", "backup_workers", "lr_staleness")


def format_manifest(
    path: pathlib.Path,
    manifest: Mapping[str, Any],
    problems: Mapping[str, str | None],
    *,
    verified: bool = True,
    manifest_file: tuple[int, str, str] | None = None,
) -> str:
    """A readable summary of a checkpoint's manifest and its files' status (what
    ``aps checkpoint inspect`` prints). ``problems``: from :func:`aps.checkpoint.file_problems`;
    ``manifest_file``: the manifest's own size, SHA-256 and status, for its line."""
    lines = [f"checkpoint {path}"]

    def field(label: str, value: Any) -> None:
        lines.append(f"  {label:<10} {value}")

    config: Mapping[str, Any] = manifest["config"] if isinstance(manifest.get("config"), Mapping) else {}
    field("version", manifest.get("version", "-"))
    field("sequence", manifest.get("sequence", "-"))
    field("created", _fmt_time(manifest.get("created")))
    for key, label in (("reason", "reason"), ("run_id", "run"), ("aps_version", "written by"), ("pushes", "pushes")):
        if key in manifest:
            field(label, f"aps {manifest[key]}" if key == "aps_version" else manifest[key])
    workers = manifest.get("workers", config.get("workers"))
    if workers is not None:
        field("workers", len(workers) if isinstance(workers, list) else workers)
    if "sync" in manifest:
        field("sync", _fmt_setting(manifest["sync"]))
    elif "sync" in config:  # what aps serve writes: the run's options
        field(
            "sync",
            _fmt_setting(
                {
                    "name": config["sync"],
                    **{k: config[k] for k in _SYNC_OPTIONS if config.get(k) is not None and k in config},
                }
            ),
        )
    if "optimizer" in manifest:
        field("optimizer", _fmt_setting(manifest["optimizer"]))
    layout = manifest.get("layout")
    if isinstance(layout, Mapping) and isinstance(layout.get("shapes"), list):
        shapes = layout["shapes"]
        count = sum(math.prod(s) for s in shapes)
        field(
            "model",
            f"{len(shapes)} tensor{'' if len(shapes) == 1 else 's'}, {count:,} parameter{'' if count == 1 else 's'}",
        )
    logged = manifest.get("scalars")
    curves = [e for e in logged if isinstance(e, list) and len(e) == 5] if isinstance(logged, list) else []
    if curves:  # (what the workers logged: aps.server.engine.scalars)
        ranks = {e[0] for e in curves if isinstance(e[0], int)}
        names = sorted({e[1] for e in curves if isinstance(e[1], str) and _is_scalar_name(e[1])})
        field(
            "logged",
            f"{len(curves)} curve{'' if len(curves) == 1 else 's'} of {len(ranks)} "
            f"rank{'' if len(ranks) == 1 else 's'}: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}",
        )
    lines.append("  files")
    files = manifest.get("files", {})
    width = max((len(name) for name in [*files, ckpt.MANIFEST_FILE]), default=0)
    if manifest_file is not None:
        size, digest, status = manifest_file
        lines.append(f"    {ckpt.MANIFEST_FILE:<{width}}  {_fmt_bytes(size):>9}  sha256 {digest[:16]}  {status}")
    for name, entry in files.items():
        problem = problems.get(name)
        status = "ok" if problem is None else problem
        if problem is None and not verified:
            status = "ok (size only, checksum not verified)"
        lines.append(f"    {name:<{width}}  {_fmt_bytes(entry['bytes']):>9}  sha256 {entry['sha256'][:16]}  {status}")
    return "\n".join(lines)


# list -----------------------------------------------------------------------------------------------


def run_list(args: argparse.Namespace) -> int:
    directory = args.directory
    if not directory.exists():
        raise CheckpointError(f"{directory} does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    found = ckpt.list_checkpoints(directory)
    rows = []
    for path in found:
        try:
            manifest = ckpt.read_manifest(path)
            version, created = manifest.get("version", "-"), _fmt_time(manifest.get("created"))
        except CheckpointError as exc:
            version, created = "-", f"damaged: {exc}"
        rows.append((path.name, str(version), created, _fmt_bytes(ckpt.directory_bytes(path))))
    if rows:
        widths = [
            max(len(header), *(len(row[i]) for row in rows))
            for i, header in enumerate(("checkpoint", "version", "created"))
        ]
        print(f"{'checkpoint':<{widths[0]}}  {'version':>{widths[1]}}  {'created':<{widths[2]}}  size")
        for name, version, created, size in rows:
            print(f"{name:<{widths[0]}}  {version:>{widths[1]}}  {created:<{widths[2]}}  {size}")
    else:
        print(f"no checkpoints in {directory}")
    temporaries = ckpt.list_temporaries(directory)
    if temporaries:
        names = ", ".join(t.name for t in temporaries[:3]) + (" ..." if len(temporaries) > 3 else "")
        print(
            f"{len(temporaries)} temporary director{'y' if len(temporaries) == 1 else 'ies'} left by an "
            f"interrupted or ongoing write (not checkpoints; safe to delete once no server writes here): {names}"
        )
    return 0


def _is_scalar_name(name: str) -> bool:
    """``name`` may name a logged scalar (what inspect prints of a manifest it does not trust)."""
    try:
        check_scalar_name(name)
    except ValueError:
        return False
    return True
