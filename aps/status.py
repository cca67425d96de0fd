"""``aps status``: ask a running server for its statistics."""

from __future__ import annotations

import argparse
import json
import time

from .errors import MalformedFrame, error_from_code
from .protocol import Header, Op, decode_error, pack_header
from .stats import format_stats
from .transport.address import parse_address
from .transport.framing import FrameReader
from .transport.tcp import BlockingConnection

__all__ = ["fetch_stats", "main"]

_MAX_STATS_BYTES = 64 << 20


class _StatsReply:
    def __init__(self) -> None:
        self.header: Header | None = None
        self.payload = b""

    def frame_buffer(self, header: Header) -> memoryview:
        if header.length > _MAX_STATS_BYTES:
            raise MalformedFrame(f"stats reply of {header.length} bytes")
        return memoryview(bytearray(header.length))

    def frame_received(self, header: Header, payload: memoryview) -> None:
        self.header, self.payload = header, bytes(payload)


def fetch_stats(address: str, timeout: float = 10.0) -> dict:
    """The statistics of the server at ``address`` (``tcp://HOST:PORT``), as ``Server.stats()`` returns them."""
    parsed = parse_address(address)
    conn = BlockingConnection(parsed.host, parsed.port, timeout)
    try:
        reply = _StatsReply()
        reader = FrameReader(reply)
        conn.send([pack_header(Op.STATS, request_id=1)])
        conn.receive(reader, lambda: reply.header is not None, timeout)
    finally:
        conn.close()
    if reply.header.op == Op.ERROR:
        raise error_from_code(*decode_error(reply.payload))
    if reply.header.op != Op.STATS_REPLY:
        raise MalformedFrame(f"unexpected reply op {reply.header.op} to STATS")
    return json.loads(reply.payload)


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
