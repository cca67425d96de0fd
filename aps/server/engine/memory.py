"""How many bytes the rows of the embedding tables may take (``--table-memory``).

Given, the option's value (0: no limit). Left out, a share of the memory this process
could still take when the server started: the machine's available memory (Linux's
``MemAvailable``: free memory and the caches the kernel can give back), or less where the
control group the process runs in (a container, a systemd unit, a batch job's allocation)
allows less. The server says which at start, and shows the rows' use against it on
``/metrics`` and the dashboard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["DEFAULT_SHARE", "TableMemory", "available_memory"]

#: The share of the memory available at start the rows may take when --table-memory is not
#: given (what the messages call "half").
DEFAULT_SHARE = 0.5
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class TableMemory:
    """The tables' limit and where it came from.

    Attributes:
        limit: the bytes the rows may take (0: no limit).
        available: the bytes available at start, when the limit is the default (else None).
    """

    limit: int
    available: int | None = None

    @classmethod
    def resolve(cls, option: int | None, available: int | None = None) -> TableMemory:
        """``--table-memory``'s value as given (0: no limit), or None for the default:
        :data:`DEFAULT_SHARE` of ``available`` (measured now when not given)."""
        if option is not None:
            return cls(int(option))
        if available is None:
            available = available_memory()
        return cls(max(1, int(available * DEFAULT_SHARE)), available)

    @property
    def default(self) -> bool:
        return self.available is not None

    def describe(self) -> str:
        """What the start's log line says of it."""
        if not self.limit:
            return "table memory unlimited (--table-memory 0)"
        if self.available is not None:  # (the default)
            return (
                f"table memory up to {_size(self.limit)} (half the {_size(self.available)} available at "
                "start; --table-memory sets it)"
            )
        return f"table memory up to {_size(self.limit)} (--table-memory)"

    def source(self) -> str:
        """Where the limit came from, for a refused push's error."""
        if self.available is not None:  # (the default)
            return f"the default: half the {_size(self.available)} available when the server started"
        return "as given"


def available_memory() -> int:
    """The bytes this process could still take: the machine's available memory, or what its
    control group's limit leaves, whichever is less."""
    available = psutil.virtual_memory().available
    room = _cgroup_room()
    return min(available, room) if room is not None else available


def _cgroup_room(listing: str | None = None, root: Path = _CGROUP) -> int | None:
    """What the tightest memory limit of this process's control groups leaves (cgroup v2:
    memory.max less memory.current, up the hierarchy; v1: limit_in_bytes less usage_in_bytes),
    or None without one. ``listing``: /proc/PID/cgroup's text (this process's by default);
    ``root``: where the hierarchies are mounted."""
    rooms = []
    if listing is None:
        try:
            listing = Path(f"/proc/{os.getpid()}/cgroup").read_text()
        except OSError:
            return None
    for line in listing.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy
            where = root / path.lstrip("/")
            while True:
                rooms.append(_room(where / "memory.max", where / "memory.current"))
                if where == root or root not in where.parents:
                    break
                where = where.parent
        elif "memory" in controllers.split(","):
            for where in (root / "memory" / path.lstrip("/"), root / "memory"):
                rooms.append(_room(where / "memory.limit_in_bytes", where / "memory.usage_in_bytes"))
    found = [room for room in rooms if room is not None]
    return min(found) if found else None


def _room(limit_file: Path, usage_file: Path) -> int | None:
    try:
        limit = limit_file.read_text().strip()
        usage = int(usage_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 62:  # (v1 says "none" with a huge number)
        return None
    return max(0, int(limit) - usage)


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} bytes"
