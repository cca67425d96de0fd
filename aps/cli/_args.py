"""Command-line parsing every ``aps`` command shares.

One definition of each kind of value a user types (sizes such as ``64M``,
per-worker speed lists such as ``1,1,1,2.5``, sync settings such as
``ssp:3`` or ``dssp:3:15``, comma lists), the ``aps serve`` flags with their
``APS_*`` environment twins, and the parser behaviour every command has: a
bad value is one line naming the flag and the accepted form (exit status 2),
and ``--help`` shows every default.

Type functions (``type=`` of ``add_argument``) check the form of a value;
the ``require_*`` helpers check ranges after parsing, where a message can
name the flag, and raise :class:`~aps.errors.ConfigurationError`, which the
``aps`` command prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..config import RESUME_LATEST, ServerConfig, env_name
from ..errors import ConfigurationError

__all__ = [
    "ArgumentParser",
    "HelpFormatter",
    "Setting",
    "add_server_arguments",
    "choice_list",
    "config_from_args",
    "describe_speeds",
    "format_size",
    "int_list",
    "number",
    "parse_setting",
    "parse_size",
    "parse_speeds",
    "require",
    "size_list",
    "sync_setting",
]


# The parser every command uses -------------------------------------------------------------------


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" not in text
            and "%(default)" not in text
            and action.option_strings
            and default is not None
            and default is not False
            and default != argparse.SUPPRESS
            and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
        ):
            shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
            text += f" (default {shown})"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``aps bench: error: argument --sizes: ...``, exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# Values ------------------------------------------------------------------------------------------


def _type(form: str) -> Callable[[Callable[[str], Any]], Callable[[str], Any]]:
    """Turn a parser raising ValueError into an argparse type naming the accepted ``form``."""

    def wrap(parse: Callable[[str], Any]) -> Callable[[str], Any]:
        def convert(text: str) -> Any:
            try:
                return parse(text)
            except ValueError:  # ConfigurationError too
                raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}") from None

        convert.__name__ = parse.__name__
        return convert

    return wrap


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


@_type("sizes separated by commas, such as 4K,64M (bytes, with an optional K, M or G suffix)")
def size_list(text: str) -> list[int]:
    return [parse_size(part) for part in _split(text)]


@_type("whole numbers separated by commas, such as 1,2,4")
def int_list(text: str) -> list[int]:
    return [int(part) for part in _split(text)]


def parse_speeds(text: str, count: int | None = None, flag: str = "--speeds") -> list[float]:
    """Per-worker multiples such as ``1,1,1,2.5``: positive and finite, ``count`` of them if given."""
    try:
        values = [float(part) for part in _split(text)]
    except ValueError:
        values = []
    if not values or (count is not None and len(values) != count) or \
            not all(math.isfinite(v) and v > 0 for v in values):
        how_many = "" if count is None else f"{count} "
        raise ConfigurationError(f"{flag} needs {how_many}positive numbers separated by commas, such as 1,1,1,2.5, "
                                 f"got {text!r}")
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
    return (f"{len(speeds)} workers, iteration times {sum(speeds) / len(speeds):.2f} mean, "
            f"{min(speeds):.2f}-{max(speeds):.2f}")


@_type("a number")
def number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of some of ``choices``, each at most once."""

    @_type(f"one or more of {','.join(choices)} separated by commas")
    def parse(text: str) -> list[str]:
        values = _split(text)
        if any(v not in choices for v in values) or len(set(values)) != len(values):
            raise ValueError(text)
        return values

    return parse


# Sync settings (aps simulate, aps compare) ------------------------------------------------------------

SETTING_FORM = "bsp[:K], asp, ssp:S, dssp:S_L:S_U or softsync:N[:S]"


@dataclass(frozen=True)
class Setting:
    """One sync configuration: its text (``ssp:3``) and its ``ServerConfig`` options."""

    label: str
    options: dict = field(hash=False, compare=False)


