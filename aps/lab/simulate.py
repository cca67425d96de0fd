"""``aps simulate``: compare sync paradigms on a simulated cluster before spending a real one.

A discrete-event simulation of P workers whose iteration times come from
given distributions, driving the real server engine (the same sync policy
classes, the same native ``StalenessWindow``, the same update lane) on a
virtual clock. Each worker loops: compute for one iteration time, push, wait
for the gate, repeat. The model is a single float, so the figures measure
synchronization only: how many iterations per second the cluster completes,
how long workers wait at the gate, and how stale the applied gradients are.
Communication time is not modelled separately; fold it into the iteration
times.

Example::

    aps simulate --speeds 1,1,1,3 --jitter 0.2 --iterations 20000 \\
        --sync bsp --sync asp --sync ssp:3 --sync dssp:3:15
"""

from __future__ import annotations

import dataclasses
import math
import os
import textwrap
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from . import compare
from .clock import IterationTimes, SimulationError, Stragglers, VirtualCluster
from ..config import ServerConfig, usable_cores
from ..errors import ConfigurationError
from ..layout import Layout
from .settings import Setting, command_line, describe_speeds, parse_setting, parse_speeds, require

__all__ = ["DEFAULT_SETTINGS", "SimulationError", "simulate", "worker_speeds"]

#: The bundled datasets --train takes (aps.workloads.DATASETS, without importing torch here).
DATASETS = ("mnist", "digits")

DEFAULT_SETTINGS = ("bsp", "asp", "ssp:3", "ssp:15", "dssp:3:15", "softsync:1")
#: The cluster ``aps simulate`` runs without --speeds or --workers: four workers, one three times slower.
DEFAULT_SPEEDS = (1.0, 1.0, 1.0, 3.0)


@dataclass(frozen=True)
class ClusterSpec:
    """One simulated cluster of a ``--train`` comparison: its workers' mean iteration times, the
    jitter and stragglers on top, and how long each run lasts (virtual seconds or gradients)."""

    name: str
    speeds: tuple[float, ...]
    jitter: float = 0.0
    stragglers: Stragglers | None = None
    budget: float | None = None
    iterations: int | None = None
    #: Virtual seconds between test evaluations (None: a 25th of the run, or --eval-every).
    eval_every: float | None = None

    def describe(self) -> str:
        text = describe_speeds(self.speeds)
        if self.jitter:
            text += f", jitter {self.jitter:g}"
        if self.stragglers is not None:
            s = self.stragglers
            text += f", on/off stragglers {s.rate:g}/s for {s.duration:g} s, {s.slowdown:g}x slower"
        return text


@dataclass(frozen=True)
class Experiment:
    """A paper's experiment at its own scale, as one ``aps simulate --experiment NAME``."""

    title: str
    clusters: tuple[ClusterSpec, ...]
    sync: tuple[str, ...]
    lr_staleness: str = "both"
    lr: float = 0.05
    target: float = 0.95
    seeds: int = 3


