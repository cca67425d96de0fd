"""Server options: one definition for ``aps serve`` flags, ``APS_*`` variables and ``aps.Server``.

Every field of :class:`ServerConfig` is an ``aps serve`` flag (``--max-staleness``
for ``max_staleness``) and has an environment variable twin (``APS_MAX_STALENESS``).
A flag on the command line wins over the variable, which wins over the default
(the command-line side is ``aps.cli._args``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .wire.tokens import check_token
from .errors import ConfigurationError

__all__ = [
    "MAX_WORKERS",
    "RESUME_LATEST",
    "RUN_OPTIONS",
    "ServerConfig",
    "env_name",
    "generates_token",
    "parse_workers",
    "resolve_token",
    "usable_cores",
]

SYNC_CHOICES = ("bsp", "asp", "ssp", "dssp", "softsync")
LR_STALENESS_CHOICES = ("none", "inverse")
ASYNC_SCALE_CHOICES = ("sum", "mean")
DEFAULT_STALENESS = 3
DEFAULT_MAX_STALENESS = 15
OPTIMIZER_CHOICES = ("sgd", "adam", "adamw", "delayed-nesterov")
#: The arrays of each optimizer's state, in order, as STATE replies and checkpoints name them
#: (torch.optim's names): what a worker checks a state against before sending it.
OPTIMIZER_STATE: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
    # (delta: the sum of the pushes since the momentum last moved)
    "delayed-nesterov": ("momentum_buffer", "delta"),
}
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_PORT = 7450
#: The most workers a server takes (a reply header says how many are live in 16 bits).
MAX_WORKERS = 65535
#: Options that must be finite (any float option must be a number: NaN is refused for all).
_FINITE_OPTIONS = ("lr", "momentum", "momentum_activation", "weight_decay", "eps", "checkpoint_every")
#: The optimizer's options, with what torch.optim requires of each (its optimizers refuse the rest).
_OPTIMIZER_RANGES = (("lr", ">= 0"), ("momentum", ">= 0"), ("weight_decay", ">= 0"), ("eps", ">= 0"))
#: ``--resume`` without a path: the newest complete checkpoint in ``--checkpoint-dir``.
RESUME_LATEST = "latest"
#: The options that define a run: a resumed server takes them from the checkpoint,
#: and refuses a value given that differs (the others are the operator's to change).
RUN_OPTIONS = (
    "workers",
    "sync",
    "staleness",
    "max_staleness",
    "softsync_n",
    "backup_workers",
    "lr_staleness",
    "async_scale",
    "optimizer",
    "lr",
    "momentum",
    "nesterov",
    "momentum_period",
    "momentum_activation",
    "weight_decay",
    "betas",
    "eps",
    "shard",
    "shards",
    "staleness_cutoff",
    "compensation",
)
#: Run options newer than some checkpoints: a manifest that does not say one had it at this value.
RUN_OPTIONS_SINCE = {
    "staleness_cutoff": None,
    "compensation": "none",
    "momentum_period": 0,
    "momentum_activation": 0.0,
}
#: The options every shard of a model must share: workers check them across shards.
SHARED_OPTIONS = (*(name for name in RUN_OPTIONS if name != "shard"), "min_workers")


#: The kinds ``--compensation`` takes, with whether each takes a LAMBDA.
COMPENSATIONS = {"none": False, "dc": True, "dc-adaptive": True, "gap": False}


def parse_compensation(text: str) -> tuple[str, float]:
    """``(kind, lambda)`` of a ``--compensation`` value: ``none``, ``dc:LAMBDA``,
    ``dc-adaptive:LAMBDA`` or ``gap`` (lambda 0 where it takes none)."""
    kind, sep, value = str(text).partition(":")
    if kind not in COMPENSATIONS:
        raise ConfigurationError(f"unknown --compensation {text!r}: none, dc:LAMBDA, dc-adaptive:LAMBDA or gap")
    if not COMPENSATIONS[kind]:
        if sep:
            raise ConfigurationError(f"--compensation {kind} takes no value, got {text!r}")
        return kind, 0.0
    try:
        lam = float(value)
    except ValueError:
        raise ConfigurationError(f"--compensation {kind} takes a LAMBDA ({kind}:0.04), got {text!r}") from None
    if not (lam >= 0.0 and lam < float("inf")):
        raise ConfigurationError(f"--compensation {kind}: LAMBDA must be a finite number >= 0, got {value}")
    return kind, lam


def format_compensation(kind: str, lam: float) -> str:
    """The one spelling of a ``--compensation`` value (``dc:.10`` is ``dc:0.1``; exact, not rounded)."""
    return f"{kind}:{repr(float(lam)).removesuffix('.0')}" if COMPENSATIONS[kind] else kind


def parse_workers(text: str, min_workers: int | None = None) -> tuple[int | None, int]:
    """``(MIN, MAX)`` of ``--workers``: ``"4"`` is a fixed size (MIN ``min_workers``, None
    unless given apart), ``"2:6"`` elastic."""
    low, sep, high = str(text).strip().partition(":")
    try:
        if sep:
            return int(low), int(high)
        return min_workers, int(low)
    except ValueError:
        raise ConfigurationError(
            f"--workers takes a number of workers P or MIN:MAX (such as 2:8), got {text!r}"
        ) from None


def _opt(help: str, *, choices: tuple[str, ...] | None = None, metavar: str | None = None) -> dict:
    return {"help": help, "choices": choices, "metavar": metavar}


@dataclass
class ServerConfig:
    """Options of an aps server (``aps serve --help`` describes each)."""

    host: str = field(default="127.0.0.1", metadata=_opt("address to listen on (0.0.0.0 for every interface)"))
    port: int = field(default=DEFAULT_PORT, metadata=_opt("TCP port; 0 picks a free one and prints it"))
    workers: int = field(
        default=1,
        metadata=_opt(
            "number of workers P, training starting when all have joined; or MIN:MAX, elastic: training "
            "starts when MIN have joined, others may join up to MAX and leave while MIN remain",
            metavar="P|MIN:MAX",
        ),
    )
    min_workers: int | None = field(
        default=None,
        metadata=_opt(
            "elastic: training starts when this many have joined and holds while fewer are live "
            "(--workers MIN:MAX sets it; default: --workers, a fixed size)",
            metavar="MIN",
        ),
    )
    quorum_timeout: float = field(
        default=300.0,
        metadata=_opt(
            "elastic: seconds training may hold below MIN live workers before the server checkpoints "
            "(with --checkpoint-dir) and goes on waiting",
            metavar="SECONDS",
        ),
    )
    shard: int = field(default=0, metadata=_opt("this server's shard I (0..K-1) of --shards K", metavar="I"))
    shards: int = field(
        default=1,
        metadata=_opt(
            "cut the model into K contiguous ranges, one per aps serve process (shard I holds range I); "
            "workers are given every shard's address",
            metavar="K",
        ),
    )
    sync: str = field(default="bsp", metadata=_opt("synchronization paradigm", choices=SYNC_CHOICES))
    staleness: int | None = field(
        default=None,
        metadata=_opt(
            "SSP threshold s (a worker runs at most s iterations ahead of the slowest; ssp default 3), "
            "DSSP lower bound s_L (default 3), or an optional SSP bound for softsync",
            metavar="S",
        ),
    )
    max_staleness: int | None = field(
        default=None, metadata=_opt("DSSP upper bound s_U (default max(15, s_L))", metavar="S_U")
    )
    staleness_cutoff: int | None = field(
        default=None,
        metadata=_opt(
            "drop a gradient computed more than R versions before the one it would be applied to "
            "(counted, its worker not held; asp, ssp, dssp, softsync; default: none)",
            metavar="R",
        ),
    )
    compensation: str = field(
        default="none",
        metadata=_opt(
            "compensate each stale gradient for the weights it is applied to: dc:LAMBDA (DC-ASGD), "
            "dc-adaptive:LAMBDA (its adaptive variant) or gap (gap-aware); asp, ssp, dssp, softsync "
            '(docs/algorithms.md, "Delay compensation"; default: none)',
            metavar="KIND",
        ),
    )
    softsync_n: int | None = field(
        default=None, metadata=_opt("n-softsync: one update per max(1, P // n) gradients (default 1)", metavar="N")
    )
    backup_workers: int = field(
        default=0, metadata=_opt("BSP backup workers k: a round closes on the first P-k gradients")
    )
    lr_staleness: str = field(
        default="none",
        metadata=_opt(
            "staleness-aware learning rate: inverse divides lr by each gradient's staleness",
            choices=LR_STALENESS_CHOICES,
        ),
    )
    async_scale: str = field(
        default="sum",
        metadata=_opt(
            "asp/ssp/dssp: mean scales each gradient by 1/P, so a round of pushes moves "
            "the weights about as far as one BSP step",
            choices=ASYNC_SCALE_CHOICES,
        ),
    )
    optimizer: str = field(default="sgd", metadata=_opt("server-side optimizer", choices=OPTIMIZER_CHOICES))
    lr: float = field(default=0.01, metadata=_opt("learning rate"))
    momentum: float = field(default=0.0, metadata=_opt("SGD momentum"))
    nesterov: bool = field(default=False, metadata=_opt("use Nesterov momentum (SGD)"))
    momentum_period: int = field(
        default=0,
        metadata=_opt(
            "delayed-nesterov: the momentum moves every N updates, by their mean; 0: one round's updates "
            "(--workers under asp, ssp and dssp; n under softsync; 1 under bsp, a round being one update)",
            metavar="N",
        ),
    )
    momentum_activation: float = field(
        default=0.0,
        metadata=_opt(
            "delayed-nesterov: the share c of the momentum applied at each push between its moves, "
            "the rest (1 - cN + c) when it moves; at most 1/(N-1)",
            metavar="C",
        ),
    )
    weight_decay: float = field(default=0.0, metadata=_opt("weight decay (L2 for sgd/adam, decoupled for adamw)"))
    betas: tuple[float, float] = field(
        default=(0.9, 0.999), metadata=_opt("Adam coefficients beta1,beta2", metavar="B1,B2")
    )
    eps: float = field(default=1e-8, metadata=_opt("Adam epsilon"))
    unix_socket: str = field(
        default="auto",
        metadata=_opt(
            "Unix socket for co-located workers (shared memory): a path, auto "
            "($XDG_RUNTIME_DIR or the temp dir, /aps-UID/PORT.sock), or none",
            metavar="PATH",
        ),
    )
    heartbeat_timeout: float = field(
        default=30.0,
        metadata=_opt(
            "a worker that sends nothing for this many seconds while no request of its is pending "
            "leaves the live set (aps.Worker pings when idle); 0 disables",
            metavar="SECONDS",
        ),
    )
    max_frame_bytes: int = field(
        default=4 << 30, metadata=_opt("largest frame payload accepted (K/M/G suffixes)", metavar="SIZE")
    )
    max_connections: int = field(
        default=1024,
        metadata=_opt(
            "connections accepted at once; more are refused with an error (the server raises its "
            "descriptor limit to fit)",
            metavar="N",
        ),
    )
    handshake_timeout: float = field(
        default=10.0,
        metadata=_opt(
            "seconds a connection that has not joined has to complete a frame (slow peers are closed)",
            metavar="SECONDS",
        ),
    )
    stream_min_bytes: int = field(
        default=1 << 20,
        metadata=_opt(
            "TCP gradients of at least this size are applied while they arrive, when the sync policy "
            "applies them alone (K/M/G suffixes; 0: never)",
            metavar="SIZE",
        ),
    )
    kernel_threads: int = field(
        default=0,
        metadata=_opt(
            "threads one large update (4 MiB and up) runs on, bit for bit the one-thread result "
            "(0: half the cores, at most 8)",
            metavar="N",
        ),
    )
    kernel_isa: str | None = field(
        default=None,
        metadata=_opt(
            "the instruction set the update kernels run on, each giving the same results bit for bit "
            "(default: the widest this processor runs; aps status and /metrics say which)",
            choices=("baseline", "avx2", "avx512"),
        ),
    )
    table_memory: int | None = field(
        default=None,
        metadata=_opt(
            "the bytes the rows of the embedding tables may take (K/M/G suffixes; 0: no limit; default: half "
            "the memory available at start, as its log line says): beyond it the least recently used rows of "
            "tables declared evict=True are dropped (touched again, they start from their initial values); a "
            "push that cannot fit is refused (TABLE_MEMORY_FULL) and changes nothing",
            metavar="SIZE",
        ),
    )
    token: str | None = field(
        default=None,
        repr=False,
        metadata=_opt(
            "shared secret every connection must prove it knows before anything is served (a challenge-"
            "response: it never crosses the wire); at least 128 bits (make one with aps token); needed to listen "
            "beyond loopback. On loopback without one, the server makes its own and writes it to a file only "
            "this user can read, where workers and aps status find it",
            metavar="TOKEN",
        ),
    )
    token_file: str | None = field(
        default=None, metadata=_opt("read the token from the first line of this file instead", metavar="PATH")
    )
    tls_cert: str | None = field(
        default=None,
        metadata=_opt(
            "serve TCP over TLS with this certificate (PEM; its chain, and the key unless --tls-key)", metavar="PATH"
        ),
    )
    tls_key: str | None = field(default=None, metadata=_opt("the private key of --tls-cert (PEM)", metavar="PATH"))
    tls_ca: str | None = field(
        default=None,
        metadata=_opt("require client certificates signed by these CAs (PEM) on TLS connections", metavar="PATH"),
    )
    insecure: bool = field(
        default=False,
        metadata=_opt(
            "serve without a token: anyone who reaches the port (on loopback: any user of this "
            "machine) can join, push, pull and read the model"
        ),
    )
    http_port: int | None = field(
        default=None,
        metadata=_opt(
            "serve a live dashboard (/), Prometheus metrics (/metrics) and a JSON API (/api/stats, "
            "/api/config) over HTTP on this port of --host (0 picks a free one and prints it); off by "
            "default (aps launch and aps demo: on, on a free port)",
            metavar="PORT",
        ),
    )
    checkpoint_dir: str | None = field(
        default=None,
        metadata=_opt(
            "write checkpoints (weights, optimizer state, version, clocks) into this directory: "
            "periodically, on request (aps checkpoint now), and at a clean shutdown",
            metavar="DIR",
        ),
    )
    checkpoint_every: float = field(
        default=60.0,
        metadata=_opt("seconds between checkpoints (0: none on a timer)", metavar="SECONDS"),
    )
    checkpoint_every_updates: int = field(
        default=0, metadata=_opt("also write a checkpoint every N updates (0: never)", metavar="N")
    )
    checkpoint_keep: int = field(default=3, metadata=_opt("checkpoints kept; older ones are deleted", metavar="K"))
    resume: str | None = field(
        default=None,
        metadata=_opt(
            "continue a run from a checkpoint: PATH, or the newest complete one in --checkpoint-dir "
            "when given without PATH (a new run when there is none); flags left out take the "
            "checkpoint's values, flags given must agree with them",
            metavar="PATH",
        ),
    )
    fork_run: bool = field(
        default=False,
        metadata=_opt(
            "with --resume: go on from the checkpoint as a new run, under a run id of its own (the "
            "original run's server may still be live; its workers are not served here)"
        ),
    )
    resume_unsigned: bool = field(
        default=False,
        metadata=_opt(
            "with --resume and a token: resume a checkpoint that is not signed with it (written by a "
            "server without a token of its operator's, or with another one): only when you know where "
            "it comes from"
        ),
    )
    replicas: str | None = field(
        default=None,
        metadata=_opt(
            "run as one replica of a replica set: every replica's address, comma-separated (each "
            "replica is given the same list, its own address as --advertise). One is primary, the others "
            "backups that hold every acknowledged update and take over within --failover-timeout of "
            "losing it (docs/replicas.md); needs --coordinator and a token of the operator's",
            metavar="ADDR,ADDR,...",
        ),
    )
    advertise: str | None = field(
        default=None,
        metadata=_opt("this replica's address in --replicas (default HOST:PORT)", metavar="HOST:PORT"),
    )
    coordinator: str | None = field(
        default=None,
        metadata=_opt(
            "the etcd that decides which replica is primary (its client URL, etcd://HOST:PORT, or "
            "unix:///PATH for its Unix socket)",
            metavar="URL",
        ),
    )
    replica_set: str = field(
        default="aps",
        metadata=_opt("the replica set's name in the coordinator (one per shard)", metavar="NAME"),
    )
    failover_timeout: float = field(
        default=0.5,
        metadata=_opt(
            "a backup takes over once its primary has said nothing for this long (it beats 4 times as often)",
            metavar="SECONDS",
        ),
    )
    replica_timeout: float = field(
        default=2.0,
        metadata=_opt(
            "a backup that holds no new state for this long leaves the set (replies wait for it until then)",
            metavar="SECONDS",
        ),
    )
    log_level: str = field(default="info", metadata=_opt("logging level", choices=LOG_LEVELS))

    def __post_init__(self) -> None:
        if isinstance(self.workers, str):  # "N" or "MIN:MAX" (aps.Server(workers="2:8"), $APS_WORKERS)
            self.min_workers, self.workers = parse_workers(self.workers, self.min_workers)
        elif isinstance(self.workers, tuple):
            self.min_workers, self.workers = self.workers
        self.compensation = format_compensation(*parse_compensation(self.compensation))  # (compared as text)
        self.validate()

    @property
    def elastic(self) -> bool:
        """Workers may join and leave while training runs (``--workers MIN:MAX``, MIN < MAX)."""
        return self.min_workers is not None and self.min_workers < self.workers

    @property
    def quorum(self) -> int:
        """MIN: the live workers training needs to start and to go on."""
        return self.workers if self.min_workers is None else self.min_workers

    def describe_workers(self) -> str:
        """``4`` or ``2:6``, as --workers takes it."""
        return f"{self.min_workers}:{self.workers}" if self.elastic else str(self.workers)

    def validate(self) -> None:
        """Raise ConfigurationError if an option is out of range."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (
                isinstance(value, float)
                and not math.isfinite(value)
                and (math.isnan(value) or f.name in _FINITE_OPTIONS)
            ):
                raise ConfigurationError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
        if not 0 <= self.port <= 65535:
            raise ConfigurationError(f"--port {self.port} is out of range 0..65535")
        if self.workers < 1:
            raise ConfigurationError(f"--workers must be at least 1, got {self.workers}")
        if self.workers > MAX_WORKERS:
            raise ConfigurationError(f"--workers must be at most {MAX_WORKERS}, got {self.workers}")
        if self.min_workers is not None and not 1 <= self.min_workers <= self.workers:
            raise ConfigurationError(f"--workers MIN:MAX needs 1 <= MIN <= MAX, got {self.min_workers}:{self.workers}")
        if not self.quorum_timeout > 0:
            raise ConfigurationError(f"--quorum-timeout must be > 0 seconds, got {self.quorum_timeout}")
        if self.shards < 1:
            raise ConfigurationError(f"--shards must be at least 1, got {self.shards}")
        if not 0 <= self.shard < self.shards:
            raise ConfigurationError(
                f"--shard must be in 0..{self.shards - 1} for --shards {self.shards}, got {self.shard}"
            )
        if self.sync not in SYNC_CHOICES:
            raise ConfigurationError(f"unknown sync paradigm {self.sync!r}: choose from {', '.join(SYNC_CHOICES)}")
        if self.staleness is not None:
            if self.staleness < 0:
                raise ConfigurationError(f"--staleness must be >= 0, got {self.staleness}")
            if self.sync in ("bsp", "asp"):
                raise ConfigurationError(f"--staleness applies to ssp, dssp and softsync, not {self.sync}")
        if self.max_staleness is not None:
            if self.sync != "dssp":
                raise ConfigurationError("--max-staleness applies to --sync dssp only")
            lower = DEFAULT_STALENESS if self.staleness is None else self.staleness
            if self.max_staleness < lower:
                raise ConfigurationError(
                    f"--max-staleness ({self.max_staleness}) must be at least --staleness ({lower})"
                )
        if self.staleness_cutoff is not None:
            if self.staleness_cutoff < 0:
                raise ConfigurationError(f"--staleness-cutoff must be >= 0, got {self.staleness_cutoff}")
            if self.sync == "bsp":
                raise ConfigurationError(
                    "--staleness-cutoff applies to asp, ssp, dssp and softsync: a BSP round takes "
                    "only gradients computed on its own version (staleness 0)"
                )
        if parse_compensation(self.compensation)[0] != "none" and self.sync == "bsp":
            raise ConfigurationError(
                "--compensation applies to asp, ssp, dssp and softsync: a BSP round takes only "
                "gradients computed on its own version (staleness 0)"
            )
        if self.softsync_n is not None:
            if self.sync != "softsync":
                raise ConfigurationError("--softsync-n applies to --sync softsync only")
            if not 1 <= self.softsync_n <= self.quorum:
                raise ConfigurationError(
                    f"--softsync-n must be in 1..{self.quorum}"
                    + (" (MIN of --workers)" if self.elastic else "")
                    + f", got {self.softsync_n}"
                )
        if self.lr_staleness not in LR_STALENESS_CHOICES:
            raise ConfigurationError(f"unknown --lr-staleness {self.lr_staleness!r}")
        if self.async_scale not in ASYNC_SCALE_CHOICES:
            raise ConfigurationError(f"unknown --async-scale {self.async_scale!r}")
        if not 0 <= self.backup_workers < self.quorum:
            raise ConfigurationError(
                f"backup workers must be in 0..{self.quorum - 1} for {self.quorum} workers, got {self.backup_workers}"
            )
        if self.backup_workers and self.sync != "bsp":
            raise ConfigurationError("--backup-workers applies to --sync bsp only")
        if self.optimizer not in OPTIMIZER_CHOICES:
            raise ConfigurationError(
                f"unknown optimizer {self.optimizer!r}: choose from {', '.join(OPTIMIZER_CHOICES)}"
            )
        self._validate_optimizer()
        if self.heartbeat_timeout < 0:
            raise ConfigurationError(f"--heartbeat-timeout must be >= 0, got {self.heartbeat_timeout}")
        if self.max_frame_bytes < 1 << 16:
            raise ConfigurationError(f"--max-frame-bytes must be at least 64K, got {self.max_frame_bytes}")
        if self.max_connections < 1:
            raise ConfigurationError(f"--max-connections must be at least 1, got {self.max_connections}")
        if not self.handshake_timeout > 0:
            raise ConfigurationError(f"--handshake-timeout must be > 0, got {self.handshake_timeout}")
        if not 0 <= self.kernel_threads <= 64:
            raise ConfigurationError(f"--kernel-threads must be in 0..64, got {self.kernel_threads}")
        if self.table_memory is not None and self.table_memory < 0:
            raise ConfigurationError(f"--table-memory must be >= 0, got {self.table_memory}")
        if self.stream_min_bytes < 0:
            raise ConfigurationError(f"--stream-min-bytes must be >= 0, got {self.stream_min_bytes}")
        if self.token is not None and not self.token:
            raise ConfigurationError("--token must not be empty")
        if self.token is not None and self.token_file is not None:
            raise ConfigurationError("give --token or --token-file, not both")
        if self.insecure and (self.token is not None or self.token_file is not None):
            raise ConfigurationError("--insecure serves without a token: give it or --token/--token-file, not both")
        if self.token is not None:
            check_token(self.token.decode("utf-8", "replace") if isinstance(self.token, bytes) else self.token)
        if not self.insecure and self.token is None and self.token_file is None and not is_loopback(self.host):
            raise ConfigurationError(
                f"refusing to listen on {self.host} without a token: anyone who reaches the port could join, "
                "push gradients, pull and read the model. Give --token or --token-file (or APS_TOKEN), "
                "or --insecure to accept that"
            )
        if (self.tls_key or self.tls_ca) and not self.tls_cert:
            raise ConfigurationError("--tls-key and --tls-ca go with --tls-cert")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ConfigurationError(f"--http-port {self.http_port} is out of range 0..65535")
        if self.checkpoint_every < 0:
            raise ConfigurationError(f"--checkpoint-every must be >= 0 seconds, got {self.checkpoint_every}")
        if self.checkpoint_every_updates < 0:
            raise ConfigurationError(f"--checkpoint-every-updates must be >= 0, got {self.checkpoint_every_updates}")
        if self.checkpoint_keep < 1:
            raise ConfigurationError(f"--checkpoint-keep must be at least 1, got {self.checkpoint_keep}")
        if self.replicas is not None:
            if self.coordinator is None:
                raise ConfigurationError(
                    "--replicas needs --coordinator etcd://HOST:PORT (who is primary is decided there)"
                )
            if self.token is None and self.token_file is None:
                raise ConfigurationError(
                    "--replicas needs a token of the operator's (--token, --token-file or APS_TOKEN), the same for "
                    "every replica: they prove it to each other, and a backup that takes over serves the workers "
                    "with it"
                )
            if self.port == 0 and self.advertise is None:
                raise ConfigurationError("a replica's --port is part of its address in --replicas: give it")
        if not 0 < self.failover_timeout <= 60 or not 0 < self.replica_timeout <= 600:
            raise ConfigurationError("--failover-timeout is in (0, 60] s and --replica-timeout in (0, 600] s")
        if self.resume == RESUME_LATEST and self.checkpoint_dir is None:
            raise ConfigurationError("--resume without a PATH resumes from --checkpoint-dir: give one of them")
        if self.fork_run and self.resume is None:
            raise ConfigurationError("--fork-run starts a new run from a checkpoint: give --resume PATH with it")
        if self.resume_unsigned and self.resume is None:
            raise ConfigurationError("--resume-unsigned is about the checkpoint --resume names: give --resume with it")
        if self.log_level not in LOG_LEVELS:
            raise ConfigurationError(f"unknown log level {self.log_level!r}")

    def _validate_optimizer(self) -> None:
        """The ranges torch.optim's SGD, Adam and AdamW accept, checked as they check them
        (the kernels' float32 limits are the server's to check: aps.server.engine.optim)."""
        for name, rule in _OPTIMIZER_RANGES:
            value = getattr(self, name)
            if not value >= 0.0:
                raise ConfigurationError(
                    f"--{name.replace('_', '-')} must be {rule} (as torch.optim requires), got {value}"
                )
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ConfigurationError(f"--betas takes two numbers B1,B2, got {betas!r}")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ConfigurationError(
                    f"--betas: beta{index + 1} must be in [0, 1) (as torch.optim requires), got {beta}"
                )
        delayed = self.optimizer == "delayed-nesterov"
        if self.optimizer not in ("sgd", "delayed-nesterov") and (self.momentum or self.nesterov):
            raise ConfigurationError(
                f"--momentum and --nesterov apply to --optimizer sgd, not {self.optimizer} (Adam's momentum is --betas)"
            )
        if self.nesterov and not self.momentum > 0.0:
            raise ConfigurationError("--nesterov needs a --momentum > 0 (as torch.optim.SGD requires)")
        if not delayed and (self.momentum_period or self.momentum_activation):
            raise ConfigurationError(
                "--momentum-period and --momentum-activation apply to --optimizer delayed-nesterov, "
                f"not {self.optimizer}"
            )
        if delayed:
            self._validate_delayed_nesterov()

    def _validate_delayed_nesterov(self) -> None:
        if self.nesterov:
            raise ConfigurationError("--nesterov applies to sgd: delayed-nesterov is Nesterov's step by construction")
        if self.weight_decay:
            raise ConfigurationError("delayed-nesterov takes no --weight-decay")
        period = self.momentum_period
        if isinstance(period, bool) or not isinstance(period, int) or not 0 <= period <= 1 << 24:
            raise ConfigurationError(f"--momentum-period must be a whole number in 0..{1 << 24}, got {period!r}")
        if not self.momentum > 0.0:
            raise ConfigurationError("delayed-nesterov needs a --momentum > 0 (the paper's outer momentum is 0.9)")
        kind = parse_compensation(self.compensation)[0]
        if kind in ("dc", "dc-adaptive"):
            raise ConfigurationError(
                f"--compensation {kind} does not apply to delayed-nesterov: its pushes are pseudo-gradients (the sum "
                "of a worker's local steps), and DC-ASGD's correction is a Taylor step of one gradient at the weights "
                "it was computed on; gap (a penalty on parameters that moved) or none"
            )
        period, c = self.delayed_period, self.momentum_activation
        if not (math.isfinite(c) and 0.0 <= c and c * (period - 1) <= 1.0):
            raise ConfigurationError(
                f"--momentum-activation must be in [0, 1/(N-1)] for a period N of {period}, so that the share of "
                f"the momentum applied when it moves, 1 - cN + c, is not negative; got {c}"
            )

    @property
    def delayed_period(self) -> int:
        """delayed-nesterov's period N: ``--momentum-period``, or when 0 the updates of one round:
        ``--workers`` (MAX, elastic) under asp, ssp and dssp, n under softsync, 1 under bsp."""
        if self.momentum_period:
            return self.momentum_period
        if self.sync == "bsp":
            return 1
        if self.sync == "softsync":
            return self.softsync_n or 1
        return self.workers

    def public(self) -> dict[str, Any]:
        """Every option but the token, by field name (what may be shown or saved)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "token"}

    def shard_description(self) -> dict[str, Any]:
        """What a worker checks across shards: this shard's index, and the options all the
        shards of a model must share (SHARED_OPTIONS), by name."""
        return {"shard": self.shard, **{name: getattr(self, name) for name in SHARED_OPTIONS}}

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)

    def staleness_bounds(self) -> tuple[int, int] | None:
        """The window's ``(lower, upper)`` for this sync policy, or None when unbounded."""
        if self.sync == "ssp":
            s = DEFAULT_STALENESS if self.staleness is None else self.staleness
            return s, s
        if self.sync == "dssp":
            lower = DEFAULT_STALENESS if self.staleness is None else self.staleness
            upper = max(DEFAULT_MAX_STALENESS, lower) if self.max_staleness is None else self.max_staleness
            return lower, upper
        if self.sync == "softsync" and self.staleness is not None:
            return self.staleness, self.staleness
        return None

    def describe_sync(self) -> str:
        """The sync policy and its parameters, e.g. ``dssp s_L=3 s_U=15 lr/staleness``."""
        bounds = self.staleness_bounds()
        text = self.sync
        if self.sync == "bsp" and self.backup_workers:
            text += f" backup={self.backup_workers}"
        elif self.sync == "dssp" and bounds is not None:  # always bounded
            text += f" s_L={bounds[0]} s_U={bounds[1]}"
        elif self.sync == "ssp" and bounds is not None:  # always bounded
            text += f" s={bounds[0]}"
        elif self.sync == "softsync":
            text += f" n={self.softsync_n or 1}" + (f" s={bounds[0]}" if bounds else "")
        if self.lr_staleness == "inverse" and self.sync != "bsp":
            text += " lr/staleness"
        if self.async_scale == "mean" and self.sync in ("asp", "ssp", "dssp"):
            text += " mean-scaled"
        if self.staleness_cutoff is not None:
            text += f" cutoff={self.staleness_cutoff}"
        if self.compensation != "none":
            text += f" compensation={self.compensation}"
        return text


