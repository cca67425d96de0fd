"""bench/pipeline.py at a tiny scale: a real server and worker, and the bare handler it sets aps
against (--floor), each answering every push it was sent and measured by its own CPU time."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]


def test_the_pipeline_bench_measures_aps_and_the_bare_handler_in_one_run(tmp_path):
    out = tmp_path / "pipeline.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pipeline.py"), "--depths", "1,4", "--workers", "1",
         "--repeats", "1", "--seconds", "0.3", "--floor", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,  # (never the checkout: its `aps` for -m's)
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted((row["system"], row["depth"]) for row in rows) == [("aps", 1), ("aps", 4), ("floor", 1), ("floor", 4)]
    for row in rows:
        assert row["pushes_per_s"] > 100 and row["payload_bytes"] == 4096, row
        assert 0 < row["server_cpu_us_per_push"] < 100_000, row  # (the server's own CPU time, per push)
