#!/usr/bin/env python
"""Local SGD on a real language task: BSP every step, DiLoCo, int8/4-bit, asynchronous local SGD.

A byte-level decoder-only transformer (:class:`aps.workloads.text.ByteLM`) learns
the source files of this Python's standard library, split by file into training
and held-out text (nothing downloaded). Four workers, one 2.5x slower; every
method gets the same token budget (``--steps`` inner steps of ``--batch``
windows per worker, ``4 x --steps`` in all):

- ``bsp``: BSP every step, the gradients averaged and AdamW on the server
  (:class:`aps.torch.Optimizer`);
- ``diloco-H``: DiLoCo (BSP, the user's AdamW as the inner optimizer, SGD with
  Nesterov momentum 0.9 at learning rate 0.7 as the server's outer one), with
  ``-int8``/``-int4`` pseudo-gradients quantized with error feedback;
- ``async-H``: asynchronous local SGD (ASP, delayed Nesterov on the server,
  dynamic local updates: every worker's H from its step rate);
- ``-lrX`` after either: the outer learning rate X instead of 0.7.

Each run is a real ``aps serve`` process and real :class:`aps.torch.LocalSGD`
workers over TCP in this process; the bytes are what that server counted
(``bytes_in`` of its statistics). Time is virtual: a fast worker's inner step
takes 1 virtual second, the slow one's 2.5, and communication none (which
flatters BSP every step most). Under BSP the run is the same whatever the
speeds (every worker waits for the slowest at each sync), so its curve is put on
the clock of the uneven workers; the asynchronous runs are driven in virtual-time
order, one inner step at a time, so a seed reproduces them.

``--warm-steps N`` starts every run from one model trained N steps of BSP every step
(DiLoCo's own setting: its runs start from a pretrained model).

Writes one JSON file, a markdown table and one plot (held-out loss against bytes
pushed, and against virtual time). Example (about an hour on 2 cores):
``python bench/local_sgd_lm.py --jobs 2 --out bench/results/local-sgd-lm``.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from aps.cli._args import ArgumentParser
from aps.cli.status import fetch_stats
from aps.lab.bench import machine_info, start_server, stop_server
from aps.lab.settings import command_line
from aps.torch import LocalSGD, Optimizer
from aps.workloads.text import ByteLM, held_out_loss, lm_batch, stdlib_corpus

WORKERS = 4
SPEEDS = (1.0, 1.0, 1.0, 2.5)  # virtual seconds per inner step
INNER = {"betas": (0.9, 0.95), "weight_decay": 0.1}
DILOCO = ["--optimizer", "sgd", "--lr", "0.7", "--momentum", "0.9", "--nesterov"]
DELAYED_NESTEROV = ["--optimizer", "delayed-nesterov", "--lr", "0.7", "--momentum", "0.9"]


@dataclass(frozen=True)
class Method:
    name: str
    sync: str  # "bsp" or "asp"
    every: int | None  # None: BSP every step with AdamW on the server
    compression: str | None = None
    dynamic: bool = False
    outer_lr: float | None = None  # (-lrX) the outer step's learning rate, else the papers' 0.7

    def server_options(self, lr: float) -> list[str]:
        if self.every is None:
            betas = ",".join(str(b) for b in INNER["betas"])
            outer = ["--optimizer", "adamw", "--lr", str(lr), "--betas", betas,
                     "--weight-decay", str(INNER["weight_decay"])]
        else:
            outer = list(DELAYED_NESTEROV if self.sync == "asp" else DILOCO)
            if self.outer_lr is not None:
                outer[outer.index("--lr") + 1] = str(self.outer_lr)
        return ["--sync", self.sync, *outer, "--log-level", "warning"]


def parse_method(text: str) -> Method:
    """``bsp``, ``diloco-H[-int8|-int4][-lrX]`` or ``async-H[-int8|-int4][-lrX]`` (``-lrX``:
    the outer learning rate, 0.7 without it)."""
    kind, *rest = text.split("-")
    if kind == "bsp" and not rest:
        return Method(text, "bsp", None)
    outer_lr = None
    if rest and rest[-1].startswith("lr"):
        try:
            outer_lr = float(rest.pop()[2:])
        except ValueError:
            outer_lr = math.nan
        if not (math.isfinite(outer_lr) and outer_lr > 0):
            raise SystemExit(f"bad method {text!r}: -lrX takes a learning rate above 0 (e.g. -lr0.5; no exponent)")
    if kind in ("diloco", "async") and rest and rest[0].isdigit() and int(rest[0]) >= 1:
        compression = rest[1] if len(rest) == 2 and rest[1] in ("int8", "int4") else None
        if len(rest) == 1 or compression is not None:
            if kind == "async":
                return Method(text, "asp", int(rest[0]), compression, dynamic=True, outer_lr=outer_lr)
            return Method(text, "bsp", int(rest[0]), compression, outer_lr=outer_lr)
    raise SystemExit(f"bad method {text!r}: bsp, diloco-H[-int8|-int4][-lrX] or async-H[-int8|-int4][-lrX]")


@dataclass(frozen=True)
class Task:
    width: int
    layers: int
    heads: int
    context: int
    batch: int
    steps: int  # inner steps per worker (the token budget is WORKERS x steps x batch x context)
    lr: float
    held_out: int  # held-out windows evaluated
    evaluations: int  # points on a curve
    start: str | None = None  # a file of weights every run starts from (--warm-steps), else seed 0's


def _model(task: Task) -> ByteLM:
    model = ByteLM(width=task.width, layers=task.layers, heads=task.heads, context=task.context, seed=0)
    if task.start is not None:
        model.load_state_dict(torch.load(task.start))
    return model


def warm_start(task: Task, steps: int, path: str) -> dict:
    """DiLoCo's setting: every method starts from one model already trained for ``steps``
    steps of BSP every step (its own run: a server, four workers, another data seed), saved
    to ``path``; returns that run's record."""
    record = run_one(Method("warm-up", "bsp", None), replace(task, steps=steps), seed=1000, keep=path)
    return {**record, "steps": steps}


