"""Hostile frames against a live server, while a legitimate worker trains beside them.

Shared by the fuzz test (tests/integration/test_fuzz.py, a few thousand frames) and
``bench/fuzz.py`` (10^5 and more). A *case* opens a connection (TCP or the shared-memory
Unix socket), sends one or a few frames mutated from valid ones, reads what comes back for
a moment, and closes. The server under test runs one worker seat, held by the legitimate
worker, so no fuzzed INIT can join and nothing a case sends may change the weights: under
ASP with SGD at learning rate 1 and all-ones gradients, the legitimate worker's weights
after its k-th step are exactly -k, and it checks that after every step.
"""

from __future__ import annotations

import os
import json
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import numpy as np

import aps
from aps.layout import Layout
from aps.wire.protocol import (
    ANY_RANK,
    HEADER_SIZE,
    MAGIC,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Flag,
    HyperGroup,
    Op,
    auth_proof,
    decode_hello_reply,
    encode_hyper,
    encode_init,
    encode_state_head,
    pack_header,
    unpack_header,
)

N = 64  # the legitimate model: 64 floats
_HEADER = struct.Struct("<IHBBB3xIQQQ")  # (the live count of replies read as reserved)
_LENGTHS = (0, 1, 8, 39, 40, 4 * N, 4 * N + 1, 1 << 16, (1 << 20) + 3, 1 << 32, (1 << 63) - 1)


@dataclass
class Tally:
    """What the cases met."""

    cases: int = 0
    frames: int = 0
    error_frames: int = 0  # replies that were error frames
    replies: int = 0  # other replies
    closed_by_server: int = 0
    refused: int = 0  # connection attempts refused outright
    errors: dict = field(default_factory=dict)  # error code -> count


def random_header(rng: random.Random, length: int | None = None) -> bytes:
    """A header with every field drawn, each usually valid and sometimes not."""
    magic = MAGIC if rng.random() < 0.9 else rng.getrandbits(32)
    version = PROTOCOL_VERSION if rng.random() < 0.9 else rng.getrandbits(16)
    op = rng.choice([int(o) for o in Op]) if rng.random() < 0.7 else rng.getrandbits(8)
    if length is None:
        length = rng.choice(_LENGTHS) if rng.random() < 0.8 else rng.getrandbits(rng.choice([8, 16, 24, 63]))
    return _HEADER.pack(
        magic,
        version,
        op,
        rng.getrandbits(8),
        rng.choice([0, 1, 1, 2, 3, rng.getrandbits(8)]),
        rng.getrandbits(32),
        rng.getrandbits(64),
        rng.getrandbits(64),
        length,
    )


