"""The deployment recipes (Dockerfile, examples/deploy/): the Kubernetes manifests are
valid against Kubernetes' own schemas (kubernetes-validate) and agree with the code (every
variable is one aps reads, with a value it takes; ports, probe paths, shard and worker
counts and addresses line up); the image's entrypoint turns what Kubernetes and Slurm say
of a process into aps's variables (run with a real shell)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from aps.cli._args import config_from_args
from aps.config import ServerConfig, env_name
from aps.errors import ConfigurationError
from aps.server.http import HttpSide
from aps.wire.tokens import check_token

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "examples" / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
KUBERNETES = "1.30.0"  # the oldest release the manifests are for (pod-index labels, backoffLimitPerIndex)
#: What a worker reads (aps.client.arguments, aps.Worker): the rest are the server's twins.
WORKER_VARIABLES = {"APS_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "APS_TOKEN", "APS_TOKEN_FILE",
                    "APS_COMPRESSION", "APS_TLS_CA"}
STRONG = "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw"


def documents() -> dict[str, dict]:
    found = {}
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            found[document["kind"]] = document
    return found


def container(kind: str) -> dict:
    (only,) = documents()[kind]["spec"]["template"]["spec"]["containers"]
    return only


def env(kind: str) -> dict[str, object]:
    """A container's variables: values, or where they come from (fieldRef, secretKeyRef)."""
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container(kind)["env"]}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path):
    for document in yaml.safe_load_all(path.read_text()):
        if document["apiVersion"].startswith("monitoring.coreos.com/"):  # (the Prometheus Operator's CRD)
            assert document["kind"] == "ServiceMonitor"
            continue
        kubernetes_validate.validate(document, KUBERNETES, strict=True)


