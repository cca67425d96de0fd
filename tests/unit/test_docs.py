"""What the README and the documentation site promise, checked against the project's own files.

The README's two Python examples run here exactly as written, against a real ``aps serve``
started with the README's own command, so they cannot rot; the CLI reference is checked
against the ``aps`` command's parsers and the API reference against ``aps.__all__``."""

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from aps.config import ServerConfig, env_name
from tests.helpers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
# The address the README's examples use; a test server listens on a free port instead.
README_ADDRESS = "tcp://127.0.0.1:7450"


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _two_commands() -> list[str]:
    return _blocks(_section(README, "Two commands"), "sh")


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 300


def test_the_first_screen_says_when_to_use_a_parameter_server():
    first_screen = "\n".join(README.splitlines()[:45])
    assert "all-reduce" in first_screen and "DDP" in first_screen
    for case in ("uneven", "preemptible", "asynchronous"):
        assert case in first_screen, case


def test_the_install_says_what_pytorch_costs_and_how_to_avoid_the_cuda_build():
    section = _section(README, "Two commands")
    assert "CUDA" in section and "GB" in section
    assert "https://download.pytorch.org/whl/cpu" in section  # the CPU-only wheels
    commands = _two_commands()
    assert any("aps demo" in c for c in commands) and any("pytest" in c for c in commands)


def test_the_cpu_only_warning_and_alternative_come_before_the_commands():
    section = _section(README, "Two commands")
    cpu = section.index("https://download.pytorch.org/whl/cpu")
    demo = section.index("aps demo\n```")
    tests = section.index('pytest -n 4 -m "not slow"')
    assert section.index("CUDA") < cpu < demo < tests


def test_the_test_command_is_what_ci_runs():
    """.ci/run runs the README's suite, with its arguments and its extra, on the installed wheel."""
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(c for c in _two_commands() if "pytest" in c and "pip install -e" in c)
    install, arguments = re.fullmatch(
        r"python3 -m venv \.venv && \.venv/bin/pip install -e '\.\[(\w+)\]' && \.venv/bin/python -m pytest (.+)",
        test_command.strip().splitlines()[-1],
    ).groups()
    assert f"\ninstalled_pytest {arguments} || rc=$?\n" in ci
    assert f'pip install --only-binary aps-server "$wheel[{install},' in ci


def test_the_readme_says_how_to_run_the_fast_tests_and_one_area():
    section = _section(README, "Two commands")
    assert '`-m "not slow"` leaves out the long scenarios' in section
    assert re.search(r"pytest tests/\w+", section)  # one directory
    assert "-k " in section


