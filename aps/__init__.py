"""aps: an asyncio parameter server for distributed deep-learning training.

One ``aps serve`` process holds the weights and the optimizer state; training
processes use :class:`Worker` to push gradients and pull weights under a
synchronization paradigm (BSP, ASP, SSP), and rows of embedding tables (:class:`Table`)
by id.
"""

from typing import TYPE_CHECKING

from .checkpoint import Checkpoint, load_checkpoint
from .config import ServerConfig
from .errors import (
    APSConnectionError,
    APSError,
    APSTimeoutError,
    AuthenticationError,
    ConfigurationError,
    DTypeMismatch,
    Evicted,
    InitTimeout,
    InvalidHyperparameters,
    InvalidIds,
    InvalidState,
    WeightsRefused,
    LayoutMismatch,
    NonFiniteGradient,
    ProtocolError,
    RankOutOfRange,
    RankTaken,
    RunChanged,
    ServerError,
    ServerSilent,
    ServerUnproven,
    ShuttingDown,
    NotPrimary,
    TableMemoryFull,
    TableMismatch,
)
from .layout import Layout
from .tables import Table
from .client.aio import AsyncWorker
from .client.worker import Worker

from ._version import __version__

if TYPE_CHECKING:
    from .server.server import Server


def __getattr__(name: str) -> object:
    # The server (aiohttp, the HTTP page, the coordinator, replicas) is loaded when first named:
    # a worker process that never runs one starts without it (about half of `import aps`).
    if name == "Server":
        from .server.server import Server

        return Server
    raise AttributeError(f"module 'aps' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "Server"})


__all__ = [
    "APSConnectionError",
    "APSError",
    "APSTimeoutError",
    "AsyncWorker",
    "AuthenticationError",
    "Checkpoint",
    "ConfigurationError",
    "DTypeMismatch",
    "Evicted",
    "InitTimeout",
    "InvalidHyperparameters",
    "InvalidIds",
    "InvalidState",
    "WeightsRefused",
    "Layout",
    "LayoutMismatch",
    "NonFiniteGradient",
    "ProtocolError",
    "RankOutOfRange",
    "RankTaken",
    "RunChanged",
    "Server",
    "ServerConfig",
    "ServerError",
    "ServerSilent",
    "ServerUnproven",
    "ShuttingDown",
    "Table",
    "NotPrimary",
    "TableMemoryFull",
    "TableMismatch",
    "Worker",
    "__version__",
    "load_checkpoint",
]
