"""``aps compare`` and ``aps demo``: the flags; the comparison itself is :mod:`aps.lab.compare`."""

from __future__ import annotations

import argparse

from ..errors import ConfigurationError
from ..lab.compare import COMPRESSIONS, DEFAULT_PARADIGMS, compare
from ..lab.simulate import compare_virtual
from ._args import number


def register(commands) -> None:
    for demo in (False, True):
        if demo:
            parser = commands.add_parser(
                "demo",
                help="the comparison on small defaults: a few minutes on 2 cores (needs the torch extra)",
                description="aps compare with small defaults: the heterogeneous cluster, BSP, ASP, SSP s=3, "
                "SSP s=15 and DSSP [3,15].",
            )
        else:
            parser = commands.add_parser(
                "compare",
                help="train one model under every paradigm and compare time to accuracy (needs the torch extra)",
                description="Train the same model under each sync paradigm on emulated homogeneous and "
                "heterogeneous clusters; write DIR/results.json, results.md and accuracy.png.",
            )
        _add_arguments(parser, demo=demo)
        parser.set_defaults(run=run)


def _add_arguments(parser: argparse.ArgumentParser, *, demo: bool = False) -> None:
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where results.json, results.md and accuracy.png go (default: a new temporary directory, printed)",
    )
    parser.add_argument("--target", type=number, default=0.95, help="test accuracy to reach")
    parser.add_argument(
        "--paradigms",
        default="bsp,asp,ssp:3,ssp:15,dssp:3:15" if demo else ",".join(DEFAULT_PARADIGMS),
        help="sync settings, as aps simulate takes them",
    )
    parser.add_argument(
        "--lr-staleness",
        default="none" if demo else "both",
        choices=("both", "none", "inverse"),
        help="run the asynchronous paradigms without/with the staleness-aware learning rate",
    )
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument(
        "--speeds",
        default="1,1,1,2.5",
        help="the heterogeneous cluster's iteration times, as multiples of --step-time (bigger is slower)",
    )
    parser.add_argument(
        "--clusters",
        default="heterogeneous" if demo else "homogeneous,heterogeneous",
        help="homogeneous and/or heterogeneous",
    )
    parser.add_argument("--budget", type=number, default=30.0 if demo else 20.0, help="seconds of training per run")
    parser.add_argument("--step-time", type=number, default=0.04, help="emulated iteration time of a speed-1 worker")
    parser.add_argument("--jitter", type=number, default=0.1, help="random variation of iteration times")
    parser.add_argument("--dataset", default="mnist", choices=("mnist", "digits"), help="the bundled dataset")
    parser.add_argument(
        "--compression",
        default="none",
        help="wire compression rows, comma-separated from "
        + ", ".join(COMPRESSIONS)
        + " (e.g. none,bf16; anything but none makes every run's workers use TCP)",
    )
    parser.add_argument("--lr", type=number, default=0.05, help="learning rate (server-side SGD)")
    parser.add_argument("--momentum", type=number, default=0.0, help="SGD momentum")
    parser.add_argument("--batch-size", type=int, default=32, help="each worker's batch size")
    parser.add_argument(
        "--eval-every",
        type=number,
        default=0.0,
        help="seconds between evaluations (default 0: budget/25, at least 0.5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="data split and initial weights")
    parser.add_argument(
        "--repeats",
        type=int,
        help="run everything N times with different data orders and pacing (default 1; 3 with --virtual)",
    )
    parser.add_argument(
        "--virtual",
        action="store_true",
        help="the same comparison on a virtual clock (aps simulate --train): no processes, real "
        "gradients in virtual-time order, every run reproducible from its seed; --budget, "
        "--eval-every and the speeds count in --step-time units of virtual time; no server runs, so the "
        "dashboard flags do not apply",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar during each run")
    parser.add_argument(
        "--http-port",
        type=int,
        default=0 if demo else None,
        metavar="PORT",
        help="serve the live dashboard and /metrics of each run's server on this port (0: a free "
        "one, printed)" + ("; on by default" if demo else "; off by default"),
    )
    parser.add_argument("--no-dashboard", action="store_true", help="no HTTP side")


def run(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [name for name in ("torch", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigurationError(
            f"aps compare and aps demo train PyTorch models: install the extras ({', '.join(missing)} missing): "
            "pip install 'aps[torch,examples]'"
        )
    if args.virtual:
        return compare_virtual(args)
    args.repeats = 1 if args.repeats is None else args.repeats
    compare(args)
    if getattr(args, "command", None) == "demo":
        print("The same comparison on a virtual clock, 3 seeds per paradigm, about a minute: aps demo --virtual")
    return 0
