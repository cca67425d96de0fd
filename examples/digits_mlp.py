#!/usr/bin/env python
"""Train a small MLP on scikit-learn's handwritten digits with aps.

The 1,797 8x8 digits ship inside scikit-learn, so nothing is downloaded. The
model is plain numpy (no deep-learning framework needed): the point is the
parameter server, not the model.

Run everything locally (a real ``aps serve`` process and P worker processes)::

    python examples/digits_mlp.py --workers 4 --sync ssp --staleness 2

Or run one worker against a server started elsewhere (``aps serve --workers 2``)::

    python examples/digits_mlp.py --address tcp://HOST:7450 --rank 0 --workers 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

import aps


def load_digits(seed: int = 0, test_fraction: float = 0.2):
    """Standardized digits, shuffled with ``seed``, split into train and test."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = data.data.astype(np.float32) / 16.0
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    n_test = int(len(y) * test_fraction)
    mean, std = x[n_test:].mean(axis=0), x[n_test:].std(axis=0) + 1e-3
    x = (x - mean) / std
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def init_params(hidden: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((64, hidden)) * np.sqrt(2.0 / 64)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 10)) * np.sqrt(1.0 / hidden)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def forward(p, x):
    h = np.maximum(x @ p["w1"] + p["b1"], 0.0)
    logits = h @ p["w2"] + p["b2"]
    return h, logits


def accuracy(p, x, y) -> float:
    return float((forward(p, x)[1].argmax(axis=1) == y).mean())


def gradients(p, x, y, out: dict[str, np.ndarray]) -> float:
    """Mean softmax cross-entropy over the batch; writes its gradients into ``out``."""
    h, logits = forward(p, x)
    logits = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = float(-np.log(probs[np.arange(len(y)), y] + 1e-12).mean())
    d_logits = probs
    d_logits[np.arange(len(y)), y] -= 1.0
    d_logits /= len(y)
    out["w2"][:] = h.T @ d_logits
    out["b2"][:] = d_logits.sum(axis=0)
    d_h = (d_logits @ p["w2"].T) * (h > 0)
    out["w1"][:] = x.T @ d_h
    out["b1"][:] = d_h.sum(axis=0)
    return loss


def train_worker(address: str, rank: int, workers: int, args, report=None) -> dict:
    (x_train, y_train), (x_test, y_test) = load_digits(args.seed)
    shard = np.arange(rank, len(y_train), workers)  # each worker sees its own slice
    rng = np.random.default_rng(args.seed + rank)
    history = []
    start = time.perf_counter()
    with aps.Worker(address, rank, workers) as worker:
        weights = worker.init(init_params(args.hidden, args.seed))
        grads = worker.grads  # views into the worker's flat gradient buffer
        steps_per_epoch = max(1, len(shard) // args.batch_size)
        for epoch in range(1, args.epochs + 1):
            rng.shuffle(shard)
            losses = []
            for step in range(steps_per_epoch):
                batch = shard[step * args.batch_size : (step + 1) * args.batch_size]
                losses.append(gradients(weights, x_train[batch], y_train[batch], grads))
                if args.slowdown and rank == workers - 1:
                    time.sleep(args.slowdown)  # an unevenly fast cluster
                weights = worker.push_pull(grads)
            entry = {
                "epoch": epoch,
                "loss": float(np.mean(losses)),
                "test_accuracy": accuracy(weights, x_test, y_test),
                "seconds": time.perf_counter() - start,
                "version": worker.version,
            }
            history.append(entry)
            if report is not None:
                report(rank, entry)
        if getattr(args, "save", None) and rank == 0:
            np.savez(args.save, **weights)
    return {"rank": rank, "history": history}


def _worker_process(address, rank, workers, args, queue) -> None:
    try:
        result = train_worker(address, rank, workers, args, report=lambda r, e: queue.put(("epoch", r, e)))
        queue.put(("done", rank, result))
    except BaseException as exc:
        queue.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def run_local(args) -> int:
    """Start a real ``aps serve`` and ``--workers`` worker processes; print rank 0's progress."""
    cmd = [sys.executable, "-m", "aps", "serve", "--port", "0", "--workers", str(args.workers), "--sync", args.sync,
           "--staleness", str(args.staleness), "--lr", str(args.lr), "--momentum", str(args.momentum),
           "--log-level", "warning"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline().strip()
        address = line.rsplit(" ", 1)[-1]
        print(f"{line}  ({args.workers} workers, sync {args.sync}"
              + (f" s={args.staleness}" if args.sync == "ssp" else "") + f", lr {args.lr})")
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker_process, args=(address, r, args.workers, args, queue)) for r in range(args.workers)]
        for proc in procs:
            proc.start()
        print(f"{'epoch':>5} {'loss':>8} {'test acc':>9} {'version':>8} {'seconds':>8}   (rank 0)")
        finished, failed, final = 0, False, None
        while finished < args.workers:
            kind, rank, payload = queue.get(timeout=600)
            if kind == "epoch" and rank == 0:
                print(f"{payload['epoch']:>5} {payload['loss']:>8.4f} {payload['test_accuracy']:>9.3f} "
                      f"{payload['version']:>8} {payload['seconds']:>8.2f}", flush=True)
            elif kind == "done":
                finished += 1
                if rank == 0:
                    final = payload["history"][-1]
            elif kind == "error":
                print(f"worker {rank} failed: {payload}", file=sys.stderr)
                failed, finished = True, finished + 1
        for proc in procs:
            proc.join(30)
        if final is not None:
            print(f"final test accuracy {final['test_accuracy']:.3f} after {final['seconds']:.1f} s")
        return 1 if failed else 0
    finally:
        server.terminate()
        server.wait(10)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("APS_ADDRESS") or None,
                        help="join this server instead of starting one (then also give --rank; default: "
                             "$APS_ADDRESS, as aps launch and a cluster's manifests set it)")
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    parser.add_argument("--workers", type=int, default=int(os.environ.get("WORLD_SIZE", 4)))
    parser.add_argument("--sync", default="ssp", choices=("bsp", "asp", "ssp"))
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slowdown", type=float, default=0.0, help="seconds the last worker sleeps per step")
    parser.add_argument("--save", help="with --address: rank 0 writes the final weights to this .npz file")
    args = parser.parse_args(argv)
    if args.address:
        result = train_worker(args.address, args.rank, args.workers, args)
        last = result["history"][-1]
        print(f"rank {args.rank}: test accuracy {last['test_accuracy']:.3f} after {last['seconds']:.1f} s")
        return 0
    return run_local(args)


if __name__ == "__main__":
    sys.exit(main())