def parse_setting(text: str) -> Setting:
    """``bsp[:K]``, ``asp``, ``ssp:S``, ``dssp:S_L:S_U``, ``softsync:N[:S]``; append
    ``+inverse`` for ``--lr-staleness inverse``."""
    label = text.strip()
    body, _, extra = label.partition("+")
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
    if extra:
        if extra != "inverse":
            raise ConfigurationError(f"bad sync setting {text!r}: the only suffix is +inverse")
        options["lr_staleness"] = "inverse"
    return Setting(label, options)


def sync_setting(text: str) -> Setting:
    """An argparse type: one sync setting."""
    try:
        return parse_setting(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# Ranges, checked after parsing --------------------------------------------------------------------------


def require(condition: bool, message: str) -> None:
    """Raise ConfigurationError(``message``) unless ``condition`` (a range check naming its flag)."""
    if not condition:
        raise ConfigurationError(message)


# aps serve's flags and their APS_* twins -----------------------------------------------------------------


def _parse_betas(text: str) -> tuple[float, float]:
    try:
        beta1, beta2 = (float(part) for part in text.split(","))
    except ValueError:
        raise ConfigurationError(f"betas must be two comma-separated numbers, got {text!r}") from None
    return beta1, beta2


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigurationError(f"expected a boolean (1/0, true/false), got {text!r}")


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "betas": _parse_betas, "max_frame_bytes": parse_size, "stream_min_bytes": parse_size
}


def _converter(f: dataclasses.Field) -> Callable[[str], Any]:
    if f.name in _CONVERTERS:
        return _CONVERTERS[f.name]
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    kind = kind.split("|")[0].strip()  # "int | None" -> "int"
    return {"int": int, "float": float, "str": str, "bool": _parse_bool}[kind]


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_server_arguments(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per ServerConfig field to ``parser`` (defaults stay unset, see config_from_args)."""
    for f in dataclasses.fields(ServerConfig):
        if f.name in skip:
            continue
        meta = f.metadata
        default = f.default
        shown = ",".join(str(b) for b in default) if isinstance(default, tuple) else default
        if default is None:
            shown = "" if "default" in meta["help"] else "default none; "
        else:
            shown = f"default {shown}; "
        help_text = f"{meta['help']} ({shown}env {env_name(f.name)})"
        if _converter(f) is _parse_bool:
            parser.add_argument(_flag(f.name), action="store_const", const=True, default=None, help=help_text)
            continue
        if f.name == "resume":  # --resume alone: the newest checkpoint
            parser.add_argument(_flag(f.name), nargs="?", const=RESUME_LATEST, default=None,
                                metavar=meta["metavar"], help=help_text)
            continue

        def convert(text: str, _conv=_converter(f)):
            try:
                return _conv(text)
            except (ValueError, ConfigurationError) as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        parser.add_argument(
            _flag(f.name),
            type=convert,
            default=None,
            choices=meta.get("choices"),
            metavar=meta.get("metavar") or f.name.upper(),
            help=help_text,
        )


def config_from_args(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """A ServerConfig from parsed flags, falling back to ``APS_*`` variables, then defaults."""
    return ServerConfig(**given_options(args, environ))


def given_options(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options given by flag or ``APS_*`` variable (not left at their defaults)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ServerConfig):
        given = getattr(args, f.name, None) if args is not None else None
        if given is not None:
            values[f.name] = given
            continue
        raw = environ.get(env_name(f.name))
        if raw is None or raw == "":
            continue
        try:
            value = _converter(f)(raw)
        except (ValueError, ConfigurationError) as exc:
            raise ConfigurationError(f"{env_name(f.name)}={raw!r}: {exc}") from None
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigurationError(f"{env_name(f.name)}={raw!r}: choose from {', '.join(choices)}")
        values[f.name] = value
    return values


def command_line() -> str:
    """How this process was started, to print beside the results it writes."""
    program = os.path.basename(sys.argv[0])
    if program in ("aps", "__main__.py"):
        return " ".join(["aps", *sys.argv[1:]])
    return " ".join(["python", *sys.argv] if program.endswith(".py") else sys.argv)
