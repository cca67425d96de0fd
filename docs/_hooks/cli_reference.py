"""The CLI reference, rendered from the ``aps`` command's own argparse parsers.

A page marks where a command's flags go with ``<!-- aps-cli: serve -->`` (or
``checkpoint now``, or ``aps`` for the top level); at build time this MkDocs hook
(``hooks:`` in mkdocs.yml) replaces each marker with a table of that command's
flags, their ``APS_*`` environment twins and the help ``--help`` prints. The
table is made from the same parsers the command runs, so it cannot drift from
them; a marker naming no command fails the build, and tests/unit/test_docs.py
checks that every command has a marker.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

MARKER = re.compile(r"<!-- aps-cli: ([a-z][a-z -]*?) -->")
# How a flag's help names its variable: "(default 7450; env APS_PORT)" for the
# server's options, "(default $APS_ADDRESS)" or "$APS_TOKEN" for the others.
ENV = re.compile(r"\benv (APS_[A-Z0-9_]+)|\$(APS_[A-Z0-9_]+)")


def root_parser() -> argparse.ArgumentParser:
    """The ``aps`` command's parser, as ``aps`` builds it."""
    from aps.cli import build_parser

    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (aliases left out)."""
    found: dict[str, argparse.ArgumentParser] = {}
    seen: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    found[name] = sub
    return found


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command and nested subcommand: ``((), aps), (("serve",), serve), ...``."""
    yield path, parser
    for name, sub in subcommands(parser).items():
        yield from walk(sub, (*path, name))


def find(path: str) -> argparse.ArgumentParser:
    """The parser of ``path`` (``"serve"``, ``"checkpoint now"``; ``"aps"`` is the top level)."""
    words = tuple(path.split())
    if words == ("aps",):
        words = ()
    for found_path, parser in walk(root_parser()):
        if found_path == words:
            return parser
    raise KeyError(f"no command 'aps {path}' in aps.cli (a <!-- aps-cli: {path} --> marker names it)")


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options and positional arguments a reader can give (help and subcommands left out)."""
    return [
        a for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS
    ]


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help of ``action`` as ``--help`` prints it (the default appended where aps's formatter adds it)."""
    return parser._get_formatter()._expand_help(action) if action.help else ""


def env_twins(text: str) -> list[str]:
    """The ``APS_*`` variables a help text names."""
    return list(dict.fromkeys(a or b for a, b in ENV.findall(text)))


def _usage(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar or action.dest.upper()
    shown = ", ".join(action.option_strings)
    if action.nargs == 0:
        return shown
    metavar = action.metavar or (action.dest.upper() if not action.choices else "{" + ",".join(map(str, action.choices)) + "}")
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return f"{shown} [{metavar}]" if action.nargs == "?" else f"{shown} {metavar}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(path: str) -> str:
    """The markdown table of the flags of ``aps PATH``."""
    parser = find(path)
    rows = ["| flag | variable | what it does (as `--help` says) |", "|---|---|---|"] if flags(parser) else []
    for action in flags(parser):
        text = help_text(parser, action)
        if action.choices and action.metavar and not all(str(c) in text for c in action.choices):
            text += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
        variables = ", ".join(f"`{v}`" for v in env_twins(text)) or ""
        rows.append(f"| `{_cell(_usage(action))}` | {variables} | {_cell(text)} |")
    subs = subcommands(parser)
    if subs:
        rows.append("" if rows else "")
        prefix = "aps " if path == "aps" else f"aps {path} "
        rows.append("Subcommands: " + ", ".join(f"`{prefix}{name}`" for name in subs) + ".")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs) -> str:
    """MkDocs hook: replace every ``<!-- aps-cli: COMMAND -->`` marker with its table."""
    return MARKER.sub(lambda m: render(m.group(1)), markdown)
