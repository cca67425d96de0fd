"""Values the tools and their commands share, parsed and checked without argparse: byte
sizes, per-worker speed lists, sync settings (``ssp:3``), range checks, and the command line
a result was made with. :mod:`aps.cli._args` turns them into argparse types."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import COMPENSATIONS, parse_compensation
from ..errors import ConfigurationError


def _split(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise ValueError(text)
    return parts


def parse_size(text: str) -> int:
    """A byte count with an optional binary K, M or G suffix (``4K``, ``64M``, ``1.5G``, ``512``)."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if value.endswith(suffix):
            value, scale = value[:-1], factor
            break
    try:
        size = float(value) * scale
    except ValueError:
        raise ConfigurationError(f"expected a size in bytes such as 512, 64K or 1.5G, got {text!r}") from None
    if not math.isfinite(size) or size < 0 or size != int(size):
        raise ConfigurationError(f"expected a whole, non-negative number of bytes, got {text!r}")
    return int(size)


def format_size(nbytes: int) -> str:
    """The shortest exact way to write ``nbytes`` with a K, M or G suffix."""
    for suffix, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{suffix}"
    return str(nbytes)


def parse_speeds(text: str, count: int | None = None, flag: str = "--speeds") -> list[float]:
    """Per-worker multiples such as ``1,1,1,2.5``: positive and finite, ``count`` of them if given."""
    try:
        values = [float(part) for part in _split(text)]
    except ValueError:
        values = []
    if (
        not values
        or (count is not None and len(values) != count)
        or not all(math.isfinite(v) and v > 0 for v in values)
    ):
        how_many = "" if count is None else f"{count} "
        raise ConfigurationError(
            f"{flag} needs {how_many}positive numbers separated by commas, such as 1,1,1,2.5, got {text!r}"
        )
    return values


def describe_speeds(speeds: Sequence[float]) -> str:
    """``speeds 1,1,1,2.5``; for many workers, how many at each speed, or their spread."""
    if len(speeds) <= 8:
        return "speeds " + ",".join(f"{s:g}" for s in speeds)
    counts: dict[float, int] = {}
    for s in speeds:
        counts[s] = counts.get(s, 0) + 1
    if len(counts) <= 3:
        return f"{len(speeds)} workers, iteration times " + ", ".join(f"{s:g} (x{n})" for s, n in counts.items())
    return (
        f"{len(speeds)} workers, iteration times {sum(speeds) / len(speeds):.2f} mean, "
        f"{min(speeds):.2f}-{max(speeds):.2f}"
    )


SETTING_FORM = "bsp[:K], asp, ssp:S, dssp:S_L:S_U or softsync:N[:S]"


@dataclass(frozen=True)
class Setting:
    """One sync configuration: its text (``ssp:3``) and its ``ServerConfig`` options; for local
    SGD (``+local:H``), the inner steps between syncs and whether they are dynamic (``+dylu``);
    and the pushes' compression (``+int8``, ``+int4``: block-quantized with error feedback)."""

    label: str
    options: dict = field(hash=False, compare=False)
    local_every: int | None = None
    dynamic: bool = False
    compression: str | None = None


#: The outer step of local SGD settings: DiLoCo's (Douillard et al., 2023: SGD, learning rate
#: 0.7, Nesterov momentum 0.9), and with ``+dn`` delayed Nesterov (Liu et al., 2024) at the same.
DILOCO_OUTER = {"optimizer": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
DELAYED_NESTEROV_OUTER = {"optimizer": "delayed-nesterov", "lr": 0.7, "momentum": 0.9}
#: The suffixes that quantize every push (``aps.Worker(compression=...)``).
QUANTIZED_COMPRESSIONS = ("int8", "int4")


def parse_setting(text: str) -> Setting:
    """``bsp[:K]``, ``asp``, ``ssp:S``, ``dssp:S_L:S_U``, ``softsync:N[:S]``; append
    ``+inverse`` for ``--lr-staleness inverse``, ``+cutoff:R`` for ``--staleness-cutoff R``, and
    ``+dc:LAMBDA``, ``+dc-adaptive:LAMBDA`` or ``+gap`` for ``--compensation`` (``asp+cutoff:8+gap``);
    ``+local:H`` for local SGD, with ``+dn`` and ``+dylu``; ``+int8`` or ``+int4`` for pushes
    block-quantized with error feedback (``bsp+local:50+int4``)."""
    label = text.strip()
    body, *extras = label.split("+")
    name, *args = body.split(":")
    try:
        numbers = [int(a) for a in args]
    except ValueError:
        raise ConfigurationError(f"bad sync setting {text!r}: parameters must be integers") from None
    options: dict = {"sync": name}
    if name == "bsp" and len(numbers) <= 1:
        if numbers:
            options["backup_workers"] = numbers[0]
    elif name == "asp" and not numbers:
        pass
    elif name == "ssp" and len(numbers) == 1:
        options["staleness"] = numbers[0]
    elif name == "dssp" and len(numbers) == 2:
        options["staleness"], options["max_staleness"] = numbers
    elif name == "softsync" and 1 <= len(numbers) <= 2:
        options["softsync_n"] = numbers[0]
        if len(numbers) == 2:
            options["staleness"] = numbers[1]
    else:
        raise ConfigurationError(f"bad sync setting {text!r}: use {SETTING_FORM}")
    local_every, outer, dynamic, compression = None, DILOCO_OUTER, False, None
    for extra in extras:
        key, _, value = extra.partition(":")
        if key == "local" and value.isdigit() and int(value) >= 1 and local_every is None:
            local_every = int(value)
        elif extra == "dn" and outer is DILOCO_OUTER:
            outer = DELAYED_NESTEROV_OUTER
        elif extra == "dylu" and not dynamic:
            dynamic = True
        elif extra in QUANTIZED_COMPRESSIONS and compression is None:
            compression = extra
        elif extra == "inverse" and "lr_staleness" not in options:
            options["lr_staleness"] = "inverse"
        elif key == "cutoff" and value.isdigit() and "staleness_cutoff" not in options:
            options["staleness_cutoff"] = int(value)
        elif key in COMPENSATIONS and key != "none" and "compensation" not in options:
            parse_compensation(extra)  # (its own message for a bad LAMBDA)
            options["compensation"] = extra
        else:
            raise ConfigurationError(
                f"bad sync setting {text!r}: the suffixes are +inverse, +cutoff:R, one compensation "
                "(+dc:LAMBDA, +dc-adaptive:LAMBDA or +gap), and local SGD's +local:H with +dn "
                "(delayed Nesterov) and +dylu (dynamic local updates), and +int8 or +int4 (quantized "
                "pushes), once each"
            )
    if local_every is None:
        if outer is not DILOCO_OUTER or dynamic:
            raise ConfigurationError(f"bad sync setting {text!r}: +dn and +dylu go with +local:H (local SGD)")
        return Setting(label, options, compression=compression)
    return Setting(label, {**options, **outer}, local_every, dynamic, compression)


def require(condition: bool, message: str) -> None:
    """Raise ConfigurationError(``message``) unless ``condition`` (a range check naming its flag)."""
    if not condition:
        raise ConfigurationError(message)


def command_line() -> str:
    """How this process was started, to print beside the results it writes."""
    program = os.path.basename(sys.argv[0])
    if program in ("aps", "__main__.py"):
        return " ".join(["aps", *sys.argv[1:]])
    return " ".join(["python", *sys.argv] if program.endswith(".py") else sys.argv)
