"""Shared fixtures: both kernel implementations, and real server processes."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

from aps import _core, _reference
from aps.testing.drivers import DRIVERS, connect

settings.register_profile(
    "aps",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", parent=settings.get_profile("aps"), print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "aps"))

_runtime_dir: str | None = None


def pytest_configure(config):
    """Give this test process (each pytest-xdist worker has its own) a private runtime
    directory: the servers it starts put their Unix sockets there ($XDG_RUNTIME_DIR), so
    one process's socket sweep never meets another's servers, whatever runs beside it."""
    global _runtime_dir
    if _runtime_dir is None:
        _runtime_dir = tempfile.mkdtemp(prefix=f"aps-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
        os.environ["XDG_RUNTIME_DIR"] = _runtime_dir
    try:
        # What torch imports at the first optimizer made (torch._dynamo: some 900 modules,
        # seconds on a loaded machine), imported before any test starts a server: made inside
        # a test, after aps.torch.Optimizer has connected, it can outlast the handshake deadline.
        import torch._dynamo  # noqa: F401
    except ImportError:
        pass


def pytest_unconfigure(config):
    global _runtime_dir
    if _runtime_dir is not None:
        shutil.rmtree(_runtime_dir, ignore_errors=True)
        _runtime_dir = None


@pytest.fixture(params=[_core, _reference], ids=["native", "reference"])
def kernels(request):
    """The native module and its plain-Python twin: every test using this runs on both."""
    return request.param


@pytest.fixture(params=["tcp", "shm"])
def transport(request):
    """Both worker transports: every test using this runs over TCP and over shared memory."""
    return request.param


@pytest.fixture
def server_process():
    """Factory for real ``aps serve`` processes; every one started is stopped at teardown."""
    from aps.testing import ServerProcess

    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        proc = ServerProcess(*args, env=env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def network():
    """A ``aps.testing.netns.Network`` of separate hosts (skips where namespaces are unusable);
    its processes and namespaces are gone after the test, whatever happened."""
    from aps.testing.netns import Network, require_netns

    require_netns()
    with Network() as net:
        yield net


@pytest.fixture(params=DRIVERS, ids=[f"{driver}-{transport}" for driver, transport in DRIVERS])
def client(request):
    """Both drivers of the worker, over every transport each speaks: ``client(address, rank,
    num_workers, **options)`` is an :class:`aps.Worker`, or an :class:`aps.AsyncWorker` called
    the same way (:class:`aps.testing.drivers.AsyncDriven`); ``client.transport`` and
    ``client.driver`` say which. Every test using this runs its one body over all of them."""
    driver, transport = request.param

    def make(address, rank=0, num_workers=1, **options):
        return connect(driver, address, rank, num_workers, options.pop("transport", transport), **options)

    make.driver, make.transport = driver, transport
    return make