#: ``aps simulate --experiment``: the two papers' experiments on the bundled MNIST digits (see docs/paradigms.md).
EXPERIMENTS = {
    # Zhang et al.: 30 learners, n-softsync for n in 1, 2, 4, 30 (and ASP), fixed learning rate and lr/tau.
    "zhang": Experiment(
        title="Zhang et al., staleness-aware async SGD: 30 learners, n-softsync, fixed learning rate and lr/tau",
        clusters=(ClusterSpec("30 learners", (1.0,) * 30, jitter=0.3, iterations=8000, eval_every=8.0),),
        # With 30 workers, softsync n=30 applies each gradient alone: it is ASP, run for run (so ASP is not
        # run again).
        sync=("softsync:1", "softsync:2", "softsync:4", "softsync:30"),
        target=0.9,
    ),
    # Zhao et al.: heterogeneous clusters (a slow worker or several; persistent and on/off stragglers).
    # The on/off stragglers: each worker turns slow every 200 virtual s on average and stays slow 50 s
    # (a fifth of the time), 4x slower meanwhile; so at any moment some worker is usually slow, but
    # never the same one for long, which is where a threshold set at run time can pay off.
    "zhao": Experiment(
        title="Zhao et al., dynamic SSP: heterogeneous clusters of 4 and 16 workers, persistent and on/off stragglers",
        clusters=(
            ClusterSpec("4 workers, one 3x slower", (1.0, 1.0, 1.0, 3.0), jitter=0.1, budget=600, eval_every=15.0),
            ClusterSpec(
                "4 workers, on/off stragglers",
                (1.0,) * 4,
                jitter=0.1,
                stragglers=Stragglers(0.005, 50.0, 4.0),
                budget=600,
                eval_every=15.0,
            ),
            ClusterSpec(
                "16 workers, four 3x slower", (1.0,) * 12 + (3.0,) * 4, jitter=0.1, budget=400, eval_every=10.0
            ),
            ClusterSpec(
                "16 workers, on/off stragglers",
                (1.0,) * 16,
                jitter=0.1,
                stragglers=Stragglers(0.005, 50.0, 4.0),
                budget=400,
                eval_every=10.0,
            ),
        ),
        sync=("bsp", "asp", "ssp:3", "ssp:15", "dssp:3:15"),
        target=0.9,
    ),
}
# Beyond lr/tau: delay compensation (DC-ASGD's adaptive variant at the paper's lambda0 = 2, gap-aware)
# and a delay cut-off, against ASP and DSSP with a fixed rate and ASP with lr/tau, on Zhang's 30
# learners and Zhao's four clusters (docs/science/papers.md, "Beyond lr/tau").
# Shorter runs than the papers' presets (which wait for BSP): every setting here that gets to 0.9
# on these clusters does so within 7,000 gradients (30 learners), 300 virtual s (4 workers) and
# 320 (16), and the whole experiment stays within 15 minutes with --jobs 2 on 2 cores.
EXPERIMENTS["compensation"] = Experiment(
    title="Beyond lr/tau: DC-ASGD, gap-aware and a delay cut-off against ASP, ASP lr/tau and DSSP",
    clusters=(
        dataclasses.replace(EXPERIMENTS["zhang"].clusters[0], iterations=7000),
        *(
            dataclasses.replace(cluster, budget=300.0 if len(cluster.speeds) == 4 else 320.0)
            for cluster in EXPERIMENTS["zhao"].clusters
        ),
    ),
    sync=(
        "asp",
        "asp+inverse",
        "asp+dc-adaptive:2",
        "asp+gap",
        "asp+cutoff:20",
        "dssp:3:15",
        "dssp:3:15+dc-adaptive:2",
        "dssp:3:15+gap",
    ),
    lr_staleness="none",
    target=0.9,
)
# Local SGD (docs/science/papers.md, "Local SGD"): BSP every step against DiLoCo (H = 10 and 50,
# BSP rounds of pseudo-gradients with Nesterov's outer step) and asynchronous local SGD (ASP, H = 10,
# delayed Nesterov; and with dynamic local updates), on 4 workers one 2.5x slower and on 4 with on/off
# stragglers. --lr and --momentum are the inner SGD's in the local settings (the outer step is 0.7
# with momentum 0.9) and the server's for BSP every step.
EXPERIMENTS["local-sgd"] = Experiment(
    title="Local SGD: BSP every step, DiLoCo (H = 10, 50) and asynchronous local SGD with delayed Nesterov "
    "and dynamic local updates, on uneven workers",
    clusters=(
        ClusterSpec("4 workers, one 2.5x slower", (1.0, 1.0, 1.0, 2.5), jitter=0.1, budget=400, eval_every=10.0),
        dataclasses.replace(EXPERIMENTS["zhao"].clusters[1], budget=400.0, eval_every=10.0),  # (on/off stragglers)
    ),
    sync=("bsp", "bsp+local:10", "bsp+local:50", "asp+local:10+dn", "asp+local:10+dn+dylu"),
    lr_staleness="none",
    target=0.9,
)
#: What a preset sets, and so may not be given with --experiment.
_CLUSTER_OPTIONS = ("speeds", "workers", "hetero", "jitter", "stragglers", "budget", "iterations")
#: What only training uses (refused without --train or --experiment rather than ignored).
_TRAINING_OPTIONS = ("budget", "lr", "momentum", "batch_size", "lr_staleness", "eval_every", "target", "seeds", "jobs")


def worker_speeds(speeds: str | None, workers: int | None, hetero: str | None, seed: int) -> list[float]:
    """Mean iteration time per worker, from ``--speeds`` or ``--workers`` with ``--hetero``."""
    if speeds:
        values = parse_speeds(speeds, workers)
    else:
        if not workers:
            raise ConfigurationError("give --speeds, or --workers (with --hetero for uneven speeds)")
        values = [1.0] * workers
        if hetero:
            kind, _, sigma_text = hetero.partition(":")
            try:
                sigma = float(sigma_text)
            except ValueError:
                sigma = -1.0
            if kind != "lognormal" or sigma < 0:
                raise ConfigurationError(f"--hetero takes lognormal:SIGMA, got {hetero!r}")
            rng = np.random.default_rng(seed + 7919)
            values = list(np.exp(rng.normal(0.0, sigma, workers)))
    if not values or any(not v > 0 or math.isinf(v) for v in values):
        raise ConfigurationError("iteration times must be positive")
    return values


