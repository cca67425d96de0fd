"""A griffe extension: the reST bits of aps's docstrings, as markdown for mkdocstrings.

aps's docstrings are Google style with two habits from Sphinx: roles
(``:class:`aps.Worker```, ``:meth:`pull```) and literal blocks after ``::``
(``Example::`` and an indented block). mkdocstrings renders markdown, so this
extension (``extensions:`` of the python handler in mkdocs.yml) turns a role
into a cross-reference, a link where the name is documented and plain code
where it is not, and a literal block into a fenced Python block; a page of the
docs named by its path (``docs/guide/troubleshooting.md#...``) becomes a link. The source
stays as it is: ``help()`` and editors read it as before.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|attr|exc|data|mod|obj):`~?([^`]+)`")
#: A page of the documentation named by its path in the repository (``docs/guide/x.md#part``).
PAGE = re.compile(r"(?<![\w/`\[])(?<!\]\()docs/((?:[\w-]+/)*[\w-]+\.md)(#[\w-]+)?")


def _role(match: re.Match[str]) -> str:
    name = match[1]
    return f'<autoref identifier="{name}" optional><code>{name}</code></autoref>'


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def literal_blocks(text: str) -> str:
    """``Label::`` and the indented block after it, as ``Label:`` and a fenced block."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
            indent = _indent(line)
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            start = j
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > indent):
                j += 1
            block = lines[start:j]
            while block and not block[-1].strip():
                block.pop()
            if block:
                label = line.rstrip()[:-2].rstrip()
                if label.strip() in ("Example", "Examples"):
                    out += [" " * indent + f"**{label.strip()}**", ""]
                elif label.strip():
                    out += [label + ":", ""]
                common = min(_indent(b) for b in block if b.strip())
                fence = " " * indent + "```python"
                out += [fence, *((" " * indent + b[common:]) if b.strip() else "" for b in block), " " * indent + "```", ""]
                i = j
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _page(match: re.Match[str]) -> str:
    # The API reference is docs/reference/api.md: a page's path from there.
    return f"[docs/{match[1]}{match[2] or ''}](../{match[1]}{match[2] or ''})"


def to_markdown(text: str) -> str:
    """A docstring's reST roles and literal blocks, as markdown; a page of the docs named by
    its path in the repository, as a link to it."""
    return PAGE.sub(_page, ROLE.sub(_role, literal_blocks(text)))


class SphinxMarkup(griffe.Extension):
    """Rewrites every docstring griffe loads (see the module's docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
