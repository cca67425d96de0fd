"""LOG (:meth:`aps.Worker.log`): what a worker's training loop reports, checked on arrival.

The payload is one UTF-8 JSON object of at most :data:`MAX_LOG_BYTES`::

    {"points": [[step, {name: value, ...}], ...],
     "process": {"pid": int, "cpu_s": float, "rss_bytes": int},
     "batches": [[step, digest], ...]}

``points`` are the scalars logged since the last LOG (at most :data:`MAX_LOG_POINTS`
values in all); ``process`` is the worker process's CPU time and resident memory
(optional); ``batches`` are digests of the batches it trained on (16 hex digits each;
optional), which show the server two ranks reading the same data. A name is 1 to
:data:`MAX_SCALAR_NAME` characters of ``[A-Za-z0-9_.:/-]``; a step an integer from 0 to
2**53; a value a float, NaN and the infinities included (a loss that diverged is worth
seeing). Anything else refuses the whole request.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from ..errors import MalformedFrame

__all__ = [
    "MAX_LOG_BYTES",
    "MAX_LOG_POINTS",
    "MAX_SCALAR_NAME",
    "MAX_STEP",
    "LogReport",
    "check_scalar_name",
    "decode_log",
    "encode_log",
]

#: A LOG's payload is at most this many bytes.
MAX_LOG_BYTES = 64 << 10
#: A LOG carries at most this many values (and as many batch digests).
MAX_LOG_POINTS = 1024
#: A scalar's name is at most this many characters.
MAX_SCALAR_NAME = 64
MAX_STEP = 1 << 53
_NAME = re.compile(rf"[A-Za-z0-9_.:/-]{{1,{MAX_SCALAR_NAME}}}")
_DIGEST = re.compile(r"[0-9a-f]{16}")


@dataclass(slots=True)
class LogReport:
    """A LOG, decoded and checked: ``points`` as (step, name, value) in the order logged."""

    points: list[tuple[int, str, float]] = field(default_factory=list)
    process: dict | None = None
    batches: list[tuple[int, str]] = field(default_factory=list)


def check_scalar_name(name: object) -> str:
    """``name`` when it may name a scalar; ValueError saying why not."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"a scalar's name is 1 to {MAX_SCALAR_NAME} characters of A-Z a-z 0-9 _ . : / -, not {name!r:.80}"
        )
    return name


def encode_log(
    points: list[tuple[int, dict[str, float]]],
    process: dict | None = None,
    batches: list[tuple[int, str]] | None = None,
) -> bytes:
    """The payload of a LOG (the caller has checked names, steps and counts)."""
    body: dict = {"points": [[step, values] for step, values in points]}
    if process is not None:
        body["process"] = process
    if batches:
        body["batches"] = [list(batch) for batch in batches]
    return json.dumps(body, separators=(",", ":")).encode()


def decode_log(payload: memoryview | bytes) -> LogReport:
    """The report a LOG carries; MalformedFrame when any part of it is wrong (nothing is kept)."""
    if len(payload) > MAX_LOG_BYTES:
        raise MalformedFrame(f"a LOG carries {MAX_LOG_BYTES} bytes at most, got {len(payload)}")
    try:
        body = json.loads(bytes(payload).decode("utf-8"))
    except (ValueError, RecursionError):
        raise MalformedFrame("a LOG is a JSON object in UTF-8") from None
    if not isinstance(body, dict) or not set(body) <= {"points", "process", "batches"}:
        raise MalformedFrame("a LOG is an object of points, process and batches")
    report = LogReport()
    for entry in _list(body.get("points", []), "points"):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], dict)):
            raise MalformedFrame("a LOG's point is [step, {name: value}]")
        step = _step(entry[0])
        for name, value in entry[1].items():
            try:
                check_scalar_name(name)
            except ValueError as exc:
                raise MalformedFrame(str(exc)) from None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise MalformedFrame(f"scalar {name}: a number, not {type(value).__name__}")
            report.points.append((step, name, float(value)))
        if len(report.points) > MAX_LOG_POINTS:
            raise MalformedFrame(f"a LOG carries {MAX_LOG_POINTS} values at most")
    for entry in _list(body.get("batches", []), "batches"):
        if not (
            isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str) and _DIGEST.fullmatch(entry[1])
        ):
            raise MalformedFrame("a LOG's batch is [step, 16 hex digits]")
        report.batches.append((_step(entry[0]), entry[1]))
    if "process" in body:
        report.process = _process(body["process"])
    return report


def _list(value: object, what: str) -> list:
    if not isinstance(value, list) or len(value) > MAX_LOG_POINTS:
        raise MalformedFrame(f"a LOG's {what} are a list of at most {MAX_LOG_POINTS}")
    return value


def _step(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        raise MalformedFrame(f"a LOG's step is an integer from 0 to 2**53, not {value!r:.40}")
    return value


def _process(value: object) -> dict:
    if not isinstance(value, dict) or set(value) != {"pid", "cpu_s", "rss_bytes"}:
        raise MalformedFrame("a LOG's process is {pid, cpu_s, rss_bytes}")
    pid, cpu, rss = value["pid"], value["cpu_s"], value["rss_bytes"]
    if (
        isinstance(pid, bool)
        or not isinstance(pid, int)
        or not 0 < pid < 1 << 32
        or isinstance(rss, bool)
        or not isinstance(rss, int)
        or not 0 <= rss < 1 << 60
        or isinstance(cpu, bool)
        or not isinstance(cpu, (int, float))
        or not (math.isfinite(cpu) and cpu >= 0)
    ):
        raise MalformedFrame("a LOG's process: pid a positive integer, cpu_s seconds, rss_bytes a byte count")
    return {"pid": pid, "cpu_s": float(cpu), "rss_bytes": rss}