def valid_frame(rng: random.Random, token: bytes | None) -> bytes:
    """A well-formed request a stranger might send (its replies are refusals, or harmless)."""
    kind = rng.randrange(9)
    if kind == 0:  # an INIT for a seat that is taken, or a rank out of range, or another model
        names = ("w",) if rng.random() < 0.5 else tuple(f"t{i}" for i in range(rng.randrange(1, 5)))
        layout = Layout(names, tuple((rng.randrange(1, 2 * N),) for _ in names))
        # any rank (ANY_RANK) and any count (0), with or without the SEAT flag, with or without values
        rank = rng.choice([0, 1, 2, ANY_RANK])
        block = encode_init(rank, rng.choice([0, 1, 2]), layout)
        values = (
            b""
            if rng.random() < 0.25
            else np.full(layout.numel, rng.choice([1e6, -1e6, float("nan"), 0.0]), np.float32).tobytes()
        )
        flags = rng.choice([0, Flag.SEAT, Flag.SEAT | Flag.REJOIN])
        return pack_header(Op.INIT, flags, 1, 1, 0, len(block), len(block) + len(values)) + block + values
    if kind == 1:
        payload = np.full(N, rng.choice([1e9, float("inf"), float("nan")]), np.float32).tobytes()
        return pack_header(Op.PUSH_PULL, 0, 1, 2, 0, 0, len(payload)) + payload
    if kind == 5 and rng.random() < 0.5:  # a counter: a name too long, not UTF-8, or a count past 2**53
        name = rng.choice([b"c", b"x" * 300, b"\xff\xfe", b""])
        return pack_header(Op.CLAIM, 0, 0, 5, 0, rng.choice([1, 1 << 60]), len(name)) + name
    if kind == 5 and rng.random() < 0.5:  # what a training loop reports: sound, too many names, or not what a LOG is
        payload = rng.choice(
            [
                b'{"points": [[1, {"loss": 0.5}]], "process": {"pid": 1, "cpu_s": 1.0, "rss_bytes": 1}}',
                json.dumps({"points": [[2, {f"n{i}": 1.0 for i in range(40)}]]}).encode(),
                b'{"points": [[1, {"loss": NaN}]], "batches": [[1, "0123456789abcdef"]]}',
                b"[" * 5000,
                b"\xff",
            ]
        )
        return pack_header(Op.LOG, 0, 0, 6, 0, 0, len(payload)) + payload
    if kind == 5 and rng.random() < 0.3:  # a step count: sound, or past 2**53, or with a payload
        count, payload = rng.choice([(7, b""), (1 << 60, b""), (7, b"x")])
        return pack_header(Op.PACE, 0, 0, 7, 0, count, len(payload)) + payload
    if kind == 6:  # per-group optimizer values, sound or not
        stops = sorted(rng.sample(range(1, 2 * N), rng.randrange(1, 4)))
        groups = [
            HyperGroup(stop, rng.choice([0.1, -1.0, float("nan"), 1e39]), 0.0, rng.choice([0.0, 0.9, 2.0]), 0.0)
            for stop in stops
        ]
        payload = encode_hyper(groups)
        return pack_header(Op.HYPER, 0, 0, 3, 0, 0, len(payload)) + payload
    if kind == 7:  # an optimizer state to load: another optimizer, other arrays or sizes, bad values
        numel = rng.choice([N, N + 1, 1 << 40])
        arrays = rng.choice([["momentum_buffer"], ["exp_avg", "exp_avg_sq"], []])
        head = encode_state_head(
            rng.choice(["sgd", "adam"]), rng.choice([0, 5, -1 & 0xFFFF]), numel, arrays, digest=rng.randbytes(16)
        )
        values = np.full(min(numel, N) * len(arrays), rng.choice([0.5, float("nan")]), np.float32).tobytes()
        return pack_header(Op.LOAD_STATE, 0, 1, 4, 0, 0, len(head) + len(values)) + head + values
    op = [Op.PULL, Op.PING, Op.STATS, Op.LEAVE, Op.STATE][kind - 2 if kind < 6 else 4]
    return pack_header(op, request_id=rng.getrandbits(32))


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """Flip, overwrite, cut or stretch a frame."""
    data = bytearray(frame)
    for _ in range(rng.randrange(1, 4)):
        how = rng.randrange(4)
        if how == 0 and data:  # flip bits, most often in the header
            i = rng.randrange(min(len(data), HEADER_SIZE + 16) if rng.random() < 0.8 else len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif how == 1 and len(data) >= HEADER_SIZE:  # a new length, far from the truth
            struct.pack_into("<Q", data, 32, rng.choice(_LENGTHS))
        elif how == 2 and data:  # cut short
            del data[rng.randrange(len(data)) :]
        else:  # trailing bytes
            data += rng.randbytes(rng.randrange(1, 64))
    return bytes(data)


def make_case(rng: random.Random, token: bytes | None) -> tuple[bool, list[bytes]]:
    """``(handshake first, frames)`` for one connection."""
    kind = rng.randrange(5)
    if kind == 0:  # headers with every field drawn, payloads shorter than promised
        frames = []
        for _ in range(rng.randrange(1, 4)):
            header = random_header(rng)
            length = unpack_header_unchecked(header)
            frames.append(header + rng.randbytes(min(length, rng.choice([0, 8, 100, 4096]))))
        return rng.random() < 0.5, frames
    if kind == 1:  # valid frames, mutated
        return rng.random() < 0.7, [mutate(rng, valid_frame(rng, token)) for _ in range(rng.randrange(1, 4))]
    if kind == 2:  # valid frames as they are: refused without harm
        return True, [valid_frame(rng, token) for _ in range(rng.randrange(1, 6))]
    if kind == 3:  # noise
        return rng.random() < 0.3, [rng.randbytes(rng.randrange(1, 300))]
    header = random_header(rng, length=rng.choice([1 << 20, 1 << 30, (1 << 63) - 1]))  # a promise never kept
    return rng.random() < 0.5, [header + rng.randbytes(rng.randrange(0, 256))]


def unpack_header_unchecked(header: bytes) -> int:
    return _HEADER.unpack_from(header)[-1]


class Target:
    """Where the cases go: a server's TCP port and (optionally) its Unix socket."""

    def __init__(self, port: int, unix_path: str | None, token: bytes | None) -> None:
        self.port, self.unix_path, self.token = port, unix_path, token

    def connect(self, rng: random.Random) -> socket.socket:
        if self.unix_path and rng.random() < 0.5:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.unix_path)
        else:
            sock = socket.create_connection(("127.0.0.1", self.port))
        sock.settimeout(2.0)
        return sock

    def handshake(self, sock: socket.socket) -> None:
        nonce = os.urandom(NONCE_BYTES)
        _send(sock, pack_header(Op.HELLO, length=NONCE_BYTES) + nonce)
        header, payload = _read_frame(sock)
        if header is None or header.op != Op.HELLO_REPLY:
            raise ConnectionError("no HELLO reply")
        required, server_nonce, _ = decode_hello_reply(payload)
        if required:
            if self.token is None:  # loud: run_case takes an OSError for the server's doing
                raise RuntimeError("the server asks for a token: give the fuzzer's target its token")
            proof = auth_proof(self.token, "client", server_nonce, nonce)
            _send(sock, pack_header(Op.AUTH, length=len(proof)) + proof)
            header, _ = _read_frame(sock)
            if header is None or header.op != Op.AUTH_REPLY:
                raise ConnectionError("no AUTH reply")


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)


