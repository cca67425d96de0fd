"""PyTorch integration: an aps-backed drop-in for the optimizer of a standard loop.

::

    model = Net()
    opt = aps.torch.Optimizer(model, "tcp://ps-host:7450", rank=0, num_workers=4)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()  # push the gradients, wait for the gate, load the new weights

The server applies the update (its ``--optimizer``) with the values of this
worker's param groups, which any ``torch.optim.lr_scheduler`` may change:
this object is a ``torch.optim.Optimizer`` that moves gradients, weights and,
when they change, the groups' values. On the CPU, the model's parameters and their
``.grad`` become views into the worker's flat buffers (the gradient buffer is
shared memory when the server shares the host), so ``backward()`` writes the
gradients where the push reads them and a pull writes the new weights straight
into the model: ``step()`` copies nothing it does not have to. A model on a
GPU keeps its tensors there; ``step()`` then stages through the worker's host
buffers (pinned memory): one device-to-host copy of the gradients and one
host-to-device copy of the weights per step.

Only trainable parameters go through the server, laid out group by group;
they may be float32, bfloat16 or float16 (16-bit ones train on float32 master
weights kept by the server).
Buffers (BatchNorm running statistics and the like) stay local to each worker.
Embedding tables too large for a worker live on the server: :class:`Embedding` and
:class:`EmbeddingBag` (aps/torch/embedding.py) take the place of torch's sparse
embeddings, and ``step()`` pushes their rows' gradient with the dense one.

Address, rank and worker count default to ``APS_ADDRESS``, ``RANK`` and
``WORLD_SIZE`` (what ``torchrun`` and ``aps launch`` set). Under ``aps
launch --step-time T --slowdown ...``, ``step()`` also pads each iteration to
this worker's multiple of ``T`` to emulate GPUs of different speeds: the
padding is sleep, not work.
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

from ..errors import ConfigurationError
from ..client.steps import DEFAULT_RECONNECT_TIMEOUT
from ..client.channel import run
from ..client.worker import Worker
from .embedding import Embedding, EmbeddingBag, bind_tables, distinct_ids
from .pacing import Pacer
from .sampler import ElasticSampler

__all__ = ["ElasticSampler", "Embedding", "EmbeddingBag", "Optimizer", "Pacer"]

#: The dtypes a trainable parameter may have; 16-bit ones train on float32 master weights.
_TRAINABLE = (torch.float32, torch.bfloat16, torch.float16)
_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}

log = logging.getLogger("aps.torch")


def _pin(*tensors: torch.Tensor) -> list[int]:
    """Page-lock host buffers so copies to and from the GPU run at full speed
    (best effort). Returns the addresses pinned, for :func:`_unpin`."""
    cudart = torch.cuda.cudart()
    pinned = []
    for tensor in tensors:
        status = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        if int(status) == 0:
            pinned.append(tensor.data_ptr())
        else:
            log.warning("could not pin a %d-byte host buffer (CUDA error %s): copies will be slower",
                        tensor.numel() * tensor.element_size(), int(status))
    return pinned


def _unpin(addresses: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for address in addresses:
        cudart.cudaHostUnregister(address)


def _loaded_hook(ref: weakref.ref) -> Callable:
    """A ``load_state_dict`` post-hook for the model: its optimizer (held weakly: the model
    does not keep it alive) sends the loaded weights at its next step."""

    def hook(module: torch.nn.Module, incompatible_keys: Any) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._module_loaded = True

    return hook


#: What each server optimizer takes from a param group: the four HYPER values, in order.
_SENT = {
    "sgd": lambda group: (group["lr"], group["weight_decay"], group["momentum"], group["dampening"]),
    "adam": lambda group: (group["lr"], group["weight_decay"], *group["betas"]),
}
_SENT["adamw"] = _SENT["adam"]
_KEYS = {"sgd": ("lr", "weight_decay", "momentum", "dampening"), "adam": ("lr", "weight_decay", "betas")}


def _server_defaults(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """torch.optim's ``defaults`` for the server's optimizer, from its options."""
    if options is None or options.get("optimizer") not in _SENT:
        raise ConfigurationError("the server did not say which optimizer it runs (an older aps?): "
                                 "aps.torch.Optimizer needs it for its param groups")
    common = {"lr": float(options["lr"]), "weight_decay": float(options["weight_decay"])}
    if options["optimizer"] == "sgd":
        return {**common, "momentum": float(options["momentum"]), "dampening": 0.0,
                "nesterov": bool(options["nesterov"]), "maximize": False}
    beta1, beta2 = options["betas"]
    return {**common, "betas": (float(beta1), float(beta2)), "eps": float(options["eps"]),
            "amsgrad": False, "maximize": False}


def _places(places: tuple, address: str | None, rank: int | None, num_workers: int | None,
            lr: float | None) -> tuple[str | None, int | None, int | None, float | None]:
    """What ``Optimizer(params, ...)`` was given in place: ``(address, rank, num_workers)`` as
    aps has always taken them, or torch.optim's learning rate alone (a number in second place:
    ``Optimizer(model.parameters(), 0.1, momentum=0.9)``), the address then coming from the
    ``address=`` keyword or ``APS_ADDRESS``."""
    if places and isinstance(places[0], (int, float)) and not isinstance(places[0], bool):
        if len(places) > 1:
            raise ConfigurationError(
                f"Optimizer(params, {', '.join(map(repr, places))}): after the learning rate, give momentum= and "
                "torch's other options by keyword (and the server as address= or $APS_ADDRESS)")
        if lr is not None:
            raise ConfigurationError(f"the learning rate is given twice: {places[0]!r} in second place and lr={lr!r}")
        return address, rank, num_workers, float(places[0])
    if len(places) > 3:
        raise ConfigurationError(f"Optimizer(params, address, rank, num_workers) takes at most 3 of them in place, "
                                 f"got {len(places)}: give the others by keyword")
    given = dict(zip(("address", "rank", "num_workers"), places))
    for name, value in (("address", address), ("rank", rank), ("num_workers", num_workers)):
        if name in given and value is not None:
            raise ConfigurationError(f"{name} is given twice: in place and as {name}=")
    return (given.get("address", address), given.get("rank", rank), given.get("num_workers", num_workers), lr)


_LR_SCALES = (None, "linear", "sqrt")


def _check_alone(worker: Worker) -> None:
    """Neither RANK nor WORLD_SIZE set and none given: a single process is rank 0 of 1,
    provided the server expects one worker (else the server would wait for others forever)."""
    options = worker.server_options or {}
    expected, low = options.get("workers"), options.get("min_workers")
    if low is not None and expected is not None and low < expected:
        log.info("neither RANK nor WORLD_SIZE is set: the elastic server (--workers %d:%d) assigns this process a "
                 "rank", low, expected)
        return
    if expected is not None and expected != 1:
        raise ConfigurationError(
            f"neither RANK nor WORLD_SIZE is set and no rank= or num_workers= given, and the server at "
            f"{worker.address} expects {expected} workers: give each process its rank (torchrun and aps launch set "
            "RANK and WORLD_SIZE), or run the server with --workers 1")
    log.info("neither RANK nor WORLD_SIZE is set: this process is rank 0 of 1")


def _uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (its parameters are the same; their names lack the
    wrapper's ``_orig_mod.`` prefix), or ``model`` itself."""
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, torch.nn.Module) else model


