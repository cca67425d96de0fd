"""PyTorch Lightning on an aps server: ``Trainer(strategy=aps.lightning.Strategy(...))``.

The ``LightningModule`` stays as it is. Its ``configure_optimizers`` returns a
``torch.optim`` SGD, Adam or AdamW (with any scheduler), and the strategy has the server
take each step instead: every optimizer gets an :class:`aps.torch.Optimizer` over the same
parameters and param groups, which pushes the gradients and loads the server's weights.
The torch optimizer stays Lightning's (its schedulers, its learning rates, what
``self.optimizers()`` returns); its group values go to the server with each step::

    trainer = lightning.Trainer(max_epochs=5, strategy=aps.lightning.Strategy("tcp://ps:7450"))
    trainer.fit(module, loader)  # each worker process: RANK and WORLD_SIZE from its launcher

What each worker does for Lightning:

- its rank and the worker count are aps's, so Lightning hands each worker its own part of
  the data (a ``DistributedSampler`` in every loader, ``set_epoch`` each epoch, as under DDP);
- checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) hold the server's
  optimizer state, written by rank 0, and ``trainer.fit(ckpt_path=...)`` loads it back into
  the server (once, whichever workers load it) with the model's weights;
- each training step's loss, its learning rate and the step's scalars the module logged
  with ``self.log`` go to the server (:meth:`aps.Worker.log`) with a digest of the batch, for
  its dashboard and ``/metrics``.

There is no process group: ``reduce``, ``all_gather`` and ``broadcast`` return what they
are given, and ``barrier`` waits for nobody (the server's sync policy is what keeps the
workers together), so ``self.log(..., sync_dist=True)`` logs the worker's own value.

Local SGD (DiLoCo, asynchronous local SGD): ``Strategy(..., local_every=H)`` keeps the
module's optimizer as the *inner* one, stepping locally, and syncs with the server every H
steps through :class:`aps.torch.LocalSGD` (whose ``dynamic`` and ``compression`` it takes
too); the server's optimizer is then the outer one, whatever it is, and checkpoints hold
the inner optimizer's state, the steps and the anchor (``LocalSGD.state_dict``).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import ParallelStrategy

from .client.arguments import from_env
from .errors import ConfigurationError
from .torch import LocalSGD, Optimizer
from .torch.reporting import Reporter

__all__ = ["Strategy"]

log = logging.getLogger("aps.lightning")

#: torch optimizers the server runs, by the name ``aps serve --optimizer`` gives them.
_SERVED = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
#: The group values a step sends (the rest are the server's and fixed).
_VALUES = {"sgd": ("lr", "weight_decay", "momentum", "dampening"), "adam": ("lr", "weight_decay", "betas")}
_VALUES["adamw"] = _VALUES["adam"]


class _Seat(ClusterEnvironment):
    """Lightning's view of where this process sits: aps's rank among its workers."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self._rank, self._world_size = rank, world_size

    @property
    def creates_processes_externally(self) -> bool:
        return True  # (the launcher started every worker)

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        pass  # (aps's)

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass  # (aps's)

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0


