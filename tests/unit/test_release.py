"""What a release is made of (docs/development.md, "Releases"): an sdist that holds every file git
tracks and nothing generated, one version, the wheels cibuildwheel is told to build, and the
workflow that builds and publishes them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml

import aps

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
DISTRIBUTION = PYPROJECT["project"]["name"]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
#: What the sdist adds to the tracked files: its metadata, made by setuptools.
SDIST_METADATA = {"PKG-INFO", "setup.cfg"}


def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60, check=True)
    return [name for name in listed.stdout.decode().split("\0") if name]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> tuple[list[str], list[str]]:
    """The sdist built from a copy of the tracked files alone: (the tracked files, its files)."""
    files = tracked()
    source = tmp_path_factory.mktemp("source")
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (archive,) = out.glob("*.tar.gz")
    assert archive.name == f"{DISTRIBUTION.replace('-', '_')}-{aps.__version__}.tar.gz"
    with tarfile.open(archive) as tar:
        top = f"{archive.name.removesuffix('.tar.gz')}/"
        names = [m.name.removeprefix(top) for m in tar.getmembers() if m.isfile()]
    return files, names


def test_the_sdist_holds_every_tracked_file(sdist):
    files, names = sdist
    missing = sorted(set(files) - set(names))
    assert not missing, f"MANIFEST.in leaves tracked files out of the sdist: {missing}"


def test_the_sdist_holds_nothing_generated(sdist):
    files, names = sdist
    generated = [n for n in names if n.endswith((".c", ".so", ".pyc", ".pyd", ".o")) or "__pycache__" in n]
    assert not generated, generated  # Cython's C is made again from native/*.pyx by the build
    metadata = {n for n in names if n in SDIST_METADATA or n.startswith(f"{DISTRIBUTION.replace('-', '_')}.egg-info/")}
    assert set(names) - set(files) == metadata, sorted(set(names) - set(files) - metadata)


def test_the_version_lives_in_one_place():
    assert "version" in PYPROJECT["project"]["dynamic"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "aps._version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?", aps.__version__), aps.__version__


def test_the_distribution_name_is_used_wherever_a_user_types_one():
    """`pip install aps` installs another project (PyPI's `aps` is an unrelated package)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "Dockerfile"]
    for page in pages:
        for line in page.read_text(encoding="utf-8").splitlines():
            assert not re.search(r"pip3? install[^`\n]*?(?<![\w./-])['\"]?aps(\[[\w,]+\])?['\"]?(\s|`|$|[=<>!~;])", line), (
                page.name, line
            )


def identifiers(platform: str) -> list[str]:
    cibuildwheel = shutil.which("cibuildwheel", path=str(Path(sys.executable).parent))
    assert cibuildwheel, "cibuildwheel is in the test extra"
    listed = subprocess.run(
        [cibuildwheel, "--print-build-identifiers", "--platform", platform, str(ROOT)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.split()


def test_cibuildwheel_builds_the_platforms_the_anchors_ship():
    pythons = ("cp311", "cp312", "cp313", "cp314")
    linux = {f"{py}-{libc}_{arch}" for py in pythons for libc in ("manylinux", "musllinux")
             for arch in ("x86_64", "aarch64")}
    assert set(identifiers("linux")) == linux
    assert set(identifiers("macos")) == {f"{py}-macosx_{arch}" for py in pythons for arch in ("x86_64", "arm64")}


def test_the_wheels_are_tested_installed_and_the_light_suite_needs_no_torch():
    config = PYPROJECT["tool"]["cibuildwheel"]
    assert config["test-environment"]["APS_TESTS_INSTALLED"] == "1"
    assert config["test-environment"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "--import-mode=append" in config["test-command"] and "-m 'not slow'" in config["test-command"]
    (light,) = config["overrides"]
    assert set(light["select"]) == {"*-musllinux*", "*-macosx*"} and not light["test-extras"]
    assert not any(r.split(">")[0] in ("torch", "torchvision") for r in light["test-requires"])
    for path in re.findall(r"\{project\}/(tests/\S+\.py)", light["test-command"]):
        text = (ROOT / path).read_text(encoding="utf-8")
        assert not re.search(r"^(import|from) torch", text, re.MULTILINE), path


def test_the_release_workflow_builds_tests_and_publishes_with_trusted_publishing():
    workflow = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    triggers = workflow.get("on", workflow.get(True))  # (YAML 1.1 reads a bare `on` as true)
    assert triggers["push"]["tags"] == ["v*"]
    jobs = workflow["jobs"]
    steps = {name: " ".join(str(s.get("uses", "")) + " " + str(s.get("run", "")) for s in job["steps"])
             for name, job in jobs.items()}
    assert "cibuildwheel" in steps["wheels"] and "python -m build --sdist" in steps["sdist"]
    assert set(jobs["wheels"]["strategy"]["matrix"]["os"]) >= {"ubuntu-latest", "ubuntu-24.04-arm", "macos-latest"}
    wheels = next(s for s in jobs["wheels"]["steps"] if "cibuildwheel" in str(s.get("run", "")))
    assert wheels["env"]["CIBW_ARCHS"] == "native"  # (each wheel built, and tested, on its own architecture)
    publish = jobs["publish"]
    assert set(publish["needs"]) == {"sdist", "wheels"}
    assert publish["if"].startswith("github.event_name == 'push' && ")  # (never from a run by hand)
    assert publish["permissions"] == {"id-token": "write", "attestations": "write", "contents": "read"}
    assert "pypa/gh-action-pypi-publish" in steps["publish"] and "attest-build-provenance" in steps["publish"]
    assert publish["environment"]["url"] == f"https://pypi.org/p/{DISTRIBUTION}"
    # The tag is the version: a tag that differs from aps/_version.py stops the release.
    assert "aps/_version.py" in steps["sdist"] or "__version__" in steps["sdist"]

