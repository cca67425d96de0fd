#!/usr/bin/env python
"""aps against the peers people would otherwise use, measured in the same run.

For each payload size, interleaved and repeated like ``aps bench``, each system
running alone (started for its window and stopped after it):

- aps over TCP and over shared memory: one worker process doing push_pull
  against a real ``aps serve`` (ASP, SGD);
- a ``torch.distributed.rpc`` parameter server: one server process holding the
  flat tensor and applying SGD, one worker doing a push then a pull (two RPCs);
- a gloo ``all_reduce`` of the same tensor between two processes.

Each moves the payload both ways per step (all_reduce: each process sends and
receives about the payload), so throughput is 2 x payload per step. Ratios
are aps's throughput over the peer's. Writes a table, JSON, and a chart
(throughput against payload size, one line per system).

Needs the ``bench`` extra (torch, matplotlib):
``python bench/peers.py --sizes 4K,64K,1M,16M,64M --out bench/results/peers``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys

import numpy as np

from aps.cli._args import ArgumentParser, format_size, size_list
from aps.lab.bench import ApsSession, Session, machine_info, summarize


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torch.distributed.rpc parameter server ------------------------------------------------------

_W = None
_LR = 0.01


def _rpc_push(grad) -> None:
    _W.sub_(grad, alpha=_LR)


def _rpc_pull():
    return _W


def _rpc_server(port: int, numel: int) -> None:
    import torch
    import torch.distributed.rpc as rpc

    global _W
    torch.set_num_threads(1)
    _W = torch.zeros(numel)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("ps", rank=0, world_size=2)
    rpc.shutdown()  # waits for the worker to finish


class _RpcWorker:
    def __init__(self, port: int, numel: int) -> None:
        self.port, self.numel = port, numel

    def __enter__(self):
        import torch
        import torch.distributed.rpc as rpc

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
        rpc.init_rpc("worker", rank=1, world_size=2)
        grad = torch.zeros(self.numel)

        def step() -> None:
            rpc.rpc_sync("ps", _rpc_push, args=(grad,))
            rpc.rpc_sync("ps", _rpc_pull)

        return step

    def __exit__(self, *exc) -> None:
        import torch.distributed.rpc as rpc

        rpc.shutdown()


class RpcSession:
    def __init__(self, nbytes: int) -> None:
        import multiprocessing as mp

        port = _free_port()
        self.server = mp.get_context("fork").Process(target=_rpc_server, args=(port, nbytes // 4), daemon=True)
        self.server.start()
        self.session = Session(_RpcWorker, [(port, nbytes // 4)])

    def measure(self, seconds, min_iters):
        return self.session.measure(seconds, min_iters)

    def close(self) -> None:
        self.session.close()
        self.server.join(30)
        if self.server.is_alive():
            self.server.kill()


# gloo all_reduce -------------------------------------------------------------------------------


class _GlooRank:
    def __init__(self, port: int, rank: int, numel: int) -> None:
        self.port, self.rank, self.numel = port, rank, numel

    def __enter__(self):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=self.rank, world_size=2)
        tensor = torch.zeros(self.numel)
        return lambda: dist.all_reduce(tensor)

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class GlooSession:
    def __init__(self, nbytes: int) -> None:
        port = _free_port()
        self.session = Session(_GlooRank, [(port, rank, nbytes // 4) for rank in range(2)])
        self._iterations: int | None = None

    def measure(self, seconds, min_iters):
        # A collective needs both ranks for every step, so both run the same
        # number of steps (not "until the time is up"): calibrate it once.
        if self._iterations is None:
            count, elapsed = self.session.measure(0.0, 3)[0]
            self._iterations = max(min_iters, int(seconds / (elapsed / count)))
        windows = self.session.measure(0.0, self._iterations)
        return windows[:1]  # both ranks ran the same steps: count one

    def close(self) -> None:
        self.session.close()


# Driver ------------------------------------------------------------------------------------------


def run(sizes: list[int], seconds: float, min_iters: int, repeats: int, out: str | None) -> dict:
    rows = []
    for nbytes in sizes:
        systems = {
            "aps tcp": lambda: ApsSession(nbytes, 1, "tcp"),
            "aps shm": lambda: ApsSession(nbytes, 1, "shm"),
            "torch rpc": lambda: RpcSession(nbytes),
            "gloo all_reduce": lambda: GlooSession(nbytes),
        }
        # Each system runs alone: started for its window and stopped after it (an idle torch RPC
        # process keeps a core busy, 1.0 core each measured here, which would slow whatever runs
        # beside it), the systems' windows interleaved over the repeats.
        samples: dict[str, list] = {name: [] for name in systems}
        for _ in range(repeats):
            for name, make in systems.items():
                session = make()
                try:
                    session.measure(min(seconds, 0.5), 1)  # (warm: connections made, pages touched)
                    samples[name].append(session.measure(seconds, min_iters))
                finally:
                    session.close()
        summary = {name: summarize(values, nbytes) for name, values in samples.items()}
        for name, s in summary.items():
            row = {"system": name, "payload_bytes": nbytes, **s}
            for peer in ("torch rpc", "gloo all_reduce"):
                row[f"aps_tcp_over_{peer.split()[0]}"] = None
            if name.startswith("aps"):
                for peer in ("torch rpc", "gloo all_reduce"):
                    ratios = [a / b for a, b in zip(s["gbps_samples"], summary[peer]["gbps_samples"])]
                    row[f"x_{peer.split()[0]}"] = statistics.median(ratios)
            rows.append(row)
        print(format_table([r for r in rows if r["payload_bytes"] == nbytes]), flush=True)
    report = {"benchmark": "peers", "command": " ".join(["python", *sys.argv]), **machine_info(),
              "seconds_per_window": seconds, "repeats": repeats, "rows": rows}
    print()
    print(format_table(rows))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        with open(out + ".json", "w") as fh:
            json.dump(report, fh, indent=2)
        chart(rows, out + ".png", report["command"])
        print(f"\nwrote {out}.json and {out}.png")
    return report


def format_table(rows: list[dict]) -> str:
    header = f"{'payload':>8} {'system':<16} {'rtt us':>10} {'GB/s':>7} {'x torch rpc':>11} {'x gloo':>7}"
    lines = [header, "-" * len(header)]
    for r in rows:
        rpc = f"{r['x_torch']:>11.2f}" if r.get("x_torch") is not None else f"{'':>11}"
        gloo = f"{r['x_gloo']:>7.2f}" if r.get("x_gloo") is not None else f"{'':>7}"
        lines.append(
            f"{format_size(r['payload_bytes']):>8} {r['system']:<16} {r['rtt_us']:>10.1f} {r['gbps']:>7.2f} {rpc} {gloo}"
        )
    return "\n".join(lines)


def chart(rows: list[dict], path: str, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    styles = {"aps shm": "o-", "aps tcp": "s-", "torch rpc": "^--", "gloo all_reduce": "v--"}
    for system, style in styles.items():
        points = sorted((r["payload_bytes"], r["gbps"]) for r in rows if r["system"] == system)
        if points:
            sizes, rates = zip(*points)
            ax.plot(sizes, rates, style, label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["payload_bytes"] for r in rows})
    ax.set_xticks(sizes, [format_size(s) + "iB" if s >= 1024 else f"{s} B" for s in sizes])
    ax.set_xlabel("payload (one push and one pull per step)")
    ax.set_ylabel("throughput, GB/s (2 x payload per step)")
    ax.set_title("push + pull, one worker, 2 cores, loopback", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.text(0.01, 0.01, command, fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=size_list, default=size_list("4K,64K,1M,16M,64M"),
                        help="payload sizes (default 4K,64K,1M,16M,64M)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one measuring window (default 1)")
    parser.add_argument("--min-iters", type=int, default=3, help="least steps per window (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved windows per point (default 3)")
    parser.add_argument("--out", help="also write OUT.json and OUT.png (default: print only)")
    args = parser.parse_args(argv)
    run(args.sizes, args.seconds, args.min_iters, max(1, args.repeats), args.out)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