class Strategy(ParallelStrategy):
    """Train a ``LightningModule`` with an aps server, one worker per process.

    Args:
        address: the server (``tcp://HOST:PORT``); default ``APS_ADDRESS``.
        rank: this worker's rank; default ``RANK`` (0 when unset).
        num_workers: the workers of the run; default ``WORLD_SIZE`` (1 when unset).
            They must be what the server was started for (``aps serve --workers``).
        device: where the model trains (``"cpu"``, ``"cuda:0"``...): one device per worker.
        report: send each step's loss, learning rate and logged scalars to the server.
        local_every: local SGD: the module's optimizer steps locally and the worker syncs
            every this many steps (:class:`aps.torch.LocalSGD`); None (default): the server
            takes every step.
        **options: anything else :class:`aps.torch.Optimizer` (or, with ``local_every``,
            :class:`aps.torch.LocalSGD`) takes (``transport``, ``token``, ``compression``,
            ``init_timeout``, ``dynamic``...).
    """

    strategy_name = "aps"

    def __init__(
        self,
        address: str | None = None,
        *,
        rank: int | None = None,
        num_workers: int | None = None,
        device: str | torch.device = "cpu",
        report: bool = True,
        local_every: int | None = None,
        **options: Any,
    ) -> None:
        address, rank, num_workers = from_env(address, rank, num_workers)
        rank = 0 if rank is None else rank
        num_workers = 1 if num_workers is None else num_workers
        if not 0 <= rank < num_workers:
            raise ConfigurationError(f"rank {rank} is not one of {num_workers} workers")
        self._device = torch.device(device)
        super().__init__(parallel_devices=[self._device], cluster_environment=_Seat(rank, num_workers))
        self._address, self._rank, self._num_workers, self._options = address, rank, num_workers, options
        self._report, self._local_every = report, local_every
        #: id(torch optimizer) -> the aps optimizer taking its steps (LocalSGD: the one syncing it)
        self._servers: dict[int, Optimizer | LocalSGD] = {}
        self._reporter: Reporter | None = None

    # Where this worker sits ------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        return self._device

    @property
    def is_distributed(self) -> bool:  # (Lightning then gives every loader a DistributedSampler)
        return True

    @property
    def global_rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._num_workers

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self._num_workers, "rank": self._rank}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # No process group: what each worker has is its own ---------------------------------
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    # The server takes the steps --------------------------------------------------------
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            if isinstance(optimizer, Optimizer) or id(optimizer) in self._servers:
                continue
            self._servers[id(optimizer)] = self._serve(optimizer)
        if self._report and self._servers:
            self._reporter = Reporter(next(iter(self._servers.values())).worker)

    def _serve(self, optimizer: torch.optim.Optimizer) -> Optimizer | LocalSGD:
        if self._local_every is not None:
            if self._servers:
                raise ConfigurationError("local SGD (local_every) takes one optimizer: the model's inner one")
            module = self.lightning_module
            assert module is not None  # (optimizers are set up for a module)
            return LocalSGD(
                module,
                optimizer,
                every=self._local_every,
                address=self._address,
                rank=self._rank,
                num_workers=self._num_workers,
                **self._options,
            )
        kind = _SERVED.get(type(optimizer))
        if kind is None:
            raise ConfigurationError(
                f"configure_optimizers returned {type(optimizer).__name__}: an aps server runs "
                "SGD, Adam or AdamW (torch.optim's), or return an aps.torch.Optimizer"
            )
        groups = [{"params": g["params"], **{k: g[k] for k in _VALUES[kind] if k in g}} for g in optimizer.param_groups]
        served = Optimizer(
            groups,
            address=self._address,
            rank=self._rank,
            num_workers=self._num_workers,
            model=self.lightning_module,
            **self._options,
        )
        if served.server_optimizer != kind:
            served.close()
            raise ConfigurationError(
                f"configure_optimizers returned torch.optim.{type(optimizer).__name__}; the server "
                f"at {served.worker.address} runs {served.server_optimizer} (start it with "
                f"aps serve --optimizer {kind}, or return the optimizer it runs)"
            )
        # Lightning zeroes the gradients through the torch optimizer: in place, where the pushes read them.
        optimizer.zero_grad = served.zero_grad  # type: ignore[method-assign]  # (the instance's, on purpose)
        return served

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        inner = getattr(optimizer, "optimizer", optimizer)  # (a LightningOptimizer's)
        served = self._servers.get(id(inner))
        if served is None:  # an aps.torch.Optimizer of the module's own
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if isinstance(served, LocalSGD):  # the inner step, Lightning's, and every H steps the sync
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
            served.stepped()
            return result
        _copy_values(inner, served)
        result = super().optimizer_step(served, closure, model, **kwargs)
        inner._opt_called = True  # (what torch's schedulers look for: the step was taken)
        return result

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if self._reporter is not None and (module := self.lightning_module) is not None:
            trainer = module.trainer
            optimizer = self.optimizers[0] if self.optimizers else None
            lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
            self._reporter.step(
                trainer.global_step, loss=out, lr=lr, metrics=trainer.callback_metrics, batch=args[0] if args else None
            )
        return out

    # Checkpoints ------------------------------------------------------------------------
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        served = self._servers.get(id(getattr(optimizer, "optimizer", optimizer)))
        if served is None:
            return super().optimizer_state(optimizer)
        if isinstance(served, LocalSGD):
            return served.state_dict()  # (each worker's own: its inner optimizer, steps and anchor)
        if not self.is_global_zero:
            return {}  # (only rank 0's is written)
        _copy_values(getattr(optimizer, "optimizer", optimizer), served)  # (the scheduler's since the last step)
        return served.state_dict()

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            served = self._servers.get(id(optimizer))
            if served is None:
                optimizer.load_state_dict(state)
                continue
            served.load_state_dict(state)  # (the server takes it once, whichever workers load it)
            if not isinstance(served, LocalSGD):
                _copy_values(served, optimizer)

    def teardown(self) -> None:
        self._reporter = None  # (a worker sends what it has left to log when it closes)
        for served in self._servers.values():
            served.close()
        self._servers.clear()
        super().teardown()


def _copy_values(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """The group values the server applies (learning rate, weight decay, momentum...), from
    one optimizer's param groups to the other's."""
    keys = _VALUES["sgd" if "momentum" in target.param_groups[0] else "adam"]
    for theirs, mine in zip(source.param_groups, target.param_groups):
        for key in keys:
            if key in theirs:
                mine[key] = theirs[key]
