"""Bodies of worker processes used by the integration tests (importable by spawned children)."""

from __future__ import annotations

import functools
import os
import signal
import time

import numpy as np

import aps


def regression_data(seed: int = 7, n: int = 600, d: int = 8):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w_true = rng.standard_normal(d).astype(np.float32)
    y = (x @ w_true + 0.1 * rng.standard_normal(n)).astype(np.float32)
    return x, y


def regression_gradient(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray):
    """Gradient of the mean squared error 0.5 * mean((x w + b - y)^2)."""
    residual = x @ w + b - y
    return (x.T @ residual / len(y)).astype(np.float32), np.array([residual.mean()], np.float32)


def batch_indices(rank: int, workers: int, step: int, batch: int, n: int) -> np.ndarray:
    """Worker ``rank``'s batch at ``step``: the workers' batches tile one large batch."""
    start = (step * workers + rank) * batch
    return np.arange(start, start + batch) % n


def bsp_regression_worker(address: str, rank: int, workers: int, steps: int, batch: int, transport: str = "auto"):
    x, y = regression_data()
    with aps.Worker(address, rank, workers, transport=transport) as worker:
        params = worker.init({"w": np.zeros(x.shape[1], np.float32), "b": np.zeros(1, np.float32)})
        for step in range(steps):
            idx = batch_indices(rank, workers, step, batch, len(y))
            gw, gb = regression_gradient(params["w"], params["b"], x[idx], y[idx])
            params = worker.push_pull({"w": gw, "b": gb})
        return rank, worker.version, params["w"].copy(), params["b"].copy()


def constant_pusher(address: str, rank: int, workers: int, numel: int, pushes: int, transport: str = "auto"):
    """Pushes gradients that are constant vectors: every consistent snapshot is constant."""
    with aps.Worker(address, rank, workers, transport=transport) as worker:
        worker.init({"w": np.zeros(numel, np.float32)})
        grad = worker.flat_grad
        assert grad is not None  # init made it
        for i in range(pushes):
            grad.fill(1.0 if (i + rank) % 2 else -0.5)
            worker.push_pull(grad)
        return rank, worker.clock


def snapshot_checker(address: str, rank: int, workers: int, numel: int, seconds: float, transport: str = "auto"):
    """Pulls in a loop; counts pulls, distinct versions, and torn (non-constant) snapshots."""
    torn, pulls, versions = 0, 0, set()
    with aps.Worker(address, rank, workers, transport=transport) as worker:
        assert transport == "auto" or worker.transport == transport
        weights = worker.init({"w": np.zeros(numel, np.float32)})["w"]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            worker.pull()
            pulls += 1
            versions.add(worker.version)
            if not (weights == weights[0]).all():
                torn += 1
        return rank, pulls, len(versions), torn


def idle_worker(address: str, rank: int, workers: int, numel: int, ready_path: str, transport: str = "auto"):
    """Joins, says so by creating ``ready_path``, then waits to be killed."""
    worker = aps.Worker(address, rank, workers, transport=transport)
    worker.init({"w": np.zeros(numel, np.float32)})
    with open(ready_path, "w") as fh:
        fh.write(str(os.getpid()))
    signal.pause()


def run_role(role: str, args: tuple):
    """One process of a mixed test: ``push`` runs constant_pusher, ``check`` snapshot_checker."""
    return (constant_pusher if role == "push" else snapshot_checker)(*args)


def paced_worker(address: str, rank: int, workers: int, step_time: float, seconds: float, transport: str = "auto"):
    """Iterates for ``seconds``, each iteration taking ``step_time`` (an uneven cluster)."""
    iterations = 0
    with aps.Worker(address, rank, workers, transport=transport) as worker:
        worker.init({"w": np.zeros(16, np.float32)})
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(step_time)
            worker.grads["w"][:] = 0.01
            worker.push_pull(worker.grads)
            iterations += 1
    return rank, iterations


# PyTorch -----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def digits():
    from aps import workloads

    return workloads.load("digits", seed=0)


def digits_batches(rank: int, workers: int, step: int, batch: int):
    """Worker ``rank``'s batch of the bundled digits at ``step`` (the workers' batches tile one large batch)."""
    import torch

    data = digits()
    idx = torch.from_numpy(batch_indices(rank, workers, step, batch, len(data.y_train)))
    return data.x_train[idx], data.y_train[idx]


def torch_bsp_worker(
    address: str, rank: int, workers: int, steps: int, batch: int, transport: str = "auto", staging: bool = False
):
    """Trains the digits CNN through ``aps.torch.Optimizer``; returns its final parameters."""
    import torch
    from torch.nn import functional as F

    import aps.torch
    from aps import workloads

    torch.set_num_threads(1)
    digits()  # loaded before joining: on a loaded machine it can outlast the server's handshake deadline
    model = workloads.make_model(8, seed=0)
    with aps.torch.Optimizer(model, address, rank, workers, transport=transport, staging=staging) as opt:
        for step in range(steps):
            x, y = digits_batches(rank, workers, step, batch)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return rank, opt.version, [p.detach().numpy().copy() for p in model.parameters()]


def steady_worker(address: str, rank: int, workers: int, numel: int, transport: str, steps, errors, stop):
    """Pushes and pulls until ``stop`` is set, counting its steps in ``steps[rank]``. An error
    (the server dropped it) is put on ``errors`` as ``(rank, class name, message)``; then it
    rejoins with reconnect() and goes on."""
    worker = aps.Worker(address, rank, workers, transport=transport, heartbeat=0.2, reconnect=False)
    worker.init({"w": np.zeros(numel, np.float32)})
    while not stop.is_set():
        try:
            worker.push_pull(worker.grads)
            steps[rank] += 1
            time.sleep(0.01)
        except aps.APSError as exc:
            errors.put((rank, type(exc).__name__, str(exc)))
            worker.reconnect()
    worker.close()


def resilient_worker(
    address: str,
    rank: int,
    workers: int,
    numel: int,
    steps: int,
    pause: float,
    transport: str = "auto",
    stop_path: str | None = None,
):
    """Trains until its clock reaches ``steps`` (or the file ``stop_path`` exists), whatever
    happens to the server meanwhile (the worker reconnects by itself). Returns (rank, clock,
    version, pushes sent, pushes dropped)."""
    sent = dropped = 0
    with aps.Worker(address, rank, workers, transport=transport, reconnect_timeout=60, heartbeat=0.5) as worker:
        worker.init({"w": np.zeros(numel, np.float32)})
        grad = np.full(numel, 0.01 * (rank + 1), np.float32)
        while worker.clock < steps and not (stop_path and os.path.exists(stop_path)):
            worker.push_pull(grad)
            sent += 1
            dropped += worker.last_push_dropped
            time.sleep(pause)
        return rank, worker.clock, worker.version, sent, dropped


def stepped_gradient(weights: np.ndarray, clock: int) -> np.ndarray:
    """A gradient that depends on the weights and the step, the same in every run."""
    return (0.1 * weights + np.sin(np.arange(weights.size, dtype=np.float32) + clock)).astype(np.float32)
