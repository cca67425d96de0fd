"""The ``aps`` command as users run it."""

import json
import signal
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

import aps
from aps.testing import ServerProcess


def run_aps(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "aps", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_first_line_is_the_address(server_process):
    server = server_process("--workers", "1")
    assert server.first_line.startswith("aps: serving on tcp://127.0.0.1:")
    assert 0 < server.port < 65536


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signals_close_connections_and_exit_zero(signum):
    server = ServerProcess("--workers", "1", "--sync", "asp")
    try:
        worker = aps.Worker(server.address, 0, 1, reconnect=False)
        worker.init({"w": np.zeros(3, np.float32)})
        server.signal(signum)
        assert server.proc.wait(10) == 0
        with pytest.raises(aps.APSConnectionError):
            worker.pull()
        assert "server stopped" in server.log()
    finally:
        server.stop()


def test_environment_twins_configure_the_server(server_process):
    import os

    env = dict(os.environ, APS_WORKERS="3", APS_SYNC="ssp", APS_STALENESS="2", APS_LOG_LEVEL="debug")
    server = server_process(env=env)
    log = server.wait_for_log("listening on")
    assert "3 workers, sync ssp" in log
    with aps.Worker(server.address, 0, 2) as worker:
        with pytest.raises(aps.ServerError, match="--workers 3"):
            worker.init({"w": np.zeros(2, np.float32)})
    server.wait_for_log("DEBUG")


def test_bad_configuration_exits_2_with_a_message():
    result = run_aps("serve", "--port", "0", "--workers", "2", "--backup-workers", "2")
    assert result.returncode == 2 and "backup workers" in result.stderr
    import os

    result = run_aps("serve", "--port", "0", env=dict(os.environ, APS_SYNC="gossip"))
    assert result.returncode == 2 and "APS_SYNC" in result.stderr
    result = run_aps("serve", "--sync", "gossip")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_port_in_use_is_a_clear_error(server_process):
    server = server_process("--workers", "1")
    result = run_aps("serve", "--port", str(server.port))
    assert result.returncode == 2 and "cannot listen" in result.stderr
    # what to do about it: a new user's first server is often still running in another terminal
    assert "another aps server may be running there" in result.stderr, result.stderr
    assert "--port 0 to pick a free port" in result.stderr, result.stderr


def test_dashboard_port_in_use_is_a_clear_error(server_process):
    server = server_process("--workers", "1", "--http-port", "0")
    http_port = server.proc.stdout.readline().strip().rstrip("/").rsplit(":", 1)[1]  # aps: dashboard on URL
    for probe, text in (("healthz", "ok\n"), ("readyz", "ready\n")):  # (what an orchestrator's probes ask)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/{probe}", timeout=10) as answer:
            assert answer.status == 200 and answer.read().decode() == text
    result = run_aps("serve", "--port", "0", "--http-port", http_port)  # (no fixed worker port: it may be taken)
    assert result.returncode == 2 and "(--http-port)" in result.stderr, result.stderr
    assert "another aps server may be running there" in result.stderr
    assert "--http-port 0 to pick a free port" in result.stderr


def test_status_without_a_token_names_its_flags(server_process, tmp_path, monkeypatch):
    from tests.helpers import TOKEN

    monkeypatch.delenv("APS_TOKEN", raising=False)
    server = server_process("--workers", "1", "--token", TOKEN)
    for command in (["status", server.address], ["checkpoint", "now", server.address, "--timeout", "5"]):
        refused = run_aps(*command)
        assert refused.returncode == 1 and "needs a token" in refused.stderr, refused.stderr
        assert "--token TOKEN or --token-file PATH (or set APS_TOKEN)" in refused.stderr, refused.stderr
        assert "token=" not in refused.stderr  # the Python API's way, not this command's
    wrong = run_aps("status", server.address, "--token", "x" * len(TOKEN))
    assert wrong.returncode == 1 and "--token or --token-file, or APS_TOKEN" in wrong.stderr, wrong.stderr
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    done = run_aps("status", server.address, "--token-file", str(token_file))
    assert done.returncode == 0 and f"aps {server.address}" in done.stdout, done.stderr
    both = run_aps("status", server.address, "--token", TOKEN, "--token-file", str(token_file))
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_log_level_warning_is_quiet(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--log-level", "warning")
    with aps.Worker(server.address, 0, 1) as worker:
        worker.init({"w": np.zeros(2, np.float32)})
    assert "INFO" not in server.log()


def test_help_lists_every_flag_with_its_variable():
    result = run_aps("serve", "--help")
    assert result.returncode == 0
    for flag in ("--workers", "--sync", "--staleness", "--backup-workers", "--optimizer", "--lr", "--momentum",
                 "--nesterov", "--weight-decay", "--betas", "--eps", "--max-frame-bytes", "--log-level"):
        assert flag in result.stdout
    assert "APS_MAX_FRAME_BYTES" in result.stdout


def test_bench_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = run_aps("bench", "--sizes", "4K", "--workers", "1", "--seconds", "0.1", "--min-iters", "2", "--repeats", "1", "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    systems = {(row["system"], row["transport"]) for row in report["rows"]}
    assert systems == {("socket ping-pong", "tcp"), ("memcpy+update", "shm"), ("update pass", "shm"), ("update pass shm", "shm"),
                       ("pipe ping-pong", "shm"), ("aps", "tcp"), ("aps", "shm"), ("aps zero-copy", "shm"),
                       ("aps spin", "shm")}
    for row in report["rows"]:
        assert row["round_trips"] >= 2 and row["rtt_us"] > 0
        if row["system"].startswith("aps"):
            assert row["gbps"] > 0 and row["ratio_throughput"] > 0 and row["ratio_rtt"] > 0
    shm = next(r for r in report["rows"] if r["system"] == "aps" and r["transport"] == "shm")
    assert shm["ratio_to_tcp"] > 0
    zero_copy = next(r for r in report["rows"] if r["system"] == "aps zero-copy")
    assert zero_copy["ratio_to_tcp"] > 0 and zero_copy["ratio_update_pass"] > 0 and shm["ratio_update_pass_shm"] > 0
    assert "x bound" in result.stdout


def test_status_prints_a_table_and_json(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    with aps.Worker(server.address, 0, 1) as worker:
        worker.init({"w": np.zeros(8, np.float32)})
        for _ in range(3):
            worker.push_pull(worker.grads)
        table = run_aps("status", server.address)
        assert table.returncode == 0, table.stderr
        assert f"aps {server.address}  sync asp" in table.stdout
        assert "version 3" in table.stdout and "live 1/1" in table.stdout
        assert "* the worker's own" not in table.stdout  # the server's values: no mark, no footnote
        worker.set_hyperparameters([{"stop": 4, "lr": 0.1}, {"lr": 0.001}])  # as a torch LR scheduler does
        table = run_aps("status", server.address)
        assert " 0.001..0.1*  " in table.stdout and "* the worker's own optimizer values" in table.stdout
        result = run_aps("status", server.address, "--json")
        stats = json.loads(result.stdout)
        assert stats["server"]["version"] == 3 and stats["server"]["bytes_in"] > 3 * 32
        assert stats["workers"][0]["pushes"] == 3 and stats["workers"][0]["clock"] == 3
        assert stats["workers"][0]["hyperparameters_own"] is True
        assert [(g["stop"], g["lr"]) for g in stats["workers"][0]["hyperparameters"]] == [(4, 0.1), (8, 0.001)]


def test_status_of_nothing_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        result = run_aps("status", f"tcp://127.0.0.1:{port}", "--timeout", "2")
    assert result.returncode == 1 and "cannot connect" in result.stderr


def test_server_stats_in_python():
    with aps.Server(workers=1, sync="dssp", port=0, log_level="warning").run_in_background() as background:
        with aps.Worker(background.address, 0, 1) as worker:
            worker.init({"w": np.zeros(4, np.float32)})
            worker.push_pull(worker.grads)
            stats = background.server.stats()
        assert stats["server"]["sync"] == "dssp s_L=3 s_U=15"
        assert stats["server"]["address"] == background.address
        assert stats["workers"][0]["pushes"] == 1


def test_status_counts_both_transports_and_the_server_process(server_process):
    import psutil

    server = server_process("--workers", "2", "--sync", "asp")
    shm, tcp = aps.Worker(server.address, 0, 2, transport="shm"), aps.Worker(server.address, 1, 2, transport="tcp")
    joining = threading.Thread(target=shm.init, args=({"w": np.zeros(1000, np.float32)},))
    joining.start()
    tcp.init({"w": np.zeros(1000, np.float32)})
    joining.join(10)
    for _ in range(3):
        shm.push_pull(shm.grads)
        tcp.push_pull(tcp.grads)
    stats = json.loads(run_aps("status", server.address, "--json").stdout)["server"]
    moved = stats["transports"]
    # shared memory: the initial values and 3 gradients read in place in, 4 weight copies (init and 3 pulls)
    # out of the slots; the control frames are small
    assert 4 * 4000 <= moved["shm"]["bytes_in"] < 4 * 4000 + 4096
    assert 4 * 4000 <= moved["shm"]["bytes_out"] < 4 * 4000 + 4096
    assert 3 * 4000 <= moved["tcp"]["bytes_in"] and 4 * 4000 <= moved["tcp"]["bytes_out"]
    assert stats["bytes_in"] == moved["shm"]["bytes_in"] + moved["tcp"]["bytes_in"]
    assert stats["process"]["pid"] == server.proc.pid
    rss = psutil.Process(server.proc.pid).memory_info().rss
    assert 0.5 * rss < stats["process"]["rss_bytes"] < 2 * rss
    table = run_aps("status", server.address).stdout
    assert "(tcp " in table and "shm " in table and "server memory " in table
    shm.close()
    tcp.close()


def test_bench_measures_what_applying_gradients_while_they_arrive_is_worth(tmp_path):
    out = tmp_path / "bench.json"
    result = run_aps("bench", "--sizes", "1M", "--workers", "1", "--transports", "tcp", "--streaming", "both",
                     "--seconds", "0.1", "--min-iters", "2", "--repeats", "1", "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    rows = {row["system"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"socket ping-pong", "aps", "aps no-stream"}
    assert rows["aps no-stream"]["ratio_to_tcp"] > 0 and rows["aps"]["ratio_to_tcp"] is None
    assert "aps no-stream" in result.stdout


@pytest.mark.parametrize("flags, said", [
    (["--lr", "-1"], "--lr must be >= 0 (as torch.optim requires), got -1.0"),
    (["--optimizer", "adam", "--betas", "0.9,1"], "beta2 must be in [0, 1)"),
    (["--optimizer", "adam", "--momentum", "0.9"], "--momentum and --nesterov apply to --optimizer sgd, not adam"),
    (["--nesterov"], "--nesterov needs a --momentum > 0"),
    (["--lr", "1e39"], "--lr is 1e+39, beyond float32"),
    (["--optimizer", "adam", "--lr", "1e36", "--betas", "0.99999,0.999"], "adam's first step size"),
])
def test_optimizer_values_torch_or_the_kernels_refuse_stop_the_server_before_it_listens(flags, said):
    result = run_aps("serve", "--port", "0", *flags)
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert "serving on" not in result.stdout


def test_status_without_an_address_asks_aps_address_then_the_local_default(server_process, monkeypatch):
    import os

    from aps.cli import build_parser
    from aps.cli._args import server_address

    server = server_process("--workers", "1")
    found = run_aps("status", env=dict(os.environ, APS_ADDRESS=server.address))
    assert found.returncode == 0 and f"aps {server.address}" in found.stdout, found.stderr
    # without $APS_ADDRESS: the address aps serve listens on by default (not asked here: it may be anyone's)
    assert build_parser().parse_args(["status"]).address is None  # no argparse error
    monkeypatch.delenv("APS_ADDRESS", raising=False)
    assert server_address(None) == "tcp://127.0.0.1:7450" and server_address("tcp://h:1") == "tcp://h:1"
    assert "$APS_ADDRESS, else tcp://127.0.0.1:7450" in " ".join(run_aps("status", "--help").stdout.split())


def test_an_unknown_host_is_said_so_with_its_name():
    result = run_aps("status", "tcp://no-such-host.invalid:7450", "--timeout", "5")
    assert result.returncode == 1 and "Unknown error" not in result.stderr, result.stderr
    # (a resolver that answers says the name is unknown; none reachable: the lookup failed)
    assert ("host not found: no-such-host.invalid" in result.stderr
            or "cannot look up host no-such-host.invalid" in result.stderr), result.stderr
    served = run_aps("serve", "--host", "no-such-host.invalid", "--port", "0", "--insecure")
    assert served.returncode == 2 and "no-such-host.invalid" in served.stderr and "Unknown error" not in served.stderr
