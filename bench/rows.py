#!/usr/bin/env python
"""The server's row store against torch's own sparse embedding, measured in one run.

One batch of ``--batch`` ids (Zipf(1.1)-skewed: a few ids many times, as recommender
traffic is) into a table of ``--rows`` declared rows of ``--dim`` float32 values, of which
``--touched`` rows are held (made by pushes of zeros first). Per optimizer, in one thread:

- ``aps pull``: ``RowTable.pull(ids, out=...)`` (the index lookup and the gather of rows);
- ``aps push``: ``RowTable.push(ids, grads)`` (lookup, distinct rows copied out, the
  native row kernel, written back);
- ``torch``: the same step on ``nn.Embedding(touched, dim, sparse=True)``: the forward's
  gather, and ``optimizer.step()`` with the sparse gradient (SGD, Adagrad, SparseAdam);
- the dense bound: one fused SGD pass (``aps._core.sgd_step``) over as many bytes as the
  batch's rows, what a dense push of those bytes costs the server.

Windows of ``--steps`` steps are interleaved across ``--repeats``; the figures are medians
and the ratios of medians. Example: ``python bench/rows.py --out bench/results/rows.json``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from aps import _core
from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, write_report
from aps.server.engine.rows import RowTable
from aps.tables import Table

TORCH = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.SparseAdam}


def batches(seed: int, count: int, batch: int, touched: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.zipf(1.1, batch) % touched).astype(np.int64) for _ in range(count)]


def timed(step, inputs: list) -> float:
    """Seconds per step of ``step(x)`` over ``inputs``."""
    began = time.perf_counter()
    for x in inputs:
        step(x)
    return (time.perf_counter() - began) / len(inputs)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10**8, help="declared rows (default 10^8)")
    parser.add_argument("--touched", type=int, default=1_000_000, help="rows held (default 10^6)")
    parser.add_argument("--dim", type=int, default=64, help="values a row (default 64)")
    parser.add_argument("--batch", type=int, default=4096, help="ids a batch (default 4096)")
    parser.add_argument("--steps", type=int, default=50, help="steps per window (default 50)")
    parser.add_argument("--repeats", type=int, default=5, help="windows per point (default 5)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.sparse.check_sparse_tensor_invariants.disable()
    ids = batches(0, args.steps, args.batch, args.touched)
    grads = np.random.default_rng(1).standard_normal((args.batch, args.dim)).astype(np.float32)
    torch_grads = torch.from_numpy(grads)
    numel = args.batch * args.dim
    dense = [np.zeros(numel, np.float32) for _ in range(2)]
    dense_grad = np.full(numel, 1e-3, np.float32)
    rows_out = np.empty((args.batch, args.dim), np.float32)

    setups = {}
    for name in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
        table = RowTable("items", Table(rows=args.rows, dim=args.dim, init="uniform:0.01", optimizer=name, lr=0.01))
        for start in range(0, args.touched, 100_000):
            made = np.arange(start, min(start + 100_000, args.touched), dtype=np.int64)
            table.push(made, np.zeros((len(made), args.dim), np.float32))
        emb = None
        if name in TORCH:
            emb = torch.nn.Embedding(args.touched, args.dim, sparse=True)
            setups[name] = (table, emb, TORCH[name](emb.parameters(), lr=0.01))
        else:
            setups[name] = (table, None, None)

    def torch_step(emb, opt):
        def step(x):
            opt.zero_grad()
            emb(torch.from_numpy(x)).backward(torch_grads)
            opt.step()
        return step

    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        samples.setdefault(("dense", "sgd pass"), []).append(
            timed(lambda x: _core.sgd_step(dense[1], dense[0], dense_grad, None, None, 0.01), ids))
        for name, (table, emb, opt) in setups.items():
            samples.setdefault((name, "aps pull"), []).append(timed(lambda x: table.pull(x, out=rows_out), ids))
            samples.setdefault((name, "aps push"), []).append(timed(lambda x: table.push(x, grads), ids))
            if emb is not None:
                samples.setdefault((name, "torch gather"), []).append(
                    timed(lambda x: torch.nn.functional.embedding(torch.from_numpy(x), emb.weight.detach()), ids))
                samples.setdefault((name, "torch step"), []).append(timed(torch_step(emb, opt), ids))
    median = {key: statistics.median(values) for key, values in samples.items()}
    bound = median["dense", "sgd pass"]
    rows = []
    print(f"{args.batch} ids (Zipf 1.1) x dim {args.dim} ({numel * 4 / 2**20:.2f} MiB of rows), "
          f"{args.touched:,} rows held of {args.rows:,}; dense SGD pass over the same bytes: {bound * 1e6:.0f} us")
    print(f"{'optimizer':>16} {'aps pull us':>12} {'aps push us':>12} {'torch gather':>13} {'torch step':>11}"
          f" {'push/torch':>11} {'push/dense':>11}")
    for name in setups:
        pull, push = median[name, "aps pull"], median[name, "aps push"]
        gather, step = median.get((name, "torch gather")), median.get((name, "torch step"))
        row = {"optimizer": name, "aps_pull_us": pull * 1e6, "aps_push_us": push * 1e6,
               "torch_gather_us": gather and gather * 1e6, "torch_step_us": step and step * 1e6,
               "push_over_torch_step": step and push / step, "push_over_dense_pass": push / bound,
               "samples": {kind: samples[name, kind] for (n, kind) in samples if n == name}}
        rows.append(row)
        print(f"{name:>16} {pull * 1e6:12.0f} {push * 1e6:12.0f} "
              f"{'-' if gather is None else f'{gather * 1e6:.0f}':>13} {'-' if step is None else f'{step * 1e6:.0f}':>11}"
              f" {'-' if step is None else f'{push / step:.2f}':>11} {push / bound:11.2f}")
    write_report({"benchmark": "rows", "command": "python bench/rows.py", **machine_info(), "rows": args.rows,
                  "touched": args.touched, "dim": args.dim, "batch": args.batch, "steps": args.steps,
                  "repeats": args.repeats, "dense_sgd_pass_us": bound * 1e6, "results": rows}, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
