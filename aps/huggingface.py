"""Hugging Face on an aps server: :class:`Trainer`, a ``transformers.Trainer`` whose steps the server takes.

One process needs nothing of this module: ``transformers.Trainer(model, args, train_dataset=...,
optimizers=(aps.torch.Optimizer(model, ...), scheduler))`` trains with aps as it is (and so does
``accelerate``'s loop with an ``aps.torch.Optimizer`` given to ``accelerator.prepare``). Several
worker processes need what :class:`Trainer` and :class:`TrainingArguments` add::

    args = aps.huggingface.TrainingArguments("out", num_train_epochs=10)
    trainer = aps.huggingface.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()  # each worker process: RANK and WORLD_SIZE from its launcher

- each worker trains alone as far as ``transformers`` and ``accelerate`` know: under a
  launcher (torchrun, ``aps launch``, Slurm) they would start a ``torch.distributed`` process
  group, wrap the model in ``DistributedDataParallel`` and average the gradients of all ranks
  before each push (and on the CPU place the model on ``cpu:RANK``, a copy: the optimizer's
  pushes and pulls would miss the model). :class:`TrainingArguments` set up one process whatever
  the launcher set; arguments of ``transformers`` given to :class:`Trainer` are set up again so;
- each worker reads its own part of the data (a ``DistributedSampler`` with aps's rank and
  worker count, seeded with ``args.seed``, its epoch set each epoch);
- without ``optimizers=``, the optimizer is an :class:`aps.torch.Optimizer` laid out as the
  Trainer lays out its own (weight decay on all but biases and norms), with ``args``'s learning
  rate, betas and weight decay; the server must run AdamW (``aps serve --optimizer adamw``), the
  Trainer's default, or what the arguments ask for;
- rank 0 alone writes checkpoints (with the server's optimizer state);
  ``train(resume_from_checkpoint=...)`` loads it back into the server, once whichever workers load it;
- each step's loss and learning rate, with a digest of its batch, and what the Trainer logs
  go to the server (:meth:`aps.Worker.log`).

Local SGD (DiLoCo, asynchronous local SGD): ``Trainer(..., aps_local_every=H)`` keeps the
Trainer's own optimizer (``args.optim``, AdamW by default, with its scheduler) as the *inner*
one, stepping locally, and syncs with the server every H optimizer steps through
:class:`aps.torch.LocalSGD` (``aps_options`` may add its ``dynamic`` and ``compression``); the
server's optimizer is the outer one, whatever it is. Checkpoints are the Trainer's own (the
model, the inner optimizer); a worker that resumes takes the server's global weights at join,
as any worker joining a run under way does.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import torch
import transformers
from accelerate.utils import DistributedType  # type: ignore[import-untyped]  # (accelerate ships no types)
from torch.utils.data import DistributedSampler

from .client.arguments import from_env
from .errors import ConfigurationError
from .torch import LocalSGD, Optimizer
from .torch.reporting import Reporter

__all__ = ["Trainer", "TrainingArguments"]

log = logging.getLogger("aps.huggingface")

#: What ``TrainingArguments.optim`` names, as the server's optimizer.
_OPTIM = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "sgd": "sgd"}
#: What launchers set that makes ``accelerate`` start a process group (torchrun's, MPI's).
_LAUNCHED = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_SIZE",
)


@contextlib.contextmanager
def _unlaunched() -> Iterator[None]:
    """The launcher's variables hidden from this process's environment for a while."""
    hidden = {name: os.environ.pop(name) for name in _LAUNCHED if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def _set_up_alone(args: transformers.TrainingArguments) -> torch.device:
    """``args``'s device, set up (``TrainingArguments._setup_devices``) as one process's whatever
    launched it; on a GPU, the one ``LOCAL_RANK`` names (as a launcher places its processes)."""
    local_rank = os.environ.get("LOCAL_RANK")
    setup = inspect.getattr_static(transformers.TrainingArguments, "_setup_devices")  # (the cached_property)
    with _unlaunched():
        device: torch.device = setup.func(args)
    if device.type == "cuda" and local_rank and torch.cuda.device_count() > int(local_rank):
        device = torch.device("cuda", int(local_rank))
        torch.cuda.set_device(device)
    return device


class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` for one worker of an aps run: the same fields, set up
    as one process whatever launched it (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are aps's
    to read): ``transformers`` and ``accelerate`` start no process group (which would ask for
    ``MASTER_ADDR`` under a plain launch, and average the workers' gradients under torchrun)."""

    _setup_devices = cached_property(_set_up_alone)


def _alone(args: transformers.TrainingArguments) -> transformers.TrainingArguments:
    """``args`` set up as one process's (see :class:`TrainingArguments`), in place, when they
    were set up for several."""
    state = args.distributed_state
    if isinstance(args, TrainingArguments) or state is None or state.distributed_type == DistributedType.NO:
        return args
    log.warning(
        "the TrainingArguments were set up for %d processes of torch.distributed (%s): an aps worker "
        "trains alone, so they are set up again as one process's (aps.huggingface.TrainingArguments "
        "are so from the start)",
        args.world_size,
        state.distributed_type,
    )
    args.__dict__.pop("_setup_devices", None)
    args.__dict__["_setup_devices"] = _set_up_alone(args)
    return args