def simulate(
    setting: Setting,
    speeds: list[float],
    *,
    iterations: int,
    jitter: float = 0.0,
    seed: int = 0,
    stragglers: Stragglers | None = None,
) -> dict:
    """Run one setting until the cluster has pushed ``iterations`` gradients in all.

    Returns a JSON-able dict: ``sync``, ``iterations_per_s`` (per simulated
    second), gate waits (``mean_wait``, ``p99_wait``, ...), staleness of the
    applied gradients (``mean_staleness``, ``staleness_hist``, ...),
    ``max_gap`` (the largest ``t_i - min_j t_j`` at any release), and more.

    Raises:
        SimulationError: every worker is waiting and none can push (deadlock).
    """
    config = ServerConfig(workers=len(speeds), lr=0.0, heartbeat_timeout=0, **setting.options)
    times = IterationTimes(speeds, jitter, stragglers, seed)
    cluster = VirtualCluster(config, times, Layout(("w",), ((1,),)), np.zeros(1, np.float32))
    wall = time.perf_counter()
    try:
        while cluster.pushes < iterations:
            cluster.step()
    except SimulationError as exc:
        raise SimulationError(f"{setting.label}: {exc}") from None
    wall = time.perf_counter() - wall
    return {
        "sync": setting.label,
        "policy": cluster.engine.policy.describe(),
        "workers": len(speeds),
        "iterations": cluster.pushes,
        "simulated_s": cluster.now,
        "iterations_per_s": cluster.pushes / cluster.now if cluster.now > 0 else 0.0,
        "updates": cluster.engine.version,
        "dropped": cluster.engine.policy.dropped,
        **cluster.sync_figures(),
        "iterations_per_worker": {"min": min(cluster.per_worker), "max": max(cluster.per_worker)},
        "wall_s": wall,
    }


def format_table(results: list[dict]) -> str:
    header = (
        f"{'sync':<16} {'iter/s':>8} {'mean wait':>10} {'p99 wait':>9} {'stale mean':>10} {'p99':>5} "
        f"{'max':>5} {'max gap':>7} {'updates':>8} {'slowest/fastest':>15}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        per = r["iterations_per_worker"]
        lines.append(
            f"{r['sync']:<16} {r['iterations_per_s']:>8.3f} {r['mean_wait']:>10.3f} {r['p99_wait']:>9.3f} "
            f"{r['mean_staleness']:>10.2f} {r['p99_staleness']:>5} {r['max_staleness']:>5} {r['max_gap']:>7} "
            f"{r['updates']:>8} {per['min']:>7}/{per['max']:<7}"
        )
    return "\n".join(lines)


def _one_run(dataset, cluster: ClusterSpec, options: dict, setting: Setting, mode: str, seed: int) -> dict:
    import torch

    from .virtual import train_virtual

    torch.set_num_threads(1)  # the same arithmetic in every process, whatever --jobs is
    options = dict(options)
    if options["eval_every"] is None:
        options["eval_every"] = cluster.eval_every
    return train_virtual(
        setting,
        list(cluster.speeds),
        dataset=dataset,
        lr_staleness=mode,
        seed=seed,
        jitter=cluster.jitter,
        stragglers=cluster.stragglers,
        budget=cluster.budget,
        iterations=cluster.iterations,
        **options,
    )


def _in_order(runs: list, jobs: int, dataset, options: dict):
    """``(index, run, record)`` for every run, in the order of ``runs``: one after the other,
    or ``jobs`` at a time in processes of their own."""
    if jobs <= 1:
        for index, run in enumerate(runs, 1):
            yield index, run, _one_run(dataset, run[0], options, *run[1:])
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_one_run, dataset.name, run[0], options, *run[1:]) for run in runs]
        for index, (run, future) in enumerate(zip(runs, futures), 1):
            yield index, run, future.result()