def _split_groups(params: Any) -> list[dict[str, Any]]:
    """torch.optim's forms of ``params`` as group dicts (copies), each with a list of
    tensors under ``params`` and, when the tensors came named, ``param_names``."""
    if isinstance(params, torch.nn.Module):
        params = _uncompiled(params).named_parameters()
    if isinstance(params, (set, frozenset)):
        raise ConfigurationError("parameters must come in an ordered collection (a list), not a set: "
                                 "the flat layout follows their order")
    if isinstance(params, torch.Tensor):
        raise ConfigurationError("params must be an nn.Module, an iterable of tensors or of (name, tensor), "
                                 "or a list of param group dicts, not one tensor")
    groups = list(params)
    if not groups:
        raise ConfigurationError("the optimizer got an empty parameter list")
    if not isinstance(groups[0], Mapping):
        groups = [{"params": groups}]
    parsed = []
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ConfigurationError(f"param group {index} must be a dict with 'params'")
        group = dict(group)
        members = group["params"]
        if isinstance(members, torch.Tensor):
            members = [members]
        elif isinstance(members, (set, frozenset)):
            raise ConfigurationError(f"param group {index}: parameters must come in an ordered collection "
                                     "(a list), not a set: the flat layout follows their order")
        members = list(members)
        named = [isinstance(m, tuple) for m in members]
        if any(named) and not all(named):
            raise ConfigurationError(f"param group {index}: give every parameter with its name or none")
        if members and all(named):
            group["param_names"] = [str(name) for name, _ in members]
            members = [tensor for _, tensor in members]
        for member in members:
            if not isinstance(member, torch.Tensor):
                raise ConfigurationError(f"param group {index}: parameters must be tensors, "
                                         f"not {type(member).__name__}")
            if not member.is_leaf:
                raise ConfigurationError(f"param group {index}: a parameter is not a leaf tensor "
                                         "(it was computed from others): it cannot be optimized")
        group["params"] = members
        parsed.append(group)
    return parsed


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
        groups = _split_groups(params)
        self._building = True
        # The model's trainable parameters, group by group: the flat layout's order.
        model_names = {id(p): n for n, p in _uncompiled(model).named_parameters()} if model is not None else {}
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
                        "(name them by the whole model: model.named_parameters())")
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
        if compression is None and not os.environ.get("APS_COMPRESSION") and len(dtypes) == 1 \
                and (dtype := dtypes.pop()) in _HALF:
            # A 16-bit model sends its gradients as they are (exactly) and takes its weights
            # rounded by the server, as it would round them itself: half the bytes on TCP.
            compression, compress_pulls = _HALF[dtype], True
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
            # storage and each pull copies into it (one memcpy: see docs/design.md).
            raise ConfigurationError("aps.torch.Optimizer copies the weights into the model's parameters: give it "
                                     "a worker made without zero_copy")
        self._pinned: list[int] = []
        own_worker = worker is None
        alone = worker is None and rank is None and num_workers is None and \
            "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
        self.worker = worker or Worker(address, rank, num_workers, transport=transport, token=token,
                                       reconnect=reconnect, reconnect_timeout=reconnect_timeout,
                                       compression=compression, compress_pulls=compress_pulls)
        try:
            if alone:
                _check_alone(self.worker)
            server = _server_defaults(self.worker.server_options)
            #: The server's optimizer: "sgd", "adam" or "adamw".
            self.server_optimizer: str = self.worker.server_options["optimizer"]
            self._kind = "sgd" if "momentum" in server else "adam"
            self._value_keys = _KEYS[self._kind]
            defaults = dict(server)
            for key, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum),
                               ("dampening", dampening), ("betas", betas)):
                if value is None:
                    continue
                if key not in defaults:
                    raise ConfigurationError(f"{key} is not an option of the server's optimizer "
                                             f"({self.server_optimizer})")
                defaults[key] = tuple(float(b) for b in value) if key == "betas" else float(value)
            super().__init__(groups, defaults)
            self._server_values = _SENT[self._kind](server)
            with torch.no_grad():
                initial = {n: p.detach().to("cpu", torch.float32).contiguous().numpy()
                           for n, p in zip(self.names, self.params)}
            self._tables = bind_tables(_uncompiled(model) if model is not None else None, self)
            #: Rows pulled ahead (prefetch, or the last step's pull_rows), by table: (sorted ids, rows).
            self._prefetched: dict[str, tuple[np.ndarray, np.ndarray]] = {}
            self.worker.init(initial, timeout=init_timeout,
                             tables={name: module.spec for name, module in self._tables.items()} or None)
            self._stops = self._group_stops()
            # A worker of our own starts with the server's values; another may have set some.
            self._sent: list[tuple[float, ...]] | None = (
                [self._server_values] * len(self.param_groups) if own_worker else None)
            self._send_hyperparameters()
            self._building = False
            self._attach()
            # What the server holds before the first step: a model whose weights differ at that
            # step (a checkpoint loaded into it) sends them (see _send_loaded_weights). Kept
            # until the first step only.
            self._initial_weights: np.ndarray | None = self._model_weights().copy()
            self._module_loaded = False
            self._load_hook = (_uncompiled(model).register_load_state_dict_post_hook(_loaded_hook(weakref.ref(self)))
                               if model is not None else None)
            #: Steps skipped because ``torch.amp.GradScaler`` found inf/NaN gradients (nothing was pushed).
            self.skipped_steps = 0
            self.pacer = pacer if pacer is not None else Pacer.from_env(self.worker.rank)
        except BaseException:
            if self._pinned:
                _unpin(self._pinned)
                self._pinned = []
            if own_worker:
                self.worker.close()
            raise

    def _model_weights(self) -> np.ndarray:
        """The model's trainable parameters now, as one flat float32 vector in the layout's
        order: the worker's weight buffer itself when every parameter is a float32 view of it."""
        if not self._staged and self._push_buffer is self.worker.grads:
            return self.worker.flat_weights
        flat = np.empty(self.worker.layout.numel, np.float32)
        for view, param in zip(self._views(torch.from_numpy(flat)), self.params):
            view.copy_(param.detach())  # widened exactly, from any device
        return flat

    def _send_loaded_weights(self, *, stepping: bool = True) -> None:
        """Before the first step (and after a load into a known module): when the model's
        weights are no longer what the server holds, make them the server's (it refuses
        once it has applied an update, or when another rank loaded other weights).
        ``stepping``: a step follows (nothing is compared after it)."""
        # Compared only while the worker holds version 0: a pull of a newer version (code may
        # pull before its first step) wrote the server's weights into the model, which then
        # differ from the initial ones without being loaded (and the server would refuse any
        # other weights by now anyway).
        compare = self._initial_weights is not None and self.worker.version == 0
        if not compare and not self._module_loaded:
            self._initial_weights = None if stepping else self._initial_weights
            return
        current = self._model_weights()
        sent = self._module_loaded or not np.array_equal(current, self._initial_weights)
        if sent:
            loaded = self.worker.load_weights(current)
            log.info("rank %d: %s", self.worker.rank, "the model's loaded weights are the server's now" if loaded
                     else "the server holds the same weights already (another rank loaded them)")
        self._module_loaded = False
        if stepping:
            self._initial_weights = None
        elif sent:
            self._initial_weights = current.copy()  # what the server holds now

    def _attach(self) -> None:
        """Make the model's parameters and gradients views into the worker's buffers, or set
        up their staging copies."""
        self._host_weights = torch.from_numpy(self.worker.flat_weights)
        self._host_grads = torch.from_numpy(self.worker.flat_grad)
        if self.device.type == "cuda":
            self._pinned = _pin(self._host_weights, self._host_grads)
        self._weight_views = self._views(self._host_weights)
        self._grad_views = self._views(self._host_grads)
        # Float32 parameters on the CPU become views into the worker's buffers. A model all
        # of one 16-bit type, over TCP, becomes views into the worker's 16-bit buffers: the
        # gradients go as they are and the weights arrive rounded by the server (the float32
        # master weights stay there). Any other parameter (on a GPU, or 16-bit in another
        # setting) is copied each step.
        self._push_buffer = self.worker.grads
        half_dtype = self.params[0].dtype
        if (not self.staging and half_dtype in _HALF and all(p.dtype == half_dtype for p in self.params)
                and self.worker.compression == _HALF[half_dtype]):
            try:
                half_weights, half_grads = self.worker.half_buffers()
            except ConfigurationError:  # the weights come back float32 (compress_pulls=False): copy them
                half_weights = None
        else:
            half_weights = None
        if half_weights is not None:
            self._weight_views = self._views(torch.from_numpy(half_weights.view(np.int16)).view(half_dtype))
            self._grad_views = self._views(torch.from_numpy(half_grads.view(np.int16)).view(half_dtype))
            self._host_grads = torch.from_numpy(half_grads.view(np.int16)).view(half_dtype)
            self._push_buffer = half_grads
        views = list(zip(self.params, self._weight_views, self._grad_views))
        self._viewed = [] if self.staging else [v for v in views if v[0].dtype == v[1].dtype]
        self._staged = [v for v in views if self.staging or v[0].dtype != v[1].dtype]
        for param, weights, grads in self._viewed:
            param.data = weights  # the model's storage is the worker's weight buffer
            param.grad = grads  # backward() accumulates into the (shared) gradient buffer
        self._load_weights()

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        layout = self.worker.layout
        return [flat[o : o + s].view(p.shape) for p, o, s in zip(self.params, layout.offsets, layout.sizes)]

    def _group_stops(self) -> list[int]:
        """Where each param group's range of the flat vector ends (the layout is group by group)."""
        sizes = dict(zip(map(id, self.params), self.worker.layout.sizes))
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
                "at init. Give every group to the constructor (an lr of 0 keeps a group still until you raise it)")
        super().add_param_group(param_group)

    def prefetch(self, ids: Mapping[str, Any]) -> None:
        """Pull the rows of ``ids`` (``{table: ids}``) of every table at once, in one request:
        the next forwards of the model's aps embeddings take them from here instead of each
        asking the server (a forward whose ids are not all here asks for its own). Kept until
        the next step, which pushes and so changes rows (``step(prefetch=...)`` pulls the
        next batch's rows in the step's own request)."""
        wanted = distinct_ids(ids)
        pulled = run(self.worker._pull_rows(wanted, None, None, versioned=False)) if wanted else {}
        self._prefetched = {name: (wanted[name], pulled[name]) for name in wanted}

    def _rows_of(self, table: str, distinct: np.ndarray) -> np.ndarray:
        """The rows of ``distinct`` (sorted, each once) of ``table``: prefetched, or pulled now."""
        kept = self._prefetched.get(table)
        if kept is not None and len(distinct):
            ids, rows = kept
            at = np.minimum(np.searchsorted(ids, distinct), len(ids) - 1)
            if len(ids) and np.array_equal(ids[at], distinct):
                return rows[at]
        # (the reply's version is not the worker's: its dense weights are the last step's, and the
        # next push must say so: docs/guide/tables.md)
        return run(self.worker._pull_rows(table, distinct, None, versioned=False))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place. ``set_to_none`` is accepted and not followed: the
        gradients stay views into the worker's buffer (a parameter with no gradient at a
        ``step()`` is pushed a zero gradient either way). The rows the model's aps
        embeddings used since the last step are forgotten (their gradients too)."""
        for module in self._tables.values():
            module.used = []
        if self._viewed:
            self._host_grads.zero_()
        for param, _, _ in self._staged:
            if param.grad is not None:
                param.grad.zero_()

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
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._send_loaded_weights()
            found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
            if found_inf is not None and self._tables:
                raise ConfigurationError(
                    "torch.amp.GradScaler does not see the rows of aps embeddings (they are not in the param "
                    "groups): their gradients would be pushed scaled and unchecked. Train a model with aps "
                    "embeddings without a loss scale (bfloat16 autocast needs none)")
            if found_inf is not None and float(found_inf) > 0:  # torch.amp.GradScaler found inf/NaN: skip
                for module in self._tables.values():
                    module.used = []
                self.skipped_steps += 1
                log.debug("rank %d: step skipped (inf/NaN gradients at scale %s)", self.worker.rank, grad_scale)
                return loss
            self._send_hyperparameters()
            if grad_scale is not None:  # GradScaler's scale, not yet taken out: unscale as it would
                self._unscale(grad_scale)
            if self.pacer is not None:
                self.pacer.wait()
            self._adopt_stray_grads()
            self._gather_grads()
            rows = {name: used for name, module in self._tables.items()
                    if (used := module._gradient_rows()) is not None}
            ahead = distinct_ids(prefetch)
            self._prefetched = {}
            if rows or ahead:  # the dense gradient, the batch's rows and the next batch's: one round trip
                _, pulled = self.worker.push_pull(self._push_buffer, rows=rows, pull_rows=ahead or {})
                self._prefetched = {name: (ahead[name], pulled[name]) for name in ahead}
            else:
                self.worker.push_pull(self._push_buffer)  # the weights land in the views' storage
            self._load_weights()
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
        offsets = dict(zip(map(id, self.params), zip(self.worker.layout.offsets, self.worker.layout.sizes)))
        arrays, steps = server["arrays"], int(server["steps"])
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) not in offsets or not arrays or steps == 0:
                    continue
                offset, size = offsets[id(param)]
                state = {name: torch.from_numpy(array[offset : offset + size].copy()).view(param.shape)
                         for name, array in arrays.items()}
                if self._kind == "adam":
                    state = {"step": torch.tensor(float(steps)), **state}
                self.state[param] = state
        try:
            packed = super().state_dict()
        finally:
            self.state.clear()
        packed["aps"] = {"optimizer": server["optimizer"], "steps": steps, "version": int(server["version"])}
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

        def capture(_, processed):  # registered last: sees the dict torch loads, after the user's pre-hooks
            final.update(processed)

        before = self.param_groups
        handle = self.register_load_state_dict_pre_hook(capture)
        try:
            super().load_state_dict(state_dict)  # checks the groups, sets their values (the next step sends them)
            self.state.clear()  # the state lives on the server, in float32, whatever the parameters' dtype
            server_state = self._server_state(final, final.get("aps", state_dict.get("aps")) or {}, before)
            self._group_values()  # the loaded groups are the server optimizer's (raises otherwise)
            if server_state is not None:
                self.worker.load_optimizer_state(server_state)
        except BaseException:
            self.param_groups = before  # nothing changed
            self.state.clear()
            raise
        finally:
            handle.remove()

    def _server_state(self, state_dict: Mapping[str, Any], described: Mapping[str, Any],
                      groups: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The server's state from a torch-format ``state_dict`` (``groups``: the param groups it
        was loaded into), or None when it holds nothing to load."""
        saved = state_dict.get("state", {})
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        mine = [p for group in groups for p in group["params"]]
        by_param = {id(param): saved[index] for index, param in zip(saved_ids, mine) if index in saved}
        if not by_param:
            return None  # nothing to load: a state from before the first step
        layout = self.worker.layout
        names = ("momentum_buffer",) if self._kind == "sgd" else ("exp_avg", "exp_avg_sq")
        if described.get("optimizer", self.server_optimizer) != self.server_optimizer:
            raise ConfigurationError(f"the state is {described['optimizer']}'s; the server runs "
                                     f"{self.server_optimizer}")
        arrays = {name: np.zeros(layout.numel, np.float32) for name in names}
        steps = set()
        for param, offset, size in zip(self.params, layout.offsets, layout.sizes):
            state = by_param.get(id(param), {})
            unknown = set(state) - set(names) - {"step"}
            if unknown:
                raise ConfigurationError(f"the state holds {sorted(unknown)}: not the server optimizer's "
                                         f"({self.server_optimizer}: {', '.join(names)})")
            if self._kind == "adam":
                steps.add(int(float(state["step"])) if "step" in state else 0)
            for name in names:
                if state.get(name) is not None:
                    arrays[name][offset : offset + size] = state[name].detach().to("cpu", torch.float32).reshape(-1)
        if self._kind == "adam":
            if len(steps) != 1:
                raise ConfigurationError(f"the parameters' Adam steps differ ({sorted(steps)}): the server keeps "
                                         "one step count for the whole model (a parameter without state has "
                                         "taken no step)")
            count = steps.pop()
        else:  # a momentum buffer missing for a parameter starts at zero: the gradient, as torch starts it
            count = int(described.get("steps", 1))
            if not any(s.get("momentum_buffer") is not None for s in by_param.values()):
                return None
        return {"optimizer": self.server_optimizer, "steps": count, "arrays": arrays}

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
        if self._pinned:
            _unpin(self._pinned)
            self._pinned = []
        self.worker.close()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"aps.torch.{super().__repr__()}"

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim's pickles param_groups and state only: a copy would have no connection and
        # no flat buffers, and would fail at its first step.
        raise TypeError("an aps.torch.Optimizer holds a connection to its server and cannot be pickled or "
                        "copied: save its state_dict() (and make a new Optimizer to load it into)")

    # Internals ----------------------------------------------------------------------
    def _group_values(self) -> list[tuple[float, ...]]:
        """The values each group asks of the server now (checking those it cannot change)."""
        sent = _SENT[self._kind]
        fixed = ("nesterov",) if self._kind == "sgd" else ("eps",)
        values = []
        decoupled = self.server_optimizer == "adamw"
        for index, group in enumerate(self.param_groups):
            missing = [key for key in (*fixed, *self._value_keys) if key not in group]
            if missing:
                raise ConfigurationError(f"param group {index} has no {', '.join(missing)}: not a group of the "
                                         f"server's optimizer ({self.server_optimizer})")
            if self._kind == "adam" and group.get("decoupled_weight_decay", decoupled) != decoupled:
                raise ConfigurationError(
                    f"param group {index}: decoupled_weight_decay is {group['decoupled_weight_decay']} (a group "
                    f"of torch.optim.{'Adam' if decoupled else 'AdamW'}); the server runs "
                    f"{self.server_optimizer}")
            for key in fixed:
                if group[key] != self.defaults[key]:
                    raise ConfigurationError(
                        f"param group {index}: {key} is {group[key]}, the server's is {self.defaults[key]}; "
                        f"it is the server's option (aps serve --{key}) and cannot be set per group")
            for key in ("maximize", "amsgrad"):
                if group.get(key):
                    raise ConfigurationError(f"param group {index}: {key} is not supported by the server's "
                                             "optimizer")
            try:
                values.append(tuple(float(v) for v in sent(group)))
            except (KeyError, TypeError, ValueError) as error:
                raise ConfigurationError(f"param group {index}: its optimizer values are not numbers ({error})") \
                    from None
        return values

    def _send_hyperparameters(self) -> None:
        """Send the groups' values if they changed since they were last sent."""
        for name, param in self._frozen:
            if param.grad is not None:
                raise ConfigurationError(
                    f"parameter {name} was frozen (requires_grad=False) when the optimizer was made and now has a "
                    "gradient: the server's model was laid out at init without it. Make the optimizer after "
                    "unfreezing (an lr of 0 keeps a group still until you raise it)")
        values = self._group_values()
        scale = self._lr_factor()
        if scale != 1.0:
            values = [(lr * scale, *rest) for lr, *rest in values]
        self.lr_scale = scale
        if values == self._sent:
            return
        groups, start = [], 0
        for stop, (lr, weight_decay, momentum, dampening) in zip(self._stops, values):
            if stop > start:  # a group of frozen parameters only has no range
                groups.append({"stop": stop, "lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                               "dampening": dampening})
            start = stop
        self.worker.set_hyperparameters(groups)
        self._sent = values

    def _lr_factor(self) -> float:
        """``scale_lr``'s factor for the workers live now (1 on a fixed-size server)."""
        if self.scale_lr is None or not self.worker.elastic:
            return 1.0
        ratio = self.worker.num_workers / self.worker.workers_range[0]
        return ratio if self.scale_lr == "linear" else math.sqrt(ratio)

    def _unscale(self, grad_scale: torch.Tensor) -> None:
        """Divide the gradients by GradScaler's scale, in their own dtype, as its ``unscale_`` does."""
        inv_scale = grad_scale.double().reciprocal().float()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self.params:
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in by_dtype.values():
            torch._foreach_mul_(grads, inv_scale.to(grads[0].device))

    def _adopt_stray_grads(self) -> None:
        # model.zero_grad() (set_to_none, the torch default) or other code may have replaced
        # a .grad: copy it back into the buffer and re-attach. model.to("cpu:N") (accelerate)
        # replaces the storage of the parameters and of their .grad, the views: attach again,
        # or no step would reach the model.
        if any(param.data_ptr() != weights.data_ptr() for param, weights, _ in self._viewed):
            moved = [(param, param.grad) for param, _, _ in self._viewed]
            if any(p.dtype != w.dtype or p.device != w.device for p, w, _ in self._viewed):
                raise ConfigurationError("the model was moved to another dtype or device after the optimizer was "
                                         "made: make the optimizer after moving the model")
            self._attach()
            for (_, grad), (_, _, grads) in zip(moved, self._viewed):
                grads.copy_(grad) if grad is not None else grads.zero_()
        for param, _, grads in self._viewed:
            grad = param.grad
            if grad is grads:
                continue
            if grad is None:
                grads.zero_()
            elif grad.data_ptr() != grads.data_ptr():
                grads.copy_(grad)
            param.grad = grads

    def _gather_grads(self) -> None:
        if not self._staged:
            return
        for param, _, grads in self._staged:
            if param.grad is None:
                grads.zero_()
            else:
                grads.copy_(param.grad, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":  # the push reads the host buffer next
            torch.cuda.synchronize(self.device)

    def _load_weights(self) -> None:
        if not self._staged:
            return
        for param, weights, _ in self._staged:
            param.data.copy_(weights, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":  # the next pull overwrites the host buffer
            torch.cuda.synchronize(self.device)

# Checkpoints --------------------------------------------------------------------------

from ..checkpoint import Checkpoint, load_checkpoint  # noqa: E402  (kept apart from the training code above)
from ..errors import CheckpointError  # noqa: E402

__all__.append("load_state_dict")


def load_state_dict(model: torch.nn.Module, path: str | os.PathLike, *, strict: bool = True) -> Checkpoint:
    """Load the weights of an aps checkpoint into ``model``, in place: no server needed.

    The checkpoint names tensors as :class:`Optimizer` does, by
    ``model.named_parameters()``, and holds the trainable parameters only;
    buffers (BatchNorm running statistics ...) keep their values. Each
    parameter keeps its own dtype and device (the values are copied into it).

    Args:
        model: the model the checkpoint was trained on (the same architecture).
        path: a checkpoint (``ckpts/checkpoint-00000007-v70``) or a checkpoint
            directory (its newest checkpoint).
        strict: require that every trainable parameter of ``model`` is in the
            checkpoint and every tensor of the checkpoint is a parameter of
            ``model``. With ``strict=False`` the names in both are loaded and the
            others left alone. Shapes must match either way.

    Returns:
        The checkpoint read (``.version``, ``.manifest``, ``.state`` ...).

    Raises:
        CheckpointError: the checkpoint is missing or damaged (see
            :func:`aps.load_checkpoint`), a parameter's shape differs, or
            (``strict``) names differ: the message lists the missing and
            unexpected parameter names.

    Example::

        model = Net()
        ckpt = aps.torch.load_state_dict(model, "ckpts")  # the newest checkpoint
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean()
        print(f"version {ckpt.version}: accuracy {accuracy:.3f}")
        # or fine-tune it locally: torch.optim.SGD(model.parameters(), lr=1e-3) ...
    """
    checkpoint = load_checkpoint(path)
    params = dict(model.named_parameters())
    if strict:
        missing = [name for name, param in params.items() if param.requires_grad and name not in checkpoint.weights]
        unexpected = [name for name in checkpoint.weights if name not in params]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing from the checkpoint: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
            if unexpected:
                parts.append(f"not parameters of the model: {', '.join(unexpected[:10])}"
                             f"{' ...' if len(unexpected) > 10 else ''}")
            raise CheckpointError(f"checkpoint {checkpoint.path} does not fit the model ({'; '.join(parts)}); "
                                  "pass strict=False to load the parameters both have")
    state = {}
    for name, array in checkpoint.weights.items():
        if name not in params:
            continue
        if tuple(params[name].shape) != array.shape:
            raise CheckpointError(f"checkpoint {checkpoint.path}: parameter {name!r} has shape {array.shape}, "
                                  f"the model's is {tuple(params[name].shape)}")
        state[name] = torch.from_numpy(array)
    model.load_state_dict(state, strict=False)
    return checkpoint
