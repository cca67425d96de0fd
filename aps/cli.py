"""The ``aps`` command and its subcommands."""

from __future__ import annotations

import argparse
import logging
import sys

from . import __version__
from .config import add_server_arguments, config_from_args
from .errors import APSError, ConfigurationError

__all__ = ["main"]


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _serve(args: argparse.Namespace) -> int:
    from .server import Server

    config = config_from_args(args)
    _setup_logging(config.log_level)
    return Server(config).run()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aps",
        description="aps: an asyncio parameter server for distributed deep-learning training.",
    )
    parser.add_argument("--version", action="version", version=f"aps {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    serve = commands.add_parser(
        "serve",
        help="run a parameter server",
        description="Run a parameter server. Every flag also reads an APS_* environment variable.",
    )
    add_server_arguments(serve)
    serve.set_defaults(run=_serve)

    from .bench import add_bench_arguments, run_bench

    bench = commands.add_parser(
        "bench",
        help="measure push/pull throughput against a raw-socket bound",
        description="Benchmark push_pull round trips over TCP against a blocking-socket ping-pong of the same payloads.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(run=run_bench)

    from .status import add_status_arguments, run_status

    status = commands.add_parser(
        "status",
        help="print a running server's statistics",
        description="Print a running server's statistics: version, update rate, and per worker its clock, "
        "staleness, time waited at the gate and DSSP grants.",
    )
    add_status_arguments(status)
    status.set_defaults(run=run_status)

    from .simulate import add_simulate_arguments, run_simulate

    simulate = commands.add_parser(
        "simulate",
        help="compare sync paradigms on a simulated cluster",
        description="Discrete-event simulation of P workers of given speeds, driving the real sync policies on "
        "a virtual clock: iterations per second, gate waits, staleness and the largest gap, per paradigm.",
    )
    add_simulate_arguments(simulate)
    simulate.set_defaults(run=run_simulate)

    from .launch import add_launch_arguments, run_launch

    launch = commands.add_parser(
        "launch",
        help="run an embedded server and N local workers of a training script",
        description="Run an embedded server (any aps serve flag) and --workers local processes of SCRIPT, "
        "with APS_ADDRESS, RANK and WORLD_SIZE set; --step-time and --slowdown emulate devices of different speeds.",
    )
    add_launch_arguments(launch)
    launch.set_defaults(run=run_launch)

    from .compare import add_compare_arguments, run_compare

    compare = commands.add_parser(
        "compare",
        help="train one model under every paradigm and compare time to accuracy (needs the torch extra)",
        description="Train the same model under each sync paradigm on emulated homogeneous and heterogeneous "
        "clusters; write DIR/results.json, results.md and accuracy.png.",
    )
    add_compare_arguments(compare)
    compare.set_defaults(run=run_compare)

    demo = commands.add_parser(
        "demo",
        help="the comparison on small defaults: a few minutes on 2 cores (needs the torch extra)",
        description="aps compare with small defaults: the heterogeneous cluster, BSP, ASP, SSP s=3, SSP s=15 and DSSP [3,15].",
    )
    add_compare_arguments(demo, demo=True)
    demo.set_defaults(run=run_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ConfigurationError as exc:
        parser.exit(2, f"aps: error: {exc}\n")
    except APSError as exc:
        parser.exit(1, f"aps: {exc}\n")
    except KeyboardInterrupt:
        return 130
