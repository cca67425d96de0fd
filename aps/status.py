"""``aps status``: ask a running server for its statistics."""

from __future__ import annotations

import argparse
import json
import time

from .protocol import Op
from .stats import format_stats
from .transport.address import parse_address
from .transport._client import exchange
from .transport.tcp_client import BlockingConnection

__all__ = ["fetch_stats", "main"]

def fetch_stats(address: str, timeout: float = 10.0) -> dict:
    """The statistics of the server at ``address`` (``tcp://HOST:PORT``), as ``Server.stats()`` returns them."""
    parsed = parse_address(address)
    conn = BlockingConnection(parsed.host, parsed.port, timeout)
    try:
        _, payload = exchange(conn, Op.STATS, timeout)
    finally:
        conn.close()
    return json.loads(payload)


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="the server, tcp://HOST:PORT")
    parser.add_argument("--json", action="store_true", help="print the raw statistics as JSON")
    parser.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until interrupted")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server (default 10)")


def run_status(args: argparse.Namespace) -> int:
    while True:
        stats = fetch_stats(args.address, args.timeout)
        if args.json:
            print(json.dumps(stats, indent=2), flush=True)
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
            print(format_stats(stats), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aps status", description=__doc__.splitlines()[0])
    add_status_arguments(parser)
    return run_status(parser.parse_args(argv))