class _Run:
    """One method, one seed: the server, the workers' data and models, and the curve."""

    def __init__(self, method: Method, task: Task, seed: int) -> None:
        self.method, self.task, self.seed = method, task, seed
        self.corpus = stdlib_corpus()
        self.windows = lm_batch(self.corpus.held_out, task.held_out, task.context, np.random.default_rng(1234))
        self.rngs = [np.random.default_rng([seed, rank]) for rank in range(WORKERS)]
        self.curve: list[dict] = []  # {"time", "steps", "bytes", "loss"}
        self.server, self.address = start_server(WORKERS, method.server_options(task.lr))
        self.bytes_at_start = 0
        self.final: ByteLM | None = None  # rank 0's model at the end

    def bytes_in(self) -> int:
        return int(fetch_stats(self.address)["server"]["bytes_in"]) - self.bytes_at_start

    def inner_step(self, rank: int, model: ByteLM, optimizer) -> None:
        tokens, targets = lm_batch(self.corpus.train, self.task.batch, self.task.context, self.rngs[rank])
        optimizer.zero_grad()
        model.loss(tokens, targets).backward()
        optimizer.step()

    def record(self, model: ByteLM, at: float, steps: int) -> None:
        self.curve.append({"time": at, "steps": steps, "bytes": self.bytes_in(),
                           "loss": held_out_loss(model, self.windows)})

    def close(self) -> None:
        stop_server(self.server)


