"""TLS for TCP: tls:// addresses, the server's certificate checked by the worker, client
certificates when the server asks for them. Certificates come from a throwaway CA (trustme)."""

import asyncio
import json
import os
import ssl
import subprocess
import sys

import numpy as np
import pytest

import aps

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a stranger's CA."""
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    files = {"ca": root / "ca.pem", "other_ca": root / "other.pem", "server": root / "server.pem",
             "client": root / "client.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    other.cert_pem.write_to_path(str(files["other_ca"]))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(files["server"]))
    ca.issue_cert("worker-0").private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    return {name: str(path) for name, path in files.items()}


def context(cafile: str, client: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cafile)
    if client:
        ctx.load_cert_chain(client)
    return ctx


def test_training_over_tls(server_process, pki):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1", "--tls-cert", pki["server"])
    assert server.address.startswith("tls://127.0.0.1:")
    with aps.Worker(server.address, 0, 1, transport="tcp", tls=context(pki["ca"])) as worker:
        worker.init({"w": np.zeros(1 << 18, np.float32)})
        for _ in range(3):
            worker.push_pull({"w": np.ones(1 << 18, np.float32)})
        assert worker.weights["w"][:3].tolist() == [-3.0] * 3

    async def asynchronous():
        worker = await aps.AsyncWorker.connect(server.address, 0, 1, tls=context(pki["ca"]))
        await worker.init({"w": np.zeros(1 << 18, np.float32)})
        weights = await worker.push_pull({"w": np.ones(1 << 18, np.float32)})
        await worker.close()
        return weights["w"][0]

    assert asyncio.run(asynchronous()) == -4.0
    env = dict(os.environ, APS_TLS_CA=pki["ca"])  # aps status trusts the CA the environment names
    done = subprocess.run([sys.executable, "-m", "aps", "status", server.address, "--json"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["server"]["version"] == 4


def test_a_server_the_worker_cannot_verify_is_refused(server_process, pki):
    server = server_process("--workers", "1", "--sync", "asp", "--tls-cert", pki["server"])
    with pytest.raises(aps.APSConnectionError, match="TLS handshake .* failed: .*certificate verify failed"):
        aps.Worker(server.address, 0, 1, transport="tcp", tls=context(pki["other_ca"]))
    with pytest.raises(aps.APSConnectionError):  # plain TCP to a TLS server gets nowhere either
        with aps.Worker(server.address.replace("tls://", "tcp://"), 0, 1, transport="tcp", tls=False,
                        connect_timeout=5, server_timeout=5) as worker:
            worker.init({"w": np.zeros(4, np.float32)}, timeout=5)


def test_client_certificates_when_the_server_asks_for_them(server_process, pki, monkeypatch):
    server = server_process("--workers", "1", "--sync", "asp", "--tls-cert", pki["server"], "--tls-ca", pki["ca"])
    with pytest.raises(aps.APSConnectionError):
        with aps.Worker(server.address, 0, 1, transport="tcp", tls=context(pki["ca"]), reconnect=False) as worker:
            worker.init({"w": np.zeros(4, np.float32)}, timeout=10)
    monkeypatch.setenv("APS_TLS_CA", pki["ca"])
    monkeypatch.setenv("APS_TLS_CERT", pki["client"])  # the worker's certificate, from the environment
    with aps.Worker(server.address, 0, 1, transport="tcp") as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull(worker.grads)
        assert worker.version == 1


def test_tls_and_a_token_together(server_process, pki):
    server = server_process("--workers", "1", "--sync", "asp", "--tls-cert", pki["server"], "--token", "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw")
    with aps.Worker(server.address, 0, 1, transport="tcp", tls=context(pki["ca"]), token="Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw") as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull(worker.grads)
    with pytest.raises(aps.AuthenticationError):
        aps.Worker(server.address, 0, 1, transport="tcp", tls=context(pki["ca"]), token="wrong")


def test_the_http_side_speaks_https_with_the_same_certificate(server_process, pki):
    """With --tls-cert, the dashboard, /metrics and the token they carry are encrypted too."""
    import aiohttp

    server = server_process("--workers", "1", "--tls-cert", pki["server"], "--token", "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw", "--http-port", "0")
    line = server.proc.stdout.readline()
    assert line.startswith("aps: dashboard on https://127.0.0.1:"), line
    url = line.split(" on ", 1)[1].strip()

    async def fetch(address: str, **kwargs) -> int:
        async with aiohttp.ClientSession() as session, session.get(address, **kwargs) as response:
            return response.status

    bearer = {"Authorization": "Bearer Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"}
    assert asyncio.run(fetch(url + "metrics", ssl=context(pki["ca"]), headers=bearer)) == 200
    with pytest.raises(aiohttp.ClientError):  # plain HTTP is not spoken
        asyncio.run(fetch(url.replace("https:", "http:") + "metrics", headers=bearer))
    with pytest.raises(aiohttp.ClientError):  # nor to a client that does not trust the certificate
        asyncio.run(fetch(url + "metrics", ssl=context(pki["other_ca"]), headers=bearer))
