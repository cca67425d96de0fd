"""Server-side optimizers over the flat parameter vector.

Each optimizer owns its state (momentum buffer, Adam moments, step count),
kept twice: the current state and a spare. ``step(w_out, w_in, grad, scale)``
reads the current weights and state and writes the next weights into
``w_out`` and the next state into the spare, in a single fused native pass
(the gradient multiplied by ``scale`` first: the mean over a BSP round, or a
staleness-aware learning rate). It returns False when the gradient or a new
weight is not finite; then nothing changed. :meth:`Optimizer.commit` adopts
the new state. So every update is a transaction, which is what lets the
server refuse a bad gradient without a separate checking pass, and apply a
gradient piece by piece while it arrives. The kernels release the GIL, and
the parameter table only ever runs one step at a time.
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
    """Base class: an update rule with its (double-buffered) state for ``numel`` floats."""

    name = "optimizer"

    def __init__(self, numel: int, lr: float, kernels: ModuleType = _core) -> None:
        _require(lr >= 0.0, f"invalid learning rate {lr}: must be >= 0")
        self.numel = numel
        self.lr = float(lr)
        self.steps = 0
        self._kernels = kernels

    def step(self, w_out: np.ndarray, w_in: np.ndarray, grad: np.ndarray, scale: float = 1.0,
             grad_dtype: int = _core.FLOAT32) -> bool:
        """Write ``w_in`` updated with ``scale * grad`` into ``w_out`` and the next state
        into the spare; False (nothing to commit) when anything is not finite. ``grad``
        is float32, or 16-bit words of ``grad_dtype`` (a compressed push)."""
        return self.step_slice(w_out, w_in, grad, scale, 0, self.numel, grad_dtype)

    def step_slice(self, w_out, w_in, grad, scale: float, start: int, stop: int,
                   grad_dtype: int = _core.FLOAT32) -> bool:
        """The part ``[start, stop)`` of :meth:`step` (for a gradient still arriving)."""
        raise NotImplementedError

    def commit(self) -> None:
        """Adopt the state the last step(s) wrote: the update is applied."""
        self.steps += 1

    def describe(self) -> str:
        return self.name

    def hyperparameters(self) -> dict:
        """The options this optimizer was made with (JSON-able, for checkpoints)."""
        return {"lr": self.lr}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The current state by name (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``),
        flat and live: they change at the next commit."""
        return {}

    def load_state(self, arrays: dict[str, np.ndarray], steps: int) -> None:
        """Adopt a saved state (from :meth:`state_arrays` and :attr:`steps`)."""
        own = self.state_arrays()
        if set(arrays) != set(own):
            raise ValueError(f"the {self.name} state holds {sorted(own)}, got {sorted(arrays)}")
        for name, array in arrays.items():
            if array.shape != own[name].shape:
                raise ValueError(f"{name} has shape {array.shape}, the model needs {own[name].shape}")
            np.copyto(own[name], array)
        self.steps = int(steps)


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
        self._buffers = [np.zeros(numel, np.float32), np.zeros(numel, np.float32)] if momentum else None

    @property
    def momentum_buffer(self) -> np.ndarray | None:
        """The current momentum buffer (None without momentum)."""
        return self._buffers[0] if self._buffers is not None else None

    def step_slice(self, w_out, w_in, grad, scale, start, stop, grad_dtype=_core.FLOAT32):
        buf_in = buf_out = None
        if self._buffers is not None:
            buf_in, buf_out = self._buffers[0][start:stop], self._buffers[1][start:stop]
        return self._kernels.sgd_step(
            w_out[start:stop],
            w_in[start:stop],
            grad[start:stop],
            buf_out,
            buf_in,
            self.lr,
            self.momentum,
            self.dampening,
            self.weight_decay,
            self.nesterov,
            self.steps == 0,
            scale,
            grad_dtype,
        )

    def commit(self) -> None:
        if self._buffers is not None:
            self._buffers.reverse()
        super().commit()

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {} if self._buffers is None else {"momentum_buffer": self._buffers[0]}

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
        self._m = [np.zeros(numel, np.float32), np.zeros(numel, np.float32)]
        self._v = [np.zeros(numel, np.float32), np.zeros(numel, np.float32)]

    @property
    def exp_avg(self) -> np.ndarray:
        return self._m[0]

    @property
    def exp_avg_sq(self) -> np.ndarray:
        return self._v[0]

    def step_slice(self, w_out, w_in, grad, scale, start, stop, grad_dtype=_core.FLOAT32):
        return self._kernels.adam_step(
            w_out[start:stop],
            w_in[start:stop],
            grad[start:stop],
            self._m[1][start:stop],
            self._m[0][start:stop],
            self._v[1][start:stop],
            self._v[0][start:stop],
            self.steps + 1,
            self.lr,
            self.betas[0],
            self.betas[1],
            self.eps,
            self.weight_decay,
            self.decoupled,
            scale,
            grad_dtype,
        )

    def commit(self) -> None:
        self._m.reverse()
        self._v.reverse()
        super().commit()

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"exp_avg": self._m[0], "exp_avg_sq": self._v[0]}

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
