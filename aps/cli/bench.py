"""``aps bench``: the flags; the measurements themselves are :mod:`aps.lab.bench`."""

from __future__ import annotations

import argparse

from ..lab.bench import _DEFAULT_SIZES, measure
from ._args import choice_list, format_size, int_list, number, require, size_list


def register(commands) -> None:
    parser = commands.add_parser(
        "bench",
        help="measure push/pull throughput against a raw-socket bound",
        description="Benchmark push_pull round trips over TCP and shared memory against bounds measured in the "
        "same run (a blocking-socket ping-pong of the same payload; a memcpy plus one update pass). "
        "Prints a table; writes JSON only with --out.",
    )
    parser.add_argument(
        "--sizes",
        type=size_list,
        default=size_list(_DEFAULT_SIZES),
        metavar="SIZES",
        help="payload sizes, multiples of 4 bytes",
    )
    parser.add_argument("--workers", type=int_list, default=[1, 2, 4], metavar="COUNTS", help="worker process counts")
    parser.add_argument("--seconds", type=number, default=1.0, help="length of one measuring window")
    parser.add_argument("--min-iters", type=int, default=5, help="least round trips per window")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved windows per point")
    parser.add_argument(
        "--transports",
        type=choice_list(("tcp", "shm")),
        default=["tcp", "shm"],
        metavar="LIST",
        help="tcp, shm or both",
    )
    parser.add_argument(
        "--streaming",
        choices=("on", "off", "both"),
        default="on",
        help="TCP: apply gradients while they arrive (on), only once complete (off), or both",
    )
    parser.add_argument(
        "--tls", action="store_true", help="also measure TCP over TLS (a throwaway certificate; needs the bench extra)"
    )
    parser.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE (default: print only)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require(
        all(n > 0 and n % 4 == 0 for n in args.sizes),
        f"--sizes must be positive multiples of 4 bytes, got {','.join(map(format_size, args.sizes))}",
    )
    require(all(c >= 1 for c in args.workers), f"--workers takes counts of at least 1, got {args.workers}")
    require(args.seconds > 0, f"--seconds must be > 0, got {args.seconds:g}")
    require(args.min_iters >= 1, f"--min-iters must be at least 1, got {args.min_iters}")
    require(args.repeats >= 1, f"--repeats must be at least 1, got {args.repeats}")
    variants = {"on": ("aps",), "off": ("aps no-stream",), "both": ("aps", "aps no-stream")}[args.streaming]
    if args.tls:
        variants += ("aps tls",)
    measure(args.sizes, args.workers, args.seconds, args.min_iters, args.repeats, args.out, args.transports, variants)
    return 0
