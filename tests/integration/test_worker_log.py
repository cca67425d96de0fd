"""What the training loop reports (``aps.Worker.log``, LOG) against a real server: kept per
rank, served as curves (/api/scalars, the dashboard's socket) and in /metrics and the
statistics; bad reports refused whole; two ranks on the same data warned of."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import threading

import aiohttp
import numpy as np
import pytest

import aps
from aps.checkpoint import MANIFEST_FILE
from aps.cli.status import fetch_stats
from aps.client import logbook
from aps.errors import ErrorCode
from aps.wire.protocol import Op

from .test_bad_input import assert_error, join_pair
from .test_http import get, http_address, made_token, samples

N = 8


def _join(server, count=2, transport="tcp"):
    workers = [aps.Worker(server.address, rank, count, transport=transport) for rank in range(count)]
    threads = [threading.Thread(target=w.init, args=({"w": np.zeros(N, np.float32)},)) for w in workers[1:]]
    for thread in threads:
        thread.start()
    workers[0].init({"w": np.zeros(N, np.float32)})
    for thread in threads:
        thread.join(10)
    return workers


def test_logged_scalars_become_curves_metrics_and_statistics(server_process, transport):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "0.1", "--http-port", "0")
    base = http_address(server)
    workers = _join(server, transport=transport)
    for step in range(5):
        for rank, worker in enumerate(workers):
            worker.push_pull({"w": np.ones(N, np.float32)})
            worker.log({"loss": 1.0 / (step + 1) + rank, "lr": np.float32(0.1)})  # (step: the worker's clock)
    workers[1].log({"loss": float("nan")}, step=99)
    for worker in workers:
        worker.close()  # (sends what is left)
    status, text, _ = asyncio.run(get(base + "api/scalars"))
    assert status == 200
    answer = json.loads(text)
    curves = answer["curves"]
    assert [step for step, _ in curves["0"]["loss"]] == [1, 2, 3, 4, 5]
    assert [value for _, value in curves["0"]["loss"]] == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.2])
    assert curves["1"]["loss"][-1] == [99, None], "a NaN is a gap, in JSON a null"
    assert [value for _, value in curves["0"]["lr"]] == pytest.approx([0.1] * 5)
    status, text, _ = asyncio.run(get(base + "metrics"))
    got = samples(text)
    assert got[("aps_worker_scalar", (("name", "loss"), ("rank", "0")))] == pytest.approx(0.2)
    assert got[("aps_worker_scalar_step", (("name", "loss"), ("rank", "1")))] == 99
    assert got[("aps_worker_resident_memory_bytes", (("rank", "0"),))] > 1 << 20
    assert got[("aps_worker_cpu_seconds_total", (("rank", "1"),))] > 0
    assert got[("aps_ranks_on_same_data", ())] == 0
    stats = fetch_stats(server.address)
    reported = stats["workers"][0]["reported"]
    assert reported["scalars"]["loss"] == {"step": 5, "value": pytest.approx(0.2)}
    assert reported["process"]["pid"] > 0 and stats["warnings"] == []


def test_the_dashboard_gets_the_curves_then_each_new_point(server_process, monkeypatch):
    monkeypatch.setattr(logbook, "LOG_EVERY_S", 0.0)  # (each log() sends at once)
    server = server_process("--workers", "1", "--sync", "asp", "--http-port", "0")
    base = http_address(server)
    (worker,) = _join(server, count=1)
    for step, loss in ((1, 3.0), (2, 2.0), (2, 2.5), (2, 2.5)):  # (the last: sent again, not a new point)
        worker.log({"loss": loss}, step=step)

    async def watch():
        async with aiohttp.ClientSession() as session, session.ws_connect(base.replace("http", "ws") + "ws") as ws:
            await ws.send_str(json.dumps({"token": made_token(base)}))
            hello = json.loads((await ws.receive(timeout=10)).data)
            await asyncio.to_thread(worker.log, {"loss": 1.0, "acc": 0.5}, 3)
            seen = []
            for _ in range(20):
                frame = json.loads((await ws.receive(timeout=10)).data)
                seen += [point[1:] for point in frame.get("scalars", [])]
                if len(seen) >= 2:
                    break
            return hello, seen

    hello, seen = asyncio.run(watch())
    assert hello["curves"] == {"0": {"loss": [[1, 3.0], [2, 2.0], [2, 2.5]]}}
    assert seen == [[0, "loss", 3, 1.0], [0, "acc", 3, 0.5]]
    worker.close()


def test_a_resumed_server_draws_the_curves_from_the_runs_start(server_process, tmp_path, monkeypatch):
    """The curves are in the checkpoint: a server resumed from it serves them as they were,
    and a worker back on it adds to them."""
    monkeypatch.setattr(logbook, "LOG_EVERY_S", 0.0)
    options = ("--workers", "1", "--sync", "asp", "--checkpoint-dir", str(tmp_path))
    server = server_process(*options, "--http-port", "0")
    base = http_address(server)
    (worker,) = _join(server, count=1)
    for step in range(1, 6):
        worker.push_pull({"w": np.ones(N, np.float32)})
        worker.log({"loss": 1.0 / step, "acc": float("nan") if step == 3 else step / 10})
    worker.close()
    before = json.loads(asyncio.run(get(base + "api/scalars"))[1])["curves"]
    assert [step for step, _ in before["0"]["loss"]] == [1, 2, 3, 4, 5] and before["0"]["acc"][2] == [3, None]
    server.stop()  # (a clean stop writes a checkpoint)
    resumed = server_process(*options, "--resume", "--http-port", "0")
    base = http_address(resumed)
    assert json.loads(asyncio.run(get(base + "api/scalars"))[1])["curves"] == before
    (worker,) = _join(resumed, count=1)
    worker.push_pull({"w": np.ones(N, np.float32)})
    worker.log({"loss": 0.125}, step=6)
    worker.close()
    after = json.loads(asyncio.run(get(base + "api/scalars"))[1])["curves"]
    assert after["0"]["loss"] == before["0"]["loss"] + [[6, 0.125]]
    assert fetch_stats(resumed.address)["workers"][0]["reported"]["scalars"]["loss"] == {"step": 6, "value": 0.125}


def test_curves_that_do_not_fit_are_left_out_and_the_run_resumes(server_process, tmp_path):
    """Curves are to look at: a checkpoint whose curves do not hold together (a writer's bug:
    its checksum matches) resumes all the same, without them, and the log says so."""
    options = ("--workers", "1", "--sync", "asp", "--checkpoint-dir", str(tmp_path))
    server = server_process(*options)
    (worker,) = _join(server, count=1)
    worker.push_pull({"w": np.ones(N, np.float32)})
    worker.log({"loss": 1.0})
    worker.close()
    version = fetch_stats(server.address)["server"]["version"]
    server.stop()
    newest = sorted(path for path in tmp_path.glob("checkpoint-*") if path.is_dir())[-1]
    manifest = json.loads((newest / MANIFEST_FILE).read_text())
    assert manifest["scalars"] == [[0, "loss", 1, 1, 1]]
    manifest["scalars"] = [[0, "loss", 400, 1, 400]]  # (more points than the checkpoint holds)
    data = json.dumps(manifest).encode()
    (newest / MANIFEST_FILE).write_bytes(data)
    (newest / "manifest.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {MANIFEST_FILE}\n")
    resumed = server_process(*options, "--resume", "--http-port", "0")
    base = http_address(resumed)
    said = resumed.wait_for_log("not taken up")
    assert "runs past the points kept" in said and "start afresh" in said
    assert json.loads(asyncio.run(get(base + "api/scalars"))[1])["curves"] == {}
    assert fetch_stats(resumed.address)["server"]["version"] == version


def test_two_ranks_on_the_same_batches_are_warned_of(server_process):
    server = server_process("--workers", "3", "--sync", "asp", "--http-port", "0")
    base = http_address(server)
    workers = _join(server, count=3)
    rng = np.random.default_rng(0)
    for step in range(12):
        shared = rng.standard_normal((4, 3)).astype(np.float32)
        workers[0].log({"loss": 1.0}, step=step, batch=shared)
        workers[1].log({"loss": 1.0}, step=step, batch=shared.copy())  # the same data: no sampler
        workers[2].log({"loss": 1.0}, step=step, batch=shared + 1)
    for worker in workers:
        worker.close()
    stats = fetch_stats(server.address)
    assert [w["ranks"] for w in stats["warnings"]] == [[0, 1]]
    assert "same batches" in stats["warnings"][0]["message"]
    server.wait_for_log("ranks 0 and 1 trained on the same batches")
    assert samples(asyncio.run(get(base + "metrics"))[1])[("aps_ranks_on_same_data", ())] == 1


def test_a_bad_name_raises_where_it_is_logged_and_nothing_is_sent(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    (worker,) = _join(server, count=1)
    worker.log({"loss": 1.0}, step=1)
    for bad in ({"a loss": 1.0}, {"loss": "low"}, {f"n{i}": 1.0 for i in range(40)}):
        with pytest.raises(ValueError):
            worker.log(bad, step=2)
    with pytest.raises(ValueError, match="step"):
        worker.log({"loss": 1.0}, step=-1)
    worker.close()
    reported = fetch_stats(server.address)["workers"][0]["reported"]
    assert reported["scalars"] == {"loss": {"step": 1, "value": 1.0}}


@pytest.mark.parametrize("payload", [
    b"not json", b'{"points": [[1, {"bad name": 1}]]}', b'{"points": [[-1, {"loss": 1}]]}',
    b'{"points": [[1, {"loss": 1}]], "more": 1}', b'{"process": {"pid": 1}}',
    json.dumps({"points": [[1, {f"n{i}": 1 for i in range(33)}]]}).encode(),
])
def test_a_bad_log_is_refused_whole_and_the_connection_goes_on(server_process, payload):
    server = server_process("--workers", "2", "--sync", "asp", "--lr", "1", "--http-port", "0")
    base = http_address(server)
    good, raw = join_pair(server, "tcp")
    raw.frame(Op.LOG, b'{"points": [[1, {"loss": 2.0}]]}')
    assert raw.reply()[0].op == Op.LOG_REPLY
    raw.frame(Op.LOG, payload)
    assert_error(raw, ErrorCode.MALFORMED_FRAME, server=server)
    raw.frame(Op.PING)
    assert raw.reply()[0].op == Op.PING_REPLY
    curves = json.loads(asyncio.run(get(base + "api/scalars"))[1])["curves"]
    assert curves == {"1": {"loss": [[1, 2.0]]}}, "the refused LOG kept nothing"
    good.push_pull({"w": np.ones(4, np.float32)})
    good.close()
    raw.close()


def test_a_log_before_init_is_refused(server_process):
    from aps.testing import RawClient

    server = server_process("--workers", "1", "--sync", "asp")
    raw = RawClient.to(server, "tcp")
    raw.frame(Op.LOG, b'{"points": []}')
    assert_error(raw, ErrorCode.NOT_INITIALIZED)
    raw.close()


def test_what_a_script_logged_last_reaches_the_server_when_it_exits_without_close(server_process):
    """A training script rarely calls close(): the points it logged in its last second (here
    all of them, a few steps in well under a second) are sent as it exits."""
    server = server_process("--workers", "1", "--sync", "asp")
    script = ("import sys, numpy as np, aps\n"
              "worker = aps.Worker(sys.argv[1], 0, 1)\n"
              "worker.init({'w': np.zeros(4, np.float32)})\n"
              "for step in range(3):\n"
              "    worker.push_pull({'w': np.ones(4, np.float32)})\n"
              "    worker.log({'loss': 1.0 / (step + 1)}, step=step)\n")
    done = subprocess.run([sys.executable, "-c", script, server.address], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    reported = fetch_stats(server.address)["workers"][0]["reported"]
    assert reported["scalars"]["loss"] == {"step": 2, "value": 1.0 / 3}, reported