class Trainer(transformers.Trainer):
    """A ``transformers.Trainer`` for one worker of an aps run (see the module).

    Besides what ``transformers.Trainer`` takes:

    Args:
        aps_address: the server; default ``APS_ADDRESS``.
        aps_rank: this worker's rank; default ``RANK`` (0 when unset).
        aps_workers: the run's workers; default ``WORLD_SIZE`` (1 when unset).
        aps_options: what else :class:`aps.torch.Optimizer` (or, with ``aps_local_every``,
            :class:`aps.torch.LocalSGD`) takes (``transport``, ``token``, ``dynamic``...).
        aps_local_every: local SGD: the Trainer's own optimizer steps locally and the worker
            syncs every this many optimizer steps; None (default): the server takes every step.

    ``args`` are best :class:`TrainingArguments`; those of ``transformers`` that a launcher
    made set up for several processes are set up again as one process's (a warning says so),
    and without ``args`` the Trainer's defaults are :class:`TrainingArguments`.
    """

    def __init__(
        self,
        model: Any = None,
        args: transformers.TrainingArguments | None = None,
        *rest: Any,
        aps_address: str | None = None,
        aps_rank: int | None = None,
        aps_workers: int | None = None,
        aps_options: dict[str, Any] | None = None,
        aps_local_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        address, rank, workers = from_env(aps_address, aps_rank, aps_workers)
        self.aps_address, self.aps_rank = address, 0 if rank is None else rank
        self.aps_workers = 1 if workers is None else workers
        if not 0 <= self.aps_rank < self.aps_workers:
            raise ConfigurationError(f"rank {self.aps_rank} is not one of {self.aps_workers} workers")
        self._aps_options = dict(aps_options or {})
        self._reporter: Reporter | None = None
        #: Local SGD: the LocalSGD syncing the Trainer's own optimizer (made with it).
        self.aps_local: LocalSGD | None = None
        self._local_every = aps_local_every
        args = TrainingArguments(output_dir="tmp_trainer") if args is None else _alone(args)
        super().__init__(model, args, *rest, **kwargs)
        if aps_local_every is not None:
            self.add_callback(_Synced(self))
        if isinstance(self.optimizer, Optimizer):
            self._reporter = Reporter(self.optimizer.worker)

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler | None:
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if dataset is None or not hasattr(dataset, "__len__"):
            return super()._get_train_sampler(train_dataset)
        return DistributedSampler(dataset, num_replicas=self.aps_workers, rank=self.aps_rank, seed=self.args.seed)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        if model is None:
            raise ConfigurationError("the Trainer has no model to optimize")
        if self._local_every is not None:  # the Trainer's own optimizer, the inner one of local SGD
            inner = super().create_optimizer(model)
            self.aps_local = LocalSGD(
                model,
                inner,
                every=self._local_every,
                address=self.aps_address,
                rank=self.aps_rank,
                num_workers=self.aps_workers,
                **self._aps_options,
            )
            self._reporter = Reporter(self.aps_local.worker)
            return inner
        kind = _OPTIM.get(str(getattr(self.args.optim, "value", self.args.optim)))
        if kind is None:
            raise ConfigurationError(
                f"TrainingArguments(optim={self.args.optim!r}): an aps server runs SGD, Adam or "
                "AdamW (optim='adamw_torch' or 'sgd'), or give optimizers=(aps.torch.Optimizer)"
            )
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [group for group in groups if group["params"]]
        if kind != "sgd":
            for group in groups:
                group["betas"] = (self.args.adam_beta1, self.args.adam_beta2)
        self.optimizer = Optimizer(
            groups,
            address=self.aps_address,
            rank=self.aps_rank,
            num_workers=self.aps_workers,
            model=model,
            lr=self.args.learning_rate,
            **self._aps_options,
        )
        served, eps = self.optimizer.server_optimizer, self.optimizer.defaults.get("eps")
        wrong = (
            (
                f"TrainingArguments(optim={self.args.optim!r}) is {kind}; the server runs {served} (start it with "
                f"aps serve --optimizer {kind}, or set optim)"
            )
            if served != kind
            else (
                f"TrainingArguments(adam_epsilon={self.args.adam_epsilon}); the server's is {eps} (start it with "
                f"aps serve --eps {self.args.adam_epsilon})"
            )
            if eps is not None and eps != self.args.adam_epsilon
            else None
        )
        if wrong is not None:
            self.optimizer.close()
            self.optimizer = None
            raise ConfigurationError(wrong)
        self._reporter = Reporter(self.optimizer.worker)
        return self.optimizer

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, *args, **kwargs)
        if self._reporter is not None:
            lr = self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else None
            self._reporter.step(self.state.global_step, loss=loss, lr=lr, batch=inputs)
        return loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        super().log(logs, *args, **kwargs)
        if self._reporter is not None:  # (the Trainer's own figures: grad_norm, epoch, eval_loss...)
            self._reporter.step(self.state.global_step, metrics={k: v for k, v in logs.items() if k != "loss"})

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        if self.aps_rank == 0:  # (every worker is "process 0" to transformers: rank 0 alone writes)
            super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.aps_rank == 0:
            super().save_model(output_dir, _internal_call)


class _Synced(transformers.TrainerCallback):
    """Local SGD: each optimizer step the Trainer takes is counted, and every H-th syncs."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        local = self._trainer.aps_local
        if local is not None:
            local.stepped()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        local, self._trainer.aps_local = self._trainer.aps_local, None
        if local is not None:
            local.close()
