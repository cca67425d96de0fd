"""``aps simulate``: the flags; the simulation itself is :mod:`aps.lab.simulate`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from ..errors import ConfigurationError
from ..lab.clock import Stragglers
from ..lab.simulate import (
    _TRAINING_OPTIONS,
    DATASETS,
    DEFAULT_SETTINGS,
    DEFAULT_SPEEDS,
    EXPERIMENTS,
    ClusterSpec,
    format_table,
    run_experiment,
    run_training,
    simulate,
    worker_speeds,
)
from ._args import number, parse_setting, require, sync_setting


def register(commands) -> None:
    parser = commands.add_parser(
        "simulate",
        help="compare sync paradigms on a simulated cluster",
        description="Discrete-event simulation of P workers of given speeds, driving the real sync policies on "
        "a virtual clock: iterations per second, gate waits, staleness and the largest gap, per paradigm. "
        "Without --speeds or --workers it simulates four workers, one three times slower (--speeds 1,1,1,3).",
    )
    parser.add_argument(
        "--speeds", metavar="S,S,...", help="mean iteration time per worker, e.g. 1,1,1,3 (sets P; default 1,1,1,3)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="number of workers, all at speed 1 unless --hetero (default: as many as --speeds gives)",
    )
    parser.add_argument(
        "--hetero",
        metavar="lognormal:SIGMA",
        help="draw each worker's mean iteration time from a lognormal distribution (default: all 1)",
    )
    parser.add_argument("--jitter", type=number, help="lognormal spread of each iteration's time (default 0)")
    parser.add_argument(
        "--iterations",
        type=int,
        help="total iterations, all workers together (default 10000; with --train, batches: "
        "a local SGD setting's inner steps)",
    )
    parser.add_argument(
        "--sync",
        action="append",
        type=sync_setting,
        metavar="SETTING",
        help=f"bsp[:K], asp, ssp:S, dssp:S_L:S_U, softsync:N[:S], each with +cutoff:R (--staleness-cutoff), "
        f"+dc:LAMBDA, +dc-adaptive:LAMBDA or +gap (--compensation) and +inverse (lr/tau) suffixes, and "
        f"local SGD's +local:H (H steps between syncs, DiLoCo's outer step), +dn (delayed Nesterov) and "
        f"+dylu (dynamic local updates), and +int8 or +int4 (pushes quantized with error feedback) "
        f"(repeatable; default {' '.join(DEFAULT_SETTINGS)})",
    )
    parser.add_argument(
        "--stragglers",
        type=stragglers_arg,
        metavar="RATE:DURATION:SLOWDOWN",
        help="Markov on/off stragglers: each worker turns slow RATE times per virtual second, stays "
        "slow DURATION seconds on average, SLOWDOWN times slower (default: none)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random iteration times (and, with --train, of the data order)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (one object per setting) instead of a table")
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="also write the JSON to this file (default: print only); "
        "with --train, a directory for results.json, results.md and the figures",
    )
    train = parser.add_argument_group(
        "training on the virtual clock",
        "--train trains the bundled CNN: every gradient is real, computed on exactly the weights its worker's "
        "pull returned and applied when its push arrives in virtual time, one at a time in one process",
    )
    train.add_argument(
        "--train",
        choices=DATASETS,
        help="train on this bundled dataset (mnist: 5,000 MNIST digits; "
        "digits: scikit-learn's 8x8 digits; default: none, synchronization only)",
    )
    train.add_argument(
        "--experiment",
        choices=tuple(EXPERIMENTS),
        help="a paper's experiment at its own scale: "
        "zhang (30 learners, n-softsync, fixed lr and lr/tau) or zhao (4 and 16 heterogeneous workers, "
        "persistent and on/off stragglers, BSP/ASP/SSP/DSSP with and without lr/tau) or compensation "
        "(both papers' clusters: ASP, ASP lr/tau, DC-ASGD, gap-aware, a cut-off and DSSP) or local-sgd (BSP "
        "every step, DiLoCo, asynchronous local SGD with delayed Nesterov and dynamic local updates), 3 seeds each; "
        "--train mnist unless --train digits is given (a quick look); --sync, --lr, --momentum, "
        "--batch-size, --lr-staleness, --eval-every, --target, --seeds, --seed, --jobs and --out still "
        "apply (default: none)",
    )
    train.add_argument(
        "--budget", type=number, help="virtual seconds per run (default: none, --iterations ends each run)"
    )
    train.add_argument("--lr", type=number, help="learning rate of the server's SGD (default 0.05)")
    train.add_argument("--momentum", type=number, help="SGD momentum (default 0)")
    train.add_argument("--batch-size", type=int, help="each worker's batch (default 32)")
    train.add_argument(
        "--lr-staleness",
        choices=("none", "inverse", "both"),
        help="learning rate divided by staleness: none, inverse, or both (each setting twice; BSP once; default none)",
    )
    train.add_argument(
        "--eval-every", type=number, help="virtual seconds between test evaluations (default: a 25th of the run)"
    )
    train.add_argument("--target", type=number, help="test accuracy whose time to reach is reported (default 0.95)")
    train.add_argument("--seeds", type=int, help="runs per setting, with seeds SEED, SEED+1, ... (default 1)")
    train.add_argument(
        "--jobs",
        type=int,
        help="runs at once, one process each (default 1); the results "
        "are the same whatever the number: every run computes with one thread",
    )
    parser.set_defaults(run=run)


def stragglers_arg(text: str) -> Stragglers:
    """``RATE:DURATION:SLOWDOWN`` (see :class:`aps.lab.clock.Stragglers`)."""
    try:
        rate, duration, slowdown = (float(part) for part in text.split(":"))
        return Stragglers(rate, duration, slowdown)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--stragglers takes RATE:DURATION:SLOWDOWN, three positive numbers, got {text!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    if args.experiment:
        return run_experiment(args)
    if not args.train:
        given = [f"--{name.replace('_', '-')}" for name in _TRAINING_OPTIONS if getattr(args, name) is not None]
        require(
            not given,
            f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to training: "
            "add --train mnist|digits (or drop them)",
        )
    else:
        require(
            not args.json,
            "--json prints the synchronization-only table; with --train the results are --out DIR's results.json",
        )
        require(args.budget is None or args.iterations is None, "give --budget or --iterations, not both")
    for name, default in (
        ("jitter", 0.0),
        ("iterations", 10000),
        ("lr", 0.05),
        ("lr_staleness", "none"),
        ("target", 0.95),
        ("seeds", 1),
        ("momentum", 0.0),
        ("batch_size", 32),
        ("jobs", 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, default)
    require(args.iterations >= 1, f"--iterations must be at least 1, got {args.iterations}")
    require(args.jitter >= 0, f"--jitter must be >= 0, got {args.jitter:g}")
    require(args.workers is None or args.workers >= 1, f"--workers must be at least 1, got {args.workers}")
    if args.speeds is None and args.workers is None:
        require(args.hetero is None, "--hetero draws the speeds of --workers workers: give --workers too")
        args.speeds = ",".join(f"{s:g}" for s in DEFAULT_SPEEDS)
    speeds = worker_speeds(args.speeds, args.workers, args.hetero, args.seed)
    settings = args.sync or [parse_setting(text) for text in DEFAULT_SETTINGS]
    if args.train:
        require(args.budget is None or args.budget > 0, f"--budget must be > 0, got {args.budget}")
        cluster = ClusterSpec(
            "simulated cluster",
            tuple(speeds),
            args.jitter,
            args.stragglers,
            args.budget,
            None if args.budget else args.iterations,
        )
        return run_training(args, [cluster], settings)
    local = [item.label for item in settings if item.local_every is not None]
    require(
        not local,
        f"--sync {', '.join(local)}: local SGD trains a model between its syncs: add --train mnist|digits",
    )
    results = []
    for item in settings:
        try:
            results.append(
                simulate(
                    item,
                    speeds,
                    iterations=args.iterations,
                    jitter=args.jitter,
                    seed=args.seed,
                    stragglers=args.stragglers,
                )
            )
        except ConfigurationError as exc:
            raise ConfigurationError(f"--sync {item.label}: {exc}") from None
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        spread = (
            f"speeds {','.join(f'{s:g}' for s in speeds)}"
            if len(speeds) <= 16
            else (f"mean iteration time {statistics.fmean(speeds):.2f} (min {min(speeds):.2f}, max {max(speeds):.2f})")
        )
        print(f"{len(speeds)} workers, {spread}, jitter {args.jitter:g}, {args.iterations} iterations per setting")
        print(format_table(results))
    return 0
