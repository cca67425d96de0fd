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
import contextlib
import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

from ..config import DEFAULT_PORT, RESUME_LATEST, ServerConfig, env_name, parse_workers
from ..errors import ConfigurationError
from ..lab.settings import (  # noqa: F401  (the commands and bench/ import them from here)
    SETTING_FORM,
    Setting,
    _split,
    command_line,
    describe_speeds,
    format_size,
    parse_setting,
    parse_size,
    parse_speeds,
    require,
)

__all__ = [
    "ArgumentParser",
    "HelpFormatter",
    "Setting",
    "add_server_arguments",
    "add_token_arguments",
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
    "server_address",
    "size_list",
    "sync_setting",
    "token_advice",
    "token_from_args",
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
    """argparse with one-line errors: ``aps bench: error: argument --sizes: ...``, exit status 2.

    Flags are matched whole (no ``--worker`` for ``--workers``: a prefix that works today
    breaks silently when a longer flag is added), and an unknown flag is reported by the
    (sub)command it was given to, with the nearest flags it has (``did you mean --workers?``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]  # one signature for typeshed's three overloads
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        # argparse hands a subcommand's leftovers up to the top parser, which would then say
        # "aps: error" without knowing the subcommand's flags: a subcommand reports them itself.
        if extras and self._is_subcommand:
            self.error(unrecognized_message(extras, self._long_options()))
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    @property
    def _is_subcommand(self) -> bool:
        return " " in self.prog  # "aps serve", "aps checkpoint now"; the top parser is "aps"

    def _long_options(self) -> list[str]:
        return [option for option in self._option_string_actions if option.startswith("--")]


def unrecognized_message(extras: Sequence[str], options: Sequence[str]) -> str:
    """``unrecognized arguments: --wokers 2 (did you mean --workers?)``: each unknown flag
    followed by the closest of ``options`` (difflib), where one is close."""
    guesses = []
    for word in extras:
        if not word.startswith("--"):
            continue
        flag = word.split("=", 1)[0]
        for guess in difflib.get_close_matches(flag, options, n=1, cutoff=0.75):
            if guess not in guesses:
                guesses.append(guess)
    hint = f" (did you mean {' or '.join(guesses)}?)" if guesses else ""
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


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


@_type("sizes separated by commas, such as 4K,64M (bytes, with an optional K, M or G suffix)")
def size_list(text: str) -> list[int]:
    return [parse_size(part) for part in _split(text)]


@_type("whole numbers separated by commas, such as 1,2,4")
def int_list(text: str) -> list[int]:
    return [int(part) for part in _split(text)]


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


def sync_setting(text: str) -> Setting:
    """An argparse type: one sync setting."""
    try:
        return parse_setting(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The server and token of a client command (aps status, aps checkpoint now) ------------------------------

#: The address ``aps serve`` listens on by default: a client command's server when none is given.
LOCAL_ADDRESS = f"tcp://127.0.0.1:{DEFAULT_PORT}"
#: How a client command's help says where its server is when the command line names none.
ADDRESS_DEFAULT = f"default: $APS_ADDRESS, else {LOCAL_ADDRESS}, where aps serve listens by default"


def server_address(given: str | None) -> str:
    """The server a client command talks to: ``given``, else ``$APS_ADDRESS``, else
    :data:`LOCAL_ADDRESS`."""
    return given or os.environ.get("APS_ADDRESS") or LOCAL_ADDRESS


def add_token_arguments(parser: argparse.ArgumentParser) -> None:
    """``--token`` and ``--token-file``: the token of the server a command talks to."""
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument(
        "--token",
        help="the server's token, if it has one (default: $APS_TOKEN, else the token "
        "file a server of this user on loopback wrote for its address)",
    )
    tokens.add_argument(
        "--token-file",
        metavar="PATH",
        help="read the server's token from the first line of this file, as aps serve --token-file does (default: none)",
    )


def token_from_args(args: argparse.Namespace) -> str | None:
    """The token ``--token`` or ``--token-file`` gives (None without either: then ``$APS_TOKEN``
    or the server's own token file apply)."""
    from ..config import ServerConfig, resolve_token

    if getattr(args, "token_file", None) is None:
        return args.token
    token = resolve_token(ServerConfig(token_file=args.token_file))  # None only without a file
    return None if token is None else token.decode("utf-8")


@contextlib.contextmanager
def token_advice(args: argparse.Namespace) -> Iterator[None]:
    """Say the command's own flags when a server refuses it for want of a token: the library's
    message names the Python API (``token=``), which a command-line user cannot pass."""
    from ..errors import AuthenticationError

    flags = "give --token TOKEN or --token-file PATH (or set APS_TOKEN)"
    try:
        yield
    except AuthenticationError as exc:
        text = advised = str(exc)
        for python, command in (
            ("pass token= or set $APS_TOKEN", flags),
            ("aps.Worker(token=...) or $APS_TOKEN", "--token or --token-file, or APS_TOKEN"),
        ):
            advised = advised.replace(python, command)
        given = args.token is not None or getattr(args, "token_file", None) is not None or os.environ.get("APS_TOKEN")
        if advised == text and not given:
            advised = f"{text}; {flags}"
        raise AuthenticationError(advised) from None


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
    "workers": lambda text: parse_workers(text) if ":" in text else _parse_int(text),
    "betas": _parse_betas,
    "max_frame_bytes": parse_size,
    "stream_min_bytes": parse_size,
    "table_memory": parse_size,
}


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigurationError(f"expected an integer (a whole number such as 3), got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigurationError(f"expected a number such as 0.1 or 1e-3, got {text!r}") from None


def _converter(f: dataclasses.Field) -> Callable[[str], Any]:
    if f.name in _CONVERTERS:
        return _CONVERTERS[f.name]
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    kind = kind.split("|")[0].strip()  # "int | None" -> "int"
    # int()'s own "invalid literal for int() with base 10" tells a user nothing about the flag
    by_kind: dict[str, Callable[[str], Any]] = {
        "int": _parse_int,
        "float": _parse_float,
        "str": str,
        "bool": _parse_bool,
    }
    return by_kind[kind]


def _argparse_type(conv: Callable[[str], Any]) -> Callable[[str], Any]:
    """``conv`` as an argparse ``type=``: its errors become argparse's usage errors."""

    def convert(text: str) -> Any:
        try:
            return conv(text)
        except (ValueError, ConfigurationError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


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
            parser.add_argument(
                _flag(f.name), nargs="?", const=RESUME_LATEST, default=None, metavar=meta["metavar"], help=help_text
            )
            continue

        choices = meta.get("choices")
        parser.add_argument(
            _flag(f.name),
            type=_argparse_type(_converter(f)),
            default=None,
            choices=choices,
            # argparse lists the choices in --help only when no metavar hides them: {bsp,asp,...}
            metavar=meta.get("metavar") or ("{" + ",".join(choices) + "}" if choices else f.name.upper()),
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
    if isinstance(values.get("workers"), tuple):  # --workers MIN:MAX
        values["min_workers"], values["workers"] = values["workers"]
    return values
