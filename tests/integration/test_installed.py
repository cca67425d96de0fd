"""What a user's `pip install aps-server` gives, without PyTorch: the version in every place it is
shown, the files the package needs beside its modules, and a real server and worker training.

.ci/run and the release's wheel builds run the suites against the installed wheel (from outside
the checkout, APS_TESTS_INSTALLED=1); on musllinux and macOS, where PyTorch does not always
install, this file and the kernels' tests are the suite (pyproject.toml, [tool.cibuildwheel])."""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.metadata
import importlib.resources
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import aps
from aps import _core
from aps.client.worker import Worker
from aps.wire.segments import shm_available

from .test_http import get, http_address, samples

DISTRIBUTION = "aps-server"


def test_the_version_is_one_version_everywhere_it_is_shown():
    version = importlib.metadata.version(DISTRIBUTION)
    assert version == aps.__version__
    shown = subprocess.run([sys.executable, "-m", "aps", "--version"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.strip() == f"aps {version}", shown


def test_the_distribution_holds_the_extension_its_stub_and_the_dashboard():
    extension = Path(_core.__file__ or "")
    assert extension.parent == Path(aps.__file__ or "").parent
    assert any(extension.name.endswith(suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES), extension
    package = importlib.resources.files("aps")
    for name in ("_core.pyi", "py.typed", "server/web/index.html", "server/web/dashboard.js"):
        assert package.joinpath(name).is_file(), name
    # The console script a user types, installed beside the interpreter.
    scripts = importlib.metadata.distribution(DISTRIBUTION).entry_points.select(group="console_scripts")
    assert [(script.name, script.value) for script in scripts] == [("aps", "aps.cli:main")]


def test_the_native_kernels_load_and_match_their_python_twin():
    rng = np.random.default_rng(0)
    weights, grad = rng.standard_normal(1000, dtype=np.float32), rng.standard_normal(1000, dtype=np.float32)
    native, reference = np.empty_like(weights), np.empty_like(weights)
    native_momentum, reference_momentum = np.empty_like(weights), np.empty_like(weights)
    _core.sgd_step(native, weights, grad, native_momentum, None, 0.1, momentum=0.9, first=True)
    aps._reference.sgd_step(reference, weights, grad, reference_momentum, None, 0.1, momentum=0.9, first=True)
    assert np.array_equal(native, reference) and np.array_equal(native_momentum, reference_momentum)
    assert not np.array_equal(native, weights)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_server_and_a_worker_train(server_process, transport):
    if transport == "shm" and not shm_available():
        pytest.skip("shared memory is Linux's (memfd and Unix sockets' descriptor passing)")
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "0.5", "--http-port", "0")
    base = http_address(server)
    with Worker(server.address, 0, 1, transport=transport) as worker:
        weights = worker.init({"w": np.full(4096, 2.0, np.float32)})
        for _ in range(3):
            weights = worker.push_pull({"w": np.ones(4096, np.float32)})
        assert np.array_equal(weights["w"], np.full(4096, 2.0 - 3 * 0.5, np.float32))
    status, text, _ = asyncio.run(get(base + "metrics"))
    assert status == 200
    build = samples(text)[("aps_build_info", (("python", platform.python_version()), ("version", aps.__version__)))]
    assert build == 1