def resolve_token(config: ServerConfig) -> bytes | None:
    """The token given as bytes (read from ``token_file`` if given, and checked as
    ``--token`` is), or None without one (see :func:`generates_token`)."""
    if config.token is not None:
        return config.token.encode("utf-8")
    if config.token_file is None:
        return None
    try:
        with open(config.token_file, encoding="utf-8") as fh:
            token = fh.readline().strip()
    except OSError as exc:
        raise ConfigurationError(f"cannot read --token-file {config.token_file}: {exc.strerror or exc}") from None
    if not token:
        raise ConfigurationError(f"--token-file {config.token_file} holds no token")
    check_token(token, f"the token in --token-file {config.token_file}")
    return token.encode("utf-8")


def generates_token(config: ServerConfig) -> bool:
    """True when a server with these options makes a token of its own: on a loopback
    address, with none given and without ``--insecure`` (see :mod:`aps.wire.tokens`)."""
    return config.token is None and config.token_file is None and not config.insecure and is_loopback(config.host)


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve beyond this machine


def env_name(field_name: str) -> str:
    """The environment variable twin of an option: ``max_staleness`` -> ``APS_MAX_STALENESS``."""
    return "APS_" + field_name.upper()


def usable_cores() -> int:
    """The cores this process may run on: its affinity on Linux, every core elsewhere (macOS)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1
