"""Training on a virtual clock: the sync paradigms at the papers' scale on one machine.

:class:`aps.lab.clock.VirtualCluster` drives the real engine (the same sync
policies, staleness window and update kernels as a server) on a virtual
clock; here its workers compute real gradients of the bundled CNN, each on
exactly the weights its pull returned, one at a time in virtual-time order.
So 30 or 256 workers cost only their gradients, a run does not depend on
this machine's load, and a seed reproduces it exactly.

Seeds: ``init_seed`` fixes the train/test split and the initial weights (the
same for every run of a comparison, as in ``aps compare``); ``seed`` fixes
the run: each worker's data order and every iteration time.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .clock import IterationTimes, SimulationError, Stragglers, VirtualCluster
from .settings import Setting
from ..config import ServerConfig
from ..errors import NonFiniteGradient
from ..layout import Layout
from ..wire.protocol import DType
from ..wire.quantized import quantize
from ..workloads.data import Dataset, load, shard
from ..workloads.models import accuracy, make_model

__all__ = [
    "VirtualTrainer",
    "accuracy_at",
    "agreement",
    "curve_distance",
    "mean_staleness",
    "staleness_distance",
    "train_virtual",
]


class VirtualTrainer:
    """The model, the data and the gradient computation of a virtual run."""

    def __init__(
        self,
        dataset: Dataset,
        workers: int,
        *,
        batch_size: int,
        init_seed: int,
        seed: int,
        inner: tuple[float, float] | None = None,
        compression: str | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        #: Local SGD: the inner SGD's learning rate and momentum (None: each push is one gradient).
        self.inner = inner
        self._inner_state: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per worker: momentum, scratch
        #: ``"int8"``/``"int4"``: each push block-quantized with error feedback, as aps.Worker sends
        #: it (the engine applies what the server decodes); None: float32.
        self.compression = None if compression is None else int({"int8": DType.INT8Q, "int4": DType.INT4Q}[compression])
        self._residuals: dict[int, np.ndarray] = {}  # per worker: the error feedback
        #: The bytes the pushes' payloads would take on the wire, all workers together.
        self.pushed_bytes = 0
        self.model = make_model(dataset.side, seed=init_seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        named = {name: p.detach().numpy().copy() for name, p in self.model.named_parameters() if p.requires_grad}
        self.layout = Layout.from_arrays(named)
        self.initial = np.concatenate([v.ravel() for v in named.values()])
        # The model's parameters are views into one flat tensor, loaded with a snapshot's weights per gradient.
        self._flat = torch.from_numpy(self.initial.copy())
        self._flat_np = self._flat.numpy()
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.data = self._flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self._shards = [shard(dataset, rank, workers) for rank in range(workers)]
        self._rngs = [np.random.default_rng([seed, rank]) for rank in range(workers)]
        self._orders = [np.empty(0, np.int64)] * workers
        self._at = [0] * workers
        self.gradients = 0
        self.seconds = 0.0  # wall time spent computing gradients
        self.eval_seconds = 0.0  # and measuring test accuracy
        self.non_finite_loss = False

    def _batch(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._shards[rank]
        size = min(self.batch_size, len(y))
        if self._at[rank] + size > len(self._orders[rank]):  # a new epoch of this worker's shard
            self._orders[rank] = self._rngs[rank].permutation(len(y))
            self._at[rank] = 0
        index = torch.from_numpy(self._orders[rank][self._at[rank] : self._at[rank] + size])
        self._at[rank] += size
        return x[index], y[index]

    def compute(self, rank: int, weights: np.ndarray, grad_out: np.ndarray, steps: int = 1) -> None:
        """What worker ``rank`` pushes from ``weights``: the gradient of the mean cross-entropy of
        its next batch; under local SGD, its pseudo-gradient after ``steps`` inner SGD steps
        (``weights`` minus where they took it; the inner momentum kept across syncs, as DiLoCo
        keeps its inner optimizer's state)."""
        if self.inner is None:
            if steps != 1:
                raise ValueError("a worker without local SGD pushes one gradient an iteration")
            self._gradient(rank, weights, grad_out)
        else:
            self._local_steps(rank, weights, grad_out, steps)
        if self.compression is None:
            self.pushed_bytes += grad_out.nbytes
            return
        residual = self._residuals.setdefault(rank, np.zeros_like(grad_out))
        wanted = grad_out + residual
        payload, sent = quantize(wanted, self.compression)
        if np.isfinite(wanted).all() and np.isfinite(sent).all():
            np.subtract(wanted, sent, out=residual)
        grad_out[:] = sent  # what the server's kernels decode from the payload
        self.pushed_bytes += payload.nbytes

    def _local_steps(self, rank: int, weights: np.ndarray, grad_out: np.ndarray, steps: int) -> None:
        assert self.inner is not None  # (compute calls this under local SGD only)
        lr, momentum = (np.float32(value) for value in self.inner)
        if rank not in self._inner_state:
            self._inner_state[rank] = (np.zeros_like(weights), np.empty_like(weights))
        buf, grad = self._inner_state[rank]
        local = weights.copy()
        for _ in range(steps):
            self._gradient(rank, local, grad)
            if momentum:
                buf *= momentum
                buf += grad
                local -= lr * buf
            else:
                local -= lr * grad
        np.subtract(weights, local, out=grad_out)

    def _gradient(self, rank: int, weights: np.ndarray, grad_out: np.ndarray) -> None:
        start = time.perf_counter()
        np.copyto(self._flat_np, weights)
        x, y = self._batch(rank)
        for p in self.params:
            p.grad = None
        loss = F.cross_entropy(self.model(x), y)
        if not math.isfinite(loss.item()):
            self.non_finite_loss = True
        loss.backward()
        grads = []
        for p in self.params:
            assert p.grad is not None  # every parameter takes part in the loss
            grads.append(p.grad.reshape(-1))
        torch.cat(grads, out=torch.from_numpy(grad_out))
        self.gradients += 1
        self.seconds += time.perf_counter() - start

    def evaluate(self, weights: np.ndarray) -> float:
        """Test accuracy of ``weights``."""
        start = time.perf_counter()
        np.copyto(self._flat_np, weights)
        result = accuracy(self.model, self.dataset.x_test, self.dataset.y_test)
        self.eval_seconds += time.perf_counter() - start
        return result


def train_virtual(
    setting: Setting,
    speeds: list[float],
    *,
    dataset: str | Dataset = "mnist",
    lr: float = 0.05,
    momentum: float = 0.0,
    batch_size: int = 32,
    lr_staleness: str = "none",
    jitter: float = 0.0,
    stragglers: Stragglers | None = None,
    iterations: int | None = None,
    budget: float | None = None,
    eval_every: float | None = None,
    target: float | None = None,
    stop_at_target: bool = False,
    seed: int = 0,
    init_seed: int = 0,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Train the bundled CNN on ``dataset`` with one sync ``setting`` on a virtual cluster of
    ``len(speeds)`` workers (mean iteration times ``speeds``, virtual seconds), until
    ``iterations`` gradients were pushed or ``budget`` virtual seconds passed (at least one
    of them), or the target is reached with ``stop_at_target``.

    The server applies SGD with ``lr`` and ``momentum`` to each worker's gradient (the mean
    over its batch of ``batch_size``); ``lr_staleness`` is the server's ``--lr-staleness``.
    Test accuracy is measured every ``eval_every`` virtual seconds (default: budget / 25,
    or a 25th of the expected time of ``iterations``).

    Returns a JSON-able record: the test accuracy against virtual time (``curve``, [time,
    accuracy] rows) and against gradients applied (``curve_gradients``), every evaluation
    (``evaluations``: time, gradients applied, updates, accuracy), ``time_to_target_s`` and
    ``gradients_to_target``, ``best`` and
    ``final_accuracy``, the staleness distribution and gate waits, ``diverged``, and the
    wall time spent (``wall_s``, of which ``gradient_s`` computing gradients and ``eval_s``
    measuring accuracy).
    """
    if iterations is None and budget is None:
        raise ValueError("give iterations, or a virtual-time budget")
    data = load(dataset, seed=init_seed) if isinstance(dataset, str) else dataset
    workers = len(speeds)
    local = setting.local_every
    trainer = VirtualTrainer(
        data,
        workers,
        batch_size=batch_size,
        init_seed=init_seed,
        seed=seed,
        inner=None if local is None else (lr, momentum),
        compression=setting.compression,
    )
    config = ServerConfig(
        workers=workers,
        heartbeat_timeout=0,
        # (a +inverse setting says its own; a local SGD setting, its outer optimizer: lr and momentum are the inner's)
        **{"lr": lr, "momentum": momentum, "lr_staleness": lr_staleness, **setting.options},
    )
    times = IterationTimes(speeds, jitter, stragglers, seed)
    wall = time.perf_counter()
    cluster = VirtualCluster(
        config,
        times,
        trainer.layout,
        trainer.initial,
        trainer.compute,
        local=None if local is None else (local, setting.dynamic),
    )
    if eval_every is None:
        if budget is not None:
            horizon = budget
        else:
            assert iterations is not None  # one of the two is given (checked above)
            horizon = iterations * float(np.mean(speeds)) / workers
        eval_every = horizon / 25
    curve: list[list[float]] = []
    reached_at = reached_after = None
    diverged = False

    def evaluate(at: float) -> None:
        nonlocal reached_at, reached_after
        applied = len(cluster.staleness)
        weights = cluster.engine.weights
        assert weights is not None  # the cluster's workers have initialized the model
        acc = trainer.evaluate(weights)
        curve.append([round(at, 6), applied, cluster.engine.version, acc])
        if target is not None and reached_at is None and acc >= target:
            reached_at, reached_after = at, applied
        if progress is not None:
            progress({"time": at, "gradients": applied, "accuracy": acc})

    next_eval = 0.0
    while True:
        upcoming = cluster.next_time
        limit = min(upcoming, budget if budget is not None else math.inf)
        while next_eval <= limit:  # the weights as they are before the next push arrives
            evaluate(next_eval)
            next_eval += eval_every
        if (budget is not None and upcoming > budget) or (iterations is not None and cluster.batches >= iterations):
            break
        if stop_at_target and reached_at is not None:
            break
        try:
            cluster.step()
        except SimulationError:
            if isinstance(cluster.error, NonFiniteGradient):
                diverged = True
                break
            raise
        if trainer.non_finite_loss:
            diverged = True
            break
    end = cluster.now if budget is None else min(budget, max(cluster.now, upcoming))
    if not curve or curve[-1][0] < end:
        evaluate(end)
    wall = time.perf_counter() - wall
    figures = cluster.sync_figures()
    return {
        "sync": setting.label,
        "policy": cluster.engine.policy.describe(),
        "lr_staleness": lr_staleness,
        "workers": workers,
        "speeds": list(speeds),
        "jitter": jitter,
        "stragglers": None if stragglers is None else vars(stragglers),
        "dataset": data.name,
        "lr": lr,
        "momentum": momentum,
        **(
            {
                "local_every": local,
                "dynamic": setting.dynamic,
                "outer": f"{config.optimizer} lr={config.lr:g} momentum={config.momentum:g}",
                "steps": cluster.batches,
                "syncs_per_worker": cluster.per_worker,
            }
            if local is not None
            else {}
        ),
        "batch_size": batch_size,
        "seed": seed,
        "init_seed": init_seed,
        "target": target,
        "time_to_target_s": reached_at,
        "gradients_to_target": reached_after,
        "best_accuracy": max(row[3] for row in curve),
        "final_accuracy": curve[-1][3],
        "diverged": diverged,
        "simulated_s": end,
        "pushes": cluster.pushes,
        "compression": setting.compression,
        "bytes_pushed": trainer.pushed_bytes,
        "gradients_applied": len(cluster.staleness),
        "updates": cluster.engine.version,
        "iterations_per_s": cluster.batches / end if end > 0 else 0.0,  # (local SGD: inner steps, not syncs)
        "mean_wait_s": figures["mean_wait"],
        **figures,
        "slow_time_s": list(times.slow_time),
        "curve": [[row[0], row[3]] for row in curve],
        "curve_gradients": [[row[1], row[3]] for row in curve],
        "evaluations": curve,
        "wall_s": wall,
        "gradient_s": trainer.seconds,
        "eval_s": trainer.eval_seconds,
    }


# Comparing runs: virtual against real ------------------------------------------------------------


def accuracy_at(curve: list[list[float]], points: list[float]) -> list[float]:
    """The accuracy of ``curve`` (``[x, accuracy]`` rows, x increasing) at each of ``points``,
    linearly interpolated (held at the ends)."""
    xs = [row[0] for row in curve]
    ys = [row[1] for row in curve]
    return [float(v) for v in np.interp(points, xs, ys)]


def curve_distance(a: list[list[float]], b: list[list[float]], points: list[float]) -> float:
    """Mean absolute difference of two accuracy curves at ``points``."""
    return float(np.mean(np.abs(np.subtract(accuracy_at(a, points), accuracy_at(b, points)))))


def staleness_distance(a: dict[str, int], b: dict[str, int]) -> float:
    """Total variation distance of two staleness histograms (``{staleness: count}``): half the
    sum of the absolute differences of their fractions, 0 (the same) to 1 (disjoint)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    if not total_a or not total_b:
        raise ValueError("an empty staleness histogram")
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0) / total_a - b.get(k, 0) / total_b) for k in keys)


