"""Who is primary of a replica set: a record in etcd, changed only by compare-and-swap.

A replica set (``aps serve --replicas A,B,...``) keeps one record in the
coordinator, under ``/aps/replica-sets/NAME``: the primary's address and the
backups that hold every acknowledged update (the *listed* backups). Its etcd
``mod_revision`` is the set's **term**: every change of the record makes a new
one, and every change is a transaction that compares the revision its writer
last read, so of two replicas that both think they may change it, one wins and
the other learns it lost (docs/replicas.md):

- a primary lists a backup once it holds the whole state, and unlists one that
  stopped acknowledging: a primary whose compare fails has been deposed, and
  stops;
- a listed backup that lost its primary makes itself primary: one compare
  decides which backup it is, and fences the old primary.

The record is read and written through etcd's JSON gateway (``/v3/kv/...``),
with aiohttp. Nothing else of etcd is used: no lease, no watch. The coordinator
is asked only when the set changes; while it is gone, a set whose members stay
up trains on (a failover waits for it).
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ..errors import ConfigurationError

__all__ = ["Coordinator", "CoordinatorUnavailable", "Record"]

log = logging.getLogger("aps.server")

_TIMEOUT_S = 2.0  # one request to etcd


class CoordinatorUnavailable(Exception):
    """etcd did not answer, or answered with an error: nothing was changed by this request."""


@dataclass(frozen=True)
class Record:
    """The replica set as the coordinator holds it."""

    primary: str
    backups: tuple[str, ...] = ()
    #: The etcd revision the record was written at: the set's term (0: no record).
    term: int = 0
    #: The primary's run id and incarnation, for the record (what ``aps status`` shows).
    detail: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {"primary": self.primary, "backups": list(self.backups), **self.detail}, separators=(",", ":")
        ).encode()

    @classmethod
    def decode(cls, raw: bytes, term: int) -> Record:
        try:
            value = json.loads(raw)
            primary, backups = value.pop("primary"), value.pop("backups")
            if not isinstance(primary, str) or not all(isinstance(b, str) for b in backups):
                raise TypeError("addresses are strings")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CoordinatorUnavailable(f"the replica set's record is not one aps wrote ({exc})") from None
        return cls(primary, tuple(backups), term, value)


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


class Coordinator:
    """The replica set ``name``'s record in the etcd at ``url``: its client URL,
    ``etcd://HOST:PORT`` (or ``http://``), or ``unix:///PATH``, the Unix socket it listens
    on (``aps launch --replica-count``'s private etcd: only its user can connect)."""

    def __init__(self, url: str, name: str) -> None:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("etcd", "http", "unix") or not rest or (scheme == "unix" and rest[0] != "/"):
            raise ConfigurationError(
                f"--coordinator takes etcd://HOST:PORT (an etcd's client URL) or unix:///PATH (its Unix socket), "
                f"got {url!r}"
            )
        self._socket = rest if scheme == "unix" else None
        self.url = "http://localhost" if scheme == "unix" else f"http://{rest.rstrip('/')}"
        self.where = url if scheme == "unix" else self.url  # (what errors name)
        self.name = name
        self.key = f"/aps/replica-sets/{name}"
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, path: str, body: dict) -> dict:
        if self._session is None:
            connector = aiohttp.UnixConnector(path=self._socket) if self._socket is not None else None
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S), connector=connector)
        try:
            async with self._session.post(f"{self.url}/v3/{path}", json=body) as response:
                answer = await response.json(content_type=None)
                if response.status != 200 or not isinstance(answer, dict):
                    raise CoordinatorUnavailable(f"etcd at {self.where} answered {response.status}: {answer}")
                return answer
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise CoordinatorUnavailable(f"etcd at {self.where}: {type(exc).__name__}: {exc}") from None

    async def read(self) -> Record | None:
        """The record, or None when there is none."""
        answer = await self._call("kv/range", {"key": _b64(self.key)})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return Record.decode(base64.b64decode(kv.get("value", "")), int(kv["mod_revision"]))

    async def swap(self, expected_term: int, record: Record) -> Record | None:
        """Write ``record`` if the record is still the one of ``expected_term`` (0: if there is
        none); returns it with its new term, or None when somebody changed it first."""
        compare = (
            {"key": _b64(self.key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            if expected_term == 0
            else {"key": _b64(self.key), "target": "MOD", "result": "EQUAL", "mod_revision": str(expected_term)}
        )
        answer = await self._call(
            "kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": {"key": _b64(self.key), "value": _b64(record.encode())}}],
            },
        )
        if not answer.get("succeeded"):
            return None
        term = int(answer["header"]["revision"])
        return Record(record.primary, record.backups, term, record.detail)
