#!/usr/bin/env python
"""The GPU path, checked in one run (under 3 minutes).

A small CNN (the bundled digits model) on ``--device`` is trained by 2 BSP
workers through ``aps.torch.Optimizer``, over TCP and then over shared memory,
for ``--steps`` steps, and set beside the same model trained in this process
with ``torch.optim.SGD`` on the same device, on the same batches (the two
workers' batches together make its batch). Reported, per transport:

- the largest difference between the workers' final weights and torch's (the
  check: at most ``--tolerance``; the mean of two gradients is summed in
  another order than one large batch's, so float rounding only);
- the staging: whether the worker's host buffers are pinned (page-locked with
  ``cudaHostRegister``; on the CPU there is nothing to pin), and one gradient's
  device-to-host and the weights' host-to-device copy time through them beside
  the same copies through ordinary (pageable) memory;
- the step time of an aps worker (its own batch: forward, backward, push and
  pull, staging included) and of ``torch.optim.SGD`` on that batch alone, in
  the same run.

On a machine without a GPU it runs with ``--device cpu`` (staging forced on,
so the copies the GPU path makes are made): ``.ci/run`` runs it so as a smoke
test. Where a GPU is lent: ``python bench/gpu_check.py --out
bench/results/gpu.json``. Exit status 1 when a check fails.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch
from torch.nn import functional as F

from aps import workloads
from aps.cli._args import ArgumentParser
from aps.lab.bench import machine_info, write_report
from aps.testing import ServerProcess, run_processes
from aps.testing.workers import digits, digits_batches

LR, MOMENTUM, BATCH, WORKERS = 0.05, 0.9, 16, 2


def _exact_float32() -> None:
    """No TF32 in convolutions and matmuls (torch's default for cuDNN on recent GPUs): both
    runs compute in float32, so what differs is the order of sums only."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_ms(device: torch.device, host: torch.Tensor, reps: int = 20) -> dict:
    """Milliseconds (median) to copy ``host``'s size device-to-host and back, through
    ``host`` and through a pageable tensor of the same size."""
    on_device = torch.empty_like(host, device=device)
    pageable = torch.empty_like(host)

    def timed(target: torch.Tensor) -> tuple[float, float]:
        d2h, h2d = [], []
        for _ in range(reps):
            _sync(device)
            began = time.perf_counter()
            target.copy_(on_device, non_blocking=False)
            _sync(device)
            middle = time.perf_counter()
            on_device.copy_(target, non_blocking=False)
            _sync(device)
            d2h.append(middle - began)
            h2d.append(time.perf_counter() - middle)
        return 1e3 * statistics.median(d2h), 1e3 * statistics.median(h2d)

    staged, plain = timed(host), timed(pageable)
    return {
        "bytes": host.numel() * host.element_size(),
        "d2h_ms": round(staged[0], 4),
        "h2d_ms": round(staged[1], 4),
        "pageable_d2h_ms": round(plain[0], 4),
        "pageable_h2d_ms": round(plain[1], 4),
    }


def _timed_steps(model: torch.nn.Module, opt, rank: int, steps: int, device: torch.device) -> list[float]:
    """``steps`` steps of ``opt`` on worker ``rank``'s batches; the seconds each took."""
    times = []
    for step in range(steps):
        x, y = (t.to(device) for t in digits_batches(rank, WORKERS, step, BATCH))
        _sync(device)
        began = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - began)
    return times


def gpu_worker(address: str, rank: int, steps: int, transport: str, device_name: str):
    """One aps worker on ``device_name``: its final weights, step times and staging."""
    import aps.torch

    torch.set_num_threads(1)
    _exact_float32()
    device = torch.device(device_name)
    digits()  # (loaded before joining)
    model = workloads.make_model(8, seed=0).to(device)
    with aps.torch.Optimizer(model, address, rank, WORKERS, transport=transport, staging=True) as opt:
        times = _timed_steps(model, opt, rank, steps, device)
        flat = opt._flat
        assert flat is not None, "the optimizer is attached"
        staging = {
            "pinned": bool(flat._pinned),
            "transport": opt.worker.transport,
            **_copy_ms(device, flat._host_grads),
        }
        params = [p.detach().cpu().numpy().copy() for p in model.parameters()]
        return rank, opt.version, params, times, staging


