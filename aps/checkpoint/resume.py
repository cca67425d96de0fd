"""What a resume takes from a manifest, each field checked for its type and range
(:func:`check_resumable`)."""

from __future__ import annotations

import json
import math
import pathlib
import re
from typing import Any


from ..errors import CheckpointError
from .format import Checkpoint


_INT64 = (-(1 << 63), (1 << 63) - 1)
_MISSING = object()
_RUN_ID = re.compile(r"[!-~]{1,64}")  # printable ASCII, no spaces: what workers and SHARDS carry


class _Invalid(Exception):
    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what


def _kind(value: Any) -> str:
    if value is _MISSING:
        return "missing"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{json.dumps(value)} (true/false)"
    text = json.dumps(value, default=str)
    shown = text if len(text) <= 40 else text[:37] + "..."
    names = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return f"{names.get(type(value), type(value).__name__)} ({shown})"


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise _Invalid(where, what)


def _int(value: Any, where: str, lo: int = 0, hi: int = _INT64[1]) -> int:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, int) and not isinstance(value, bool), where, f"is {_kind(value)}, not a whole number")
    _need(lo <= value <= hi, where, f"is {value}, out of range {lo}..{hi}")
    return value


def _number(value: Any, where: str) -> float:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, (int, float)) and not isinstance(value, bool), where, f"is {_kind(value)}, not a number")
    _need(math.isfinite(value), where, f"is {value}, not a finite number")
    return value


def _bool(value: Any, where: str) -> bool:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, bool), where, f"is {_kind(value)}, not true or false")
    return value


def _object(value: Any, where: str) -> dict:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, dict), where, f"is {_kind(value)}, not an object")
    return value


def _list(value: Any, where: str, length: int | None = None) -> list:
    _need(value is not _MISSING, where, "is missing")
    _need(isinstance(value, list), where, f"is {_kind(value)}, not a list")
    if length is not None:
        _need(len(value) == length, where, f"has {len(value)} entries, the run has {length} workers")
    return value


