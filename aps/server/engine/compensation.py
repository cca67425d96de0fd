"""Delay compensation of stale gradients (docs/algorithms.md, "Delay compensation").

A gradient computed on the weights ``w_then`` of version tau and applied to the
weights ``w`` of version t > tau is compensated before the optimizer's kernel
takes it, element by element, in one native pass (``_core.compensate``):

- ``dc`` (DC-ASGD, Zheng et al. 2017): ``g + lam * g * g * (w - w_then)``;
- ``dc-adaptive``: the same with ``lam / sqrt(ms + eps)``, ``ms`` a running mean of
  ``g * g`` per parameter (decay 0.95, updated by every gradient compensated);
- ``gap`` (gap-aware, Barkai et al. 2020): ``g / max(1, |w - w_then| / C)``, ``C``
  a running mean of each parameter's step (decay 0.99, bias-corrected, updated
  after every update the table publishes).

The compensated gradient is written to a scratch vector the optimizer's kernel
then reads (``scale`` and the optimizer's own rule apply to it unchanged), a
block of :data:`BLOCK` elements at a time, so that the block is still in the
core's cache when it is read back: the memory traffic of one fused pass, and
the kernels of every optimizer stay as they are. The state is double-buffered like the optimizer's: written
aside by a job, adopted by :meth:`Compensation.commit`, thrown away otherwise.
"""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np

from ... import _core
from ...config import format_compensation
from ...errors import ConfigurationError
from ...wire.quantized import Quantized
from ...layout import line_aligned

__all__ = ["Compensation", "check_lambda"]

#: The running means' decays: DC-ASGD's adaptive mean square (the paper's m), the gap's step scale.
MEAN_SQUARE_DECAY = 0.95
STEP_SCALE_DECAY = 0.99
#: Added under the square root (dc-adaptive) and to the step scale (gap): no division by zero.
EPS = 1e-7
#: Elements compensated and applied at a time (:meth:`Compensation.apply`): the compensated
#: block is read back by the optimizer's kernel while it is still in the core's cache.
BLOCK = 1 << 16
#: The state each kind keeps, as checkpoints name it.
STATE_NAME = {"dc-adaptive": "compensation_mean_square", "gap": "compensation_step_scale"}
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_lambda(kind: str, lam: float) -> None:
    """Refuse, with ConfigurationError, a LAMBDA the kernel cannot compute with: it takes it in
    float32, and dc-adaptive divides it by ``sqrt(mean square + EPS)``, which is ``sqrt(EPS)`` for a
    parameter whose gradients are all 0 so far (a run that would refuse every gradient as not finite)."""
    if kind not in ("dc", "dc-adaptive"):
        return
    given = format_compensation(kind, lam)
    with np.errstate(over="ignore"):
        single = np.float32(lam)
        factor = single / np.sqrt(np.float32(EPS)) if kind == "dc-adaptive" else single
    if not np.isfinite(single) or not np.isfinite(factor):
        limit = _FLOAT32_MAX * (math.sqrt(np.float32(EPS)) if kind == "dc-adaptive" else 1.0)
        unit = 10.0 ** (math.floor(math.log10(limit)) - 5)
        largest = math.floor(limit / unit) * unit  # (said in 6 digits, rounded down)
        what = (
            f"LAMBDA / sqrt(mean square + {EPS:g}) reaches {lam / math.sqrt(EPS):g} for a parameter whose "
            "gradients have been 0,"
            if kind == "dc-adaptive" and np.isfinite(single)
            else f"LAMBDA {lam:g} is"
        )
        raise ConfigurationError(
            f"--compensation {given}: {what} beyond float32 (at most {_FLOAT32_MAX:.4g}), the "
            "precision the kernel computes in, and gradients would be refused as not finite: "
            f"give a LAMBDA of at most {largest:.6g}"
        )
    if single == 0.0 and lam != 0.0:
        raise ConfigurationError(
            f"--compensation {given}: LAMBDA is 0 in float32, the precision the kernel computes "
            "in: give 0 (no compensation: --compensation none) or a larger value"
        )


