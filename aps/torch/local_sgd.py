"""Local SGD with the outer optimizer on the server: :class:`LocalSGD` (DiLoCo under BSP,
asynchronous local SGD under ASP, SSP and DSSP).

::

    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = aps.torch.LocalSGD(model, inner, every=50)  # APS_ADDRESS, RANK, WORLD_SIZE
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()  # the inner step, here; every 50th also syncs with the server

Each worker takes ``every`` steps of its own inner optimizer, locally: no round
trip. Then it pushes its *pseudo-gradient*, the weights it started from (the
global weights it last received) minus the weights it has now, and takes the
server's new global weights; its inner optimizer keeps its state, as DiLoCo
does. The server's optimizer is the *outer* optimizer and its sync policy says
how the pseudo-gradients meet: under BSP each round averages every worker's
and takes one outer step, DiLoCo (Douillard et al., 2023) with ``aps serve
--sync bsp --optimizer sgd --lr 0.7 --momentum 0.9 --nesterov``; under ASP,
SSP or DSSP each is applied as it comes, asynchronous local SGD (Liu et al.,
2024), with the staleness bounds holding in units of syncs and ``--optimizer
delayed-nesterov`` its outer step (the momentum moved every N pushes). With ``every=1``
and an outer SGD step of learning rate 1, a BSP run is model averaging after
every inner step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..client.shards import server_addresses
from ..client.worker import Worker
from ..errors import ConfigurationError
from .streaming import Fragments

__all__ = ["LocalSGD"]


class LocalSGD:
    """An inner ``torch.optim`` optimizer stepped locally, and every ``every`` steps a sync with
    the server, whose optimizer is the outer one (see the module docstring).

    Args:
        model: the model; its trainable float32 parameters are the weights the workers share
            (buffers, such as BatchNorm's statistics, stay local).
        inner: the inner optimizer over the model's parameters (any ``torch.optim`` optimizer,
            with any scheduler of the user's).
        every: inner steps between syncs (DiLoCo's H); with ``dynamic``, the fastest worker's.
        dynamic: dynamic local updates (Liu et al., 2024): after each sync the worker takes
            ``ceil(every * own rate / fastest rate)`` inner steps (at least 1) before the next,
            the rates being inner steps per second of the worker's own time (between syncs,
            which the worker times and the server keeps for every live worker:
            :meth:`aps.Worker.pace`), so that uneven workers sync at about the same wall-clock
            interval. Off by default: every worker takes ``every`` steps.
        compression: ``"int8"`` or ``"int4"`` push the pseudo-gradients block-quantized, with
            error feedback (what quantizing left out is added to the next; in ``state_dict``),
            4 and 8 times fewer bytes than float32; ``"bf16"``/``"fp16"`` as :class:`aps.Worker`
            takes them; None (default) float32. Over TCP only (shared memory moves no bytes).
        address: the server (default ``APS_ADDRESS``), as :class:`aps.Worker` takes it.
        rank: this worker's rank (default ``RANK``).
        num_workers: the number of workers (default ``WORLD_SIZE``).
        token: the server's token, if it has one (see :class:`aps.Worker`).
        transport: ``"auto"``, ``"shm"`` or ``"tcp"`` (see :class:`aps.Worker`).
        reconnect: get back to a lost server by itself (see :class:`aps.Worker`).
        worker: an existing :class:`aps.Worker` to use instead of connecting.
        init_timeout: seconds to wait for every worker to join.
        streaming: with ``address`` naming the K shards of a sharded model, sync one shard's
            fragment at a time (Streaming DiLoCo): each fragment every ``every`` steps, the
            K of them spread evenly over each period (:mod:`aps.torch.streaming`), so each
            sync moves 1/K of the bytes. Not with ``dynamic`` or ``worker``.
        clock: the worker's own time, in seconds, that dynamic local updates measure its step
            rate by (default ``time.monotonic``; a virtual clock in a simulation, or one that
            counts only the compute of a worker that shares its host).

    Joining takes the global weights (the first worker's, at the start of a run; the
    server's newest, for a worker that joins a run under way) into the model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer,
        *,
        every: int,
        address: str | None = None,
        rank: int | None = None,
        num_workers: int | None = None,
        token: str | None = None,
        transport: str = "auto",
        reconnect: bool = True,
        worker: Worker | None = None,
        init_timeout: float | None = 300.0,
        dynamic: bool = False,
        compression: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        streaming: bool = False,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigurationError(f"every must be a whole number of inner steps, at least 1, got {every!r}")
        self.model, self.inner, self.every, self.dynamic = model, inner, every, bool(dynamic)
        self._clock = clock
        #: Inner steps between the last sync and the next (``every``, or less under ``dynamic``).
        self.current_every = every
        #: Inner steps taken since the last sync.
        self.since_sync = 0
        self._params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self._params:
            raise ConfigurationError("the model has no trainable parameters")
        owned = {id(p) for group in inner.param_groups for p in group["params"]}
        for name, p in self._params.items():
            if p.dtype != torch.float32:
                raise ConfigurationError(f"parameter {name} is {p.dtype}: LocalSGD shares float32 weights")
            if id(p) not in owned:
                raise ConfigurationError(f"parameter {name} is not one the inner optimizer steps")
        if worker is not None and compression is not None:
            raise ConfigurationError("give compression to the Worker (LocalSGD(worker=...) uses it as it is)")
        #: Streaming: the fragments, one per shard (None: the whole model syncs at once).
        self.fragments: Fragments | None = None
        self.steps = 0
        self.syncs = 0
        self._busy, self._since = 0.0, clock()
        if streaming:
            self._stream(address, rank, num_workers, token, transport, reconnect, worker, init_timeout, compression)
            return
        if worker is None:
            worker = Worker(
                address, rank, num_workers, transport, token=token, reconnect=reconnect, compression=compression
            )
            self._own_worker = True
        else:
            self._own_worker = False
        self.worker = worker
        weights = self.worker.init(self._local(), timeout=init_timeout)
        if self.dynamic and not (self.worker.server_options or {}).get("pace"):
            self.close()
            raise ConfigurationError(
                "dynamic local updates need a server that keeps step rates (PACE; an older aps serve "
                "does not): upgrade it, or leave dynamic off"
            )
        #: Seconds of this worker's own time its inner steps took (between syncs), and since when
        #: the steps under way have run.
        self._busy, self._since = 0.0, clock()
        #: The global weights this worker last received: where its inner steps started from.
        self._anchor = {name: np.array(weights[name], np.float32) for name in self._params}
        self._load(self._anchor)

    def _stream(self, address, rank, num_workers, token, transport, reconnect, worker, init_timeout, compression):
        addresses = server_addresses(address)
        if len(addresses) < 2 or worker is not None or self.dynamic:
            raise ConfigurationError(
                "streaming syncs the fragments of a sharded model in turn: give the address of every "
                "shard (two or more), and no worker= or dynamic=True"
            )

        def connect(one: str, fragment: tuple[int | None, int]) -> Worker:
            return Worker(
                one,
                rank,
                num_workers,
                transport,
                token=token,
                reconnect=reconnect,
                compression=compression,
                _fragment=fragment,
            )

        self.fragments = Fragments(self._params, addresses, self.every, connect, init_timeout)
        self.worker = self.fragments.workers[0]
        self._own_worker = True
        self._anchor = self.fragments.layout.views(self.fragments.anchor)

    # The training loop's calls --------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The inner optimizer's step; the ``current_every``-th since the last sync also syncs (:meth:`sync`)."""
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.stepped()
        return loss

    def stepped(self) -> None:
        """Count an inner step taken by the inner optimizer itself (what :meth:`step` does after
        it: a trainer that steps the optimizer its own way, Lightning's AMP, calls this), and
        sync when it is due."""
        self.steps += 1
        self.since_sync += 1
        if self.fragments is not None:
            for index in self.fragments.step():
                self.fragments.sync(index)
                self.syncs += 1
                self.since_sync = 0
        elif self.since_sync >= self.current_every:
            self.sync()

    def sync(self) -> None:
        """Push the pseudo-gradient (the anchor minus the weights now) and take the server's
        new global weights into the model (the inner optimizer's state is kept); streaming,
        every fragment's in turn."""
        if self.fragments is not None:
            for index in range(len(self.fragments.workers)):
                self.fragments.sync(index)
                self.syncs += 1
            self.since_sync = 0
            return
        self._busy += self._clock() - self._since
        local = self._local()
        pseudo = {name: self._anchor[name] - local[name] for name in self._params}
        weights = self.worker.push_pull(pseudo)
        self._anchor = {name: np.array(weights[name], np.float32) for name in self._params}
        self._load(self._anchor)
        self.syncs += 1
        self.since_sync = 0
        if self.dynamic:
            self.current_every = self._paced()
        self._since = self._clock()

    def _paced(self) -> int:
        """The inner steps until the next sync under dynamic local updates: ``every`` times this
        worker's step rate over the fastest live worker's, rounded up (``every`` until the
        server has measured this worker's rate)."""
        own, fastest = self.worker.pace(self.steps, self._busy)
        if own is None or fastest is None:
            return self.every
        return max(1, min(self.every, math.ceil(self.every * min(1.0, own / fastest))))

    # Checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state, the step count and the anchor (the global weights
        the current inner steps started from)."""
        return {
            "inner": self.inner.state_dict(),
            "steps": self.steps,
            "syncs": self.syncs,
            "every": self.every,
            "since_sync": self.since_sync,
            "current_every": self.current_every,
            "anchor": {name: torch.from_numpy(value.copy()) for name, value in self._anchor.items()},
            "residual": None if (residual := self._residual()) is None else torch.from_numpy(residual),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a :meth:`state_dict`: the inner optimizer's state, the step count and the anchor."""
        anchor = state["anchor"]
        if set(anchor) != set(self._params):
            raise ConfigurationError("the state's anchor names other parameters than the model's")
        for name, value in anchor.items():
            if tuple(value.shape) != tuple(self._params[name].shape):
                raise ConfigurationError(f"the state's anchor of {name} has shape {tuple(value.shape)}")
        self.inner.load_state_dict(state["inner"])
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        # (a state saved before dynamic local updates: every worker synced every ``every`` steps)
        self.since_sync = int(state.get("since_sync", self.steps % int(state.get("every", self.every))))
        # This object's ``every`` holds; a dynamic run goes on with the number it had come to.
        saved = int(state.get("current_every", self.every))
        self.current_every = max(1, min(self.every, saved)) if self.dynamic else self.every
        residual = state.get("residual")
        residual = None if residual is None else residual.detach().cpu().numpy()
        if self.fragments is not None:
            for name, value in anchor.items():
                self._anchor[name][...] = value.detach().cpu().numpy()  # (views of the fragments' flat anchor)
            self.fragments.load_residual(residual)
            return
        self._anchor = {name: value.detach().cpu().numpy().astype(np.float32) for name, value in anchor.items()}
        self.worker.load_compression_residual(residual)

    def _residual(self) -> np.ndarray | None:
        if self.fragments is not None:
            return self.fragments.residual()
        return self.worker.compression_residual

    def close(self) -> None:
        """Leave the run (when this object made its worker)."""
        if self.fragments is not None:
            self.fragments.close()
        elif self._own_worker:
            self.worker.close()

    def __enter__(self) -> LocalSGD:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The model's weights, as numpy ---------------------------------------------
    def _local(self) -> dict[str, np.ndarray]:
        return {name: p.detach().cpu().numpy().astype(np.float32, copy=False) for name, p in self._params.items()}

    def _load(self, weights: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(torch.from_numpy(weights[name]).reshape(p.shape))
