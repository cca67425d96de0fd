"""The ``aps`` command: one module per subcommand.

Each module registers its subcommand (``register(commands)``) and runs it
(``run(args)``); they share their argument parsing through ``_args``.
"""

from __future__ import annotations

import argparse
import sys

from .._version import __version__
from ..errors import APSError, ConfigurationError
from . import bench, checkpoint, compare, launch, serve, simulate, slurm, status, token
from ._args import ArgumentParser

__all__ = ["build_parser", "main"]

#: The subcommands, in the order ``aps --help`` lists them.
COMMANDS = (serve, status, checkpoint, bench, simulate, launch, slurm, compare, token)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="aps",
        description="aps: an asyncio parameter server for distributed deep-learning training.",
    )
    parser.add_argument("--version", action="version", version=f"aps {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    commands.required = True
    for module in COMMANDS:
        module.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(checkpoint.shorthand(sys.argv[1:] if argv is None else argv))
    prog = f"aps {args.command}"
    try:
        return args.run(args)
    except ConfigurationError as exc:
        parser.exit(2, f"{prog}: error: {exc}\n")
    except APSError as exc:
        parser.exit(1, f"{prog}: {exc}\n")
    except KeyboardInterrupt:
        return 130