class Compensation:
    """One model's delay compensation: its kind, its state and its scratch gradient."""

    def __init__(self, kind: str, lam: float, numel: int, kernels: ModuleType = _core) -> None:
        if kind not in STATE_NAME and kind != "dc":
            raise ConfigurationError(f"no compensation of kind {kind!r}")
        check_lambda(kind, lam)
        self.kind, self.lam, self.numel = kind, float(lam), numel
        self._kernels = kernels
        self._code = {
            "dc": kernels.COMPENSATE_DC,
            "dc-adaptive": kernels.COMPENSATE_DC_ADAPTIVE,
            "gap": kernels.COMPENSATE_GAP,
        }[kind]
        self._scratch = np.zeros(numel, np.float32)
        self._state = [line_aligned(numel), line_aligned(numel)] if kind in STATE_NAME else None
        #: Updates the step scale has taken in (gap: its bias correction), or gradients the mean
        #: square has (dc-adaptive).
        self.steps = 0
        self._written = False

    def begin(self) -> None:
        """A job begins: nothing it writes is adopted unless it commits."""
        self._written = False

    def gradient(
        self, grad: np.ndarray | Quantized, dtype: int, w: np.ndarray, w_then: np.ndarray, start: int, stop: int
    ) -> np.ndarray | None:
        """The scratch vector, its ``[start, stop)`` the gradient ``grad`` (float32, or 16-bit
        words of ``dtype``) compensated for ``w_then -> w``; None when it is not finite."""
        out = self._scratch[start:stop]
        source = grad[start:stop]
        if dtype != _core.FLOAT32:
            self._kernels.widen(out, source, dtype)
            source = out
        state_in = state_out = None
        if self._state is not None:
            state_in, state_out = self._state[0][start:stop], self._state[1][start:stop]
        corr = 1.0
        if self.kind == "gap":
            corr = 1.0 / (1.0 - STEP_SCALE_DECAY**self.steps) if self.steps else 0.0
        if self.kind == "dc-adaptive":
            self._written = True
        ok = self._kernels.compensate(
            out,
            source,
            w[start:stop],
            w_then[start:stop],
            state_out,
            state_in,
            self._code,
            self.lam,
            MEAN_SQUARE_DECAY,
            EPS,
            corr,
        )
        return self._scratch if ok else None

    def apply(
        self,
        optimizer,
        w_out: np.ndarray,
        w_in: np.ndarray,
        grad: np.ndarray | Quantized,
        dtype: int,
        w_then: np.ndarray,
        scale: float,
        groups=None,
    ) -> bool:
        """The update of ``w_in`` into ``w_out`` with ``grad`` compensated for ``w_then -> w_in``:
        block by block, the compensation then ``optimizer``'s kernel (``scale``, ``groups`` as
        :meth:`aps.server.engine.optim.Optimizer.step` takes them), then the step scale; False (nothing
        to commit) when anything is not finite."""
        numel = len(w_in)
        for start in range(0, numel, BLOCK):
            stop = min(numel, start + BLOCK)
            compensated = self.gradient(grad, dtype, w_in, w_then, start, stop)
            if compensated is None or not optimizer.step_slice(
                w_out, w_in, compensated, scale, start, stop, _core.FLOAT32, groups
            ):
                return False
            self.stepped(w_out, w_in, start, stop)
        return True

    def stepped(self, w_out: np.ndarray, w_in: np.ndarray, start: int, stop: int) -> None:
        """The weights ``[start, stop)`` went from ``w_in`` to ``w_out`` (gap: the step scale follows)."""
        if self.kind == "gap" and self._state is not None:
            self._kernels.step_scale(
                self._state[1][start:stop],
                self._state[0][start:stop],
                w_out[start:stop],
                w_in[start:stop],
                STEP_SCALE_DECAY,
            )
            self._written = True

    def commit(self) -> None:
        """Adopt what the job wrote (its gradient or update was taken)."""
        if self._written and self._state is not None:
            self._state.reverse()
            self.steps += 1
            self._written = False

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The current state by name (flat and live), for checkpoints."""
        return {} if self._state is None else {STATE_NAME[self.kind]: self._state[0]}

    def load_state(self, arrays: dict[str, np.ndarray], steps: int) -> None:
        """Adopt a saved state (from :meth:`state_arrays` and :attr:`steps`)."""
        own = self.state_arrays()
        if set(arrays) != set(own):
            raise ValueError(f"the {self.kind} compensation keeps {sorted(own)}, got {sorted(arrays)}")
        for name, value in arrays.items():
            value = np.ascontiguousarray(value, np.float32)
            if value.shape != own[name].shape or not self._kernels.all_finite(value) or (value < 0).any():
                raise ValueError(f"{name} must hold {self.numel} finite values >= 0 (a mean of squares or of steps)")
            np.copyto(own[name], value)
        self.steps = int(steps)

    def describe(self) -> str:
        return format_compensation(self.kind, self.lam)
