"""The container image, built for real: the repository's Dockerfile (VARIANT=server) on a
Debian base made with debootstrap (aps.testing.image), no registry involved. The image must
stay small, its entrypoint must start ``aps serve`` from flags alone, a worker in this
process must train against the container's server over TCP, its HTTP side must answer the
probes the Kubernetes manifests name, and a StatefulSet pod's host name must pick its shard.

The server runs with the host's network but listens on 127.0.0.1 only (``--host`` beats the
image's ``APS_HOST=0.0.0.0``): nothing beyond this machine can reach it. Needs root, podman,
debootstrap and runc (skipped, saying why, without them); the first run bootstraps the base
(minutes; cached in $APS_IMAGE_CACHE for the next)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import aps
from aps.testing import TOKEN
from aps.testing.image import LABEL, SESSION, Container, build_image, leftover_containers, podman, require_podman

ROOT = Path(__file__).resolve().parents[2]  # (the checkout: its Dockerfile and build context)

# Under pytest-xdist each worker running a test here builds the image (module fixture): the
# builds take turns (a lock), and the second is a cached one (seconds).
pytestmark = pytest.mark.slow

TAG = "localhost/aps-test:server"
#: The server image's ceiling, in bytes as podman counts them (it was 409 MB on the debootstrap base).
MAX_SIZE = 600 * 1000 * 1000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for_port(port: int, container: Container, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if not container.running():
                pytest.fail(f"the server's container exited:\n{container.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s:\n{container.logs()}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def image():
    require_podman()
    started = time.monotonic()
    size = build_image(TAG, context=ROOT)
    print(f"image {TAG}: {size} bytes ({size / 1e6:.0f} MB), base and build in {time.monotonic() - started:.0f} s")
    return TAG, size


def test_the_server_image_is_small(image, record_property):
    tag, size = image
    record_property("image_size_bytes", size)
    assert 0 < size < MAX_SIZE, f"{tag} is {size / 1e6:.0f} MB, over {MAX_SIZE / 1e6:.0f} MB"


def test_a_worker_trains_against_the_container_and_its_probes_answer(image, monkeypatch):
    tag, _ = image
    monkeypatch.delenv("APS_TOKEN", raising=False)  # the server asks for none (--insecure)
    monkeypatch.delenv("APS_TOKEN_FILE", raising=False)
    port, http_port = free_port(), free_port()
    # Flags alone: the entrypoint takes a command starting with a dash as `aps serve`'s flags.
    server = Container(tag, "--port", str(port), "--http-port", str(http_port), "--workers", "1", "--sync", "asp",
                       "--lr", "1", "--insecure", "--host", "127.0.0.1",
                       options=["--network", "host"])
    try:
        wait_for_port(port, server)
        assert f"127.0.0.1:{port}" in server.wait_for_log("serving on", timeout=30)
        wait_for_port(http_port, server)
        assert http_get(f"http://127.0.0.1:{http_port}/healthz") == (200, "ok\n")
        assert http_get(f"http://127.0.0.1:{http_port}/readyz") == (200, "ready\n")
        with aps.Worker(f"tcp://127.0.0.1:{port}", 0, 1, transport="tcp") as worker:
            assert worker.transport == "tcp"
            assert worker.init({"w": np.zeros(8, np.float32)})["w"].tolist() == [0.0] * 8
            assert worker.version == 0
            for step in range(1, 6):
                got = worker.push_pull({"w": np.ones(8, np.float32)})
                assert worker.version == step
                assert got["w"].tolist() == [-float(step)] * 8  # plain SGD, lr 1
        assert http_get(f"http://127.0.0.1:{http_port}/healthz")[0] == 200
        # The user the image runs as: not root.
        assert podman("exec", server.id, "id", "-u").stdout.strip() == "10001"
    finally:
        server.close()
    assert not server.exists()
    assert not leftover_containers()


def test_the_entrypoint_picks_a_statefulset_pods_shard(image):
    """A StatefulSet pod aps-1 of APS_SHARDS=2 (examples/deploy/kubernetes/statefulset.yaml)
    serves shard 1: the entrypoint reads the ordinal off the host name."""
    tag, _ = image
    # APS_TOKEN: the manifests pass one (the image listens on 0.0.0.0, which needs one).
    shown = "from aps.cli._args import config_from_args; c = config_from_args(); print(c.shard, c.shards)"
    done = podman("run", "--rm", "--network", "none", "--hostname", "aps-1", "--env", "APS_SHARDS=2",
                  "--env", f"APS_TOKEN={TOKEN}", "--label", f"{LABEL}={SESSION}", tag, "python3", "-c", shown, timeout=120)
    assert done.stdout.split() == ["1", "2"], done.stderr
    refused = podman("run", "--rm", "--network", "none", "--hostname", "aps", "--env", "APS_SHARDS=2",
                     "--label", f"{LABEL}={SESSION}", tag, "true", timeout=120, check=False)
    assert refused.returncode == 2 and "ends in no ordinal" in refused.stderr
    assert not leftover_containers()
