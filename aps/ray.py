"""Ray Train on an aps server: the server as a Ray actor, ``TorchTrainer`` workers training on it.

::

    import ray, ray.train, ray.train.torch, aps.ray

    server = aps.ray.ServerActor.remote(workers=4, sync="asp", optimizer="sgd", lr=0.05)
    connection = ray.get(server.connection.remote())            # its address and token

    def train_loop(config):
        model = Net()
        optimizer = aps.ray.optimizer(model, config["server"])    # rank and workers: Ray Train's
        for epoch in range(10):
            ...                                                   # the usual loop: the server takes the steps
            aps.ray.report(optimizer, {"loss": loss}, checkpoint=aps.ray.checkpoint(model, optimizer))

    ray.train.torch.TorchTrainer(train_loop, train_loop_config={"server": connection},
                                 scaling_config=ray.train.ScalingConfig(num_workers=4)).fit()

:class:`ServerActor` runs ``aps.Server`` (any ``aps serve`` option, by its keyword) on a
thread of an actor process, placed by Ray like any actor (``num_cpus=1`` by default; put it
beside the driver, or on a node of its own with Ray's options). Each worker of the trainer
makes its :class:`aps.torch.Optimizer` with :func:`optimizer`, which takes its rank and the
worker count from Ray Train's context (and the server's address); :func:`report` is
``ray.train.report`` that also sends the numbers reported to the server (its dashboard
draws them per rank). :func:`checkpoint` puts
the model's weights and the server's optimizer state in a ``ray.train.Checkpoint``, and
:func:`restore` loads them back (into the server once, whichever workers load it) from
``ray.train.get_checkpoint()`` when a run resumes; a run Ray Train restarts after a worker
failed goes on from the server actor's state instead. The process group Ray Train starts
(``torch.distributed``, gloo) is not used: the server's sync policy keeps the workers together.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from typing import Any

import ray
import torch

from .errors import ConfigurationError
from .server.server import Server
from .torch import Optimizer
from .wire.scalars import check_scalar_name

__all__ = ["ServerActor", "checkpoint", "optimizer", "report", "restore"]

_STATE_FILE = "aps.pt"

log = logging.getLogger("aps.ray")


@ray.remote(num_cpus=1)
class ServerActor:
    """An aps server in a Ray actor: ``ServerActor.remote(workers=4, sync="asp", ...)`` takes
    what ``aps.Server`` takes (``aps serve``'s options by their keywords; ``host`` defaults to
    the actor's node address, ``port`` to a free one)."""

    def __init__(self, **options: Any) -> None:
        options.setdefault("host", ray.util.get_node_ip_address())
        options.setdefault("port", 0)
        if not options.get("insecure"):  # (beyond loopback a server needs a token: one made here)
            options.setdefault("token", secrets.token_urlsafe(32))
        self._token = options.get("token")
        self._background = Server(**options).run_in_background().start()

    def address(self) -> str:
        """The server's address, ``tcp://HOST:PORT``."""
        return self._background.address

    def connection(self) -> dict[str, Any]:
        """What a worker needs to reach the server: ``{"address": ..., "token": ...}`` (give it
        to :func:`optimizer`, in the trainer's ``train_loop_config``)."""
        return {"address": self._background.address, "token": self._token}

    def stats(self) -> dict:
        """The server's statistics (what ``aps status --json`` shows)."""
        return self._background.server.stats()

    def stop(self) -> None:
        """Stop serving (the actor stays until Ray ends it)."""
        self._background.stop()


def optimizer(params: Any, server: dict[str, Any] | str, **options: Any) -> Optimizer:
    """An :class:`aps.torch.Optimizer` for this Ray Train worker, on ``server`` (what
    :meth:`ServerActor.connection` returns, or an address): its rank and the worker count from
    ``ray.train.get_context()``; ``options`` as the optimizer takes them.

    Every worker of the trainer must make one: it returns once all have joined the server. A
    run's first start waits so at the server; a run Ray Train restarts after a failure rejoins
    a server that trains on, and without this wait the first worker back would train alone
    (under BSP, into a step its peers, held at ``ray.train.report``, never take)."""
    context = ray.train.get_context()
    rank, workers = context.get_world_rank(), context.get_world_size()
    if options.get("rank", rank) != rank or options.get("num_workers", workers) != workers:
        raise ConfigurationError(f"this Ray Train worker is rank {rank} of {workers}; give no rank or num_workers")
    options.update(rank=rank, num_workers=workers)
    if isinstance(server, dict):
        options.setdefault("token", server.get("token"))
        server = server["address"]
    made = Optimizer(params, server, **options)
    if workers > 1:
        try:
            _barrier()
        except BaseException:
            made.close()
            raise
    return made


def _barrier() -> None:
    """Wait for every worker of this Ray Train run (Ray Train's barrier; the process group's
    under Ray Train v1, which has none)."""
    try:
        from ray.train.collective import barrier
    except ImportError:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        return
    barrier()


def report(
    server_optimizer: Optimizer, metrics: dict[str, Any], checkpoint: ray.train.Checkpoint | None = None, **options: Any
) -> None:
    """``ray.train.report(metrics, checkpoint)``, and the metrics that are numbers to the server too
    (:meth:`aps.Worker.log`, at this worker's clock), for its dashboard and ``/metrics``."""
    scalars = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                check_scalar_name(name)
            except ValueError:
                continue  # (a name the server cannot take: Ray has it all the same)
            scalars[name] = float(value)
    server_optimizer.worker.log(scalars)
    ray.train.report(metrics, checkpoint=checkpoint, **options)


def checkpoint(model: torch.nn.Module, server_optimizer: Optimizer, **extra: Any) -> ray.train.Checkpoint:
    """A ``ray.train.Checkpoint`` of the model's weights, the server's optimizer state and
    ``extra`` (an epoch, a scheduler's state...). Every worker may make one: Ray keeps rank 0's."""
    directory = tempfile.mkdtemp(prefix="aps-ray-")
    torch.save(
        {"model": model.state_dict(), "optimizer": server_optimizer.state_dict(), **extra},
        os.path.join(directory, _STATE_FILE),
    )
    return ray.train.Checkpoint.from_directory(directory)


def restore(
    model: torch.nn.Module, server_optimizer: Optimizer, saved: ray.train.Checkpoint | None = None
) -> dict[str, Any] | None:
    """Load a checkpoint made by :func:`checkpoint` (default: ``ray.train.get_checkpoint()``,
    the one a resumed run starts from) into the model and the server; returns what else it
    holds, or None when there is none.

    Call it before the first step. A server that has applied updates already (Ray Train
    restarted the workers after a failure, and the server actor lives on) is newer than any
    checkpoint: the model keeps the server's weights (its optimizer made them the model's),
    the server keeps its state, and only what else the checkpoint holds is returned."""
    saved = saved if saved is not None else ray.train.get_checkpoint()
    if saved is None:
        return None
    with saved.as_directory() as directory:
        state = torch.load(os.path.join(directory, _STATE_FILE), weights_only=False)
    weights, optimizer_state = state.pop("model"), state.pop("optimizer")
    if server_optimizer.version > 0:
        log.info(
            "rank %d: the server has applied %d updates: going on from its weights and state, not the checkpoint's",
            server_optimizer.worker.rank,
            server_optimizer.version,
        )
        return state
    model.load_state_dict(weights)
    server_optimizer.load_state_dict(optimizer_state)
    return state
