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
the parameter table only ever runs one step at a time. A large step may be
cut into ranges run at once on several threads (:class:`KernelThreads`,
``aps serve --kernel-threads``): every element is computed alone, so the
result is bit for bit the one-thread result.

Per-group values. A worker may ask for its pushes to be applied with values
of its own (a HYPER request, ``Worker.set_hyperparameters``): consecutive
ranges of the flat vector (torch's parameter groups), each with its own
learning rate, weight decay and momentum and dampening (Adam's betas).
:meth:`Optimizer.check_groups` checks them once and returns
:class:`HyperGroups`; a step given them calls the same fused kernel once per
range it covers, with that range's values (no per-element Python). A step
given none uses the values the optimizer was made with.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from types import ModuleType
from typing import cast

import numpy as np

from ... import _core
from ...config import OPTIMIZER_STATE, usable_cores
from ...errors import ConfigurationError, InvalidHyperparameters
from ...wire.quantized import Quantized
from ...layout import line_aligned
from ...wire.protocol import MAX_HYPER_GROUPS, HyperGroup, check_stops

__all__ = [
    "SGD",
    "Adam",
    "AdamRule",
    "AdamW",
    "DelayedNesterov",
    "HyperGroups",
    "KernelThreads",
    "Optimizer",
    "OPTIMIZERS",
    "check_kernel_values",
    "default_kernel_threads",
    "float32_problem",
    "make_optimizer",
]


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def float32_problem(value: float) -> str | None:
    """Why the update kernels, which compute in float32, cannot take ``value`` as given:
    beyond float32's range (it would be infinite there), or not 0 but rounded to 0 (the
    kernel would not see it); None when they can."""
    with np.errstate(over="ignore"):
        single = np.float32(value)  # (rounded to nearest; infinite beyond the range)
    if not np.isfinite(single):
        return f"is {value:g}, beyond float32 (at most {_FLOAT32_MAX:.4g}), the precision the update kernels compute in"
    if single == 0.0 and value != 0.0:
        return (
            f"is {value:g}, which is 0 in float32 (the precision the update kernels compute in; the smallest "
            f"it holds is {float(np.finfo(np.float32).smallest_subnormal):.2g}): give 0 or a larger value"
        )
    return None


def check_kernel_values(
    name: str,
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> None:
    """Refuse, with ConfigurationError, an optimizer's values the update kernels cannot compute
    with (a run that would refuse every gradient as not finite): each value as the kernels take
    it, in float32, and what they derive from them before the first update (Adam's step size
    ``lr / (1 - beta1)`` at its first step, the largest it takes; AdamW's decay ``lr *
    weight_decay``). The ranges torch.optim checks are :class:`aps.config.ServerConfig`'s."""
    given = {"lr": lr, "weight_decay": weight_decay}
    if name in ("sgd", DelayedNesterov.name):
        given["momentum"] = momentum
    else:
        given.update(beta1=betas[0], beta2=betas[1], eps=eps)
    for option, value in given.items():
        problem = float32_problem(value)
        if problem is not None:
            flag = "--" + option.replace("_", "-") if not option.startswith("beta") else f"--betas {option}"
            raise ConfigurationError(f"{flag} {problem}")
    problem = _derived_problem(name, lr, float(betas[0]), weight_decay)
    if problem is not None:
        raise ConfigurationError(
            f"--lr {lr:g}, --betas {betas[0]:g},{betas[1]:g}, --weight-decay {weight_decay:g}: {problem}"
        )


def _derived_problem(name: str, lr: float, beta1: float, weight_decay: float) -> str | None:
    """Why what Adam's and AdamW's kernels derive from their values overflows float32, or None."""
    if name not in ("adam", "adamw"):
        return None
    with np.errstate(over="ignore"):
        if lr and 0.0 <= beta1 < 1.0 and not np.isfinite(np.float32(lr / (1.0 - beta1))):
            return (
                f"{name}'s first step size lr / (1 - beta1) = {lr / (1.0 - beta1):g} is beyond float32 (at most "
                f"{_FLOAT32_MAX:.4g}), the precision the update kernels compute in: lower lr or beta1"
            )
        if name == "adamw" and not np.isfinite(np.float32(1.0 - lr * weight_decay)):
            return (
                f"adamw's decay factor 1 - lr * weight_decay = {1.0 - lr * weight_decay:g} is beyond float32 (at "
                f"most {_FLOAT32_MAX:.4g}), the precision the update kernels compute in"
            )
    return None


def default_kernel_threads() -> int:
    """Threads for one large update when ``--kernel-threads`` is 0 (auto): half the cores this
    process may run on (the other half left to the event loop, the transports and co-located
    workers), at most 8 (the memory bandwidth of a socket is spent by then); 1 on two cores."""
    return max(1, min(8, usable_cores() // 2))


class KernelThreads:
    """Runs a kernel over a range of the flat vector on up to ``count`` threads.

    The range is cut into ``count`` parts of whole 64-byte lines; the calling
    thread runs the first and ``count - 1`` pool threads the others. A range
    shorter than :attr:`MIN_ELEMENTS` runs on the calling thread alone (handing
    work to a thread costs tens of microseconds). The kernels compute each
    element alone, so the parts' results are bit for bit one call's.
    """

    #: 4 MiB of float32: below it, one thread (a 4 MiB SGD pass takes about a millisecond).
    MIN_ELEMENTS = 1 << 20
    _LINE = 16  # float32 elements in a 64-byte cache line

    def __init__(self, count: int = 1) -> None:
        if count < 1:
            raise ConfigurationError(f"kernel threads must be >= 1, got {count}")
        self.count = count
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(count - 1, thread_name_prefix="aps-kernel") if count > 1 else None
        )

    def run(self, kernel: Callable[[int, int], bool], start: int, stop: int) -> bool:
        """``kernel(lo, hi)`` over parts of ``[start, stop)``; True when every part returned True.
        Returns only when every part is done (its outputs are no longer being written)."""
        pool = self._pool
        if pool is None or stop - start < self.MIN_ELEMENTS:
            return kernel(start, stop)
        line = self._LINE
        part = -(-(stop - start) // (self.count * line)) * line
        cuts = [*range(start, stop, part), stop]
        futures = [pool.submit(kernel, lo, hi) for lo, hi in zip(cuts[1:-1], cuts[2:])]
        try:
            ok = kernel(cuts[0], cuts[1])
        finally:
            concurrent.futures.wait(futures)
        return all([ok] + [future.result() for future in futures])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


#: One thread: what an optimizer runs on unless the server gives it more.
ONE_THREAD = KernelThreads(1)


class HyperGroups:
    """Checked per-group values (see :meth:`Optimizer.check_groups`): ranges that cut
    the flat vector from 0 to its end, each with the values its elements are updated with."""

    __slots__ = ("groups", "_stops")

    def __init__(self, groups: Sequence[HyperGroup]) -> None:
        merged: list[HyperGroup] = []
        for group in groups:  # neighbours with the same values are one range: one kernel call
            if merged and merged[-1][1:] == group[1:]:
                merged[-1] = group
            else:
                merged.append(group)
        self.groups = tuple(merged)
        self._stops = [group.stop for group in self.groups]

    def ranges(self, start: int, stop: int) -> Iterator[tuple[int, int, HyperGroup]]:
        """``(lo, hi, group)`` for each group whose range meets ``[start, stop)``, cut to
        it, in order (a binary search finds the first)."""
        index = bisect.bisect_right(self._stops, start)
        lo = start
        while lo < stop and index < len(self.groups):
            group = self.groups[index]
            hi = min(group.stop, stop)
            yield lo, hi, group
            lo = hi
            index += 1

    def __len__(self) -> int:
        return len(self.groups)


class Optimizer(ABC):
    """The family of update rules, each with its (double-buffered) state for ``numel`` floats."""

    name = "optimizer"
    #: The names of :meth:`state_arrays`, in order (SGD has none without momentum).
    state_names: tuple[str, ...] = ()
    #: What the four values of a HYPER group mean for this optimizer (in error messages).
    value_names = ("lr", "weight_decay", "momentum", "dampening")

    def __init__(self, numel: int, lr: float, kernels: ModuleType = _core) -> None:
        _require(lr >= 0.0, f"invalid learning rate {lr}: must be >= 0")
        self.numel = numel
        self.lr = float(lr)
        self.steps = 0
        self._kernels = kernels
        #: The threads a large step runs on (the server sets its --kernel-threads).
        self.threads = ONE_THREAD

    def step(
        self,
        w_out: np.ndarray,
        w_in: np.ndarray,
        grad: np.ndarray | Quantized,
        scale: float = 1.0,
        grad_dtype: int = _core.FLOAT32,
        groups: HyperGroups | None = None,
    ) -> bool:
        """Write ``w_in`` updated with ``scale * grad`` into ``w_out`` and the next state
        into the spare; False (nothing to commit) when anything is not finite. ``grad``
        is float32, or 16-bit words of ``grad_dtype`` (a compressed push). ``groups``:
        the values of each range (a worker's HYPER); None: this optimizer's own."""
        return self.step_slice(w_out, w_in, grad, scale, 0, self.numel, grad_dtype, groups)

    def step_slice(
        self,
        w_out,
        w_in,
        grad,
        scale: float,
        start: int,
        stop: int,
        grad_dtype: int = _core.FLOAT32,
        groups: HyperGroups | None = None,
    ) -> bool:
        """The part ``[start, stop)`` of :meth:`step` (for a gradient still arriving): one
        kernel call per group range it covers (cut further across :attr:`threads`)."""
        threads = self.threads
        if groups is None and (threads.count == 1 or stop - start < threads.MIN_ELEMENTS):
            # (the common case, one range on this thread: no partial, no hand-off, for small pushes)
            return self._step_range(w_out, w_in, grad, scale, start, stop, grad_dtype, self.defaults)
        ranges = [(start, stop, self.defaults)] if groups is None else groups.ranges(start, stop)
        for lo, hi, values in ranges:
            kernel = functools.partial(self._range_kernel, w_out, w_in, grad, scale, grad_dtype, values)
            if not threads.run(kernel, lo, hi):
                return False
        return True

    def _range_kernel(self, w_out, w_in, grad, scale, grad_dtype, values, start: int, stop: int) -> bool:
        return self._step_range(w_out, w_in, grad, scale, start, stop, grad_dtype, values)

    @abstractmethod
    def _step_range(
        self, w_out, w_in, grad, scale: float, start: int, stop: int, grad_dtype: int, values: HyperGroup
    ) -> bool:
        """The kernel on ``[start, stop)`` with ``values`` (lr, weight decay, momentum, dampening)."""

    @functools.cached_property
    def defaults(self) -> HyperGroup:
        """The values this optimizer was made with, as one group over the whole vector (made
        once: every update without a worker's own values uses it)."""
        return HyperGroup(self.numel, self.lr, 0.0, 0.0, 0.0)

    def check_groups(self, groups: Sequence[HyperGroup]) -> HyperGroups:
        """Check a worker's per-group values against this optimizer and the model; returns
        them ready for :meth:`step`.

        Raises:
            InvalidHyperparameters: no group or more than MAX_HYPER_GROUPS; stops that are
                not strictly increasing or whose last is not the model's size; a value
                that is not finite, negative, or out of the optimizer's range. The
                message names the group and the value.
        """
        if not 1 <= len(groups) <= MAX_HYPER_GROUPS:
            raise InvalidHyperparameters(f"{len(groups)} groups; from 1 to {MAX_HYPER_GROUPS} are accepted")
        check_stops(list(groups), self.numel)
        for index, group in enumerate(groups):
            for name, value in zip(self.value_names, group[1:]):
                if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:  # the kernels take float32 values
                    raise InvalidHyperparameters(
                        f"group {index}: {name} is {value}; it must be finite in float32 (at most {_FLOAT32_MAX:.4g})"
                    )
                if value < 0.0:
                    raise InvalidHyperparameters(f"group {index}: {name} is {value}; it must be >= 0")
            self._check_group(index, group)
        return HyperGroups(groups)

    def _check_group(self, index: int, group: HyperGroup) -> None:  # noqa: B027  (a hook: SGD checks nothing more)
        """Refuse values this optimizer cannot take (finite and >= 0 is checked already)."""

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

    def load_state(self, arrays: Mapping[str, np.ndarray | Sequence[np.ndarray]], steps: int) -> None:
        """Adopt a saved state (from :meth:`state_arrays` and :attr:`steps`): the current
        state becomes a copy of ``arrays``; nothing is kept if one does not fit.

        Args:
            arrays: every array of :meth:`state_arrays` by name, each flat with ``numel``
                float32 elements, or a sequence of consecutive flat pieces that make one up
                (a state received in pieces).
            steps: the step count that goes with it.

        Raises:
            ValueError: other names than :meth:`state_arrays`', or an array of another size.
        """
        own = self.state_arrays()
        if set(arrays) != set(own):
            raise ValueError(f"the {self.name} state holds {sorted(own)}, got {sorted(arrays)}")
        pieces = {}
        for name, value in arrays.items():
            parts = list(value) if isinstance(value, (list, tuple)) else [cast(np.ndarray, value)]
            if len(parts) == 1 and parts[0].shape != own[name].shape:
                raise ValueError(f"{name} has shape {parts[0].shape}, the model needs {own[name].shape}")
            if any(part.ndim != 1 for part in parts) or sum(part.size for part in parts) != own[name].size:
                raise ValueError(
                    f"{name} has {sum(part.size for part in parts)} elements in pieces, the model "
                    f"needs {own[name].size}"
                )
            pieces[name] = parts
        for name, parts in pieces.items():
            offset = 0
            for part in parts:
                np.copyto(own[name][offset : offset + part.size], part)
                offset += part.size
        self.steps = int(steps)

    def state_problem(self, arrays: Mapping[str, Sequence[np.ndarray]], steps: int) -> str | None:
        """Why ``arrays`` (each a sequence of consecutive flat float32 pieces) and ``steps``
        cannot be loaded by :meth:`load_state`, or None when they can: other names, an array
        of another size, a value that is not finite, a step count out of range."""
        own = self.loadable_state(arrays)
        if list(arrays) != list(own):
            return f"the {self.name} state holds the arrays {list(own)}, in that order; got {list(arrays)}"
        if not isinstance(steps, int) or not 0 <= steps <= 1 << 53:
            return f"steps is {steps!r}; it must be an integer from 0 to 2**53"
        for name, parts in arrays.items():
            size = sum(part.size for part in parts)
            if size != own[name].size:
                return f"{name} has {size} elements; the model has {own[name].size}"
            offset = 0
            for part in parts:
                if not self._kernels.all_finite(part):
                    index = offset + int(np.flatnonzero(~np.isfinite(part))[0])
                    return f"{name}[{index}] is {part[index - offset]}: every value must be finite"
                offset += part.size
        return None

    def loadable_state(self, arrays: Collection[str]) -> Mapping[str, np.ndarray]:
        """The arrays a state to load (``arrays``: their names) must have, names and sizes:
        :meth:`state_arrays`, or what the optimizer takes up although it holds none yet."""
        return self.state_arrays()

    def allocate_for(self, groups: HyperGroups) -> None:  # noqa: B027  (a hook: only SGD's momentum is made late)
        """Make the state that ``groups`` (checked by :meth:`check_groups`) need and this
        optimizer does not hold yet; raises MemoryError, changing nothing, if it cannot."""


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov and weight decay,
    computed as ``torch.optim.SGD`` computes it."""

    name = "sgd"
    state_names = OPTIMIZER_STATE["sgd"]

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
        self._buffers = [line_aligned(numel), line_aligned(numel)] if momentum else None
        #: The step count when the buffers came: their first update starts them from the gradient.
        self._buffers_since = 0

    @property
    def momentum_buffer(self) -> np.ndarray | None:
        """The current momentum buffer (None without momentum)."""
        return self._buffers[0] if self._buffers is not None else None

    @functools.cached_property
    def defaults(self) -> HyperGroup:
        return HyperGroup(self.numel, self.lr, self.weight_decay, self.momentum, self.dampening)

    def _check_group(self, index: int, group: HyperGroup) -> None:
        # (momentum in a group of a server started without: allocate_for makes the buffers)
        if self.nesterov and (group.momentum <= 0.0 or group.dampening != 0.0):
            raise InvalidHyperparameters(
                f"group {index}: momentum {group.momentum}, dampening {group.dampening}: this server runs Nesterov "
                "momentum (--nesterov), which needs a momentum > 0 and zero dampening"
            )

    def allocate_for(self, groups: HyperGroups) -> None:
        """A worker asks for momentum (``torch.optim.SGD(..., momentum=0.9)``) from a server
        started without: make the buffers now, on its first request, rather than refuse it."""
        if self._buffers is None and any(values.momentum > 0.0 for _, _, values in groups.ranges(0, self.numel)):
            self._allocate()

    def _allocate(self) -> None:
        # Both made before either is published: a MemoryError leaves the optimizer as it was.
        # An update running meanwhile on a helper thread reads _buffers once per range: ranges
        # it did before see none (and this member's pushes with momentum come after its HYPER).
        buffers = [line_aligned(self.numel), line_aligned(self.numel)]
        self._buffers_since = self.steps
        self._buffers = buffers

    def loadable_state(self, arrays):
        if self._buffers is None and list(arrays) == ["momentum_buffer"]:
            # a saved state with momentum, loaded into a server started without: taken (see load_state)
            return {"momentum_buffer": np.broadcast_to(np.float32(0), (self.numel,))}
        return self.state_arrays()

    def load_state(self, arrays, steps: int) -> None:
        if self._buffers is None and "momentum_buffer" in arrays:
            self._allocate()
            self._buffers_since = 0  # a saved buffer goes on as it was
        super().load_state(arrays, steps)

    def _step_range(self, w_out, w_in, grad, scale, start, stop, grad_dtype, values):
        buf_in = buf_out = None
        momentum = values.momentum
        if self._buffers is not None:
            if momentum != 0.0:
                buf_in, buf_out = self._buffers[0][start:stop], self._buffers[1][start:stop]
            else:
                # A range updated without momentum keeps its buffer as it was (torch.optim
                # leaves a group's state alone while its momentum is 0); the spare must
                # hold it too, or the commit's swap would bring back an older one.
                np.copyto(self._buffers[1][start:stop], self._buffers[0][start:stop])
        return self._kernels.sgd_step(
            w_out[start:stop],
            w_in[start:stop],
            grad[start:stop],
            buf_out,
            buf_in,
            values.lr,
            momentum,
            values.dampening,
            values.weight_decay,
            self.nesterov,
            self.steps == self._buffers_since,
            scale,
            grad_dtype,
        )

    def commit(self) -> None:
        if self._buffers is not None:
            self._buffers.reverse()
        super().commit()

    def hyperparameters(self) -> dict:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "dampening": self.dampening,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
        }

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {} if self._buffers is None else {"momentum_buffer": self._buffers[0]}

    def state_problem(self, arrays, steps):
        problem = super().state_problem(arrays, steps)
        if problem is None and steps == 0 and any(np.any(part) for part in arrays.get("momentum_buffer", ())):
            # The first update starts the buffer from the gradient (as torch.optim.SGD without
            # a buffer does): a buffer loaded with it would be ignored, not used.
            return (
                "steps is 0 but the momentum buffer is not zero: before its first update sgd has no "
                "momentum buffer (the first update starts it from the gradient); give the steps the "
                "buffer was built over"
            )
        return problem

    def describe(self) -> str:
        extra = []
        if self.momentum:
            extra.append(f"momentum={self.momentum:g}{' nesterov' if self.nesterov else ''}")
        if self.weight_decay:
            extra.append(f"weight_decay={self.weight_decay:g}")
        return f"sgd lr={self.lr:g}" + "".join(" " + e for e in extra)


class AdamRule(Optimizer):
    """The family of Adam's update, as ``torch.optim.Adam`` and ``AdamW`` compute it: the
    two kinds differ in where the weight decay goes (:attr:`decoupled`) and its default."""

    state_names = OPTIMIZER_STATE["adam"]
    value_names = ("lr", "weight_decay", "beta1", "beta2")

    @property
    @abstractmethod
    def decoupled(self) -> bool:
        """The weight decay is applied to the weights (AdamW), not added to the gradient (Adam)."""

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
        self._m = [line_aligned(numel), line_aligned(numel)]
        self._v = [line_aligned(numel), line_aligned(numel)]

    @property
    def exp_avg(self) -> np.ndarray:
        return self._m[0]

    @property
    def exp_avg_sq(self) -> np.ndarray:
        return self._v[0]

    @functools.cached_property
    def defaults(self) -> HyperGroup:
        return HyperGroup(self.numel, self.lr, self.weight_decay, *self.betas)

    def _check_group(self, index: int, group: HyperGroup) -> None:
        for name, beta in (("beta1", group.momentum), ("beta2", group.dampening)):
            if not beta < 1.0:
                raise InvalidHyperparameters(f"group {index}: {name} is {beta}; it must be in [0, 1)")
        problem = _derived_problem(self.name, group.lr, group.momentum, group.weight_decay)
        if problem is not None:
            raise InvalidHyperparameters(
                f"group {index}: lr {group.lr:g}, beta1 {group.momentum:g}, weight decay "
                f"{group.weight_decay:g}: {problem}"
            )

    def _step_range(self, w_out, w_in, grad, scale, start, stop, grad_dtype, values):
        # A group's momentum and dampening carry Adam's beta1 and beta2.
        return self._kernels.adam_step(
            w_out[start:stop],
            w_in[start:stop],
            grad[start:stop],
            self._m[1][start:stop],
            self._m[0][start:stop],
            self._v[1][start:stop],
            self._v[0][start:stop],
            self.steps + 1,
            values.lr,
            values.momentum,
            values.dampening,
            self.eps,
            values.weight_decay,
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


class Adam(AdamRule):
    """Adam, computed as ``torch.optim.Adam`` computes it (weight decay added to the gradient)."""

    name = "adam"
    decoupled = False


class AdamW(AdamRule):
    """AdamW: Adam with decoupled weight decay, as ``torch.optim.AdamW``."""

    name = "adamw"
    decoupled = True

    def __init__(
        self,
        numel: int,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        kernels: ModuleType = _core,
    ) -> None:
        super().__init__(numel, lr, betas, eps, weight_decay, kernels)


class DelayedNesterov(Optimizer):
    """Delayed Nesterov, the outer optimizer of asynchronous local SGD (Liu et al., 2024,
    "Asynchronous Local-SGD Training for Language Modeling", Algorithm 3).

    Each push ``d`` (the scaled gradient: a worker's pseudo-gradient) moves the weights by
    ``d / N`` at once; the momentum moves only every ``period`` (N) pushes, by the mean of
    the period's pushes, which :attr:`delta` sums meanwhile. Between those milestones a share
    ``c`` (the paper's momentum activation) of the momentum is applied at each push, and at
    the milestone the rest (``1 - cN + c``), so a period applies the momentum once in all.
    Under asynchronous training this keeps one fast worker's burst of pushes from driving the
    momentum alone. With N = 1 it is ``torch.optim.SGD``'s Nesterov step, bit for bit.

    The step count is the push count (a BSP round is one push). No weight decay or
    dampening: a HYPER group gives a learning rate and a momentum only.
    """

    name = "delayed-nesterov"
    state_names = OPTIMIZER_STATE["delayed-nesterov"]

    def __init__(
        self,
        numel: int,
        lr: float,
        momentum: float = 0.9,
        period: int = 1,
        c: float = 0.0,
        kernels: ModuleType = _core,
    ) -> None:
        super().__init__(numel, lr, kernels)
        _require(momentum >= 0.0, f"invalid momentum {momentum}: must be >= 0")
        _require(1 <= period <= MAX_PERIOD, f"invalid period {period}: must be in 1..{MAX_PERIOD}")
        _require(
            0.0 <= c and c * (period - 1) <= 1.0,
            f"invalid momentum activation {c} for a period of {period}: must be in [0, 1/(N-1)] so that the "
            "milestone's share 1 - cN + c is not negative",
        )
        self.momentum = float(momentum)
        self.period = int(period)
        self.c = float(c)
        self._m = [line_aligned(numel), line_aligned(numel)]
        self._delta = [line_aligned(numel), line_aligned(numel)]

    @property
    def momentum_buffer(self) -> np.ndarray:
        return self._m[0]

    @property
    def delta(self) -> np.ndarray:
        """The sum of the pushes since the last milestone."""
        return self._delta[0]

    @property
    def milestone(self) -> bool:
        """The next step moves the momentum (it ends a period)."""
        return (self.steps + 1) % self.period == 0

    @functools.cached_property
    def defaults(self) -> HyperGroup:
        return HyperGroup(self.numel, self.lr, 0.0, self.momentum, 0.0)

    def _check_group(self, index: int, group: HyperGroup) -> None:
        if group.weight_decay != 0.0 or group.dampening != 0.0:
            raise InvalidHyperparameters(
                f"group {index}: weight decay {group.weight_decay}, dampening {group.dampening}: "
                f"{self.name} takes a learning rate and a momentum only (both others must be 0)"
            )

    def _step_range(self, w_out, w_in, grad, scale, start, stop, grad_dtype, values):
        milestone = self.milestone
        return self._kernels.delayed_nesterov_step(
            w_out[start:stop],
            w_in[start:stop],
            grad[start:stop],
            self._m[1][start:stop] if milestone else None,
            self._m[0][start:stop],
            self._delta[1][start:stop],
            self._delta[0][start:stop],
            self.steps + 1,
            values.lr,
            values.momentum,
            self.period,
            self.c,
            scale,
            grad_dtype,
        )

    def commit(self) -> None:
        if self.milestone:  # (between milestones the momentum is read, not written: the current one stays)
            self._m.reverse()
        self._delta.reverse()
        super().commit()

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "period": self.period, "c": self.c}

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"momentum_buffer": self._m[0], "delta": self._delta[0]}

    def state_problem(self, arrays, steps):
        problem = super().state_problem(arrays, steps)
        if problem is None and steps % self.period == 0 and any(np.any(part) for part in arrays["delta"]):
            return (
                f"steps is {steps}, a multiple of the period {self.period}, but delta (the sum of the pushes "
                "since the last milestone) is not zero: a milestone empties it"
            )
        return problem

    def describe(self) -> str:
        return f"{self.name} lr={self.lr:g} momentum={self.momentum:g} period={self.period} c={self.c:g}"


#: The longest period of :class:`DelayedNesterov` (the kernels divide by it in float32, exactly).
MAX_PERIOD = 1 << 24

OPTIMIZERS: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adam": Adam,
    "adamw": AdamW,
    DelayedNesterov.name: DelayedNesterov,
}


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
    period: int = 1,
    c: float = 0.0,
    kernels: ModuleType = _core,
    threads: KernelThreads = ONE_THREAD,
) -> Optimizer:
    """The optimizer called ``name`` (``sgd``, ``adam``, ``adamw`` or ``delayed-nesterov``,
    whose ``period`` and ``c`` these are) for ``numel`` parameters, its large steps run on
    ``threads``."""
    optimizer: Optimizer
    if name in OPTIMIZERS:
        check_kernel_values(name, lr=lr, momentum=momentum, weight_decay=weight_decay, betas=betas, eps=eps)
    if name == "sgd":
        optimizer = SGD(numel, lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, kernels=kernels)
    elif name in ("adam", "adamw"):
        _require(momentum == 0.0 and not nesterov, f"--momentum/--nesterov apply to sgd, not {name}")
        rule = Adam if name == "adam" else AdamW
        optimizer = rule(numel, lr, betas=betas, eps=eps, weight_decay=weight_decay, kernels=kernels)
    elif name == DelayedNesterov.name:
        _require(not nesterov, f"--nesterov applies to sgd: {name} is Nesterov's step by construction")
        _require(weight_decay == 0.0, f"{name} takes no weight decay")
        optimizer = DelayedNesterov(numel, lr, momentum=momentum, period=period, c=c, kernels=kernels)
    else:
        raise ConfigurationError(f"unknown optimizer {name!r}: choose from {', '.join(OPTIMIZERS)}")
    optimizer.threads = threads
    return optimizer