def _each_rank(call) -> list:
    """``call(rank)`` for every rank at once, in threads (joining waits for every worker, and
    BSP's barriers for every push); the results by rank, or the first error raised."""
    results: list = [None] * WORKERS
    errors: list = []

    def one(rank: int) -> None:
        try:
            results[rank] = call(rank)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _synchronous(run: _Run) -> None:
    """BSP (every step, or DiLoCo): the workers in threads, each at its own pace between the
    barriers; virtual time after ``s`` inner steps is ``s`` x the slowest worker's step."""
    method, task = run.method, run.task
    every = method.every or 1
    syncs = task.steps // every
    record_every = max(1, syncs // task.evaluations)

    def make(rank: int):
        model = _model(task)
        if method.every is None:
            opt = Optimizer(model.parameters(), address=run.address, rank=rank, num_workers=WORKERS,
                            model=model, transport="tcp")
        else:
            inner = torch.optim.AdamW(model.parameters(), lr=task.lr, **INNER)
            opt = LocalSGD(model, inner, every=every, address=run.address, rank=rank, num_workers=WORKERS,
                           transport="tcp", compression=method.compression)
        return model, opt

    made = _each_rank(make)
    run.bytes_at_start = run.bytes_in()
    run.record(made[0][0], 0.0, 0)

    def train(rank: int) -> None:
        model, opt = made[rank]
        for s in range(1, syncs * every + 1):
            run.inner_step(rank, model, opt)
            sync = s // every
            if rank == 0 and s % every == 0 and (sync % record_every == 0 or sync == syncs):
                run.record(model, s * max(SPEEDS), s * WORKERS)

    _each_rank(train)
    run.final = made[0][0]
    for _, opt in made:
        opt.close()


def _asynchronous(run: _Run) -> None:
    """Asynchronous local SGD: every inner step in the order it would end on the virtual clock,
    each worker's sync (a push_pull that ASP answers at once) when its step ends; the run
    ends when the workers' inner steps reach the budget."""
    method, task = run.method, run.task
    now = [0.0] * WORKERS

    def make(rank: int):
        model = _model(task)
        inner = torch.optim.AdamW(model.parameters(), lr=task.lr, **INNER)
        opt = LocalSGD(model, inner, every=method.every, address=run.address, rank=rank, num_workers=WORKERS,
                       transport="tcp", compression=method.compression, dynamic=method.dynamic,
                       clock=lambda: now[rank])
        return model, opt

    made = _each_rank(make)
    run.bytes_at_start = run.bytes_in()
    run.record(made[0][0], 0.0, 0)
    budget = task.steps * WORKERS
    horizon = task.steps * max(SPEEDS)  # BSP's time for the same budget
    grid = iter([horizon * (i + 1) / (2 * task.evaluations) for i in range(task.evaluations * 8)])
    next_record = next(grid)
    events = [(SPEEDS[rank], rank) for rank in range(WORKERS)]
    heapq.heapify(events)
    steps, last = 0, None
    while steps < budget:
        at, rank = heapq.heappop(events)
        now[rank] = at
        model, opt = made[rank]
        before = opt.syncs
        run.inner_step(rank, model, opt)
        steps += 1
        if opt.syncs != before:
            last = (model, at)
            if at >= next_record:
                run.record(model, at, steps)
                while next_record <= at:
                    next_record = next(grid)
        heapq.heappush(events, (at + SPEEDS[rank], rank))
    run.final = made[0][0]
    if last is not None and run.curve[-1]["time"] != last[1]:
        run.record(last[0], last[1], steps)  # the newest global weights, as the last sync took them
    for _, opt in made:
        opt.close()


def run_one(method: Method, task: Task, seed: int, keep: str | None = None) -> dict:
    """One run; ``keep``: save rank 0's model there at the end (the global weights, under BSP)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    started = time.perf_counter()
    run = _Run(method, task, seed)
    try:
        (_asynchronous if method.sync == "asp" else _synchronous)(run)
        pushed = run.bytes_in()
        if keep is not None:
            torch.save(run.final.state_dict(), keep)
    finally:
        run.close()
    return {"method": method.name, "seed": seed, "curve": run.curve, "bytes_pushed": pushed,
            "final_loss": run.curve[-1]["loss"], "wall_s": time.perf_counter() - started,
            "server_options": method.server_options(task.lr),
            "corpus": {"train_bytes": len(run.corpus.train), "held_out_bytes": len(run.corpus.held_out),
                       "train_files": run.corpus.train_files, "held_out_files": run.corpus.held_out_files}}


def _first_time_at(curve: list[dict], loss: float) -> float | None:
    return next((p["time"] for p in curve if p["loss"] <= loss), None)


def summarize(records: list[dict], levels: list[float] = ()) -> dict:
    """Per method over seeds: final held-out loss, bytes, and each against BSP's; the virtual
    time each takes to reach the same seed's BSP final loss, and each of ``levels``."""
    by_method: dict[str, list[dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    bsp = {r["seed"]: r for r in by_method.get("bsp", [])}
    summary = {}
    for name, runs in by_method.items():
        losses = [r["final_loss"] for r in runs]
        row: dict = {"seeds": len(runs), "final_loss": statistics.median(losses),
                     "final_loss_range": [min(losses), max(losses)],
                     "bytes_pushed": statistics.median(r["bytes_pushed"] for r in runs)}
        if bsp:
            # each run against the same seed's BSP run (the seeds' data orders differ), then the median
            paired = [r["final_loss"] / bsp[r["seed"]]["final_loss"] - 1 for r in runs if r["seed"] in bsp]
            row["loss_vs_bsp_per_seed"] = paired
            row["loss_vs_bsp"] = statistics.median(paired) if paired else None
            bsp_bytes = statistics.median(r["bytes_pushed"] for r in bsp.values())
            row["fewer_bytes_than_bsp"] = bsp_bytes / row["bytes_pushed"]
            times = [_first_time_at(r["curve"], bsp[r["seed"]]["final_loss"]) for r in runs if r["seed"] in bsp]
            row["time_to_bsp_loss"] = times
            reached = [t for t in times if t is not None]
            every_seed = bool(times) and len(reached) == len(times)
            row["time_to_bsp_loss_median"] = statistics.median(reached) if every_seed else None
        row["time_to_level"] = {str(level): [_first_time_at(r["curve"], level) for r in runs] for level in levels}
        summary[name] = row
    return summary


def markdown(summary: dict) -> str:
    levels = list(next(iter(summary.values()))["time_to_level"]) if summary else []
    lines = ["| method | held-out loss (nats/byte, median; range) | vs the seed's BSP (median; range) | bytes pushed | "
             "fewer bytes | "
             "virtual s to BSP's final loss (per seed) |" + "".join(f" virtual s to {lv} |" for lv in levels),
             "|---|---|---|---|---|---|" + "---|" * len(levels)]

    def seconds(times: list) -> str:
        return ", ".join("never" if t is None else f"{t:.0f}" for t in times)

    for name, row in summary.items():
        lo, hi = row["final_loss_range"]
        paired = row.get("loss_vs_bsp_per_seed") or []
        versus = "" if name == "bsp" or not paired else f"{row['loss_vs_bsp']:+.2%}"
        if versus and len(paired) > 1:
            versus += f" ({min(paired):+.2%} to {max(paired):+.2%})"
        lines.append(f"| {name} | {row['final_loss']:.4f} ({lo:.4f}-{hi:.4f}) | {versus} | "
                     f"{row['bytes_pushed'] / 1e6:.1f} MB | {row.get('fewer_bytes_than_bsp', 1):.1f}x | "
                     f"{seconds(row.get('time_to_bsp_loss', []))} |"
                     + "".join(f" {seconds(row['time_to_level'][lv])} |" for lv in levels))
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_bytes, by_time) = plt.subplots(1, 2, figsize=(12, 4.6))
    methods = list(dict.fromkeys(r["method"] for r in records))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"] if len(methods) <= 10 else plt.get_cmap("tab20").colors
    colors = {method: palette[i % len(palette)] for i, method in enumerate(methods)}  # (distinct up to 20)
    for r in records:
        points = r["curve"][1:]  # (the start pushed nothing: no point on a log scale)
        label = r["method"] if r["seed"] == min(x["seed"] for x in records if x["method"] == r["method"]) else None
        by_bytes.plot([p["bytes"] / 1e6 for p in points], [p["loss"] for p in points], color=colors[r["method"]],
                      label=label, alpha=0.8, marker="." if len(points) < 12 else None)
        by_time.plot([p["time"] for p in r["curve"]], [p["loss"] for p in r["curve"]], color=colors[r["method"]],
                     label=label, alpha=0.8)
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("MB pushed (counted by the server)")
    by_time.set_xlabel("virtual seconds (workers' step times 1, 1, 1, 2.5)")
    for ax in (by_bytes, by_time):
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="bsp,diloco-50,diloco-200,diloco-50-int8,diloco-50-int4,async-50")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=800, help="inner steps per worker (default 800)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's (inner, or the server's under bsp)")
    parser.add_argument("--held-out", type=int, default=256, help="held-out windows evaluated")
    parser.add_argument("--evaluations", type=int, default=20, help="points on each curve")
    parser.add_argument("--warm-steps", type=int, default=0,
                        help="start every run from a model trained this many steps of BSP every step (DiLoCo's "
                        "setting: a pretrained model), the same for all (default 0: from scratch)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each its own process and server")
    parser.add_argument("--out", help="a folder for results.json, results.md and loss.png")
    parser.add_argument("--levels", default="",
                        help="held-out losses to time each method to, comma-separated (e.g. 2.2,2.1)")
    parser.add_argument("--replot", action="store_true",
                        help="only summarize and draw again from the results.json in --out (with --levels)")
    args = parser.parse_args(argv)
    levels = [float(level) for level in args.levels.split(",") if level.strip()]
    if args.replot:
        if not args.out:
            raise SystemExit("--replot needs --out")
        with open(os.path.join(args.out, "results.json")) as f:
            report = json.load(f)
        report["summary"] = summarize(report["records"], levels)
        write(args.out, report, markdown(report["summary"]))
        return 0
    methods = [parse_method(m.strip()) for m in args.methods.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    task = Task(args.width, args.layers, args.heads, args.context, args.batch, args.steps, args.lr,
                args.held_out, args.evaluations)
    warm = None
    if args.warm_steps:
        if not args.out:
            raise SystemExit("--warm-steps needs --out (the warm-up's weights are kept there)")
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "warm-start.pt")
        warm = warm_start(task, args.warm_steps, path)
        task = replace(task, start=path)
        print(f"warm start: {args.warm_steps} steps of BSP, held-out loss {warm['final_loss']:.4f}", flush=True)
    parameters = sum(p.numel() for p in _model(task).parameters())
    tokens = WORKERS * task.steps * task.batch * task.context
    print(f"ByteLM {parameters:,} parameters; {tokens:,} training bytes per run; "
          f"{len(methods)} methods x {len(seeds)} seeds", flush=True)
    jobs = [(m, task, s) for s in seeds for m in methods]
    title = (f"ByteLM ({parameters / 1e6:.2f}M parameters) on the stdlib, 4 workers, "
             f"{tokens / 1e6:.1f}M bytes each run, seeds {args.seeds}"
             + (f", from {args.warm_steps} steps of BSP" if args.warm_steps else ""))
    report = {"command": command_line(), "machine": machine_info(), "task": asdict(task), "title": title,
              "parameters": parameters, "speeds": SPEEDS, "workers": WORKERS, "warm_start": warm, "summary": None,
              "records": []}
    records = report["records"]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, *job) for job in jobs]
        for future in futures:
            record = future.result()
            records.append(record)
            print(f"{record['method']:>16} seed {record['seed']}: loss {record['final_loss']:.4f}, "
                  f"{record['bytes_pushed'] / 1e6:.1f} MB pushed, {record['wall_s']:.0f} s", flush=True)
            if args.out:  # (each run as it ends, so that nothing can lose it: --replot summarizes them again)
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "results.json"), "w") as f:
                    json.dump(report, f, indent=1)
    report["summary"] = summarize(records, levels)
    table = markdown(report["summary"])
    print(table)
    if args.out:
        write(args.out, report, table)
    return 0


def write(out: str, report: dict, table: str) -> None:
    """results.json, results.md and loss.png in ``out``."""
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        warm = report.get("warm_start")
        warmed = f"Every run starts from {warm['steps']} steps of BSP every step.\n\n" if warm else ""
        f.write(f"`{report['command']}`\n\n{warmed}{table}")
    plot(report["records"], os.path.join(out, "loss.png"), report.get("title", ""))


if __name__ == "__main__":
    sys.exit(main())
