"""The throwaway Slurm cluster (aps/testing/slurm.py): one slurmctld and three slurmd in
network namespaces, a real ``sbatch`` job across two of them.

- ``--nodes=2 --ntasks=4``: four tasks, on two different nodes (each its own hostname),
  with Slurm's environment, and ``scontrol show hostnames $SLURM_JOB_NODELIST`` works
  inside the job;
- a task on one node reaches, over TCP and by node name, a server that a task runs on
  the other (what a parameter server and its workers need);
- at exit, every daemon is gone and every namespace deleted.
"""

from __future__ import annotations

import re
import secrets
import sys
import time

import pytest

from aps.testing.netns import list_netns, pid_alive
from aps.testing.slurm import SlurmCluster, require_slurm

pytestmark = pytest.mark.slow

PY = sys.executable

# One HTTP server (serves the directory it is given) that answers `count` requests, then exits.
SERVER = """
import functools, http.server, socket, sys
directory, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=directory)
server = http.server.HTTPServer(("0.0.0.0", port), handler)
server.timeout = 60
print(f"SERVER host={socket.gethostname()} port={port}", flush=True)
for _ in range(count):
    server.handle_request()
server.server_close()
"""

# Fetch a URL (retrying until the server listens), print what came back and from where.
FETCH = """
import socket, sys, time, urllib.parse, urllib.request
url = sys.argv[1]
host = urllib.parse.urlsplit(url).hostname
deadline = time.monotonic() + 30
while True:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = reply.read().decode()
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
print(f"FETCH host={socket.gethostname()} server={host} address={socket.gethostbyname(host)} "
      f"own={socket.gethostbyname(socket.gethostname())} body={body}", flush=True)
"""

JOB = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks=4
#SBATCH --time=5
#SBATCH --job-name=aps-slurm-check
set -eu
echo "BATCH host=$(hostname) nodelist=$SLURM_JOB_NODELIST"
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed 's/^/HOSTNAME /'
srun bash -c 'echo "TASK $SLURM_PROCID host=$(hostname) node=$SLURMD_NODENAME"; env | grep "^SLURM_" | sed "s/^/ENV $SLURM_PROCID /"'
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
OTHER=${NODES[1]}
srun --overlap --nodes=1 --ntasks=1 --nodelist="$HEAD" "$CHECK_PY" "$CHECK_DIR/server.py" "$CHECK_DIR/www" 8765 1 &
SERVER=$!
srun --overlap --nodes=1 --ntasks=1 --nodelist="$OTHER" "$CHECK_PY" "$CHECK_DIR/fetch.py" "http://$HEAD:8765/token.txt"
wait "$SERVER"
echo "DONE"
"""


def test_sbatch_two_nodes_four_tasks_and_tcp_between_nodes(tmp_path):
    require_slurm()
    token = secrets.token_hex(16)
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "fetch.py").write_text(FETCH)
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "token.txt").write_text(token)
    script = tmp_path / "job.sh"
    script.write_text(JOB)

    began = time.monotonic()
    with SlurmCluster(nodes=3, cpus_per_node=2) as cluster:
        started_in = cluster.started_in
        pids = cluster.pids()
        namespaces = cluster.namespaces
        assert set(cluster.nodes) == {"node1", "node2", "node3"}
        assert cluster.node_states() == {name: "idle" for name in cluster.nodes}
        assert cluster.env["SLURM_CONF"].startswith(cluster.root)

        job = cluster.sbatch(str(script), env={"CHECK_PY": PY, "CHECK_DIR": str(tmp_path)})
        state = cluster.wait(job, timeout=120)
        out_path = cluster.output_path(job)
        with open(out_path) as fh:
            output = fh.read()
        info = cluster.job_info(job)
        assert state == "COMPLETED", f"job {job} ended {state} ({info})\n{output}\n{cluster.diagnostics()}"
        assert info["ExitCode"] == "0:0"
        assert out_path.startswith(cluster.job_dir)
        for label, alive in cluster.alive().items():
            assert alive, f"{label} died"
    elapsed = time.monotonic() - began
    print(f"cluster started in {started_in:.1f} s; start, job and teardown {elapsed:.1f} s")

    # Four tasks on two different nodes, each node its own hostname.
    tasks = dict(re.findall(r"^TASK (\d+) host=(\S+) node=\S+$", output, re.M))
    assert sorted(tasks) == ["0", "1", "2", "3"], output
    task_nodes = dict(re.findall(r"^TASK (\d+) host=\S+ node=(\S+)$", output, re.M))
    assert tasks == task_nodes, output
    assert len(set(tasks.values())) == 2, output

    # scontrol show hostnames inside the job: the two nodes the tasks ran on.
    hostnames = re.findall(r"^HOSTNAME (\S+)$", output, re.M)
    assert hostnames and set(hostnames) == set(tasks.values()), output
    batch_host = re.search(r"^BATCH host=(\S+) nodelist=(\S+)$", output, re.M)
    assert batch_host is not None and batch_host.group(1) == hostnames[0], output

    # Slurm's environment in every task.
    env = {}
    for procid, line in re.findall(r"^ENV (\d+) (SLURM_\w+=.*)$", output, re.M):
        key, _, value = line.partition("=")
        env.setdefault(procid, {})[key] = value
    assert sorted(env) == ["0", "1", "2", "3"], output
    for procid, task_env in env.items():
        assert task_env["SLURM_PROCID"] == procid
        assert task_env["SLURM_NTASKS"] == "4"
        assert task_env["SLURM_JOB_NUM_NODES"] == "2"
        assert task_env["SLURM_JOB_ID"] == str(job)
        assert "SLURM_JOB_NODELIST" in task_env and "SLURM_LOCALID" in task_env

    # A task on the second node fetched, by node name over TCP, what the first node served.
    server = re.search(r"^SERVER host=(\S+) port=8765$", output, re.M)
    fetch = re.search(r"^FETCH host=(\S+) server=(\S+) address=(\S+) own=(\S+) body=(\S+)$", output, re.M)
    assert server is not None and fetch is not None, output
    assert server.group(1) == hostnames[0] and fetch.group(1) == hostnames[1], output
    assert fetch.group(2) == hostnames[0] and fetch.group(3) != fetch.group(4), output
    assert fetch.group(5) == token, output
    assert "DONE" in output

    # Everything the cluster started is gone.
    assert not [label for label, pid in pids.items() if pid_alive(pid)]
    assert not set(namespaces) & set(list_netns())
