"""``aps token``: print a new random token for ``--token`` (or write it to a file)."""

from __future__ import annotations

import argparse
import os

from ..wire.tokens import MIN_TOKEN_BITS, new_token
from ..errors import ConfigurationError

__all__ = ["register", "run"]


def register(commands) -> None:
    parser = commands.add_parser(
        "token",
        help="print a new random token for --token",
        description=f"Print a new random token: 32 bytes from the operating system's generator, URL-safe "
        f"(256 bits; aps serve wants at least {MIN_TOKEN_BITS}). Give it to the server (--token, APS_TOKEN or "
        "--token-file) and to the workers (token=, APS_TOKEN).",
    )
    parser.add_argument(
        "--file",
        metavar="PATH",
        help="write it to PATH instead, readable by this user only (mode 0600; for --token-file); "
        "PATH must not exist yet (default: print it)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    token = new_token()
    if args.file is None:
        print(token, flush=True)
        return 0
    try:
        fd = os.open(args.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ConfigurationError(f"cannot create {args.file}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode("ascii"))
    finally:
        os.close(fd)
    return 0
