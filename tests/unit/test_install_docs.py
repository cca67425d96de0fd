"""The install commands and the token recipes the docs give, as a new user copies them."""

import os
import re
import stat
from pathlib import Path

import pytest

from aps.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _tested_pair() -> tuple[str, str]:
    found = re.search(r"torch (\d+\.\d+\.\d+) with torchvision (\d+\.\d+\.\d+) is the pair",
                      (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml names the torch and torchvision this project is tested with"
    return found[1], found[2]


def test_the_cpu_only_install_pins_the_tested_pair():
    """Unpinned, it installs the newest torch, which the extras' range refuses: the next command
    would swap it for the CUDA build (6 GB) it was meant to avoid."""
    torch, torchvision = _tested_pair()
    for page in (ROOT / "README.md", ROOT / "docs" / "guide" / "start.md"):
        commands = [line for line in page.read_text().splitlines() if "download.pytorch.org/whl/cpu" in line]
        assert commands, page
        for command in commands:
            assert f"torch=={torch} torchvision=={torchvision} " in command, (page.name, command)


def test_every_cpu_wheel_install_in_the_docs_is_pinned():
    for page in PAGES:
        for line in page.read_text().splitlines():
            if "pip install" in line and "whl/cpu" in line:
                assert re.search(r"torch==\S+ torchvision==\S+", line), (page.name, line)


def test_no_recipe_writes_a_token_file_others_can_read():
    """A token written by a shell redirection gets the umask's mode (0644 as a rule): readable by
    every local user. The docs make token files with `aps token --file`, which writes 0600."""
    for page in PAGES:
        for line in page.read_text().splitlines():
            assert not re.search(r"token\S*\)?\"?\s*>\s*\S*token", line), (page.name, line)
            assert not re.search(r"secrets\.token_\w+\(\d*\)\)?\"?\s*>", line), (page.name, line)
    assert "aps token --file ~/.aps-token" in (ROOT / "docs" / "guide" / "launching.md").read_text()


def test_the_recipes_command_writes_the_token_for_this_user_alone(tmp_path):
    """`aps token --file`, as the launching guide runs it: mode 0600 whatever the umask, and an
    existing file (someone else's, a link) is refused, not written through."""
    path = tmp_path / ".aps-token"
    previous = os.umask(0)
    try:
        assert main(["token", "--file", str(path)]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text().strip()) >= 43
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    for taken in (path, tmp_path / "link"):
        with pytest.raises(SystemExit) as refused:
            main(["token", "--file", str(taken)])
        assert refused.value.code == 2
    assert not (tmp_path / "elsewhere").exists()
