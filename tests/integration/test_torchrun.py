"""torchrun's elastic launch (``--nnodes 1:2``, c10d rendezvous) with aps unchanged: when a
node joins, torchrun restarts every worker, and the restarted processes join the running
model (its weights and their clocks come from the server, training does not start over);
when a node dies (its agent and its worker killed), the other node's worker goes on."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # (three torchrun processes and two rendezvous rounds)

SCRIPT = Path(__file__).parents[1] / "scripts" / "torchrun_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logs(directory: Path) -> dict[int, list[dict]]:
    out = {}
    for path in directory.glob("pid-*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        if lines:
            out[lines[0]["pid"]] = lines
    return out


def wait_for(predicate, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def test_torchrun_elastic_restarts_rejoin_the_running_model(server_process, tmp_path):
    pytest.importorskip("torch")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    server = server_process("--workers", "1:4", "--sync", "asp", "--lr", "0.01")
    # torch's shared rendezvous store skips publishing the master address in later rounds when
    # the new node is not rank 0 (torch 2.14): the documented opt-out avoids it.
    env = {**os.environ, "APS_ADDRESS": server.address, "LOG_DIR": str(tmp_path),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    port = free_port()
    command = [torchrun, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "aps-test", "--max-restarts", "3", "--monitor-interval", "0.5",
               "--local-addr", "127.0.0.1", "--rdzv-conf", "last_call_timeout=1", str(SCRIPT)]
    agents = []
    try:
        with open(tmp_path / "agent-a.log", "wb") as out:
            agents.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        first = wait_for(lambda: [lines for lines in logs(tmp_path).values() if len(lines) > 5], "node A's worker")[0]
        assert first[0]["world_size"] == 1
        with open(tmp_path / "agent-b.log", "wb") as out:
            agents.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        # Node B joins: torchrun restarts node A's worker too; both new processes join the running model.
        restarted = wait_for(lambda: (lambda new: new if len(new) == 2 and all(len(v) > 5 for v in new) else None)(
            [lines for pid, lines in logs(tmp_path).items() if pid != first[0]["pid"]]), "two restarted workers")
        before = max(entry["version"] for entry in logs(tmp_path)[first[0]["pid"]][1:] if "version" in entry)
        for lines in restarted:
            head = lines[0]
            assert head["world_size"] == 2 and head["joined_running"], head
            assert head["version"] >= before  # the server's weights, not a fresh start
        assert sorted(lines[0]["rank"] for lines in restarted) == [0, 1]
        assert max(entry.get("live", 0) for lines in restarted for entry in lines) == 2
        # Node B dies: its agent and its worker, with SIGKILL. Node A's worker goes on alone.
        node_b = agents[1]
        doomed = children(node_b.pid)
        os.killpg(node_b.pid, signal.SIGKILL)
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)
        node_b.wait()
        survivor = next(lines for lines in restarted if lines[0]["pid"] not in doomed)
        pid = survivor[0]["pid"]
        at_kill = len(logs(tmp_path)[pid])
        wait_for(lambda: len(logs(tmp_path)[pid]) > at_kill + 20 and logs(tmp_path)[pid][-1].get("live") == 1,
                 "the surviving worker to go on alone")
        versions = [entry["version"] for entry in logs(tmp_path)[pid][1:] if "version" in entry]
        assert versions == sorted(versions) and versions[-1] > before
        (tmp_path / "STOP").touch()
        # It finishes cleanly (its agent then waits at torchrun's exit barrier for node B, which
        # torchrun cannot tell is gone: that wait is torchrun's, and the test ends it).
        wait_for(lambda: logs(tmp_path)[pid][-1].get("done"), "the surviving worker to finish", 30)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for lines in logs(tmp_path).values():
            try:
                os.kill(lines[0]["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