def _read_frame(sock: socket.socket):
    header = _read_exact(sock, HEADER_SIZE)
    if header is None:
        return None, b""
    decoded = unpack_header(header)
    payload = _read_exact(sock, decoded.length) if decoded.length <= 1 << 20 else None
    return decoded, payload or b""


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def run_case(target: Target, rng: random.Random, tally: Tally, linger: float = 0.02) -> None:
    handshake, frames = make_case(rng, target.token)
    try:
        sock = target.connect(rng)
    except OSError:
        tally.refused += 1
        return
    tally.cases += 1
    try:
        if handshake:
            target.handshake(sock)
        for frame in frames:
            sock.sendall(frame)
            tally.frames += 1
        sock.settimeout(linger)
        while True:  # read what comes back, briefly
            header, payload = _read_frame(sock)
            if header is None:
                tally.closed_by_server += 1
                break
            if header.op == Op.ERROR:
                tally.error_frames += 1
                code = int.from_bytes(payload[:4], "little") if len(payload) >= 4 else -1
                tally.errors[code] = tally.errors.get(code, 0) + 1
            else:
                tally.replies += 1
    except (OSError, ValueError, aps.APSError):
        pass  # a reset, a timeout, a frame that is not ours to parse: the server's business
    finally:
        sock.close()


class Trainer(threading.Thread):
    """The legitimate worker: trains while the cases run and checks its weights after every step."""

    def __init__(self, address: str, transport: str, token: str | None) -> None:
        super().__init__(daemon=True)
        self.worker = aps.Worker(address, 0, 1, transport=transport, token=token)
        self.worker.init({"w": np.zeros(N, np.float32)})
        self.stop = threading.Event()
        self.steps = 0
        self.deviations = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        ones = {"w": np.ones(N, np.float32)}
        try:
            while not self.stop.is_set():
                weights = self.worker.push_pull(ones)["w"]
                self.steps += 1
                if not (weights == -float(self.steps)).all():
                    self.deviations += 1
                    self.steps = int(-weights[0])  # count on from where the weights are
                time.sleep(0.001)
        except BaseException as exc:  # reported by the caller
            self.error = exc

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        self.worker.close()
