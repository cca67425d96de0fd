"""The programs of the chaos soak's processes (:mod:`aps.testing.chaos`): a ledger worker
that pushes each gradient's identity and logs what was acknowledged, a stranger that floods a
shard without a token, and a puller that reads the final ledger.
``python -m aps.testing.chaos_processes worker|stranger|pull ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import sys
import time
from collections import Counter

import numpy as np

from .ledger import LedgerLayout


class _CappedLog:
    """A line-buffered append-only log whose kinds of lines (after the first few) are capped."""

    def __init__(self, path: str) -> None:
        self.fh = open(path, "a", buffering=1)
        self.counts: Counter = Counter()

    def line(self, kind: str, text: str, cap: int | None = None) -> None:
        self.counts[kind] += 1
        if cap is None or self.counts[kind] <= cap:
            self.fh.write(f"{kind} {text}\n")


def worker_main(args: argparse.Namespace) -> int:
    """One training process of the soak: pushes its ledger gradients until the stop file
    appears (or its ledger row is full), logging each gradient's slot before its push
    (``t SLOT``, so that the rank's next process never takes it again) and every
    acknowledged push as ``a DROPPED CLOCK SLOT0,SLOT1,... V0 V1 ...`` (whether the
    server dropped it, the clock it pushed at, its slot on each shard, each shard's
    version in the reply), and its slowest call."""
    import aps

    layout = LedgerLayout(args.shards, args.workers, args.slots)
    next_slot = _next_slot(args.log)
    log = _CappedLog(args.log)
    log.line("start", f"{os.getpid()} {time.time():.3f} slot {next_slot}")
    addresses = args.addresses.split(",")
    value = float(args.workers) if args.bsp else 1.0
    slowest = 0.0
    calls = 0
    try:
        worker = aps.Worker(
            addresses if len(addresses) > 1 else addresses[0],
            args.rank,
            args.workers,
            transport=args.transport,
            heartbeat=args.heartbeat,
            server_timeout=args.server_timeout,
            reconnect=True,
            reconnect_timeout=args.reconnect_timeout,
        )
    except aps.APSError as exc:
        log.line("err", f"connect {type(exc).__name__}: {exc}", cap=50)
        return 3
    shards = getattr(worker, "shards", (worker,))
    try:
        started = time.monotonic()
        worker.init({"ledger": np.zeros(layout.numel, np.float32)}, timeout=args.reconnect_timeout)
        log.line("joined", f"{time.monotonic() - started:.3f} clock {worker.clock}")
        grad = np.zeros(layout.numel, np.float32)
        while not os.path.exists(args.stop):
            clock = worker.clock
            # BSP: the round each shard's part is for; otherwise the rank's next gradient
            slots = [shard.version for shard in shards] if args.bsp else [next_slot] * args.shards
            if max(slots) >= args.slots:
                log.line("full", str(max(slots)))
                break
            if not args.bsp:
                log.line("t", str(next_slot))
                next_slot += 1
            where = [layout.index(s, args.rank, slot) for s, slot in enumerate(slots)]
            grad[where] = -value
            began = time.monotonic()
            try:
                worker.push_pull(grad)
            except aps.APSError as exc:
                log.line("err", f"push {type(exc).__name__}: {exc}", cap=50)
                grad[where] = 0.0
                worker.reconnect(timeout=args.reconnect_timeout)
                continue
            took = time.monotonic() - began
            calls += 1
            grad[where] = 0.0
            versions = " ".join(str(shard.version) for shard in shards)
            log.line("a", f"{int(worker.last_push_dropped)} {clock} {','.join(map(str, slots))} {versions}")
            if took > slowest:
                slowest = took
                if took > 0.5:
                    log.line("slow", f"{took:.3f} {clock}", cap=200)
            if took > args.call_bound:
                log.line("over", f"{took:.3f} {clock}", cap=200)
            if args.step_time:
                time.sleep(args.step_time)
    except aps.APSError as exc:
        log.line("err", f"{type(exc).__name__}: {exc}", cap=50)
        return 3
    finally:
        log.line("end", f"calls {calls} slowest {slowest:.3f}")
    worker.close()
    return 0


def _next_slot(log_path: str) -> int:
    """The first slot no earlier process of this rank took (its ``t`` lines)."""
    taken = -1
    with contextlib.suppress(FileNotFoundError), open(log_path) as fh:
        for line in fh:
            if line.startswith("t "):
                with contextlib.suppress(ValueError):
                    taken = max(taken, int(line.split()[1]))
    return taken + 1


def stranger_main(args: argparse.Namespace) -> int:
    """Connections that never authenticate, against one server for ``seconds``: each
    sends a HELLO, then either a garbage AUTH proof, a pipelined burst of PINGs, or
    nothing at all; at most ``connections`` at once. Writes a JSON summary to ``out``."""
    from aps.wire.protocol import NONCE_BYTES, Op, pack_header

    host, port = args.address.split("://")[-1].rsplit(":", 1)
    deadline = time.monotonic() + args.seconds
    stats: Counter = Counter()
    ping = pack_header(Op.PING)
    hello = pack_header(Op.HELLO, length=NONCE_BYTES)
    open_socks: list[socket.socket] = []

    def attempt(style: int) -> None:
        try:
            sock = socket.create_connection((host, int(port)), timeout=2.0)
        except OSError:
            stats["refused"] += 1
            return
        stats["connections"] += 1
        try:
            sock.settimeout(1.0)
            if style == 0:  # a token-less handshake: HELLO, then a proof made of nothing
                sock.sendall(hello + secrets.token_bytes(NONCE_BYTES))
                sock.sendall(pack_header(Op.AUTH, length=32) + secrets.token_bytes(32))
            elif style == 1:  # pings pipelined before (instead of) authenticating
                sock.sendall(hello + secrets.token_bytes(NONCE_BYTES) + ping * args.pings)
                stats["pings"] += args.pings
            else:  # silent: holds a seat until the server's handshake deadline
                open_socks.append(sock)
                if len(open_socks) > args.connections:
                    open_socks.pop(0).close()
                return
            got = 0
            with contextlib.suppress(OSError):
                while time.monotonic() < deadline:
                    chunk = sock.recv(65536)
                    if not chunk:
                        stats["closed_by_server"] += 1
                        break
                    got += len(chunk)
                    if got > 1 << 20:
                        break
            stats["bytes_back"] += got
        except OSError:
            stats["reset"] += 1
        finally:
            if style != 2:
                sock.close()

    style = 0
    while time.monotonic() < deadline:
        attempt(style % 3)
        style += 1
        time.sleep(0.01)
    for sock in open_socks:
        sock.close()
    with open(args.out, "w") as fh:
        json.dump(dict(stats), fh)
    return 0


def guesser_main(args: argparse.Namespace) -> int:
    """Guesses at a server's token, as another user of its host would: ``count`` AUTH
    attempts with a wrong token (each on a connection of its own, a proper HELLO first), at
    most ``parallel`` at once, each sent from the next of ``sources`` (loopback addresses:
    any local process may send from any of 127/8). Writes a JSON summary to ``out``: the
    answers by kind (``wrong``, ``refused``, ``accepted``: a guess let in, which must never
    happen, ``lost``), and the seconds each took to be answered."""
    import concurrent.futures

    from aps.errors import ErrorCode
    from aps.testing import HEADER_SIZE, unpack_header
    from aps.wire.protocol import NONCE_BYTES, Op, auth_proof, decode_error, decode_hello_reply, pack_header

    host, port = args.address.split("://")[-1].rsplit(":", 1)
    sources = args.sources.split(",")

    def read_frame(sock: socket.socket) -> tuple:
        data = b""
        while len(data) < HEADER_SIZE:
            chunk = sock.recv(HEADER_SIZE - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        header = unpack_header(data)
        payload = b""
        while len(payload) < header.length:
            chunk = sock.recv(header.length - len(payload))
            if not chunk:
                raise ConnectionError("closed")
            payload += chunk
        return header, payload

    def attempt(index: int) -> tuple[str, float]:
        try:
            sock = socket.create_connection(
                (host, int(port)), timeout=args.timeout, source_address=(sources[index % len(sources)], 0)
            )
        except OSError:
            return "lost", 0.0
        try:
            nonce = secrets.token_bytes(NONCE_BYTES)
            sock.sendall(pack_header(Op.HELLO, length=NONCE_BYTES) + nonce)
            header, payload = read_frame(sock)
            _, server_nonce, _ = decode_hello_reply(payload)
            proof = auth_proof(secrets.token_urlsafe(32).encode(), "client", server_nonce, nonce)
            began = time.monotonic()
            sock.sendall(pack_header(Op.AUTH, length=len(proof)) + proof)
            header, payload = read_frame(sock)
            took = time.monotonic() - began
            if header.op == Op.AUTH | Op.REPLY:
                return "accepted", took
            code, _ = decode_error(payload) if header.op == Op.ERROR else (None, "")
            return (
                "wrong" if code == ErrorCode.AUTHENTICATION else "refused" if code == ErrorCode.OVERLOADED else "lost"
            ), took
        except (OSError, ConnectionError, ValueError):
            return "lost", 0.0
        finally:
            sock.close()

    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        answers = list(pool.map(attempt, range(args.count)))
    summary: dict[str, int | list[float]] = dict(Counter(kind for kind, _ in answers))
    summary["took"] = [round(took, 4) for _, took in answers]
    with open(args.out, "w") as fh:
        json.dump(summary, fh)
    return 0


def pull_main(args: argparse.Namespace) -> int:
    """Rejoin as rank 0 and save the server(s)' weights (the ledger) to ``out`` (.npy)."""
    import aps

    addresses = args.addresses.split(",")
    layout = LedgerLayout(args.shards, args.workers, args.slots)
    with aps.Worker(
        addresses if len(addresses) > 1 else addresses[0],
        0,
        args.workers,
        transport="tcp",
        heartbeat=1.0,
        reconnect=True,
        reconnect_timeout=60,
    ) as worker:
        weights = worker.init({"ledger": np.zeros(layout.numel, np.float32)}, timeout=60)
        np.save(args.out, np.asarray(weights["ledger"], np.float32))
    return 0


def _program(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m aps.testing.chaos_processes")
    sub = parser.add_subparsers(dest="role", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--addresses", required=True)
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--workers", type=int, required=True)
    w.add_argument("--shards", type=int, required=True)
    w.add_argument("--slots", type=int, required=True)
    w.add_argument("--bsp", action="store_true")
    w.add_argument("--transport", default="tcp")
    w.add_argument("--log", required=True)
    w.add_argument("--stop", required=True)
    w.add_argument("--step-time", type=float, default=0.02)
    w.add_argument("--heartbeat", type=float, default=1.0)
    w.add_argument("--server-timeout", type=float, default=10.0)
    w.add_argument("--reconnect-timeout", type=float, default=120.0)
    w.add_argument("--call-bound", type=float, default=60.0)
    s = sub.add_parser("stranger")
    s.add_argument("--address", required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--connections", type=int, default=8)
    s.add_argument("--pings", type=int, default=256)
    s.add_argument("--out", required=True)
    g = sub.add_parser("guesser")
    g.add_argument("--address", required=True)
    g.add_argument("--count", type=int, required=True)
    g.add_argument("--parallel", type=int, default=1)
    g.add_argument("--sources", default="127.0.0.1")
    g.add_argument("--timeout", type=float, default=60.0)
    g.add_argument("--out", required=True)
    p = sub.add_parser("pull")
    p.add_argument("--addresses", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    return {"worker": worker_main, "stranger": stranger_main, "guesser": guesser_main, "pull": pull_main}[args.role](
        args
    )


if __name__ == "__main__":
    sys.exit(_program(sys.argv[1:]))
