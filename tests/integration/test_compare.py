"""``aps compare``: every paradigm on both emulated clusters, results as JSON, Markdown and a PNG."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

KEYS = {"sync", "label", "lr_staleness", "cluster", "speeds", "repeat", "time_to_target_s", "best_accuracy",
        "final_accuracy", "iterations_per_s", "mean_wait_s", "mean_staleness", "updates", "diverged", "curve",
        "curve_gradients", "staleness_hist"}


@pytest.mark.slow
def test_compare_on_a_tiny_budget_writes_well_formed_results(tmp_path):
    budget = 1.5
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "aps", "compare", "--workers", "2", "--speeds", "1,2", "--paradigms", "bsp,ssp:2+gap",
         "--budget", str(budget), "--step-time", "0.02", "--dataset", "digits", "--target", "0.3",
         "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr
    records = json.loads((out / "results.json").read_text())
    # BSP once, the asynchronous paradigm without and with lr/tau, on each cluster
    assert len(records) == 2 * (1 + 2)
    assert {(r["cluster"], r["sync"], r["lr_staleness"]) for r in records} == {
        (cluster, sync, mode)
        for cluster in ("homogeneous", "heterogeneous")
        for sync, modes in (("bsp", ["none"]), ("ssp:2+gap", ["none", "inverse"]))  # (a real server, gap-aware)
        for mode in modes
    }
    for r in records:
        assert KEYS <= r.keys()
        assert r["speeds"] == ([1.0, 1.0] if r["cluster"] == "homogeneous" else [1.0, 2.0])
        times = [t for t, _ in r["curve"]]
        assert times == sorted(times) and times[0] < 0.5 and budget <= times[-1] < budget + 1.0
        assert all(0.0 <= acc <= 1.0 for _, acc in r["curve"])
        applied = [n for n, _ in r["curve_gradients"]]  # gradients applied at each evaluation
        assert len(applied) == len(times) and applied == sorted(applied) and applied[-1] > 0
        assert [acc for _, acc in r["curve_gradients"]] == [acc for _, acc in r["curve"]]
        assert sum(r["staleness_hist"].values()) >= applied[-1] - 4  # every applied gradient's staleness
        assert set(r["staleness_hist"]) == {"0"} if r["sync"] == "bsp" else len(r["staleness_hist"]) >= 1
        assert r["best_accuracy"] == max(acc for _, acc in r["curve"])
        reached, accuracy_at = r["time_to_target_s"], dict(map(tuple, r["curve"]))
        if reached is None:
            assert r["best_accuracy"] < 0.3
        else:  # the first evaluation at or above the target
            assert accuracy_at[reached] >= 0.3 and all(acc < 0.3 for t, acc in r["curve"] if t < reached)
        assert r["iterations_per_s"] > 0 and r["updates"] > 0
        assert r["mean_staleness"] == 0.0 if r["sync"] == "bsp" else r["mean_staleness"] >= 0.0
        assert r["diverged"] is False
        assert (r["compensated"] > 0) == (r["sync"] == "ssp:2+gap")
    bsp = {r["cluster"]: r for r in records if r["sync"] == "bsp"}
    assert bsp["heterogeneous"]["mean_wait_s"] > 0  # the fast worker waits for the slow one
    png = (out / "accuracy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = (out / "results.md").read_text()
    assert "### heterogeneous cluster (speeds 1,2)" in table and "| SSP s=2 gap lr/tau |" in table
    assert "| BSP |" in done.stdout
    assert f"the plot is {out / 'accuracy.png'}" in done.stdout


def test_compare_refuses_inconsistent_arguments(tmp_path, capsys):
    """Each refused before anything runs, with exit status 2 and what is wrong; through the
    command's own entry point in this process (the first also as a process of its own)."""
    from aps.cli import main

    for args, message in [
        (["--workers", "3", "--speeds", "1,2"], "--speeds needs 3 positive numbers"),
        (["--workers", "2", "--speeds", "1,x"], "--speeds needs 2 positive numbers"),
        (["--paradigms", "bsp,sspp:3"], "sspp"),
        (["--paradigms", "asp+inverse"], "with --lr-staleness, not a +suffix"),
        (["--workers", "2", "--speeds", "1,2", "--paradigms", "bsp:2"], "backup"),
        (["--workers", "2", "--speeds", "1,2", "--paradigms", "dssp:15:3"], "max"),
        (["--clusters", "heterogenous"], "--clusters takes homogeneous and/or heterogeneous"),
        (["--budget", "0"], "--budget must be > 0"),
        (["--jitter", "-0.1"], "--jitter must be >= 0"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--target", "95"], "--target is a test accuracy"),
        (["--paradigms", ","], "--paradigms names no sync setting"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(["compare", "--out", str(tmp_path), *args])
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and message in stderr, stderr
    assert not any(tmp_path.iterdir())  # nothing was written
    done = subprocess.run([sys.executable, "-m", "aps", "compare", "--out", str(tmp_path), "--budget", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--budget must be > 0" in done.stderr, done.stderr


def _run_on_a_terminal(cmd, cwd, timeout=240):
    """Run ``cmd`` with a pseudo-terminal (120 columns) as its stdout and stderr; returns (status, output)."""
    import fcntl
    import os
    import struct
    import termios
    import time

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.wait(30), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_demo_shows_progress_and_writes_only_where_it_says(tmp_path):
    import os
    import re
    import shutil
    import tempfile

    import time

    begun = time.monotonic()
    status, output = _run_on_a_terminal(
        [sys.executable, "-m", "aps", "demo", "--workers", "2", "--speeds", "1,2", "--paradigms", "asp",
         "--budget", "2", "--step-time", "0.02", "--dataset", "digits"], cwd=tmp_path)
    took = time.monotonic() - begun
    assert status == 0, output
    first = output.splitlines()[0]
    estimate = re.match(r"1 runs of 2 s on 2 workers \(digits, .*\): about (\d+) s in all; results in ", first)
    assert estimate, first
    # the estimate counts the workers' start-up: loosely right on a machine others share
    assert int(estimate[1]) / 3 <= took <= 3 * int(estimate[1]), (took, first)
    assert re.search(r"workers ready in \d+ s; the runs take about \d+ s more", output), output
    # the table read in words, and how sure it is
    assert "ASP reached" in output or "no paradigm reached" in output, output
    assert "one run of each: gaps of a few seconds are noise" in " ".join(output.split()), output
    out = first.rsplit("results in ", 1)[1].strip()
    try:
        assert os.listdir(tmp_path) == [] and os.path.dirname(out) == tempfile.gettempdir()
        assert (Path(out) / "results.json").exists() and f"the plot is {out}/accuracy.png" in output
        assert "workers ready in" in output
        assert re.search(r"aps: dashboard on http://127\.0\.0\.1:\d+/ \(each run's server in turn\)", output)
        bars = re.findall(r"1/1 heterogeneous ASP: +\d+%\|[^|]*\| \d/2 s, accuracy (0\.\d{3})  updates \d+", output)
        assert bars, output  # the bar shows the run's paradigm, its accuracy and the server's version
    finally:
        shutil.rmtree(out)


@pytest.mark.slow  # (many processes, a long run: the slow call of .ci/run)
def test_demo_on_a_virtual_clock_runs_the_same_comparison_for_several_seeds(tmp_path):
    out = tmp_path / "virtual"
    done = subprocess.run(
        [sys.executable, "-m", "aps", "demo", "--virtual", "--workers", "2", "--speeds", "1,2", "--paradigms",
         "asp,ssp:2", "--budget", "2", "--step-time", "0.02", "--dataset", "digits", "--target", "0.5",
         "--repeats", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    records = json.loads((out / "results.json").read_text())
    # the demo's heterogeneous cluster, each paradigm for two seeds; 2 s of 20 ms steps: 100 virtual seconds
    assert [(r["cluster"], r["label"], r["seed"]) for r in records] == [
        ("heterogeneous", name, seed) for seed in (0, 1) for name in ("ASP", "SSP s=2")]
    assert all(r["speeds"] == [1.0, 2.0] and r["simulated_s"] == 100.0 and r["jitter"] == 0.1 for r in records)
    assert records[0]["curve"] != records[2]["curve"]  # another seed, another run
    assert "### heterogeneous (speeds 1,2, jitter 0.1), 2 runs each" in (out / "results.md").read_text()
    refused = subprocess.run([sys.executable, "-m", "aps", "demo", "--virtual", "--compression", "bf16"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--virtual does not model wire compression" in refused.stderr


@pytest.mark.slow
def test_compare_runs_local_sgd_settings_with_real_local_sgd_workers(tmp_path):
    """asp+local:4+dn: the server runs delayed Nesterov and each worker process LocalSGD, pushing
    once every 4 of its iterations (the pushes a quarter of the iterations, about); with +int8
    each push is about a quarter of the bytes, as the server counted them."""
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "aps", "compare", "--workers", "2", "--speeds", "1,2", "--paradigms",
         "asp+local:4+dn,asp+local:4+dn+int8",
         "--clusters", "heterogeneous", "--lr-staleness", "none", "--budget", "2", "--step-time", "0.02",
         "--dataset", "digits", "--target", "0.3", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr
    record, quantized = json.loads((out / "results.json").read_text())
    assert record["label"] == "ASP local H=4 delayed Nesterov" and record["diverged"] is False
    pushes = record["pushes"]
    assert pushes > 0 and 3 * pushes <= record["iterations"] <= 4 * pushes + 8
    assert record["iterations_per_s"] == record["iterations"] / 2  # (the inner steps: a push is a sync)
    assert quantized["label"] == "ASP local H=4 delayed Nesterov int8" and quantized["compression"] == "int8"
    per_push = [r["bytes_pushed"] / r["pushes"] for r in (record, quantized)]
    assert 3.0 < per_push[0] / per_push[1] < 4.2, per_push
    assert "MB pushed" in (out / "results.md").read_text()
