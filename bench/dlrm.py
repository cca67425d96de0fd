#!/usr/bin/env python
"""examples/dlrm.py's click model over aps against the same model on torch's sparse embeddings,
and the dense push aps avoids, measured in one run.

The model and the data are the example's (8 tables of 10^6 to 10^8 declared rows, Zipf ids,
labels from a hidden model); ``--steps`` batches of ``--batch-size`` samples are made first,
and both sides train on the same batches, from the same initial weights:

- ``aps``: the DLRM with ``aps.torch.Embedding``/``EmbeddingBag`` against a real ``aps serve``
  process (one worker, ASP; the dense layers by the server's ``--dense-optimizer``, the rows by
  the table's ``--table-optimizer``), each step one round trip (``step(prefetch=...)``);
- ``torch``: the same DLRM in this process with ``nn.Embedding(sparse=True)`` and
  ``nn.EmbeddingBag(sparse=True)``, the rows by ``torch.optim.Adagrad`` (``SparseAdam``,
  ``SGD``) and the dense layers by ``torch.optim.Adam`` (``SGD``). A 10^8-row table does not
  fit a torch process (6.4 GB at dim 16, as much again for Adagrad's state), so torch's tables
  hold only the ids the run touches, renumbered (the most favourable case for torch: a real
  pipeline would hash ids into a table of fixed size), each row starting from the value aps
  gives that id.

Both are timed per step (forward, backward, optimizer step; windows of ``--window`` steps
interleaved, medians of the windows), and scored by the test AUC after the same steps. One
torch thread for each (the server takes the other core). Then the cost aps avoids:

- ``dense``: ``aps.Worker.push_pull`` of one table of ``--dense-rows`` rows as a dense float32
  vector (the size of the example's smallest tables, 64 MB at the defaults) on a server holding
  that dense model;
- ``rows``: the rows step of that same table held as an aps table instead: ``push_pull`` of a
  one-value dense gradient with a batch's gradient rows and the next batch's ids (``--batch-size``
  x 3 Zipf ids, one bag feature's traffic), one round trip.

Figures are medians; the ratios are of medians. Example:
``python bench/dlrm.py --out bench/results/dlrm.json``.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import aps
import aps.torch
from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, write_report
from aps.testing import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_OPTIMIZERS = {
    "adagrad": lambda params, lr: torch.optim.Adagrad(params, lr=lr, eps=1e-10),
    "adam": lambda params, lr: torch.optim.SparseAdam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
}
DENSE_OPTIMIZERS = {
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
}


def load_example():
    """examples/dlrm.py as a module (its model, data and AUC)."""
    spec = importlib.util.spec_from_file_location("aps_example_dlrm", os.path.join(ROOT, "examples", "dlrm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps on each side (default 400)")
    parser.add_argument("--window", type=int, default=20, help="steps per timed window (default 20)")
    parser.add_argument("--batch-size", type=int, default=256, help="samples a step (default 256)")
    parser.add_argument("--test-size", type=int, default=4096, help="held-out samples for the AUC (default 4096)")
    parser.add_argument("--dim", type=int, default=16, help="the embeddings' length (default 16)")
    parser.add_argument("--table-optimizer", default="adagrad", choices=sorted(TABLE_OPTIMIZERS))
    parser.add_argument("--table-lr", type=float, default=0.05, help="the rows' learning rate (default 0.05)")
    parser.add_argument("--dense-optimizer", default="adam", choices=sorted(DENSE_OPTIMIZERS))
    parser.add_argument("--lr", type=float, default=0.003, help="the dense layers' learning rate (default 0.003)")
    parser.add_argument("--zipf", type=float, default=1.2, help="the ids' Zipf exponent (default 1.2)")
    parser.add_argument("--dense-rows", type=int, default=10**6,
                        help="rows of the table pushed dense in the last comparison (default 10^6)")
    parser.add_argument("--dense-repeats", type=int, default=10, help="windows of the last comparison (default 10)")
    parser.add_argument("--transport", default="auto", choices=("auto", "tcp", "shm"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.sparse.check_sparse_tensor_invariants.disable()
    ex = load_example()

    data = ex.ClickData(zipf=args.zipf, task_seed=args.seed)
    stream = np.random.default_rng([args.seed, 2, 0])
    batches = [data.batch(stream, args.batch_size) for _ in range(args.steps + 1)]
    test = data.batch(np.random.default_rng([args.seed, 1]), args.test_size)

    # aps: the example's model; torch: the same dense layers (same seed), tables of the touched ids.
    ours = ex.DLRM(ex.aps_embeddings(dim=args.dim, optimizer=args.table_optimizer, lr=args.table_lr), args.dim,
                   seed=args.seed)
    touched, tables = {}, {}
    for feature in ex.FEATURES:
        touched[feature.name] = ids = np.unique(np.concatenate(
            [b.ids[feature.name].numpy().reshape(-1) for b in (*batches, test)]))
        kind = (nn.Embedding(len(ids), args.dim, sparse=True) if feature.ids == 1
                else nn.EmbeddingBag(len(ids), args.dim, mode=feature.mode, sparse=True))
        with torch.no_grad():
            kind.weight.copy_(torch.from_numpy(ours.embeddings[feature.name].spec.initial_rows(feature.name, ids)))
        tables[feature.name] = kind
    theirs = ex.DLRM(tables, args.dim, seed=args.seed)

    def renumbered(batch):
        return batch.dense, {name: torch.from_numpy(np.searchsorted(touched[name], ids.numpy()))
                             for name, ids in batch.ids.items()}, batch.labels

    torch_batches = [renumbered(b) for b in batches]
    torch_test = ex.Batch(*renumbered(test))
    sparse_opt = TABLE_OPTIMIZERS[args.table_optimizer]([t.weight for t in tables.values()], args.table_lr)
    dense_opt = DENSE_OPTIMIZERS[args.dense_optimizer](
        [p for name, p in theirs.named_parameters() if not name.startswith("embeddings.")], args.lr)
    declared = sum(f.rows for f in ex.FEATURES)
    print(f"DLRM: 8 tables of {declared:,} declared rows x dim {args.dim} ({declared * args.dim * 4 / 2**30:.1f} GiB "
          f"as dense float32), {sum(map(len, touched.values())):,} touched in {args.steps} steps of "
          f"{args.batch_size}; dense {args.dense_optimizer} lr {args.lr}, rows {args.table_optimizer} "
          f"lr {args.table_lr}", flush=True)

    server = ServerProcess("--workers", "1", "--sync", "asp", "--optimizer", args.dense_optimizer, "--lr",
                           str(args.lr), "--log-level", "warning")
    aps_times: list[float] = []
    torch_times: list[float] = []
    try:
        with aps.torch.Optimizer(ours, server.address, 0, 1, transport=args.transport) as opt:
            transport = opt.worker.transport
            opt.prefetch(batches[0].ids)
            for start in range(0, args.steps, args.window):
                stop = min(start + args.window, args.steps)
                began = time.perf_counter()
                for i in range(start, stop):
                    batch = batches[i]
                    opt.zero_grad()
                    F.binary_cross_entropy_with_logits(ours(batch.dense, batch.ids), batch.labels).backward()
                    opt.step(prefetch=batches[i + 1].ids)
                aps_times.append((time.perf_counter() - began) / (stop - start))
                began = time.perf_counter()
                for i in range(start, stop):
                    dense, ids, labels = torch_batches[i]
                    sparse_opt.zero_grad()
                    dense_opt.zero_grad()
                    F.binary_cross_entropy_with_logits(theirs(dense, ids), labels).backward()
                    sparse_opt.step()
                    dense_opt.step()
                torch_times.append((time.perf_counter() - began) / (stop - start))
            opt.prefetch(test.ids)
            with torch.no_grad():
                ours.eval()
                theirs.eval()
                aps_logits = ours(test.dense, test.ids).numpy()
                torch_logits = theirs(torch_test.dense, torch_test.ids).numpy()
            aps_version = opt.version
    finally:
        server.stop()
    aps_auc = ex.roc_auc(test.labels.numpy(), aps_logits)
    torch_auc = ex.roc_auc(test.labels.numpy(), torch_logits)
    aps_step, torch_step = median_ms(aps_times), median_ms(torch_times)
    print(f"{'':>8} {'step ms':>9} {'AUC':>7}   (after {args.steps} steps; max |logit difference| "
          f"{float(np.abs(aps_logits - torch_logits).max()):.2g})")
    print(f"{'aps':>8} {aps_step:9.2f} {aps_auc:7.4f}   ({transport}, one round trip a step)")
    print(f"{'torch':>8} {torch_step:9.2f} {torch_auc:7.4f}   (nn.EmbeddingBag(sparse=True), one process)")
    print(f"aps / torch step time: {aps_step / torch_step:.2f}", flush=True)

    # The cost aps avoids: one table pushed and pulled whole, against its rows step.
    numel = args.dense_rows * args.dim
    bag_ids = [data.draw_ids(np.random.default_rng([args.seed, 3, i]), 0, (args.batch_size * 3,))
               % args.dense_rows for i in range(args.window + 1)]
    grad_rows = np.full((len(bag_ids[0]), args.dim), 1e-3, np.float32)
    dense_server = ServerProcess("--workers", "1", "--sync", "asp", "--optimizer", "sgd", "--lr", "0.01",
                                 "--log-level", "warning")
    rows_server = ServerProcess("--workers", "1", "--sync", "asp", "--optimizer", "sgd", "--lr", "0.01",
                                "--log-level", "warning")
    dense_times: list[float] = []
    rows_times: list[float] = []
    try:
        with aps.Worker(dense_server.address, 0, 1, transport=args.transport) as dense_worker, \
                aps.Worker(rows_server.address, 0, 1, transport=args.transport) as rows_worker:
            dense_worker.init({"table": np.zeros(numel, np.float32)})
            dense_grad = np.full(numel, 1e-6, np.float32)
            table = aps.Table(rows=args.dense_rows, dim=args.dim, init="normal:0.01", optimizer=args.table_optimizer,
                              lr=args.table_lr)
            rows_worker.init({"bias": np.zeros(1, np.float32)}, tables={"table": table})
            bias_grad = np.zeros(1, np.float32)
            rows_worker.pull_rows("table", bag_ids[0])
            dense_worker.push_pull(dense_grad)  # (warm)
            for _ in range(args.dense_repeats):
                began = time.perf_counter()
                for _ in range(2):
                    dense_worker.push_pull(dense_grad)
                dense_times.append((time.perf_counter() - began) / 2)
                began = time.perf_counter()
                for i in range(args.window):
                    rows_worker.push_pull(bias_grad, rows={"table": (bag_ids[i], grad_rows)},
                                          pull_rows={"table": bag_ids[i + 1]})
                rows_times.append((time.perf_counter() - began) / args.window)
    finally:
        dense_server.stop()
        rows_server.stop()
    dense_ms, rows_ms = median_ms(dense_times), median_ms(rows_times)
    print(f"one table of {args.dense_rows:,} rows x dim {args.dim} ({numel * 4 / 2**20:.0f} MiB): dense push_pull "
          f"{dense_ms:.2f} ms, its rows step ({len(bag_ids[0])} ids) {rows_ms:.3f} ms: "
          f"dense / rows {dense_ms / rows_ms:.0f}x, dense / aps DLRM step {dense_ms / aps_step:.1f}x")
    largest = max(f.rows for f in ex.FEATURES)
    print(f"(a dense push_pull grows with the bytes: the {largest:,}-row table would move "
          f"{largest * args.dim * 4 / 2**30:.1f} GiB each way, {largest / args.dense_rows:.0f}x as much)")

    write_report({
        "benchmark": "dlrm", "command": "python bench/dlrm.py", **machine_info(),
        "steps": args.steps, "window": args.window, "batch_size": args.batch_size, "test_size": args.test_size,
        "dim": args.dim, "zipf": args.zipf, "table_optimizer": args.table_optimizer, "table_lr": args.table_lr,
        "dense_optimizer": args.dense_optimizer, "lr": args.lr, "transport": transport,
        "tables": [{"name": f.name, "rows": f.rows, "ids_per_sample": f.ids, "mode": f.mode if f.ids > 1 else None,
                    "touched": int(len(touched[f.name]))} for f in ex.FEATURES],
        "declared_rows": declared, "declared_dense_gib": declared * args.dim * 4 / 2**30,
        "aps": {"step_ms": aps_step, "auc": aps_auc, "version": aps_version, "window_ms": [t * 1e3 for t in aps_times]},
        "torch": {"step_ms": torch_step, "auc": torch_auc, "window_ms": [t * 1e3 for t in torch_times]},
        "aps_over_torch_step": aps_step / torch_step,
        "max_logit_difference": float(np.abs(aps_logits - torch_logits).max()),
        "dense_table": {"rows": args.dense_rows, "mib": numel * 4 / 2**20, "push_pull_ms": dense_ms,
                        "rows_step_ms": rows_ms, "ids_per_rows_step": len(bag_ids[0]),
                        "dense_over_rows_step": dense_ms / rows_ms, "dense_over_aps_dlrm_step": dense_ms / aps_step,
                        "dense_window_ms": [t * 1e3 for t in dense_times],
                        "rows_window_ms": [t * 1e3 for t in rows_times]},
    }, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
