"""``aps serve``: run a parameter server."""

from __future__ import annotations

import argparse
import logging
import sys

from ._args import add_server_arguments, config_from_args, given_options

__all__ = ["register"]


def register(commands) -> None:
    parser = commands.add_parser(
        "serve",
        help="run a parameter server",
        description="Run a parameter server. Every flag also reads an APS_* environment variable.",
    )
    add_server_arguments(parser)
    parser.set_defaults(run=run)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    from ..server.server import Server

    config = config_from_args(args)
    setup_logging(config.log_level)
    server = Server(config, given=set(given_options(args)))
    # The same command again, so that the server can restart itself from a checkpoint (REWIND).
    server.restart_command = [sys.executable, *sys.orig_argv[1:]]
    from ..server.replicas import SetRetired

    try:
        return server.run()
    except SetRetired as exc:  # (a backup whose primary ended the run: nothing went wrong)
        print(f"aps: {exc}", flush=True)
        return 0
