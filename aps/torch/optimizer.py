"""The aps-backed ``torch.optim.Optimizer``: :class:`Optimizer` (see :mod:`aps.torch`).

It holds its parts: the server's optimizer as torch sees it (:class:`~aps.torch.groups.ServerOptimizer`:
the values each param group sends, the state in torch's format), the model's tensors over the
worker's flat buffers (:class:`~aps.torch.staging.FlatModel`), and the model's aps embeddings
(:class:`~aps.torch.embedding.TableRows`); it moves what they compute through its worker.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..client.steps import DEFAULT_RECONNECT_TIMEOUT
from ..client.worker import Worker
from ..errors import ConfigurationError
from .embedding import TableRows
from .groups import ServerOptimizer, split_groups, uncompiled
from .pacing import Pacer
from .staging import HALF, FlatModel

__all__ = ["Optimizer"]

#: The dtypes a trainable parameter may have; 16-bit ones train on float32 master weights.
_TRAINABLE = (torch.float32, torch.bfloat16, torch.float16)
_LR_SCALES = (None, "linear", "sqrt")

log = logging.getLogger("aps.torch")


def _loaded_hook(ref: weakref.ref[Optimizer]) -> Callable[[torch.nn.Module, Any], None]:
    """A ``load_state_dict`` post-hook for the model: its optimizer (held weakly: the model
    does not keep it alive) sends the loaded weights at its next step."""

    def hook(module: torch.nn.Module, incompatible_keys: Any) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._module_loaded = True

    return hook


def _places(
    places: tuple, address: str | None, rank: int | None, num_workers: int | None, lr: float | None
) -> tuple[str | None, int | None, int | None, float | None]:
    """What ``Optimizer(params, ...)`` was given in place: ``(address, rank, num_workers)`` as
    aps has always taken them, or torch.optim's learning rate alone (a number in second place:
    ``Optimizer(model.parameters(), 0.1, momentum=0.9)``), the address then coming from the
    ``address=`` keyword or ``APS_ADDRESS``."""
    if places and isinstance(places[0], (int, float)) and not isinstance(places[0], bool):
        if len(places) > 1:
            raise ConfigurationError(
                f"Optimizer(params, {', '.join(map(repr, places))}): after the learning rate, give momentum= and "
                "torch's other options by keyword (and the server as address= or $APS_ADDRESS)"
            )
        if lr is not None:
            raise ConfigurationError(f"the learning rate is given twice: {places[0]!r} in second place and lr={lr!r}")
        return address, rank, num_workers, float(places[0])
    if len(places) > 3:
        raise ConfigurationError(
            f"Optimizer(params, address, rank, num_workers) takes at most 3 of them in place, "
            f"got {len(places)}: give the others by keyword"
        )
    given = dict(zip(("address", "rank", "num_workers"), places))
    for name, value in (("address", address), ("rank", rank), ("num_workers", num_workers)):
        if name in given and value is not None:
            raise ConfigurationError(f"{name} is given twice: in place and as {name}=")
    return (given.get("address", address), given.get("rank", rank), given.get("num_workers", num_workers), lr)


def _check_alone(worker: Worker) -> None:
    """Neither RANK nor WORLD_SIZE set and none given: a single process is rank 0 of 1,
    provided the server expects one worker (else the server would wait for others forever)."""
    options = worker.server_options or {}
    expected, low = options.get("workers"), options.get("min_workers")
    if low is not None and expected is not None and low < expected:
        log.info(
            "neither RANK nor WORLD_SIZE is set: the elastic server (--workers %d:%d) assigns this process a rank",
            low,
            expected,
        )
        return
    if expected is not None and expected != 1:
        raise ConfigurationError(
            f"neither RANK nor WORLD_SIZE is set and no rank= or num_workers= given, and the server at "
            f"{worker.address} expects {expected} workers: give each process its rank (torchrun and aps launch set "
            "RANK and WORLD_SIZE), or run the server with --workers 1"
        )
    log.info("neither RANK nor WORLD_SIZE is set: this process is rank 0 of 1")


class Optimizer(torch.optim.Optimizer):
    """Train a model with an aps server: a ``torch.optim.Optimizer`` whose step the server takes.

    Args:
        params: what ``torch.optim`` takes: an ``nn.Module`` (its parameters,
            named), an iterable of parameters or of ``(name, parameter)``, or a
            list of param group dicts (``{"params": ..., "lr": ..., ...}``).
            Trainable parameters must be float32, bfloat16 or float16, on one device.
        address: the server (``tcp://HOST:PORT``); default ``APS_ADDRESS``. A number
            in this place is the learning rate instead, as ``torch.optim`` takes it:
            ``Optimizer(model.parameters(), 0.1, momentum=0.9)`` is
            ``torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)`` on the server at
            ``APS_ADDRESS`` (or ``address=``).
        rank: this worker's rank; default ``RANK``.
        num_workers: the number of workers; default ``WORLD_SIZE``. With neither given
            nor set (a single process run by hand), rank 0 of 1, provided the server
            expects one worker.
        model: the model, to name parameters given without names (checkpoints
            name tensors by ``model.named_parameters()``).
        lr: this worker's learning rate for the groups that do not set their
            own; default: the server's (``--lr``).
        weight_decay: likewise, the weight decay (``--weight-decay``).
        momentum: likewise, SGD's momentum (``--momentum``). A momentum above 0 on
            a server started without ``--momentum`` is fine: the server makes its
            momentum buffers when a worker first asks for momentum.
        dampening: likewise, SGD's dampening.
        betas: likewise, Adam's coefficients (``--betas``).
        transport: ``"auto"``, ``"shm"`` or ``"tcp"`` (see :class:`aps.Worker`).
        init_timeout: seconds to wait for every worker to join.
        worker: an existing :class:`aps.Worker` to use instead of connecting.
        staging: stage through host buffers even on the CPU (the GPU code
            path; meant for tests). Default: only for models not on the CPU.
        pacer: iteration pacing; default: what ``aps launch`` asked for.
        token: the server's token, if it has one (default ``$APS_TOKEN``, else the
            token file a loopback server of this user wrote).
        reconnect: get back to a lost server by itself and go on (see
            :class:`aps.Worker`); ``reconnect=False`` raises at once.
        reconnect_timeout: seconds to keep trying (see :class:`aps.Worker`).
        compression: send gradients over TCP as ``"bf16"`` or ``"fp16"`` (see
            :class:`aps.Worker`).
        compress_pulls: with ``compression``, receive the weights as 16-bit
            values too (see :class:`aps.Worker`).
        scale_lr: on an elastic server (``--workers MIN:MAX``), follow the live
            workers ``P`` with the learning rate: ``"linear"`` applies ``lr * P / MIN``,
            ``"sqrt"`` ``lr * sqrt(P / MIN)`` (the groups' ``lr`` is for MIN workers and
            stays as given; :attr:`lr_scale` is the factor of the last step); None
            (default) keeps it. A fixed-size server's factor is always 1.

    ``param_groups`` and ``defaults`` are torch's, with the keys of the
    server's optimizer (SGD: ``lr``, ``momentum``, ``dampening``,
    ``weight_decay``, ``nesterov``; Adam and AdamW: ``lr``, ``betas``,
    ``eps``, ``weight_decay``), so every ``torch.optim.lr_scheduler``
    scheduler works unchanged: each ``step()`` that finds a group's values
    changed sends them first (one more round trip, only then), and the
    server applies this worker's gradients with them, range by range, still
    times the staleness-aware scale where the server uses one. ``nesterov``,
    ``eps`` (``amsgrad`` and ``maximize`` off) are the server's and cannot
    change. The flat model is laid out group by group, so each group is one
    range of it.

    Parameters may be bfloat16 or float16: the server keeps float32 master
    weights and optimizer state, the worker pushes the 16-bit gradients
    (widened exactly; over TCP they travel as 16 bits, and the weights come
    back rounded to the model's dtype) and copies the new weights into the
    model rounded to nearest even, as ``tensor.to(dtype)`` rounds. With
    ``torch.amp.GradScaler``, ``scaler.step(opt)`` hands this optimizer the
    scale and whether a gradient overflowed: an overflowing step pushes
    nothing and counts in :attr:`skipped_steps`; otherwise the gradients are
    unscaled as GradScaler would and pushed.

    The first worker to join provides the initial weights (its model's);
    every worker's model then holds the server's weights.

    Resuming as training scripts do (build the model and this optimizer, then
    ``model.load_state_dict(checkpoint[...])`` and ``load_state_dict(...)``)
    works as with ``torch.optim``: weights loaded into the model before the
    first ``step()`` become the server's at that step (or at
    :meth:`load_state_dict`, whichever comes first), provided the server has
    applied no update yet. Every rank may load the same checkpoint (the server
    takes it once); other weights on another rank, or a load once updates were
    applied, raise :class:`aps.WeightsRefused` saying how to do it instead of
    training on from other weights. A load into a module this optimizer knows
    (``params`` was the model, or ``model=`` was given) after the first step is
    sent at the next one, and refused the same way.
    """

    #: torch.amp.GradScaler gives step() its scale and found-inf flag (``grad_scale``,
    #: ``found_inf``) instead of unscaling first and not calling step() on overflow, so
    #: that a skipped step is counted here.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Any,
        *places: Any,
        address: str | None = None,
        rank: int | None = None,
        num_workers: int | None = None,
        model: torch.nn.Module | None = None,
        lr: float | None = None,
        weight_decay: float | None = None,
        momentum: float | None = None,
        dampening: float | None = None,
        betas: tuple[float, float] | None = None,
        transport: str = "auto",
        init_timeout: float | None = 300.0,
        worker: Worker | None = None,
        staging: bool | None = None,
        pacer: Pacer | None = None,
        token: str | None = None,
        reconnect: bool = True,
        reconnect_timeout: float | None = DEFAULT_RECONNECT_TIMEOUT,
        compression: str | None = None,
        compress_pulls: bool = False,
        scale_lr: str | None = None,
    ) -> None:
        address, rank, num_workers, lr = _places(places, address, rank, num_workers, lr)
        if scale_lr not in _LR_SCALES:
            raise ConfigurationError(f"scale_lr is 'linear', 'sqrt' or None, not {scale_lr!r}")
        self.scale_lr = scale_lr
        #: The factor the learning rates were sent with at the last step (see ``scale_lr``).
        self.lr_scale = 1.0
        if model is None and isinstance(params, torch.nn.Module):
            model = params
        groups = split_groups(params)
        self._building = True
        # The model's trainable parameters, group by group: the flat layout's order.
        model_names = {id(p): n for n, p in uncompiled(model).named_parameters()} if model is not None else {}
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self._frozen: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        taken: set[str] = set()
        for group in groups:
            names = group.get("param_names") or [model_names.get(id(p)) for p in group["params"]]
            for name, param in zip(names, group["params"]):
                if id(param) in seen:
                    raise ConfigurationError(f"a parameter ({name or 'unnamed'}) appears twice in the param groups")
                seen.add(id(param))
                name = name or f"param{len(seen) - 1}"
                if name in taken:
                    raise ConfigurationError(
                        f"two parameters are named {name!r}: the server's model names every parameter once "
                        "(name them by the whole model: model.named_parameters())"
                    )
                taken.add(name)
                if param.requires_grad:
                    self.names.append(name)
                    self.params.append(param)
                else:
                    self._frozen.append((name, param))
        if not self.params:
            raise ConfigurationError("the model has no trainable parameters")
        wrong = [f"{n} ({p.dtype})" for n, p in zip(self.names, self.params) if p.dtype not in _TRAINABLE]
        if wrong:
            raise ConfigurationError(
                f"aps trains float32, bfloat16 and float16 parameters; these are not: {', '.join(wrong[:5])}"
                + (" ..." if len(wrong) > 5 else "")
                + " (convert the model with .float(), or freeze them with requires_grad_(False))"
            )
        dtypes = {p.dtype for p in self.params}
        if (
            compression is None
            and not os.environ.get("APS_COMPRESSION")
            and len(dtypes) == 1
            and (dtype := dtypes.pop()) in HALF
        ):
            # A 16-bit model sends its gradients as they are (exactly) and takes its weights
            # rounded by the server, as it would round them itself: half the bytes on TCP.
            compression, compress_pulls = HALF[dtype], True
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ConfigurationError(f"the parameters are on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        if torch_threads := os.environ.get("APS_TORCH_THREADS"):
            torch.set_num_threads(int(torch_threads))
        self.staging = (self.device.type != "cpu") if staging is None else bool(staging)
        if not self.staging and self.device.type != "cpu":
            raise ConfigurationError(f"staging=False needs a model on the CPU, not on {self.device}")
        if worker is not None and worker.zero_copy:
            # torch cannot mark a tensor read-only: a write into a parameter that is a view of
            # the server's slot would end the process, not raise. The parameters keep their own
            # storage and each pull copies into it (one memcpy: see docs/design/wire.md, "Shared memory").
            raise ConfigurationError(
                "aps.torch.Optimizer copies the weights into the model's parameters: give it "
                "a worker made without zero_copy"
            )
        self._flat: FlatModel | None = None
        own_worker = worker is None
        alone = (
            worker is None
            and rank is None
            and num_workers is None
            and "RANK" not in os.environ
            and "WORLD_SIZE" not in os.environ
        )
        self.worker = worker or Worker(
            address,
            rank,
            num_workers,
            transport=transport,
            token=token,
            reconnect=reconnect,
            reconnect_timeout=reconnect_timeout,
            compression=compression,
            compress_pulls=compress_pulls,
        )
        try:
            if alone:
                _check_alone(self.worker)
            self._server = ServerOptimizer(self.worker.server_options)
            #: The server's optimizer: "sgd", "adam" or "adamw".
            self.server_optimizer: str = self._server.name
            defaults = self._server.with_values(
                lr=lr, weight_decay=weight_decay, momentum=momentum, dampening=dampening, betas=betas
            )
            super().__init__(groups, defaults)
            with torch.no_grad():
                initial = {
                    n: p.detach().to("cpu", torch.float32).contiguous().numpy() for n, p in zip(self.names, self.params)
                }
            self._rows = TableRows(uncompiled(model) if model is not None else None, self.worker, self.device)
            self.worker.init(initial, timeout=init_timeout, tables=self._rows.specs)
            self._stops = self._group_stops()
            # A worker of our own starts with the server's values; another may have set some.
            self._sent: list[tuple[float, ...]] | None = (
                [self._server.server_values] * len(self.param_groups) if own_worker else None
            )
            self._send_hyperparameters()
            self._building = False
            self._flat = FlatModel(self.worker, self.params, self.device, self.staging)
            # What the server holds before the first step: a model whose weights differ at that
            # step (a checkpoint loaded into it) sends them (see _send_loaded_weights). Kept
            # until the first step only.
            self._initial_weights: np.ndarray | None = self._flat.weights().copy()
            self._module_loaded = False
            self._load_hook = (
                uncompiled(model).register_load_state_dict_post_hook(_loaded_hook(weakref.ref(self)))
                if model is not None
                else None
            )
            #: Steps skipped because ``torch.amp.GradScaler`` found inf/NaN gradients (nothing was pushed).
            self.skipped_steps = 0
            self.pacer = pacer if pacer is not None else Pacer.from_env(self.worker.rank)
        except BaseException:
            if self._flat is not None:
                self._flat.close()
            if own_worker:
                self.worker.close()
            raise

    def _send_loaded_weights(self, *, stepping: bool = True) -> None:
        """Before the first step (and after a load into a known module): when the model's
        weights are no longer what the server holds, make them the server's (it refuses
        once it has applied an update, or when another rank loaded other weights).
        ``stepping``: a step follows (nothing is compared after it)."""
        # Compared only while the worker holds version 0: a pull of a newer version (code may
        # pull before its first step) wrote the server's weights into the model, which then
        # differ from the initial ones without being loaded (and the server would refuse any
        # other weights by now anyway).
        initial = self._initial_weights
        compare = initial is not None and self.worker.version == 0
        if not compare and not self._module_loaded:
            self._initial_weights = None if stepping else initial
            return
        current = self._model.weights()
        sent = self._module_loaded or initial is None or not np.array_equal(current, initial)
        if sent:
            loaded = self.worker.load_weights(current)
            log.info(
                "rank %d: %s",
                self.worker.rank,
                "the model's loaded weights are the server's now"
                if loaded
                else "the server holds the same weights already (another rank loaded them)",
            )
        self._module_loaded = False
        if stepping:
            self._initial_weights = None
        elif sent:
            self._initial_weights = current.copy()  # what the server holds now

    @property
    def _model(self) -> FlatModel:
        """The model's tensors over the worker's buffers (made once the worker has joined)."""
        if self._flat is None:
            raise ConfigurationError("the optimizer is not made yet")
        return self._flat

    def _group_stops(self) -> list[int]:
        """Where each param group's range of the flat vector ends (the layout is group by group)."""
        layout = self.worker.layout
        sizes = dict(zip(map(id, self.params), layout.sizes if layout is not None else ()))
        stops, stop = [], 0
        for group in self.param_groups:
            stop += sum(sizes.get(id(p), 0) for p in group["params"])
            stops.append(stop)
        return stops

    # The optimizer interface ------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once the optimizer is made: the server's model is laid out at init and
        cannot grow. Put every parameter in a group from the start (frozen ones too: a
        group's values can change at any step, an ``lr`` of 0 keeps it still)."""
        if not getattr(self, "_building", False):
            raise ConfigurationError(
                "aps.torch.Optimizer cannot add a param group after it is made: the server laid out the model "
                "at init. Give every group to the constructor (an lr of 0 keeps a group still until you raise it)"
            )
        super().add_param_group(param_group)

    def prefetch(self, ids: Mapping[str, Any]) -> None:
        """Pull the rows of ``ids`` (``{table: ids}``) of every table at once, in one request:
        the next forwards of the model's aps embeddings take them from here instead of each
        asking the server (a forward whose ids are not all here asks for its own). Kept until
        the next step, which pushes and so changes rows (``step(prefetch=...)`` pulls the
        next batch's rows in the step's own request)."""
        self._rows.prefetch(ids)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place. ``set_to_none`` is accepted and not followed: the
        gradients stay views into the worker's buffer (a parameter with no gradient at a
        ``step()`` is pushed a zero gradient either way). The rows the model's aps
        embeddings used since the last step are forgotten (their gradients too)."""
        self._rows.forget()
        self._model.zero_grad()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, prefetch: Mapping[str, Any] | None = None) -> Any:
        """Push this iteration's gradients, wait for the gate, load the new weights.

        The model's aps embeddings (:class:`aps.torch.Embedding`, :class:`EmbeddingBag`)
        push the gradient rows of their forwards since the last step in the same request;
        ``prefetch`` (``{table: ids}``, the next batch's) pulls those rows in it too, for the
        next forwards to use (see :meth:`prefetch`).

        When a param group's values (``lr``, ``weight_decay``, ``momentum``,
        ``dampening``, ``betas``) changed since the last step (a scheduler, or
        code), they are sent first: the server applies this gradient with them.
        Returns what ``closure`` returns, if given (it is called first, with
        gradients enabled, as ``torch.optim`` does).

        Raises:
            InvalidHyperparameters: the server refused a group's values (the
                message names the group); nothing was pushed.
            ConfigurationError: a value the server cannot take per group was
                changed (``nesterov``, ``eps``), or a parameter frozen when the
                optimizer was made now has a gradient.
        """
        loss = None
        flat = self._model
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._send_loaded_weights()
            found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
            if found_inf is not None and self._rows.tables:
                raise ConfigurationError(
                    "torch.amp.GradScaler does not see the rows of aps embeddings (they are not in the param "
                    "groups): their gradients would be pushed scaled and unchecked. Train a model with aps "
                    "embeddings without a loss scale (bfloat16 autocast needs none)"
                )
            if found_inf is not None and float(found_inf) > 0:  # torch.amp.GradScaler found inf/NaN: skip
                self._rows.forget()
                self.skipped_steps += 1
                log.debug("rank %d: step skipped (inf/NaN gradients at scale %s)", self.worker.rank, grad_scale)
                return loss
            self._send_hyperparameters()
            if grad_scale is not None:  # GradScaler's scale, not yet taken out: unscale as it would
                flat.unscale(grad_scale)
            if self.pacer is not None:
                self.pacer.wait()
            flat.adopt_stray_grads()
            flat.gather_grads()
            # the dense gradient, the batch's rows and the next batch's: one round trip (the weights
            # land in the views' storage)
            self._rows.push_pull(flat.push_buffer, prefetch)
            flat.load_weights()
        except BaseException:
            # GradScaler removes the attributes it set only when step() returns: left here, its
            # next step() would multiply its scale by this one (the gradients unscaled twice).
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        if self.pacer is not None:
            self.pacer.restart()
        return loss

    # State ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state in torch's format, fetched from the server.

        ``state`` holds, per parameter index (over ``param_groups``, frozen
        parameters included), what ``torch.optim`` keeps: SGD's
        ``momentum_buffer`` (once a step was taken, with momentum), Adam's
        ``step``, ``exp_avg`` and ``exp_avg_sq`` (float32: the server's master
        state, also for 16-bit parameters); ``param_groups`` are this worker's
        groups. ``aps`` adds the server's ``optimizer``, ``steps`` and the
        weights ``version`` the state belongs to. Saved with the model's
        weights taken at the same step (the model holds the version of its last
        ``step()``: under BSP the same version; under asynchronous paradigms the
        server's state may be newer), it restarts a run with
        :meth:`load_state_dict`.
        """
        server = self.worker.optimizer_state()
        self.state.update(self._server.torch_state(server, self.params, self._model.layout))
        try:
            packed = super().state_dict()
        finally:
            self.state.clear()
        packed["aps"] = {
            "optimizer": server["optimizer"],
            "steps": int(server["steps"]),
            "version": int(server["version"]),
        }
        return packed

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (or from a ``torch.optim`` optimizer of the
        server's kind with the same groups): the groups' values here, the optimizer state
        into the server, which takes it only before its first update (a run that has not
        started; every rank may load the same state, the server takes it once).

        Weights loaded into the model before (``model.load_state_dict``, as scripts
        resume) are made the server's first, as :meth:`step` would.

        Raises:
            ValueError: the groups differ in number or size (as torch says).
            ConfigurationError: the state is another optimizer's, or Adam's parameters
                have different step counts (the server keeps one for the model).
            aps.errors.InvalidState: the server refused it (it has applied updates
                already, or a value is not finite).
            aps.errors.WeightsRefused: the server refused the model's loaded weights
                (see the class docstring); then nothing was loaded.

        Whatever it raises, the groups keep their values.
        """
        self._send_loaded_weights(stepping=False)
        final: dict[str, Any] = {}

        def capture(_: Any, processed: dict[str, Any]) -> None:
            # registered last: sees the dict torch loads, after the user's pre-hooks
            final.update(processed)

        before = self.param_groups
        handle = self.register_load_state_dict_pre_hook(capture)
        try:
            # torch takes a dict: checks the groups, sets their values (the next step sends them)
            super().load_state_dict(dict(state_dict))
            self.state.clear()  # the state lives on the server, in float32, whatever the parameters' dtype
            described = final.get("aps", state_dict.get("aps")) or {}
            server_state = self._server.server_state(final, described, before, self.params, self._model.layout)
            self._server.group_values(self.param_groups)  # the loaded groups are the server optimizer's
            if server_state is not None:
                self.worker.load_optimizer_state(server_state)
        except BaseException:
            self.param_groups = before  # nothing changed
            self.state.clear()
            raise
        finally:
            handle.remove()

    # Introspection ------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Version of the weights the model holds."""
        return self.worker.version

    @property
    def clock(self) -> int:
        """How many gradients this worker has pushed."""
        return self.worker.clock

    def close(self) -> None:
        """Leave the training and disconnect."""
        hook, self._load_hook = getattr(self, "_load_hook", None), None
        if hook is not None:
            hook.remove()
        if self._flat is not None:
            self._flat.close()
        self.worker.close()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"aps.torch.{super().__repr__()}"

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim's pickles param_groups and state only: a copy would have no connection and
        # no flat buffers, and would fail at its first step.
        raise TypeError(
            "an aps.torch.Optimizer holds a connection to its server and cannot be pickled or "
            "copied: save its state_dict() (and make a new Optimizer to load it into)"
        )

    # The groups' values ------------------------------------------------------------
    def _send_hyperparameters(self) -> None:
        """Send the groups' values if they changed since they were last sent."""
        for name, param in self._frozen:
            if param.grad is not None:
                raise ConfigurationError(
                    f"parameter {name} was frozen (requires_grad=False) when the optimizer was made and now has a "
                    "gradient: the server's model was laid out at init without it. Make the optimizer after "
                    "unfreezing (an lr of 0 keeps a group still until you raise it)"
                )
        values = self._server.group_values(self.param_groups)
        scale = self._lr_factor()
        if scale != 1.0:
            values = [(lr * scale, *rest) for lr, *rest in values]
        self.lr_scale = scale
        if values == self._sent:
            return
        groups, start = [], 0
        for stop, (lr, weight_decay, momentum, dampening) in zip(self._stops, values):
            if stop > start:  # a group of frozen parameters only has no range
                groups.append(
                    {"stop": stop, "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "dampening": dampening}
                )
            start = stop
        self.worker.set_hyperparameters(groups)
        self._sent = values

    def _lr_factor(self) -> float:
        """``scale_lr``'s factor for the workers live now (1 on a fixed-size server)."""
        span, live = self.worker.workers_range, self.worker.num_workers
        if self.scale_lr is None or not self.worker.elastic or span is None or live is None:
            return 1.0
        ratio = live / span[0]
        return ratio if self.scale_lr == "linear" else math.sqrt(ratio)