def test_the_layout_section_names_every_room_of_the_package():
    layout = _section((DOCS / "development.md").read_text(), "Layout")
    for room in ("aps/", "native/", "bench/", "examples/", "tests/", "docs/"):
        assert f"\n{room}" in layout, room
    named = set(re.findall(r"^  ([a-z_]+)/", layout, re.M))
    rooms = {p.name for p in (ROOT / "aps").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert named == rooms, (named, rooms)


def test_the_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert len(local) > 10
    for link in local:
        assert (ROOT / link).exists(), link


# The README's examples, run as written ----------------------------------------------------------


def _aps_argv(line: str, home: Path) -> list[str]:
    """An ``aps ...`` command line of the README as arguments of ``python -m aps`` (``~`` is ``home``)."""
    words = shlex.split(line.replace("~", str(home)))
    assert words[0] == "aps", line
    return words[1:]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home directory for the README's commands; the token they make is the only one in play."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("APS_TOKEN", raising=False)
    monkeypatch.delenv("APS_TOKEN_FILE", raising=False)
    return tmp_path


def _serve(argv: list[str]) -> ServerProcess:
    assert argv[0] == "serve", argv
    # The README's flags; a free port (the README's 7450 may be taken), and a handshake deadline
    # that a loaded test machine importing torch in the worker cannot outlast.
    return ServerProcess(*argv[1:], "--handshake-timeout", "60")


def _run_example(code: str, server: ServerProcess, cwd: Path, env: dict[str, str] | None = None) -> str:
    assert code.count(README_ADDRESS) == 1, "the example names its server once"
    proc = subprocess.run(
        [sys.executable, "-c", code.replace(README_ADDRESS, server.address)],
        cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + server.log()
    return proc.stdout


def test_the_readme_example_runs_as_written(home):
    section = _section(README, "Example")
    (shell,) = _blocks(section, "sh")
    make_token, serve = [line for line in shell.splitlines() if line.startswith("aps ")]
    subprocess.run([sys.executable, "-m", "aps", *_aps_argv(make_token, home)], check=True, timeout=60)
    token = (home / ".aps-token").read_text().strip()
    server = _serve(_aps_argv(serve, home))
    try:
        assert "a token is required" in server.wait_for_log("listening on")
        (code,) = _blocks(section, "python")
        out = _run_example(code, server, home)
    finally:
        server.stop()
    # It fits the linear model its data was made from: w = 1..8, b = 1.
    found = re.fullmatch(r"w = \[([-\d. ]+)\] b = \[([-\d. ]+)\]\n", out)
    assert found, out
    assert [float(v) for v in found[1].split()] == pytest.approx(list(range(1, 9)), abs=0.05)
    assert float(found[2]) == pytest.approx(1.0, abs=0.05)
    assert token not in out


def test_the_readme_tables_example_runs_as_written(home):
    server_line = re.findall(r"^(aps serve [^\n#]*)$", _section(README, "Example"), re.M)[0]
    subprocess.run([sys.executable, "-m", "aps", "token", "--file", str(home / ".aps-token")], check=True, timeout=60)
    server = _serve(_aps_argv(server_line.strip(), home))
    try:
        (code,) = _blocks(_section(README, "Embedding tables"), "python")
        out = _run_example(code, server, home)
    finally:
        server.stop()
    assert out == "largest error: 0.0\n", out  # every item's row learned its vector


@pytest.mark.slow  # importing torch and torch._dynamo in a fresh process: about 10 s here
def test_the_readme_pytorch_example_runs_as_written(home):
    pytest.importorskip("torch")
    section = _section(README, "PyTorch")
    subprocess.run([sys.executable, "-m", "aps", "token", "--file", str(home / ".aps-token")], check=True, timeout=60)
    (serve,) = re.findall(r"`(aps serve [^`]*)`", section)
    (run,) = re.findall(r"`(APS_TOKEN=\$\(cat ~/\.aps-token\) python train\.py)`", section)
    assert run  # the section says how the script gets the token
    server = _serve(_aps_argv(serve, home))
    try:
        (code,) = _blocks(section, "python")
        out = _run_example(code, server, home, env={"APS_TOKEN": (home / ".aps-token").read_text().strip()})
    finally:
        server.stop()
    losses = [float(v) for v in re.findall(r"^epoch \d: loss (\d+\.\d+)$", out, re.M)]
    assert len(losses) == 3, out
    assert all(loss == loss and loss < 10 for loss in losses), losses  # finite, trained
    assert losses[0] > losses[1] > losses[2] and losses[2] < 0.6, losses  # it learns: the loss falls


# The documentation site ---------------------------------------------------------------------------


def _cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "_hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_lists_every_command_and_flag_with_its_env_twin():
    cli = _cli_reference()
    page = (DOCS / "reference" / "cli.md").read_text()
    markers = set(cli.MARKER.findall(page))
    server_flags = {"--" + f.name.replace("_", "-"): env_name(f.name) for f in dataclasses.fields(ServerConfig)}
    commands = list(cli.walk(cli.root_parser()))
    assert len(commands) > 8
    for path, parser in commands:
        name = " ".join(path) or "aps"
        assert name in markers, f"docs/reference/cli.md has no <!-- aps-cli: {name} --> for `aps {name}`"
        table = cli.render(name)
        rows = {row.split("|")[1].strip(): row for row in table.splitlines() if row.startswith("| `")}
        for action in cli.flags(parser):
            usage = next((u for u in rows if u.strip("`").split()[0].rstrip(",") in (action.option_strings or [action.metavar or action.dest.upper()])), None)
            assert usage, f"aps {name}: {action.option_strings or action.dest} missing from the reference"
            for flag in action.option_strings:
                if flag in server_flags and name in ("serve", "launch"):
                    assert f"`{server_flags[flag]}`" in rows[usage], f"aps {name} {flag}: no {server_flags[flag]}"
    serve_rows = cli.render("serve")
    for flag, variable in server_flags.items():
        assert f"`{flag}" in serve_rows and f"`{variable}`" in serve_rows, flag
    # and no marker names a command aps does not have (the build would fail on it)
    for name in markers:
        cli.find(name)


def test_the_api_reference_documents_every_public_name():
    import aps
    import aps.huggingface
    import aps.lightning
    import aps.ray
    import aps.torch

    page = (DOCS / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^::: (aps\.[\w.]+)$", page, re.M))
    public = {f"aps.{n}" for n in aps.__all__ if n != "__version__"} | {f"aps.torch.{n}" for n in aps.torch.__all__}
    public |= {f"aps.lightning.{n}" for n in aps.lightning.__all__}
    public |= {f"aps.huggingface.{n}" for n in aps.huggingface.__all__}
    public |= {f"aps.ray.{n}" for n in aps.ray.__all__}
    assert public - documented == set(), "add them to docs/reference/api.md"
    assert documented - public == set(), "documented but not exported"


def test_every_page_is_in_the_site_and_every_figure_resolves():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_hooks" not in p.parts}
    for page in pages:
        assert re.search(rf":\s+{re.escape(page)}$", config, re.M), f"{page} is not in mkdocs.yml's nav"
    for page in DOCS.rglob("*.md"):
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            assert (page.parent / image).resolve().is_file(), f"{page.name}: {image}"


def test_every_error_class_points_at_the_troubleshooting_page_and_its_parts_exist():
    """Each error class aps defines names the troubleshooting page in its docstring (the
    API reference makes it a link), at a part of the page that exists."""
    import inspect

    import aps.errors

    page = (DOCS / "guide" / "troubleshooting.md").read_text()
    anchors = {re.sub(r"[^\w\- ]", "", title).strip().lower().replace(" ", "-")
               for title in re.findall(r"^## (.+)$", page, re.M)}
    classes = [cls for _, cls in inspect.getmembers(aps.errors, inspect.isclass)
               if issubclass(cls, aps.errors.APSError) and cls.__module__ == "aps.errors"]
    assert len(classes) > 30
    for cls in classes:
        found = re.findall(r"docs/guide/troubleshooting\.md(?:#([\w-]+))?", cls.__doc__ or "")
        assert found, f"{cls.__name__}'s docstring does not name docs/guide/troubleshooting.md"
        assert all(anchor in anchors for anchor in found if anchor), (cls.__name__, found, sorted(anchors))
