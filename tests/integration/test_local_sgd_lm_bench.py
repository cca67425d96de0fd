"""bench/local_sgd_lm.py, the local SGD language-model benchmark, at a tiny scale: real servers
count the bytes, every method gets the same token budget, the uneven workers' clock holds."""

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.slow  # (a warm-up and five runs, each a server and four workers: ~25 s)
def test_the_benchmark_counts_bytes_on_the_server_and_keeps_the_budget(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "local_sgd_lm.py"), "--steps", "20", "--width", "32", "--layers", "1",
         "--heads", "2", "--context", "32", "--batch", "4", "--held-out", "16", "--evaluations", "4", "--seeds", "0",
         "--methods", "bsp,diloco-10,diloco-10-int8,diloco-10-int4,async-10,async-10-lr0.35", "--warm-steps", "4", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,  # (never the checkout: its `aps` for -m's)
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert (out / "loss.png").stat().st_size > 0 and "| diloco-10-int4 |" in (out / "results.md").read_text()
    runs = {r["method"]: r for r in report["records"]}
    start = report["warm_start"]["final_loss"]
    assert all(r["curve"][0]["loss"] == pytest.approx(start) for r in runs.values())  # (one warm start for all)
    parameters = report["parameters"]
    # Bytes as the servers counted them: BSP pushes every step, DiLoCo every 10th, int8 and
    # int4 a quarter and an eighth of that (plus their scales and the frames' headers).
    assert runs["bsp"]["bytes_pushed"] == pytest.approx(4 * 20 * 4 * parameters, rel=0.01)
    assert runs["diloco-10"]["bytes_pushed"] == pytest.approx(4 * 2 * 4 * parameters, rel=0.01)
    assert runs["diloco-10-int8"]["bytes_pushed"] == pytest.approx(runs["diloco-10"]["bytes_pushed"] / 3.94, rel=0.02)
    assert runs["diloco-10-int4"]["bytes_pushed"] == pytest.approx(runs["diloco-10"]["bytes_pushed"] / 7.76, rel=0.03)
    # Virtual time: BSP's 20 steps at the slow worker's 2.5 s; the asynchronous run's budget of
    # 80 steps ends sooner (the fast workers take more of them), at a sync.
    assert runs["bsp"]["curve"][-1]["time"] == 50.0 and runs["diloco-10"]["curve"][-1]["time"] == 50.0
    assert 10 < runs["async-10"]["curve"][-1]["time"] < 50
    options = runs["async-10-lr0.35"]["server_options"]  # (-lrX: the outer step's learning rate)
    assert options[options.index("--lr") + 1] == "0.35" and "delayed-nesterov" in options
    assert "0.7" in runs["async-10"]["server_options"]
    summary = report["summary"]
    assert summary["diloco-10"]["fewer_bytes_than_bsp"] == pytest.approx(10, rel=0.01)
    # each run against the same seed's BSP run
    assert summary["diloco-10"]["loss_vs_bsp_per_seed"] == [runs["diloco-10"]["final_loss"] / runs["bsp"]["final_loss"]
                                                            - 1]
    again = subprocess.run(  # (summarized again, timed to a loss every run reaches: its start)
        [sys.executable, str(ROOT / "bench" / "local_sgd_lm.py"), "--replot", "--levels", str(start + 1),
         "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    times = json.loads((out / "results.json").read_text())["summary"]["bsp"]["time_to_level"]
    assert times == {str(start + 1): [0.0]} and f"virtual s to {start + 1}" in (out / "results.md").read_text()
