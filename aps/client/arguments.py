"""What a worker is given, checked before it connects: the server's address (or the shards',
or the environment ``aps launch`` and torchrun set), the transport, and the heartbeat and
reconnect settings; and the refusal of a plain worker given one shard of a sharded model.
"""

from __future__ import annotations

import json
import os
import ssl
from typing import Any

from ..errors import ConfigurationError
from ..wire.net import Address
from ..wire.protocol import ServerInfo

__all__ = ["from_env"]

_TRANSPORTS = ("auto", "tcp", "shm")


def _refuse_one_shard(info: ServerInfo, address: str) -> None:
    """A worker given only one shard of a sharded model would train the whole model on it."""
    try:
        described = json.loads(info.shard) if info.shard else {}
    except ValueError:
        described = {}
    shards = described.get("shards", 1) if isinstance(described, dict) else 1
    if isinstance(shards, int) and shards > 1:
        shard = described.get("shard")
        raise ConfigurationError(
            f"the server at {address} is shard {shard} of {shards} (--shard {shard} --shards {shards}): give the "
            "worker every shard's address (comma-separated, or a list)"
        )


def _names_shards(address: Any) -> bool:
    """Whether ``address`` names several servers: the shards of one model."""
    if isinstance(address, (list, tuple)):
        return len(address) > 1
    return isinstance(address, str) and "," in address


def from_env(address: str | None, rank: int | None, num_workers: int | None) -> tuple[str, int | None, int | None]:
    """What a worker was given, with what was not filled in from the environment that
    ``aps launch`` and torchrun set: ``APS_ADDRESS``, ``RANK`` and ``WORLD_SIZE``.

    Args:
        address: the server's address, or None for ``$APS_ADDRESS``.
        rank: this worker's rank, or None for ``$RANK`` (without it, None: the server
            assigns a free rank).
        num_workers: the run's workers, or None for ``$WORLD_SIZE`` (without it, None: the
            worker takes the server's count).

    Returns:
        ``(address, rank, num_workers)``.

    Raises:
        ConfigurationError: no address given and ``$APS_ADDRESS`` not set, or a variable
            that is not valid (``RANK=x``).
    """
    if address is None:
        address = os.environ.get("APS_ADDRESS")
        if address is None:
            raise ConfigurationError("no address given and $APS_ADDRESS is not set")
    return address, _number(rank, "RANK"), _number(num_workers, "WORLD_SIZE")


def _number(given: int | None, variable: str) -> int | None:
    """``given``, or the integer the environment ``variable`` holds (None: not set)."""
    if given is not None:
        return given
    raw = os.environ.get(variable)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"${variable}={raw!r} is not valid") from None


def _check_heartbeat(heartbeat: float | None, server_timeout: float | None = None) -> None:
    if heartbeat is not None and heartbeat <= 0:
        raise ConfigurationError(f"heartbeat must be a positive number of seconds or None, got {heartbeat}")
    if server_timeout is not None and server_timeout <= 0:
        raise ConfigurationError(f"server_timeout must be a positive number of seconds or None, got {server_timeout}")


def _check_reconnect(reconnect: bool, reconnect_timeout: float | None) -> float | None:
    """Seconds to keep trying to reconnect (None: forever), or 0 when the worker does not."""
    if reconnect_timeout is not None and reconnect_timeout <= 0:
        raise ConfigurationError(
            f"reconnect_timeout must be a positive number of seconds or None, got {reconnect_timeout}"
        )
    return reconnect_timeout if reconnect else 0


def _check_transport(transport: str) -> None:
    if transport not in _TRANSPORTS:
        raise ConfigurationError(f"unknown transport {transport!r}: choose from {', '.join(_TRANSPORTS)}")


def _with_scheme(address: Address, tls: bool | ssl.SSLContext | None) -> Address:
    """The address as the worker will use it: ``tls://`` when it speaks TLS."""
    if tls is False and address.scheme == "tls":
        raise ConfigurationError(f"{address} is a TLS address, but tls=False")
    return address._replace(scheme="tls") if tls else address