def test_the_servers_variables_are_the_options_of_aps_serve_with_values_it_takes(tmp_path):
    variables = env("StatefulSet")
    twins = {env_name(name) for name in ServerConfig.__dataclass_fields__}
    assert set(variables) <= twins, set(variables) - twins
    token = tmp_path / "token"
    token.write_text(STRONG + "\n")
    given = {name: str(value) for name, value in variables.items() if isinstance(value, str)}
    given.update(APS_SHARD="1", APS_TOKEN_FILE=str(token), APS_CHECKPOINT_DIR=str(tmp_path / "checkpoints"))
    config = config_from_args(None, given)
    assert config.shard == 1 and config.http_port == 8080 and config.resume == "latest"
    assert variables["APS_SHARD"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert container("StatefulSet")["args"] == ["aps", "serve"]


def test_ports_probes_and_counts_line_up():
    docs = documents()
    server, service, job = docs["StatefulSet"], docs["Service"], docs["Job"]
    variables, workers = env("StatefulSet"), env("Job")
    ports = {port["name"]: port["containerPort"] for port in container("StatefulSet")["ports"]}
    assert ports == {"workers": int(variables["APS_PORT"]), "http": int(variables["APS_HTTP_PORT"])}
    assert service["spec"]["clusterIP"] == "None" and server["spec"]["serviceName"] == service["metadata"]["name"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    routes = {route.resource.canonical for route in HttpSide(ServerConfig(workers=1), dict, None).app().router.routes()}
    for probe in ("livenessProbe", "readinessProbe"):
        check = container("StatefulSet")[probe]["httpGet"]
        assert check["path"] in routes and check["port"] == "http"
    assert container("StatefulSet")["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container("StatefulSet")["readinessProbe"]["httpGet"]["path"] == "/readyz"
    annotations = server["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == variables["APS_HTTP_PORT"] and annotations["prometheus.io/path"] in routes
    shards = server["spec"]["replicas"]
    assert int(variables["APS_SHARDS"]) == shards
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(workers["WORLD_SIZE"]) == int(
        variables["APS_WORKERS"])
    name, port = server["metadata"]["name"], variables["APS_PORT"]
    assert workers["APS_ADDRESS"] == ",".join(f"tcp://{name}-{i}.{service['metadata']['name']}:{port}"
                                              for i in range(shards))


def test_the_workers_read_what_they_are_given_and_run_a_script_the_image_has():
    variables = env("Job")
    assert set(variables) <= WORKER_VARIABLES, set(variables) - WORKER_VARIABLES
    assert variables["RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert documents()["Job"]["spec"]["completionMode"] == "Indexed"
    args = container("Job")["args"]
    script = args[1]
    assert script.startswith("/opt/aps/examples/")
    source = (ROOT / "examples" / script.removeprefix("/opt/aps/examples/")).read_text()
    assert 'os.environ.get("APS_ADDRESS")' in source  # (the example joins the servers it is pointed at)
    assert "COPY examples /opt/aps/examples" in (ROOT / "Dockerfile").read_text()


def test_the_token_comes_from_the_secret_and_the_templates_placeholder_is_refused():
    secret = documents()["Secret"]
    key = env("Job")["APS_TOKEN"]["secretKeyRef"]
    assert key == {"name": secret["metadata"]["name"], "key": "token"} and "token" in secret["stringData"]
    volume = documents()["StatefulSet"]["spec"]["template"]["spec"]["volumes"][0]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    with pytest.raises(ConfigurationError, match="too weak"):  # (a copy of the template never runs with it)
        check_token(secret["stringData"]["token"], "the template's token")


def test_the_dockerfile_ships_the_entrypoint_and_exposes_the_ports():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["aps-entrypoint"]' in dockerfile
    copied = re.search(r"COPY (\S+) /usr/local/bin/aps-entrypoint", dockerfile).group(1)
    assert (ROOT / copied).is_file() and os.access(ROOT / copied, os.X_OK)
    assert re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split() == ["7450", "8080"]
    assert set(re.findall(r"^\s+(\w+)\) pip install", dockerfile, re.M)) == {"server", "cpu", "cuda"}


# The entrypoint, run by a real shell ------------------------------------------------
def entrypoint(tmp_path, environ: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """aps-entrypoint with ``environ`` and a stand-in ``aps`` that prints what it got."""
    fake = tmp_path / "aps"
    fake.write_text('#!/bin/sh\necho "aps $*"\nenv | grep -E "^(APS_SHARD|RANK|WORLD_SIZE)=" | sort\n')
    fake.chmod(0o755)
    full = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOSTNAME": "aps-1", **environ}
    return subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), *args], env=full, capture_output=True, text=True,
                          timeout=30)


@pytest.mark.parametrize(("environ", "args", "expected"), [
    ({"APS_SHARDS": "2"}, (), ["aps serve", "APS_SHARD=1"]),  # the ordinal of the host name
    ({"APS_SHARDS": "2", "APS_SHARD": ""}, (), ["aps serve", "APS_SHARD=1"]),  # (a label that was not there)
    ({"APS_SHARDS": "2", "APS_SHARD": "0"}, (), ["aps serve", "APS_SHARD=0"]),  # given: kept
    ({}, ("--workers", "4"), ["aps serve --workers 4"]),  # flags: of aps serve
    ({"JOB_COMPLETION_INDEX": "3"}, ("aps", "status"), ["aps status", "RANK=3"]),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "5"}, ("aps", "launch"), ["aps launch", "RANK=2", "WORLD_SIZE=5"]),
    ({"SLURM_PROCID": "2", "RANK": "7", "WORLD_SIZE": "8", "SLURM_NTASKS": "5"}, ("aps",),
     ["aps ", "RANK=7", "WORLD_SIZE=8"]),
])
def test_the_entrypoint_says_what_the_cluster_says_the_way_aps_reads_it(tmp_path, environ, args, expected):
    result = entrypoint(tmp_path, environ, *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == expected


def test_the_entrypoint_refuses_a_shard_it_cannot_tell():
    result = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh")], env={"PATH": "/usr/bin:/bin", "APS_SHARDS": "2",
                                                                          "HOSTNAME": "server"},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "ends in no ordinal" in result.stderr


# The replica sets' manifests (examples/deploy/kubernetes/replicated) -----------------------
REPLICATED = sorted((DEPLOY / "kubernetes" / "replicated").glob("*.yaml"))
ENTRYPOINT_VARIABLES = {"APS_REPLICA_COUNT", "APS_REPLICA_DOMAIN"}


def replicated() -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for path in REPLICATED:
        for document in yaml.safe_load_all(path.read_text()):
            found.setdefault(document["kind"], []).append(document)
    return found


@pytest.mark.parametrize("path", REPLICATED, ids=lambda path: path.name)
def test_every_replicated_manifest_is_valid_against_the_kubernetes_schemas(path):
    for document in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(document, KUBERNETES, strict=True)


def test_each_pod_of_the_replicated_statefulset_is_a_replica_of_its_shard_and_its_coordinator_is_there(tmp_path):
    server = next(s for s in replicated()["StatefulSet"] if s["metadata"]["name"] == "aps")
    (only,) = server["spec"]["template"]["spec"]["containers"]
    variables = {item["name"]: item["value"] for item in only["env"]}
    twins = {env_name(name) for name in ServerConfig.__dataclass_fields__}
    assert set(variables) <= twins | ENTRYPOINT_VARIABLES, set(variables) - twins - ENTRYPOINT_VARIABLES
    count, shards = int(variables["APS_REPLICA_COUNT"]), int(variables["APS_SHARDS"])
    assert server["spec"]["replicas"] == count * shards
    etcd = next(s for s in replicated()["Service"] if s["metadata"]["name"] == "aps-etcd")
    assert variables["APS_COORDINATOR"] == f"etcd://aps-etcd-0.{etcd['metadata']['name']}:{etcd['spec']['ports'][0]['port']}"
    token = tmp_path / "token"
    token.write_text(STRONG + "\n")
    sets = {}
    for ordinal in range(server["spec"]["replicas"]):
        fake = tmp_path / "aps"
        fake.write_text('#!/bin/sh\nenv | grep -E "^APS_" | sort\n')
        fake.chmod(0o755)
        result = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh")], capture_output=True, text=True, timeout=30,
                                env={"PATH": f"{tmp_path}:/usr/bin:/bin", "HOSTNAME": f"aps-{ordinal}", **variables})
        assert result.returncode == 0, result.stderr
        said = dict(line.split("=", 1) for line in result.stdout.splitlines())
        said.update(APS_TOKEN_FILE=str(token), APS_CHECKPOINT_DIR=str(tmp_path / "checkpoints"))
        config = config_from_args(None, {k: v for k, v in said.items() if k not in ENTRYPOINT_VARIABLES})
        assert config.shard == ordinal // count and config.advertise == f"aps-{ordinal}.aps:7450"
        assert config.advertise in config.replicas.split(",")
        sets.setdefault(config.replica_set, set()).add(config.replicas)
    # one set a shard, every replica of it given the same list
    assert len(sets) == shards and all(len(lists) == 1 for lists in sets.values())


def test_the_entrypoint_refuses_replicas_it_cannot_place(tmp_path):
    for environ, says in (({"APS_REPLICA_COUNT": "2", "HOSTNAME": "server"}, "ordinal"),
                          ({"APS_REPLICA_COUNT": "2", "HOSTNAME": "aps-1"}, "APS_REPLICA_DOMAIN")):
        result = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh")], env={"PATH": "/usr/bin:/bin", **environ},
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 2 and says in result.stderr, result.stderr
