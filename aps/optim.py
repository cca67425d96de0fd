"""Server-side optimizers over the flat parameter vector.

Each optimizer owns its state (momentum buffer, Adam moments, step count) and
applies one update with a fused native kernel: ``step(w_out, w_in, grad,
scale)`` reads the current weights ``w_in`` and writes the next version into
``w_out`` in a single pass, with the gradient multiplied by ``scale`` first
(the mean over a BSP round, or a staleness-aware learning rate). The kernels
release the GIL, and the parameter table only ever runs one step at a time.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from . import _core
from .errors import ConfigurationError

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "OPTIMIZERS", "make_optimizer"]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


class Optimizer:
    """Base class: an update rule with its state for a vector of ``numel`` floats."""

    name = "optimizer"

    def __init__(self, numel: int, lr: float, kernels: ModuleType = _core) -> None:
        _require(lr >= 0.0, f"invalid learning rate {lr}: must be >= 0")
        self.numel = numel
        self.lr = float(lr)
        self.steps = 0
        self._kernels = kernels

    @property
    def stateless(self) -> bool:
        """True when a step reads no optimizer state, so it can run piece by piece
        (``step_slice``) while a gradient is still arriving."""
        return False

    def step(self, w_out: np.ndarray, w_in: np.ndarray, grad: np.ndarray, scale: float = 1.0) -> None:
        """Write ``w_in`` updated with ``scale * grad`` into ``w_out`` (may be ``w_in``)."""
        raise NotImplementedError

    def step_slice(self, w_out, w_in, grad, scale: float, start: int, stop: int) -> None:
        """The part ``[start, stop)`` of a stateless step; call ``count_step()`` once it is whole."""
        raise NotImplementedError(f"{self.name} keeps state and cannot step piece by piece")

    def count_step(self) -> None:
        self.steps += 1

    def describe(self) -> str:
        return self.name


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov and weight decay,
    computed as ``torch.optim.SGD`` computes it."""

    name = "sgd"

    def __init__(
        self,
        numel: int,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        kernels: ModuleType = _core,
    ) -> None:
        super().__init__(numel, lr, kernels)
        _require(momentum >= 0.0, f"invalid momentum {momentum}: must be >= 0")
        _require(weight_decay >= 0.0, f"invalid weight decay {weight_decay}: must be >= 0")
        _require(
            not nesterov or (momentum > 0.0 and dampening == 0.0),
            "Nesterov momentum needs a momentum > 0 and zero dampening",
        )
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)
        self.momentum_buffer = np.zeros(numel, np.float32) if momentum else None

    def step(self, w_out, w_in, grad, scale=1.0):
        self._kernels.sgd_step(
            w_out,
            w_in,
            grad,
            self.momentum_buffer,
            self.lr,
            self.momentum,
            self.dampening,
            self.weight_decay,
            self.nesterov,
            self.steps == 0,
            scale,
        )
        self.steps += 1

    @property
    def stateless(self) -> bool:
        return self.momentum_buffer is None

    def step_slice(self, w_out, w_in, grad, scale, start, stop):
        if not self.stateless:
            return super().step_slice(w_out, w_in, grad, scale, start, stop)
        self._kernels.sgd_step(
            w_out[start:stop], w_in[start:stop], grad[start:stop], None, self.lr, 0.0, 0.0, self.weight_decay, False, False, scale
        )

    def describe(self) -> str:
        extra = []
        if self.momentum:
            extra.append(f"momentum={self.momentum:g}{' nesterov' if self.nesterov else ''}")
        if self.weight_decay:
            extra.append(f"weight_decay={self.weight_decay:g}")
        return f"sgd lr={self.lr:g}" + "".join(" " + e for e in extra)


class Adam(Optimizer):
    """Adam, computed as ``torch.optim.Adam`` computes it (weight decay added to the gradient)."""

    name = "adam"
    decoupled = False

    def __init__(
        self,
        numel: int,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        kernels: ModuleType = _core,
    ) -> None:
        super().__init__(numel, lr, kernels)
        beta1, beta2 = (float(b) for b in betas)
        _require(0.0 <= beta1 < 1.0, f"invalid beta1 {beta1}: must be in [0, 1)")
        _require(0.0 <= beta2 < 1.0, f"invalid beta2 {beta2}: must be in [0, 1)")
        _require(eps >= 0.0, f"invalid eps {eps}: must be >= 0")
        _require(weight_decay >= 0.0, f"invalid weight decay {weight_decay}: must be >= 0")
        self.betas = (beta1, beta2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.exp_avg = np.zeros(numel, np.float32)
        self.exp_avg_sq = np.zeros(numel, np.float32)

    def step(self, w_out, w_in, grad, scale=1.0):
        self._kernels.adam_step(
            w_out,
            w_in,
            grad,
            self.exp_avg,
            self.exp_avg_sq,
            self.steps + 1,
            self.lr,
            self.betas[0],
            self.betas[1],
            self.eps,
            self.weight_decay,
            self.decoupled,
            scale,
        )
        self.steps += 1

    def describe(self) -> str:
        text = f"{self.name} lr={self.lr:g} betas=({self.betas[0]:g},{self.betas[1]:g}) eps={self.eps:g}"
        return text + (f" weight_decay={self.weight_decay:g}" if self.weight_decay else "")


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay, as ``torch.optim.AdamW``."""

    name = "adamw"
    decoupled = True

    def __init__(self, numel, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, kernels=_core):
        super().__init__(numel, lr, betas, eps, weight_decay, kernels)


OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(
    name: str,
    numel: int,
    *,
    lr: float,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    kernels: ModuleType = _core,
) -> Optimizer:
    """The optimizer called ``name`` (``sgd``, ``adam`` or ``adamw``) for ``numel`` parameters."""
    if name == "sgd":
        return SGD(numel, lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, kernels=kernels)
    if name in ("adam", "adamw"):
        _require(momentum == 0.0 and not nesterov, f"--momentum/--nesterov apply to sgd, not {name}")
        return OPTIMIZERS[name](numel, lr, betas=betas, eps=eps, weight_decay=weight_decay, kernels=kernels)
    raise ConfigurationError(f"unknown optimizer {name!r}: choose from {', '.join(OPTIMIZERS)}")
