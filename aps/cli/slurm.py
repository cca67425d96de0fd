"""``aps slurm``: one task of a Slurm job step, as a server shard or as a worker.

::

    srun --ntasks 6 aps slurm --shards 2 --sync bsp train.py --epochs 5

Every task of the step runs the same command. It reads Slurm's environment the way
``torchrun``'s is read elsewhere: ``SLURM_PROCID`` (this task), ``SLURM_NTASKS``, the
step's nodes (``SLURM_STEP_NODELIST``, expanded by ``scontrol show hostnames``) and
how many tasks each holds (``SLURM_STEP_TASKS_PER_NODE``, tasks laid out in blocks,
Slurm's default). Tasks ``0..K-1`` (``--shards K``, default 1) serve the model's
shards (shard ``I`` on port ``--port + I`` of its node, on every interface); every
other task runs ``python SCRIPT ARGS`` as a worker with ``APS_ADDRESS`` (every shard's
``tcp://NODE:PORT``), ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set. ``--workers``
defaults to the worker tasks (``SLURM_NTASKS - K``); ``MIN:MAX`` makes the run elastic.

A shard stops (after a checkpoint, with ``--checkpoint-dir``) once training has run
and no worker has been live for ``--linger`` seconds, so the step ends with its
workers. Off loopback a server needs a token: export ``APS_TOKEN`` in the batch
script (every task inherits it), or give ``--insecure`` on a trusted network.
``examples/deploy/slurm/train.sbatch`` is a template to copy.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping

from ..errors import APSError, ConfigurationError
from ._args import add_server_arguments, config_from_args, number, require

__all__ = ["SlurmStep", "register", "run", "tasks_per_node"]

_REPEAT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def register(commands) -> None:
    parser = commands.add_parser(
        "slurm",
        help="one task of a Slurm job step: a server shard or a worker (srun aps slurm ... SCRIPT)",
        description="Run as one task of a Slurm job step (srun aps slurm ...): the first --shards tasks serve the "
        "model, every other task runs SCRIPT as a worker with APS_ADDRESS, RANK and WORLD_SIZE set. Every aps "
        "serve flag applies to the shards.",
    )
    add_server_arguments(parser, skip=("shard",))
    parser.add_argument(
        "--linger",
        type=number,
        default=10.0,
        help="seconds a shard waits with no worker live, once training ran, before it stops (default 10)",
    )
    parser.add_argument(
        "--replica-count",
        type=int,
        default=1,
        help="replicas a shard (default 1): more makes each shard a replica set (aps serve --replicas) of that "
        "many tasks, which needs --coordinator etcd://HOST:PORT (docs/guide/replicas.md)",
    )
    parser.add_argument("script", help="the training script each worker task runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(run=run)


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node (``[2, 2, 2, 1]``)."""
    counts: list[int] = []
    for part in text.split(","):
        match = _REPEAT.match(part.strip())
        if match is None:
            raise ConfigurationError(f"cannot read the tasks per node {text!r} (Slurm writes them as 2(x3),1)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


class SlurmStep:
    """Where this task stands in its Slurm job step (see the module docstring)."""

    def __init__(self, environ: Mapping[str, str], hostnames: list[str]) -> None:
        def number_of(name: str) -> int:
            raw = environ.get(name)
            if raw is None:
                raise ConfigurationError(
                    f"${name} is not set: run aps slurm as a task of a Slurm job step (srun aps slurm ...)"
                )
            try:
                return int(raw)
            except ValueError:
                raise ConfigurationError(f"${name}={raw!r} is not a number") from None

        self.procid, self.ntasks = number_of("SLURM_PROCID"), number_of("SLURM_NTASKS")
        counts = tasks_per_node(
            environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or str(self.ntasks)
        )
        if len(counts) != len(hostnames) or sum(counts) != self.ntasks:
            raise ConfigurationError(f"{self.ntasks} tasks on nodes {hostnames} as {counts}: they do not agree")
        #: The node of each task, in task order (Slurm's block layout).
        self.nodes = [host for host, count in zip(hostnames, counts) for _ in range(count)]
        #: This task's index among the tasks of its node.
        self.local = self.nodes[: self.procid].count(self.nodes[self.procid])

    def addresses(self, shards: int, port: int, replicas: int = 1) -> list[str]:
        """Every shard's address: shard ``I`` is task ``I`` (its first replica, task ``I * R``, with
        ``replicas`` R), on its node's port ``port + task``."""
        return [f"tcp://{self.nodes[index * replicas]}:{port + index * replicas}" for index in range(shards)]

    def replica_set(self, shard: int, port: int, replicas: int) -> list[str]:
        """The addresses of shard ``shard``'s replicas: tasks ``shard * R .. shard * R + R - 1``."""
        tasks = range(shard * replicas, (shard + 1) * replicas)
        return [f"{self.nodes[task]}:{port + task}" for task in tasks]


def _hostnames(environ: Mapping[str, str]) -> list[str]:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ConfigurationError("$SLURM_JOB_NODELIST is not set: run aps slurm as a task of a Slurm job step")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
            env=dict(environ),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise APSError(f"scontrol show hostnames {nodelist} failed: {exc}") from None
    return out.stdout.split()


def run(args: argparse.Namespace) -> int:
    environ = os.environ
    step = SlurmStep(environ, _hostnames(environ))
    shards = args.shards or 1
    replicas = args.replica_count
    require(replicas >= 1, f"--replica-count must be at least 1, got {replicas}")
    serving = shards * replicas
    require(
        1 <= serving < step.ntasks,
        f"--shards {shards} with --replica-count {replicas} needs at least {serving + 1} tasks; the step has "
        f"{step.ntasks}",
    )
    require(args.linger > 0, f"--linger must be > 0 seconds, got {args.linger:g}")
    port = 7450 if args.port is None else args.port
    require(port > 0, "--port must be a fixed port under Slurm (the workers are told it)")
    if step.procid < serving:
        return _serve(args, step, shards, port, replicas)
    node = step.nodes[step.procid]
    env = dict(
        environ,
        APS_ADDRESS=",".join(step.addresses(shards, port, replicas)),
        RANK=str(step.procid - serving),
        # (the shards' replicas, tasks 0..K*R-1, come first on their nodes)
        LOCAL_RANK=str(step.local - step.nodes[:serving].count(node)),
    )
    if isinstance(args.workers, tuple):  # --workers MIN:MAX: elastic, any count up to MAX
        env.pop("WORLD_SIZE", None)
    else:
        env["WORLD_SIZE"] = str(args.workers if args.workers is not None else step.ntasks - serving)
    sys.stdout.flush()
    os.execvpe(sys.executable, [sys.executable, args.script, *args.script_args], env)
    return 1  # (not reached)


def _serve(args: argparse.Namespace, step: SlurmStep, shards: int, port: int, replicas: int = 1) -> int:
    from ..server.replicas import SetRetired
    from ..server.server import Server

    task = step.procid
    index, replica = divmod(task, replicas)
    args.shard, args.shards, args.port = index, shards, port + task
    if args.host is None:
        args.host = "0.0.0.0"
    if args.workers is None:
        args.workers = step.ntasks - shards * replicas
    if args.checkpoint_dir is not None and (shards > 1 or replicas > 1):
        args.checkpoint_dir = os.path.join(
            args.checkpoint_dir, f"shard-{index}" + (f"-replica-{replica}" if replicas > 1 else "")
        )
    if replicas > 1:
        args.replicas = ",".join(step.replica_set(index, port, replicas))
        args.advertise = f"{step.nodes[task]}:{port + task}"
        if args.replica_set in (None, "aps"):  # (one set a shard and a job)
            args.replica_set = f"slurm-{os.environ.get('SLURM_JOB_ID', 'job')}-shard-{index}"
    config = config_from_args(args)
    background = Server(config).run_in_background()
    try:
        background.start(timeout=None if replicas > 1 else 30.0)  # (a backup starts serving when it takes over)
    except SetRetired as exc:
        print(f"aps: shard {index} replica {replica}: {exc}", flush=True)
        return 0
    with background:
        print(
            f"aps: shard {index} of {shards} serving on {step.nodes[task]}:{config.port} "
            f"({config.describe_workers()} workers)",
            flush=True,
        )
        server, idle_since = background.server, None
        while True:
            time.sleep(0.5)
            stats = server.stats()["server"]
            if not stats["started"] or stats["live"]:
                idle_since = None
                continue
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= args.linger:
                server.retire_replicas = True  # (the run is over: its backups stop too)
                break
        if config.checkpoint_dir is not None:
            print(f"aps: shard {index}: final checkpoint {server.checkpoint()}", flush=True)
        print(
            f"aps: shard {index}: no worker live for {args.linger:g} s after training: stopping at version "
            f"{stats['version']}",
            flush=True,
        )
    return 0