def mean_staleness(hist: dict[str, int]) -> float:
    """The mean of a staleness histogram."""
    return sum(int(k) * n for k, n in hist.items()) / sum(hist.values())


def agreement(real: list[dict], virtual: list[dict], points: int = 20) -> dict:
    """How far ``virtual`` runs are from ``real`` ones (records with ``curve_gradients`` and
    ``staleness_hist``, one setting), against how far the real runs are from each other:
    mean distances over every (virtual, real) pair and over every pair of real runs, of the
    accuracy against gradients applied (at ``points`` evenly spaced counts up to the fewest
    any run reached) and of the staleness distributions; and each run's mean staleness."""
    if len(real) < 2 or not virtual:
        raise ValueError("agreement needs two real runs or more and a virtual one")
    end = min(r["curve_gradients"][-1][0] for r in real + virtual)
    grid = [end * (i + 1) / points for i in range(points)]
    across = [(v, r) for v in virtual for r in real]
    within = list(itertools.combinations(real, 2))

    def mean(pairs, distance) -> float:
        return statistics.fmean(distance(a, b) for a, b in pairs)

    def accuracy(a, b) -> float:
        return curve_distance(a["curve_gradients"], b["curve_gradients"], grid)

    def staleness(a, b) -> float:
        return staleness_distance(a["staleness_hist"], b["staleness_hist"])

    return {
        "gradients_compared": end,
        "accuracy_distance_virtual_real": mean(across, accuracy),
        "accuracy_distance_real_real": mean(within, accuracy),
        "staleness_tvd_virtual_real": mean(across, staleness),
        "staleness_tvd_real_real": mean(within, staleness),
        "mean_staleness_real": [mean_staleness(r["staleness_hist"]) for r in real],
        "mean_staleness_virtual": [mean_staleness(v["staleness_hist"]) for v in virtual],
        "final_accuracy_real": [r["curve_gradients"][-1][1] for r in real],
        "final_accuracy_virtual": [v["curve_gradients"][-1][1] for v in virtual],
    }
