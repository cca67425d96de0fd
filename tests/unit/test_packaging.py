"""pyproject.toml's Python version claims: requires-python against the code, the classifiers against the interpreter."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "aps"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]

# vermin, run by the interpreter running the tests; its console script is `vermin:main`.
VERMIN = [sys.executable, "-c", "from vermin import main; main()"]
# Plain detection, machine-readable, independent of any vermin config file; -p=1 keeps it light.
VERMIN_OPTIONS = ["--no-config-file", "--no-tips", "-p=1", "-f", "parsable"]
# A module without `from __future__ import annotations` evaluates its function annotations
# when it runs, so `list[int]` (3.9) or `X | Y` (3.10) there are requirements too.
EVAL_ANNOTATIONS = ["--eval-annotations", "--feature", "union-types"]


def declared_lower_bound():
    """The X.Y of the `>=X.Y` in requires-python."""
    lower = [s.version for s in SpecifierSet(PROJECT["requires-python"]) if s.operator == ">="]
    assert len(lower) == 1, f"requires-python should have one >= bound: {PROJECT['requires-python']!r}"
    version = Version(lower[0])
    assert version.release[2:] in ((), (0,)), f"requires-python should bound a minor version: {lower[0]}"
    return version.major, version.minor


def vermin_minimum(paths, *options):
    """The minimum Python 3 version vermin finds for ``paths``, and the findings that need it."""
    proc = subprocess.run(
        [*VERMIN, *VERMIN_OPTIONS, *options, *map(str, paths)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # Parsable format: `file:line:col:py2:py3:feature`, the last line `:::py2:py3:` for all files.
    *findings, total = lines
    py3 = total.split(":")[4]
    if py3 == "~3":  # nothing that needs more than Python 3.0
        return (3, 0), []
    assert re.fullmatch(r"\d+\.\d+", py3), f"vermin found no Python 3 minimum: {total!r}\n{proc.stdout}"
    minimum = tuple(map(int, py3.split(".")))
    why = [line for line in findings if line.split(":")[1] and line.split(":")[4] == py3]
    return minimum, why


def package_minimum():
    """The minimum Python 3 version the code in aps/ needs.

    Stubs (.pyi) are never run, so they are left out; modules that evaluate their
    annotations at run time are checked with their annotations."""
    lazy, eager = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        (lazy if re.search(r"^from __future__ import .*\bannotations\b", text, re.MULTILINE) else eager).append(path)
    found = [vermin_minimum(paths, *options) for paths, options in ((lazy, ()), (eager, EVAL_ANNOTATIONS)) if paths]
    minimum = max(m for m, _ in found)
    return minimum, [line for m, why in found if m == minimum for line in why]


def test_vermin_knows_asyncio_runner(tmp_path):
    # The feature that sets aps's minimum today; an older vermin without the rule would pass anything.
    source = tmp_path / "runner.py"
    source.write_text("import asyncio\n\nwith asyncio.Runner() as runner:\n    runner.run(asyncio.sleep(0))\n")
    minimum, why = vermin_minimum([source])
    assert minimum == (3, 11)
    assert any("asyncio.Runner" in line for line in why), why


def test_requires_python_is_what_the_code_needs():
    minimum, why = package_minimum()
    declared = declared_lower_bound()
    assert minimum <= declared, f"the code needs Python {minimum}, requires-python says {declared}:\n" + "\n".join(why)
    assert minimum >= declared, f"requires-python {declared} is higher than the code needs ({minimum})"


def test_running_python_and_classifiers_match_requires_python():
    running = sys.version_info
    version = f"{running.major}.{running.minor}.{running.micro}"
    assert SpecifierSet(PROJECT["requires-python"]).contains(version), (version, PROJECT["requires-python"])
    major, lower = declared_lower_bound()
    assert running.major == major
    # The minor versions classified are the ones a release builds wheels for and tests them on
    # (cibuildwheel's `build`), from the lower bound on; this interpreter is one of them.
    pattern = re.compile(r"Programming Language :: Python :: (\d+)\.(\d+)")
    classified = {tuple(map(int, m.groups())) for c in PROJECT["classifiers"] if (m := pattern.fullmatch(c))}
    built = {(int(b[2]), int(b[3:].rstrip("-*"))) for b in PYPROJECT["tool"]["cibuildwheel"]["build"]}
    assert classified == built, (sorted(classified), sorted(built))
    assert min(classified) == (major, lower) and (running.major, running.minor) in classified, sorted(classified)
