"""``aps compare`` (also ``bench/paradigms.py``) and ``aps demo``: which paradigm reaches a target accuracy first.

Trains the same model (same seeds, data split, learning rate and batch size)
under each sync paradigm, with and without the staleness-aware learning rate,
on an emulated homogeneous and an emulated heterogeneous cluster, and
evaluates the server's weights on the held-out test set on a fixed wall-clock
cadence. Each worker pads its iterations to its multiple of a step time
(``aps launch --step-time``): emulated devices of different speeds, not
different computations.

The worker processes are started once and reused for every run; each run
gets its own embedded server. Results: ``DIR/results.json`` (one object per
run, with the accuracy curve), ``DIR/results.md`` (the tables) and
``DIR/accuracy.png`` (test accuracy against wall time, one panel per cluster).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field

import numpy as np

from ..config import ServerConfig, usable_cores
from ..errors import ConfigurationError
from ..server.server import Server
from ..server.engine.stats import merge_counts
from .settings import command_line, describe_speeds, parse_setting, parse_speeds, require

__all__ = ["DEFAULT_PARADIGMS", "Run", "compare"]

DEFAULT_PARADIGMS = ("bsp", "asp", "ssp:3", "ssp:15", "dssp:3:15", "softsync:1")
LABELS = {"bsp": "BSP", "asp": "ASP", "ssp": "SSP", "dssp": "DSSP", "softsync": "softsync"}


def label(setting: str, lr_staleness: str = "none") -> str:
    """A readable name: ``dssp:3:15`` -> ``DSSP [3,15]``, ``ssp:3`` -> ``SSP s=3``, and the
    suffixes: ``asp+cutoff:8+gap+inverse`` -> ``ASP cut-off 8 gap lr/tau``, ``asp+local:10+dn+dylu``
    -> ``ASP local H=10 delayed Nesterov dynamic H``."""
    body, *extras = setting.split("+")
    text = _base_label(body)
    for extra in extras:
        key, _, value = extra.partition(":")
        if extra == "inverse":
            lr_staleness = "inverse"
        elif key == "cutoff":
            text += f" cut-off {value}"
        elif key in ("dc", "dc-adaptive"):
            text += f" {'DC' if key == 'dc' else 'DC-a'} {value}"
        elif key == "local":
            text += f" local H={value}"
        elif extra == "dn":
            text += " delayed Nesterov"
        elif extra == "dylu":
            text += " dynamic H"
        else:
            text += f" {extra}"
    return text + (" lr/tau" if lr_staleness == "inverse" else "")


def _base_label(setting: str) -> str:
    name, *numbers = setting.split(":")
    text = LABELS.get(name, name)
    if name == "ssp":
        text += f" s={numbers[0]}"
    elif name == "dssp":
        text += f" [{numbers[0]},{numbers[1]}]"
    elif name == "softsync":
        text += f" n={numbers[0]}"
    elif name == "bsp" and numbers:
        text += f" k={numbers[0]}"
    return text


#: ``--compression`` values: none (float32), or 16-bit pushes, and pushes and pulls.
COMPRESSIONS = ("none", "bf16", "fp16", "bf16+pulls", "fp16+pulls")


def _compression_label(compression: str) -> str:
    return "" if compression == "none" else " " + compression.replace("+pulls", " push+pull")


@dataclass
class Run:
    """One training run of the comparison."""

    setting: str
    lr_staleness: str
    cluster: str
    speeds: list[float]
    repeat: int = 0
    compression: str = "none"
    curve: list[list[float]] = field(default_factory=list)
    #: ``[gradients applied, accuracy]`` at each evaluation (as ``aps simulate --train`` records it)
    curve_gradients: list[list[float]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


# Worker processes -----------------------------------------------------------------------------


def _pool_main(rank: int, workers: int, dataset_name: str, seed: int, conn) -> None:
    """A worker process: load once, then train one run per order until told to stop."""
    import torch

    from .. import workloads
    from ..torch import Pacer

    torch.set_num_threads(1)
    dataset = workloads.load(dataset_name, seed=seed)
    conn.send("ready")
    while True:
        order = conn.recv()
        if order is None:
            return
        try:
            run_seed = order["seed"]  # data order and pacing; the split and the initial weights keep `seed`
            pacer = Pacer(order["step_time"], order["speeds"][rank], order["jitter"], seed=1000 * run_seed + rank)
            compression = order.get("compression", "none")
            result = workloads.train(
                dataset,
                order["address"],
                rank,
                workers,
                batch_size=order["batch_size"],
                duration=order["duration"],
                seed=seed,
                data_seed=run_seed,
                pacer=pacer,
                stop_on_divergence=True,
                transport=order.get("transport", "auto"),
                compression=None if compression == "none" else compression.split("+")[0],
                compress_pulls=compression.endswith("+pulls"),
                local=order.get("local"),
            )
            conn.send(result)
        except Exception as exc:  # reported, and the comparison stops
            conn.send({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


class _Pool:
    """The worker processes, each at the end of a pipe: an order in, a result out."""

    def __init__(self, workers: int, dataset: str, seed: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        self._early: dict[int, dict] = {}
        try:
            for rank in range(workers):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_pool_main, args=(rank, workers, dataset, seed, child), daemon=True)
                proc.start()
                child.close()  # the worker holds the other end: EOF here when it dies
                self.pipes.append(parent)
                self.procs.append(proc)
            for rank in range(workers):
                self._receive(rank, 300, "start")
        except BaseException:
            self.close()
            raise

    def dispatch(self, order: dict) -> None:
        for pipe in self.pipes:
            pipe.send(order)

    def check(self) -> None:
        """Raise if a worker has died or reported an error (while a run is going on);
        keep a result that arrives early for :meth:`results`."""
        for rank, (pipe, proc) in enumerate(zip(self.pipes, self.procs)):
            if rank not in self._early and (pipe.poll(0) or not proc.is_alive()):
                self._early[rank] = self._receive(rank, 0, "finish its run")

    def results(self, timeout: float) -> list[dict]:
        early, self._early = self._early, {}
        return [
            early[rank] if rank in early else self._receive(rank, timeout, "finish its run")
            for rank in range(len(self.pipes))
        ]

    def _receive(self, rank: int, timeout: float, what: str):
        pipe, proc = self.pipes[rank], self.procs[rank]
        try:
            if not pipe.poll(timeout):
                raise RuntimeError(f"worker {rank} did not {what} within {timeout:g} s")
            result = pipe.recv()
        except (EOFError, OSError):
            proc.join(1)
            raise RuntimeError(f"worker {rank} died (exit code {proc.exitcode})") from None
        if isinstance(result, dict) and "error" in result:
            raise RuntimeError(f"worker {rank} failed: {result['error']}")
        return result

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


# The driver -------------------------------------------------------------------------------------


def _evaluator(dataset_name: str, seed: int):
    import torch

    from .. import workloads

    torch.set_num_threads(1)  # the workers have the other cores
    dataset = workloads.load(dataset_name, seed=seed)
    model = workloads.make_model(dataset.side, seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]

    def evaluate(flat: np.ndarray) -> float:
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(torch.from_numpy(flat[offset : offset + p.numel()]).view_as(p))
                offset += p.numel()
        return workloads.accuracy(model, dataset.x_test, dataset.y_test)

    return evaluate


def _server_config(setting: str, lr_staleness: str, workers: int, args) -> ServerConfig:
    options = parse_setting(setting).options
    if "lr_staleness" in options:
        raise ConfigurationError(f"{setting!r}: choose the learning rate with --lr-staleness, not a +suffix")
    # The workers take $APS_TOKEN if it is set: the server then asks for the same one.
    return ServerConfig(
        workers=workers,
        port=0,
        log_level="warning",
        token=os.environ.get("APS_TOKEN") or None,
        http_port=getattr(args, "http_port", None),
        # (a local SGD setting says its outer step's: --lr and --momentum are then the inner SGD's)
        **{"lr": args.lr, "momentum": args.momentum, "lr_staleness": lr_staleness, **options},
    )


def _dashboard_port(args) -> None:
    """With --http-port 0, choose the port once: every run's server takes it in turn, so an
    open dashboard follows the whole comparison (it reconnects when a run's server stops)."""
    if getattr(args, "no_dashboard", False):
        args.http_port = None
    if getattr(args, "http_port", None) == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            args.http_port = probe.getsockname()[1]


def _start_server(config: ServerConfig, args, out):
    """Start a run's server; if its dashboard port was taken meanwhile, on another (printed)."""
    try:
        return Server(config).run_in_background().start()
    except ConfigurationError as exc:
        if config.http_port is None or "--http-port" not in str(exc):
            raise
    background = Server(config.replace(http_port=0)).run_in_background().start()
    http = background.server.http
    assert http is not None  # started with an HTTP port
    args.http_port = http.port
    print(f"aps: the dashboard moved: {background.server.http_address}", file=out, flush=True)
    return background


_START_TIMEOUT = 120.0  # seconds for every worker to join a run's server


_OVERHEAD_S = 3.0  # per run beyond its budget: a server starts, workers join, the last evaluation
#: CPU seconds one process spends before it can train: Python and PyTorch imported, the bundled
#: dataset loaded and split (measured on 2 cores: 3.3-3.6 s for mnist, 3.2 s for digits, on a quiet
#: machine; about twice that while other work shares the cores). The comparison pays it once in
#: its own process (the evaluator) and once per worker process, the workers sharing the cores.
_PROCESS_START_S = 3.5


def startup_seconds(workers: int, cores: int | None = None, load: float = 0.0) -> float:
    """The time before the first run starts: the evaluator's start-up, then ``workers`` worker
    processes starting at once on ``cores`` cores (default: those this process may use), while
    ``load`` other runnable processes (the load average) share those cores."""
    cores = max(1, usable_cores() if cores is None else cores)
    share = max(1.0, (load + 1) / cores)  # the start-up's own process among the others
    return _PROCESS_START_S * (1 + max(1.0, workers / cores)) * share


def _load() -> float:
    """The machine's one-minute load average (0 where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def estimate_seconds(runs: int, budget: float, workers: int, cores: int | None = None, load: float = 0.0) -> float:
    """How long a comparison of ``runs`` runs of ``budget`` seconds on ``workers`` worker
    processes takes: their start-up once (slower on a loaded machine), then each run's budget
    and its overhead."""
    return startup_seconds(workers, cores, load) + runs * (budget + _OVERHEAD_S)


def _local_order(run: Run, args) -> tuple[int, bool, float, float] | None:
    """What a worker runs under a local SGD setting (aps.workloads.train's ``local``): H, dynamic,
    and the inner SGD's learning rate and momentum (--lr, --momentum); None for the others."""
    parsed = parse_setting(run.setting)
    if parsed.local_every is None:
        return None
    if run.compression.endswith("+pulls"):
        raise ConfigurationError(f"{run.setting}: local SGD compresses its pushes only (no {run.compression})")
    return parsed.local_every, parsed.dynamic, args.lr, args.momentum


def _compression(run: Run) -> str:
    """What a run's workers push: its setting's ``+int8``/``+int4``, else ``--compression``'s."""
    quantized = parse_setting(run.setting).compression
    if quantized is None:
        return run.compression
    if run.compression != "none":
        raise ConfigurationError(f"{run.setting} quantizes its pushes: it takes no --compression {run.compression}")
    return quantized


def _run_one(run: Run, pool: _Pool, evaluate, args, out=sys.stdout, bar=None) -> None:
    config = _server_config(run.setting, run.lr_staleness, len(run.speeds), args)
    eval_every = args.eval_every or max(0.5, args.budget / 25)
    with _start_server(config, args, out) as background:
        server = background.server
        pool.dispatch(
            {
                "address": background.address,
                "duration": args.budget,
                "seed": args.seed + run.repeat,
                "speeds": run.speeds,
                "step_time": args.step_time,
                "jitter": args.jitter,
                "batch_size": args.batch_size,
                "compression": _compression(run),
                "transport": args.transport,
                "local": _local_order(run, args),
            }
        )
        deadline = time.monotonic() + _START_TIMEOUT
        while (started := server.engine.stats.training_started) is None:
            pool.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not all join within {_START_TIMEOUT:g} s")
            time.sleep(0.02)
        joined_bytes = server.stats()["server"]["bytes_in"]  # (the workers' joins: their whole models)
        # evaluate at started, started + eval_every, ... and once more at the end of the budget
        stop = started + args.budget
        next_eval = started
        while True:
            now = time.monotonic()
            if now >= next_eval:
                version, flat = server.weights()
                engine = server.engine  # gradients applied so far (read after the weights: at most a push ahead)
                applied = engine.training.pushes - engine.policy.dropped
                run.curve.append([round(now - started, 3), evaluate(flat)])
                run.curve_gradients.append([applied, run.curve[-1][1]])
                if bar is not None:
                    bar.update(min(now - started, args.budget) - bar.n)
                    bar.set_postfix_str(f"accuracy {run.curve[-1][1]:.3f}  updates {version}", refresh=True)
                if next_eval >= stop:
                    break
                next_eval = min(next_eval + eval_every, stop)
            pool.check()
            time.sleep(max(0.0, next_eval - time.monotonic()))
        stats = server.stats()
        results = pool.results(timeout=60)
    workers = stats["workers"]
    pulls = sum(w["pulls"] for w in workers)
    applied = [
        (w["staleness_mean"], sum(w["staleness_hist"].values())) for w in workers if w["staleness_mean"] is not None
    ]
    iterations = sum(r["iterations"] for r in results)  # (the workers' count: a push is a sync under local SGD)
    run.stats = {
        "updates": stats["server"]["version"],
        "iterations": iterations,
        "iterations_per_s": iterations / args.budget,  # (the workers' batches: inner steps under local SGD)
        "pushes": stats["server"]["pushes"],
        "mean_wait_s": sum(w["wait_s_total"] for w in workers) / pulls if pulls else 0.0,
        "mean_staleness": (sum(m * n for m, n in applied) / sum(n for _, n in applied)) if applied else 0.0,
        "max_gap": max((w["max_release_gap"] or 0) for w in workers),
        "diverged": any(r["diverged"] for r in results),
        "staleness_hist": {str(k): n for k, n in merge_counts(w["staleness_hist"] for w in workers).items()},
        # (--compensation: the gradients the server compensated)
        "compensated": sum(w.get("compensated", 0) for w in workers),
        # (the bytes the server received once every worker had joined: the pushes, and the
        # pulls' and heartbeats' few)
        "bytes_pushed": stats["server"]["bytes_in"] - joined_bytes,
    }
    best = max(acc for _, acc in run.curve)
    if bar is not None:
        bar.close()
    print(
        f"  {run.cluster:<13} {_run_label(run):<22} best {best:.3f}  "
        f"{run.stats['iterations_per_s']:.1f} it/s  wait {run.stats['mean_wait_s'] * 1e3:.0f} ms  "
        f"staleness {run.stats['mean_staleness']:.2f}" + ("  (diverged)" if run.stats["diverged"] else ""),
        file=out,
        flush=True,
    )


def _run_label(run: Run) -> str:
    return label(run.setting, run.lr_staleness) + _compression_label(run.compression)


def summarize(run: Run, target: float, budget: float) -> dict:
    """The record of one run in results.json."""
    reached = next((t for t, acc in run.curve if acc >= target), None)
    return {
        "sync": run.setting,
        "label": _run_label(run),
        "lr_staleness": run.lr_staleness,
        "compression": _compression(run),
        "cluster": run.cluster,
        "speeds": run.speeds,
        "repeat": run.repeat,
        "budget_s": budget,
        "target": target,
        "time_to_target_s": reached,
        "best_accuracy": max(acc for _, acc in run.curve),
        "final_accuracy": run.curve[-1][1],
        **run.stats,
        "curve": run.curve,
        "curve_gradients": run.curve_gradients,
    }


def _groups(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Records by (cluster, paradigm label), in the order they first appear."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["cluster"], r["label"]), []).append(r)
    return groups


def _median_time(rows: list[dict]) -> float | None:
    """Median time to target over repeats, a run that never reached it counting as infinitely slow."""
    times = sorted(math.inf if r["time_to_target_s"] is None else r["time_to_target_s"] for r in rows)
    middle = len(times) // 2
    median = times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2
    return None if math.isinf(median) else median


def cluster_title(records: list[dict], cluster: str) -> str:
    """``heterogeneous cluster (speeds 1,1,1,2.5)``; a simulated cluster's name and description."""
    first = next(r for r in records if r["cluster"] == cluster)
    if "cluster_description" in first:
        return f"{cluster} ({first['cluster_description']})"
    return f"{cluster} cluster ({describe_speeds(first['speeds'])})"


def markdown(records: list[dict], target: float, *, virtual: bool = False) -> str:
    """The results as one table per cluster (medians and means over repeats), fastest first;
    ``virtual``: times are virtual seconds (``aps simulate --train``)."""
    groups = _groups(records)
    repeats = max(len(rows) for rows in groups.values())
    lines = []
    for cluster in dict.fromkeys(r["cluster"] for r in records):
        title = "### " + cluster_title(records, cluster)
        lines += [
            title
            + (
                f", {repeats} runs each: median time (the range of those that reached the target), mean of the rest"
                if repeats > 1
                else ""
            ),
            "",
        ]
        head = f"| paradigm | {'virtual ' if virtual else ''}time to {target:g} |" + (
            " reached |" if repeats > 1 else ""
        )
        counted = all("bytes_pushed" in r for r in records)
        lines += [
            head + " best accuracy | iterations/s | mean wait | mean staleness |" + (" MB pushed |" if counted else ""),
            "|---|---:|" + ("---:|" if repeats > 1 else "") + "---:|---:|---:|---:|" + ("---:|" if counted else ""),
        ]
        rows = [(name, rows) for (c, name), rows in groups.items() if c == cluster]
        rows.sort(key=lambda item: (_median_time(item[1]) is None, _median_time(item[1]) or 0))
        for name, runs in rows:
            median = _median_time(runs)
            cells = [name, "never" if median is None else f"{median:.1f} s"]
            reached = sorted(r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None)
            if median is not None and len(reached) > 1:
                cells[1] += f" ({reached[0]:.1f}-{reached[-1]:.1f})"
            if repeats > 1:
                cells.append(f"{sum(r['time_to_target_s'] is not None for r in runs)}/{len(runs)}")
            best = [r["best_accuracy"] for r in runs]
            spread = f" ± {statistics.stdev(best):.3f}" if len(best) > 1 else ""
            diverged = sum(r.get("diverged", False) for r in runs)
            cells += [
                f"{statistics.fmean(best):.3f}{spread}" + (f" ({diverged} diverged)" if diverged else ""),
                f"{statistics.fmean(r['iterations_per_s'] for r in runs):.1f}",
                (
                    f"{statistics.fmean(r['mean_wait_s'] for r in runs):.3f} s"
                    if virtual
                    else f"{statistics.fmean(r['mean_wait_s'] for r in runs) * 1e3:.0f} ms"
                ),
                f"{statistics.fmean(r['mean_staleness'] for r in runs):.2f}",
            ]
            if counted:
                cells.append(f"{statistics.fmean(r['bytes_pushed'] for r in runs) / 1e6:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


#: Below this, a gap between two single runs' times to target says nothing: the start of a run,
#: the moment of an evaluation (every budget/25 s) and a shared machine's drift each move a
#: time by a second or more (a new user's one run put DSSP level with ASP and 8 s ahead of SSP
#: s=3; three virtual seeds put ASP first by far, DSSP level with SSP s=3).
_NOISE_S = 3.0
_NOISE_FRACTION = 0.15


def reading(records: list[dict], target: float, *, virtual: bool = False, command: str = "aps demo") -> str:
    """What the table shows, in words, and how sure it is: per cluster, the paradigm that reached
    ``target`` first and whether the next one is clearly behind it. Over several runs, the spread
    of their times decides (ranges that overlap are a tie); over one run, a gap of a few seconds
    (or 15 %) is taken as noise, and the sentence says how to get a steadier answer."""
    groups = _groups(records)
    repeats = max(len(rows) for rows in groups.values())
    unit = " virtual" if virtual else ""
    sentences = []
    for cluster in dict.fromkeys(r["cluster"] for r in records):
        ranked = sorted(
            ((name, rows) for (c, name), rows in groups.items() if c == cluster),
            key=lambda item: (_median_time(item[1]) is None, _median_time(item[1]) or 0),
        )
        where = f"On the {cluster} cluster"
        reached = [(name, median_s, rows) for name, rows in ranked if (median_s := _median_time(rows)) is not None]
        if not reached:
            best_name, best_rows = max(ranked, key=lambda item: statistics.fmean(r["best_accuracy"] for r in item[1]))
            sentences.append(
                f"{where} no paradigm reached {target:g} within the budget (the best was {best_name} "
                f"at {statistics.fmean(r['best_accuracy'] for r in best_rows):.3f}): give a longer "
                "--budget or a lower --target."
            )
            continue
        first, first_time, first_rows = reached[0]
        level: list[tuple[str, float]] = []
        behind: list[tuple[str, float]] = []
        for name, median, rows in reached[1:]:
            if repeats > 1:
                first_slowest = max(r["time_to_target_s"] for r in first_rows if r["time_to_target_s"] is not None)
                fastest = min(r["time_to_target_s"] for r in rows if r["time_to_target_s"] is not None)
                clear = fastest > first_slowest  # every run of the next one slower than every run of the first
            else:
                clear = median - first_time > max(_NOISE_S, _NOISE_FRACTION * first_time)
            (behind if clear else level).append((name, median))
        text = f"{where}, {first} reached {target:g} first ({first_time:.1f}{unit} s"
        text += f", median of {repeats})" if repeats > 1 else ")"
        if level:
            text += "; " + ", ".join(f"{name} ({median:.1f}{unit} s)" for name, median in level)
            text += (
                " within the spread of the runs: level with it"
                if repeats > 1
                else " only a few seconds behind: level with it, as far as one run can tell"
            )
        if behind:
            text += "; clearly behind: " + ", ".join(
                f"{name} (+{median - first_time:.1f}{unit} s)" for name, median in behind
            )
        never = [name for name, rows in ranked if _median_time(rows) is None]
        if never:
            text += f"; never reached it: {', '.join(never)}"
        sentences.append(text + ".")
    if repeats > 1:
        how_sure = (
            f"{repeats} runs each with different data orders and pacing: a paradigm is ahead only "
            "where all its runs beat all of the other's."
        )
    elif virtual:
        how_sure = "One seed each: run more seeds (--repeats 5) for a steadier answer."
    else:
        how_sure = (
            f"This is one run of each: gaps of a few seconds are noise (start-up, evaluation times, the "
            f"machine's other work); for a steadier answer run {command} --repeats 3, or {command} --virtual "
            "(a virtual clock, several seeds, about a minute)."
        )
    return " ".join(sentences) + " " + how_sure


def plot(
    records: list[dict], path: str, target: float, command: str, *, curve: str = "curve", x_label: str = "wall time, s"
) -> None:
    """Test accuracy against the x of ``record[curve]``'s ``[x, accuracy]`` rows, one panel
    per cluster, repeats averaged point by point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = list(dict.fromkeys(r["cluster"] for r in records))
    columns = min(2, len(clusters))
    rows = -(-len(clusters) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, 4.4 * rows), dpi=110, squeeze=False)
    colors: dict[str, str] = {}
    for ax, cluster in zip(axes.flat, clusters):
        for (c, name), runs in _groups(records).items():
            if c != cluster:
                continue
            color = colors.setdefault(runs[0]["sync"], f"C{len(colors) % 10}")
            # repeats evaluate on the same cadence: average them point by point
            length = min(len(r[curve]) for r in runs)
            t = [statistics.fmean(r[curve][i][0] for r in runs) for i in range(length)]
            acc = [statistics.fmean(r[curve][i][1] for r in runs) for i in range(length)]
            ax.plot(t, acc, "--" if runs[0]["lr_staleness"] == "inverse" else "-", color=color, label=name, lw=1.5)
        ax.axhline(target, color="gray", lw=0.8, ls=":")
        ax.set_title(textwrap.fill(cluster_title(records, cluster), 80), fontsize=9)
        ax.set_xlabel(x_label)
        ax.set_ylabel("test accuracy")
        low = min(min(acc for _, acc in r[curve][1:] or r[curve]) for r in records)
        ax.set_ylim(max(0.0, min(low, target - 0.1)), 1.0)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(clusters) :]:
        ax.set_visible(False)
    axes[0][-1].legend(fontsize=7, loc="lower right", ncol=2)
    fig.text(0.01, 0.01, command, fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)


def write_records(records: list[dict], path: str) -> None:
    with open(path + ".tmp", "w") as fh:
        json.dump(records, fh, indent=2)
    os.replace(path + ".tmp", path)


@dataclass
class _Plan:
    """What a comparison's flags ask for, checked: paradigms, learning-rate modes, clusters."""

    paradigms: list[str]
    modes: tuple[str, ...]
    clusters: dict[str, list[float]]  # the chosen clusters' speeds, in the order given
    compressions: list[str]

    def modes_of(self, setting: str) -> tuple[str, ...]:
        return ("none",) if setting.startswith("bsp") else self.modes


def _plan(args) -> _Plan:
    """Check every flag of a comparison (and every server it would start) before anything runs."""
    paradigms = [p.strip() for p in args.paradigms.split(",") if p.strip()]
    if not paradigms:
        raise ConfigurationError("--paradigms names no sync setting")
    modes = {"both": ("none", "inverse"), "none": ("none",), "inverse": ("inverse",)}[args.lr_staleness]
    chosen = [c.strip() for c in args.clusters.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in ("homogeneous", "heterogeneous")]
    if unknown or not chosen:
        raise ConfigurationError(f"--clusters takes homogeneous and/or heterogeneous, got {args.clusters!r}")
    if args.workers < 1:
        raise ConfigurationError(f"--workers must be at least 1, got {args.workers}")
    speeds = parse_speeds(args.speeds, args.workers, "--speeds") if "heterogeneous" in chosen else []
    clusters = {c: {"homogeneous": [1.0] * args.workers, "heterogeneous": speeds}[c] for c in chosen}
    require(args.budget > 0, f"--budget must be > 0, got {args.budget:g}")
    for value, flag in [(args.step_time, "--step-time"), (args.jitter, "--jitter"), (args.eval_every, "--eval-every")]:
        require(value >= 0, f"{flag} must be >= 0, got {value:g}")
    if args.batch_size < 1:
        raise ConfigurationError(f"--batch-size must be at least 1, got {args.batch_size}")
    if not 0 < args.target <= 1:
        raise ConfigurationError(f"--target is a test accuracy in (0, 1], got {args.target}")
    if args.repeats is not None and args.repeats < 1:
        raise ConfigurationError("--repeats must be at least 1")
    compressions = [c.strip() for c in args.compression.split(",") if c.strip()]
    wrong = [c for c in compressions if c not in COMPRESSIONS]
    if wrong or not compressions:
        raise ConfigurationError(
            f"--compression takes {', '.join(COMPRESSIONS)} (comma-separated), got {args.compression!r}"
        )
    plan = _Plan(paradigms, modes, clusters, compressions)
    for setting in paradigms:  # every server this comparison will start, checked before any of them
        for mode in plan.modes_of(setting):
            _server_config(setting, mode, args.workers, args)
    return plan


def compare(args, out=sys.stdout) -> list[dict]:
    """Run the whole comparison described by ``args``; returns the records."""
    plan = _plan(args)
    # Compression applies over TCP only: with it in the comparison, every run's workers use TCP,
    # so that its rows differ from the others in the compression alone.
    quantized = any(parse_setting(setting).compression for setting in plan.paradigms)
    args.transport = "tcp" if plan.compressions != ["none"] or quantized else "auto"
    runs = [
        Run(setting, mode, cluster, speeds, repeat, compression)
        for repeat in range(args.repeats)  # repeats outermost: slow drifts of a shared machine hit every paradigm alike
        for cluster, speeds in plan.clusters.items()
        for setting in plan.paradigms
        for mode in plan.modes_of(setting)
        for compression in plan.compressions
    ]
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix=f"aps-{getattr(args, 'command', 'compare')}-")
    os.makedirs(args.out, exist_ok=True)
    estimate = estimate_seconds(len(runs), args.budget, args.workers, load=_load())
    print(
        f"{len(runs)} runs of {args.budget:g} s on {args.workers} workers ({args.dataset}, step time "
        f"{args.step_time * 1e3:.0f} ms, target accuracy {args.target:g}): about {_duration(estimate)} in all; "
        f"results in {args.out}",
        file=out,
        flush=True,
    )
    _dashboard_port(args)
    if args.http_port is not None:
        print(f"aps: dashboard on http://127.0.0.1:{args.http_port}/ (each run's server in turn)", file=out, flush=True)
    print(f"starting {args.workers} worker processes (PyTorch and the {args.dataset} data)...", file=out, flush=True)
    begun = time.monotonic()
    evaluate = _evaluator(args.dataset, args.seed)
    pool = _Pool(args.workers, args.dataset, args.seed)
    # the start-up as measured, and what is left: the runs themselves
    print(
        f"workers ready in {time.monotonic() - begun:.0f} s; the runs take about "
        f"{_duration(len(runs) * (args.budget + _OVERHEAD_S))} more",
        file=out,
        flush=True,
    )
    records: list[dict] = []
    try:
        for index, run in enumerate(runs, 1):
            bar = _run_bar(
                f"{index}/{len(runs)} {run.cluster} {_run_label(run)}", args.budget, getattr(args, "no_progress", False)
            )
            try:
                _run_one(run, pool, evaluate, args, out, bar)
            finally:
                if bar is not None:
                    bar.close()
            records.append(summarize(run, args.target, args.budget))
            write_records(records, os.path.join(args.out, "results.json"))  # an interrupted comparison keeps its runs
    finally:
        pool.close()
    command = command_line()
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(f"Command: `{command}`\n\n" + markdown(records, args.target))
    plot(records, os.path.join(args.out, "accuracy.png"), args.target, command)
    print("", file=out)
    print(markdown(records, args.target), file=out)
    print(
        textwrap.fill(reading(records, args.target, command=f"aps {getattr(args, 'command', None) or 'compare'}"), 100),
        file=out,
    )
    print("", file=out)
    print(
        f"wrote {os.path.join(args.out, 'results.json')} and results.md; "
        f"the plot is {os.path.join(args.out, 'accuracy.png')}",
        file=out,
    )
    return records


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{seconds:.0f} s" if seconds < 90 else f"{minutes} min"


def _run_bar(description: str, budget: float, disabled: bool):
    """A progress bar over one run's budget (on a terminal, unless --no-progress)."""
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=budget,
        desc=description,
        unit="s",
        dynamic_ncols=True,
        leave=False,
        disable=None,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s{postfix}",
    )