def _run_id(value: Any, where: str) -> str:
    _need(value is not _MISSING, where, "is missing")
    _need(
        isinstance(value, str) and _RUN_ID.fullmatch(value) is not None,
        where,
        f"is {_kind(value)}, not a run id (1 to 64 printable characters)",
    )
    return value


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against a ServerConfig field's type (int, float, bool, str,
    ``X | None``, ``tuple[float, float]``)."""
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _typed(value, inner, where)
    if origin is tuple:
        _need(
            isinstance(value, list) and len(value) == len(args), where, f"is {_kind(value)}, not a list of {len(args)}"
        )
        return tuple(_typed(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if hint is bool:
        return _bool(value, where)
    if hint is int:
        return _int(value, where, _INT64[0])
    if hint is float:
        return float(_number(value, where))
    if hint is str:
        _need(isinstance(value, str), where, f"is {_kind(value)}, not a string")
        return value
    raise TypeError(f"no check for a {hint} option")  # pragma: no cover - a new option type


def _run_options(saved: dict) -> dict:
    """The run's options (:data:`aps.config.RUN_OPTIONS`) from the manifest's config, typed and
    valid together (as ``aps serve`` would take them)."""
    import typing

    from ..config import RUN_OPTIONS, RUN_OPTIONS_SINCE, ServerConfig
    from ..errors import ConfigurationError

    hints = typing.get_type_hints(ServerConfig)
    saved = {**RUN_OPTIONS_SINCE, **saved}  # (options newer than the checkpoint: it had their former value)
    options = {name: _typed(saved.get(name, _MISSING), hints[name], f"config.{name}") for name in RUN_OPTIONS}
    try:
        ServerConfig(**options)
    except (ConfigurationError, TypeError, ValueError) as exc:
        raise _Invalid("config", str(exc)) from None
    return options


def _resume_fields(m: dict) -> None:
    """Every field a resume takes from manifest ``m``, checked for type and range (raises _Invalid)."""
    _run_id(m.get("run_id", _MISSING), "run_id")
    _int(m.get("version", _MISSING), "version")
    _int(m.get("pushes", _MISSING), "pushes")
    if "sequence" in m:
        _int(m["sequence"], "sequence")
    _need("layout" in m, "layout", "is missing")  # its form: read_manifest
    if "compensation" in m:
        _int(_object(m["compensation"], "compensation").get("steps", _MISSING), "compensation.steps", 0, 2**53)
    if "draining" in m:
        _bool(m["draining"], "draining")
    if "table_steps" in m:
        steps = _object(m["table_steps"], "table_steps")
        declared = m["layout"].get("tables", {}) if isinstance(m["layout"], dict) else {}
        for name, value in steps.items():
            _need(isinstance(declared, dict) and name in declared, f"table_steps.{name}", "names no declared table")
            _int(value, f"table_steps.{name}", 0, 2**53)
    options = _run_options(_object(m.get("config", _MISSING), "config"))
    workers = options["workers"]
    runs = m.get("shard_runs")
    if runs is not None:
        _need(
            isinstance(runs, list) and len(runs) == options["shards"],
            "shard_runs",
            f"is {_kind(runs)}, not a list of the {options['shards']} shards' run ids",
        )
        for i, run in enumerate(runs):
            _run_id(run, f"shard_runs[{i}]")

    optimizer = _object(m.get("optimizer", _MISSING), "optimizer")
    name = optimizer.get("name", _MISSING)
    _need(
        name == options["optimizer"],
        "optimizer.name",
        f"is {_kind(name)}, but the run's optimizer is {options['optimizer']!r}",
    )
    _int(optimizer.get("steps", _MISSING), "optimizer.steps")
    loaded = optimizer.get("loaded_state")
    if loaded is not None:
        _need(
            isinstance(loaded, str) and re.fullmatch(r"(?:[0-9a-f]{2})*", loaded) is not None,
            "optimizer.loaded_state",
            f"is {_kind(loaded)}, not a hexadecimal digest",
        )

    policy = _object(m.get("policy", _MISSING), "policy")
    sync = policy.get("name", _MISSING)
    _need(sync == options["sync"], "policy.name", f"is {_kind(sync)}, but the run's sync policy is {options['sync']!r}")
    _int(policy.get("min_clock", _MISSING), "policy.min_clock")
    _int(policy.get("last_r_star", _MISSING), "policy.last_r_star", -1)
    _int(policy.get("controller_calls", _MISSING), "policy.controller_calls")
    if "dropped" in policy:
        _int(policy["dropped"], "policy.dropped")
    for i, clock in enumerate(_list(policy.get("clocks", _MISSING), "policy.clocks", workers)):
        _int(clock, f"policy.clocks[{i}]", -1)
    for column in ("live", "held"):
        for i, flag in enumerate(_list(policy.get(column, _MISSING), f"policy.{column}", workers)):
            _bool(flag, f"policy.{column}[{i}]")
    for i, credit in enumerate(_list(policy.get("credits", _MISSING), "policy.credits", workers)):
        _int(credit, f"policy.credits[{i}]")
    if sync == "bsp":
        for column in ("contributed", "pushed", "round_held"):
            for i, rank in enumerate(_list(policy.get(column, _MISSING), f"policy.{column}")):
                _int(rank, f"policy.{column}[{i}]", 0, workers - 1)
    if sync == "softsync":
        _int(policy.get("count", _MISSING), "policy.count")

    for key, seat in _object(m.get("seats", _MISSING), "seats").items():
        where = f"seats.{key}"
        _need(
            key.isascii() and key.isdigit() and str(int(key)) == key and int(key) < workers,
            "seats",
            f"has a seat {key!r}, not a rank of the run's {workers} workers",
        )
        _object(seat, where)
        _int(seat.get("clock", _MISSING), f"{where}.clock", -1)
        _int(seat.get("push_id", _MISSING), f"{where}.push_id", -1, (1 << 64) - 1)
        _int(seat.get("push_clock", _MISSING), f"{where}.push_clock", -1)
        if "held" in seat:
            _bool(seat["held"], f"{where}.held")
        if "credit" in seat:
            _int(seat["credit"], f"{where}.credit")
        result = seat.get("push_result")
        if result is not None:
            _need(
                isinstance(result, list) and len(result) == 5,
                f"{where}.push_result",
                f"is {_kind(result)}, not [version, clock, dropped, staleness, scale]",
            )
            _int(result[0], f"{where}.push_result[0]")
            _int(result[1], f"{where}.push_result[1]", -1)
            _bool(result[2], f"{where}.push_result[2]")
            _int(result[3], f"{where}.push_result[3]", _INT64[0])
            _number(result[4], f"{where}.push_result[4]")

    if "counters" in m:
        counters = _object(m["counters"], "counters")
        for name in ("rejected", "duplicates"):
            if name in counters:
                _int(counters[name], f"counters.{name}")


def _check_resumable(path: pathlib.Path, manifest: dict) -> None:
    try:
        _resume_fields(manifest)
    except _Invalid as exc:
        raise CheckpointError(f"checkpoint {path} cannot be resumed: {exc}") from None


def check_resumable(checkpoint: Checkpoint) -> None:
    """Check every field of ``checkpoint``'s manifest that ``aps serve --resume`` takes up
    (run id, version, pushes, layout, the run's options, the optimizer's, the sync policy's
    clocks and rounds, each rank's seat, the counters, the shards' runs) for its type and
    range, so that a resume only ever sees well-formed state.

    Raises:
        CheckpointError: ``checkpoint X cannot be resumed: FIELD: what is wrong``
            (``policy: is a list ([]), not an object``).
    """
    _check_resumable(checkpoint.path, checkpoint.manifest)