def reference(steps: int, device: torch.device) -> tuple[list[np.ndarray], list[float]]:
    """torch.optim.SGD on the workers' batches together; and its step time on one worker's batch."""
    model = workloads.make_model(8, seed=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        parts = [digits_batches(rank, WORKERS, step, BATCH) for rank in range(WORKERS)]
        x, y = torch.cat([p[0] for p in parts]).to(device), torch.cat([p[1] for p in parts]).to(device)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    weights = [p.detach().cpu().numpy().copy() for p in model.parameters()]
    alone = workloads.make_model(8, seed=0).to(device)
    return weights, _timed_steps(alone, torch.optim.SGD(alone.parameters(), lr=LR, momentum=MOMENTUM), 0, steps, device)


def check(transport: str, steps: int, device: torch.device, want: list[np.ndarray], tolerance: float) -> dict:
    server = ServerProcess(
        "--workers", str(WORKERS), "--sync", "bsp", "--optimizer", "sgd", "--lr", str(LR), "--momentum", str(MOMENTUM)
    )
    try:
        results = run_processes(
            gpu_worker, [(server.address, rank, steps, transport, str(device)) for rank in range(WORKERS)], timeout=150
        )
    finally:
        server.stop()
    worst = 0.0
    for _, version, params, _, _ in results:
        if version != steps:
            raise SystemExit(f"{transport}: a worker ended at version {version}, not {steps}")
        for mine, theirs in zip(params, want, strict=True):
            worst = max(worst, float(np.abs(mine - theirs).max()))
    times = [t for result in results for t in result[3][5:]]  # (the first few warm up)
    return {
        "transport": transport,
        "transports_used": sorted({result[4]["transport"] for result in results}),
        "largest_difference": worst,
        "within_tolerance": worst <= tolerance,
        "aps_step_ms": round(1e3 * statistics.median(times), 4),
        "staging": results[0][4],
    }


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--transports", default="tcp,shm")
    parser.add_argument(
        "--tolerance",
        type=float,
        help="the largest difference allowed (default 1e-4 on the "
        "CPU, 1e-3 on a GPU, where cuDNN picks its own convolution algorithms)",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no GPU here: run with --device cpu")
    if args.tolerance is None:
        args.tolerance = 1e-4 if device.type == "cpu" else 1e-3
    torch.set_num_threads(1)
    _exact_float32()
    began = time.monotonic()
    digits()
    want, torch_times = reference(args.steps, device)
    runs = [check(t, args.steps, device, want, args.tolerance) for t in args.transports.split(",")]
    torch_ms = 1e3 * statistics.median(torch_times[5:])
    for run in runs:
        run["torch_step_ms"] = round(torch_ms, 4)
        run["aps_over_torch"] = round(run["aps_step_ms"] / torch_ms, 2)
        staging = run["staging"]
        print(
            f"{run['transport']}: largest difference {run['largest_difference']:.3g} "
            f"(tolerance {args.tolerance:g}); step {run['aps_step_ms']:.2f} ms with aps, {torch_ms:.2f} ms with "
            f"torch.optim.SGD; host buffers pinned: {staging['pinned']}, gradient copy "
            f"{staging['d2h_ms']:.3f} ms (pageable {staging['pageable_d2h_ms']:.3f})",
            flush=True,
        )
    report = {
        "machine": machine_info(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "steps": args.steps,
        "workers": WORKERS,
        "batch": BATCH,
        "tolerance": args.tolerance,
        "runs": runs,
        "passed": all(run["within_tolerance"] for run in runs),
        "seconds": round(time.monotonic() - began, 1),
    }
    write_report(report, args.out)
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