def run_experiment(args) -> int:
    """``aps simulate --experiment NAME``: a preset's clusters and settings; --sync, --lr, --lr-staleness,
    --target, --seeds and the rest may still change it."""
    given = [f"--{name}" for name in _CLUSTER_OPTIONS if getattr(args, name) is not None]
    require(
        not given,
        f"--experiment {args.experiment} sets the clusters and the length of each run: drop {', '.join(given)}",
    )
    experiment = EXPERIMENTS[args.experiment]
    for name in ("lr", "lr_staleness", "target", "seeds"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(experiment, name))
    for name, default in (("momentum", 0.0), ("batch_size", 32), ("jobs", 1)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.train = args.train or "mnist"
    settings = args.sync or [parse_setting(text) for text in experiment.sync]
    return run_training(args, list(experiment.clusters), settings, title=experiment.title)


def run_training(
    args, clusters: list[ClusterSpec], settings: list[Setting], *, title: str | None = None, init_seed: int = 0
) -> int:
    """``aps simulate --train``: every cluster, setting (and learning-rate mode) for ``--seeds`` seeds;
    ``init_seed`` fixes the train/test split and the initial weights of every run."""
    import tempfile

    from ..workloads import load

    require(args.seeds >= 1, f"--seeds must be at least 1, got {args.seeds}")
    require(args.jobs >= 1, f"--jobs must be at least 1, got {args.jobs}")
    require(args.batch_size >= 1, f"--batch-size must be at least 1, got {args.batch_size}")
    require(0 < args.target <= 1, f"--target is a test accuracy in (0, 1], got {args.target}")
    require(args.eval_every is None or args.eval_every > 0, "--eval-every must be > 0")
    modes = {"both": ("none", "inverse"), "none": ("none",), "inverse": ("inverse",)}[args.lr_staleness]
    runs = [
        (cluster, setting, mode, seed)
        for seed in range(args.seed, args.seed + args.seeds)
        for cluster in clusters
        for setting in settings
        for mode in (
            ("none",)
            if setting.options.get("sync") == "bsp"
            # (a setting that says its own, +inverse, is run with it alone)
            else (setting.options["lr_staleness"],)
            if "lr_staleness" in setting.options
            else modes
        )
    ]
    for cluster, setting, mode, _ in runs:  # every configuration checked before the first run
        try:
            ServerConfig(
                workers=len(cluster.speeds),
                # (a local SGD setting says its outer step's: --lr and --momentum are the inner's)
                **{"lr": args.lr, "momentum": args.momentum, "lr_staleness": mode, **setting.options},
            )
        except ConfigurationError as exc:
            raise ConfigurationError(f"--sync {setting.label}: {exc}") from None
    out = args.out or tempfile.mkdtemp(prefix="aps-simulate-")
    os.makedirs(out, exist_ok=True)
    dataset = load(args.train, seed=init_seed)
    print(
        f"{len(runs)} virtual runs{': ' + title if title else ''}; {args.train}, lr {args.lr:g}, "
        f"batch {args.batch_size}; results in {out}",
        flush=True,
    )
    for cluster in clusters:
        limit = f"{cluster.budget:g} virtual s" if cluster.budget else f"{cluster.iterations} gradients"
        print(f"  {cluster.name}: {cluster.describe()}; {limit} per run", flush=True)
    options = dict(
        lr=args.lr,
        momentum=args.momentum,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        target=args.target,
        init_seed=init_seed,
    )
    records = []
    for index, (cluster, setting, mode, seed), record in _in_order(runs, args.jobs, dataset, options):
        record.update(
            label=compare.label(setting.label, mode),
            cluster=cluster.name,
            cluster_description=cluster.describe(),
            repeat=seed - args.seed,
        )
        records.append(record)
        reached = record["time_to_target_s"]
        where = f" {cluster.name}:" if len(clusters) > 1 else ""
        print(
            f"  {index}/{len(runs)}{where} {record['label']:<22} seed {seed}: best {record['best_accuracy']:.3f}, "
            f"{args.target:g} at {'never' if reached is None else f'{reached:.1f} s'}, staleness "
            f"{record['mean_staleness']:.2f}, {record['wall_s']:.1f} s wall"
            + ("  (diverged)" if record["diverged"] else ""),
            flush=True,
        )
        compare.write_records(records, os.path.join(out, "results.json"))  # an interrupted run keeps its runs
    table = compare.markdown(records, args.target, virtual=True)
    command = command_line()
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(f"Command: `{command}`\n\n" + (f"{title}\n\n" if title else "") + table)
    compare.plot(records, os.path.join(out, "accuracy.png"), args.target, command, x_label="virtual time, s")
    compare.plot(
        records,
        os.path.join(out, "accuracy-gradients.png"),
        args.target,
        command,
        curve="curve_gradients",
        x_label="gradients applied",
    )
    plot_staleness(records, os.path.join(out, "staleness.png"), command)
    print()
    print(table)
    print(textwrap.fill(compare.reading(records, args.target, virtual=True), 100))
    print()
    print(
        f"wrote {os.path.join(out, 'results.json')}, results.md, accuracy.png, accuracy-gradients.png and staleness.png"
    )
    return 0


def draw_staleness(ax, hist: dict[int, int], label: str, color: str, style: str = "-") -> int:
    """Draw one staleness distribution (``{staleness: count}``) on ``ax`` as the fraction of
    gradients at each staleness, labelled with its mean; returns the staleness below which
    99.5% of it lies (0 for a distribution that is all fresh, which is not drawn)."""
    total = sum(hist.values())
    if total == 0 or set(hist) == {0}:  # BSP: every gradient fresh
        return 0
    values = range(max(hist) + 1)
    seen, tail = 0, max(hist) + 1
    for value in values:
        seen += hist.get(value, 0)
        if seen >= 0.995 * total:
            tail = value + 1
            break
    mean = sum(v * n for v, n in hist.items()) / total
    ax.step(
        list(values),
        [hist.get(v, 0) / total for v in values],
        where="mid",
        color=color,
        ls=style,
        label=f"{label} (mean {mean:.2f})",
        lw=1.3,
    )
    return tail


def plot_staleness(records: list[dict], path: str, command: str) -> None:
    """The staleness distribution of the applied gradients, per setting (all seeds together),
    one panel per cluster. The learning rate does not change when gradients arrive, so each
    setting is drawn once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..server.engine.stats import merge_counts

    clusters = list(dict.fromkeys(r["cluster"] for r in records))
    columns = min(2, len(clusters))
    rows = -(-len(clusters) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, 4.0 * rows), dpi=110, squeeze=False)
    for ax, cluster in zip(axes.flat, clusters):
        first: dict[str, str] = {}  # each setting's label in its first learning-rate mode
        for r in records:
            if r["cluster"] == cluster:
                first.setdefault(r["sync"], r["label"])
        tail = 1
        for index, label in enumerate(first.values()):
            hist = merge_counts(r["staleness_hist"] for r in records if r["cluster"] == cluster and r["label"] == label)
            tail = max(tail, draw_staleness(ax, hist, label, f"C{index % 10}"))
        ax.set_xlim(-0.5, tail + 0.5)
        ax.set_title(textwrap.fill(compare.cluster_title(records, cluster), 80), fontsize=9)
        ax.set_xlabel("staleness of an applied gradient (versions)")
        ax.set_ylabel("fraction of gradients")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes.flat[len(clusters) :]:
        ax.set_visible(False)
    fig.text(0.01, 0.01, command, fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)


def compare_virtual(args) -> int:
    """``--virtual``: the comparison's clusters and paradigms on a virtual clock, ``--repeats`` seeds
    (default 3), as ``aps simulate --train`` runs them; wall-clock seconds become virtual ones in
    units of ``--step-time`` (a speed-1 worker's iteration is one virtual second). ``--seed`` is
    the data split and the initial weights, and the first run's seed, as for real runs."""
    plan = compare._plan(args)
    require(plan.compressions == ["none"], "--virtual does not model wire compression: drop --compression")
    require(args.step_time > 0, "--virtual counts time in --step-time units: give a --step-time > 0")
    budget = args.budget / args.step_time
    eval_every = (args.eval_every or max(0.5, args.budget / 25)) / args.step_time  # the real runs' cadence
    clusters = [
        ClusterSpec(name, tuple(speeds), jitter=args.jitter, budget=budget, eval_every=eval_every)
        for name, speeds in plan.clusters.items()
    ]
    options = SimpleNamespace(
        train=args.dataset,
        seeds=3 if args.repeats is None else args.repeats,
        seed=args.seed,
        jobs=usable_cores(),
        lr=args.lr,
        momentum=args.momentum,
        batch_size=args.batch_size,
        lr_staleness=args.lr_staleness,
        target=args.target,
        out=args.out,
        eval_every=None,
    )
    return run_training(
        options,
        clusters,
        [parse_setting(p) for p in plan.paradigms],
        init_seed=args.seed,
        title=f"aps {getattr(args, 'command', 'compare')} --virtual: one virtual second is a speed-1 "
        f"worker's iteration ({args.step_time * 1e3:g} ms of --step-time), {budget:g} virtual s per run",
    )
