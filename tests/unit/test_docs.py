"""What the README promises a newcomer, checked against the project's own files."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _two_commands() -> list[str]:
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def test_the_install_says_what_pytorch_costs_and_how_to_avoid_the_cuda_build():
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "CUDA" in section and "GB" in section
    assert "https://download.pytorch.org/whl/cpu" in section  # the CPU-only wheels
    commands = _two_commands()
    assert any("aps demo" in c for c in commands) and any("pytest" in c for c in commands)


def test_the_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(c for c in _two_commands() if "pytest" in c and "download.pytorch.org" not in c)
    assert test_command.strip().splitlines()[-1] in ci


def test_the_layout_section_names_the_three_rooms():
    layout = README.split("## Layout", 1)[1]
    for room in ("aps/", "aps/cli/", "aps/workloads/", "native/", "bench/", "tests/"):
        assert f"\n{room}" in layout, room
    for path in re.findall(r"^(aps/[a-z_/]+/)", layout, re.M):
        assert (ROOT / path).is_dir(), path
