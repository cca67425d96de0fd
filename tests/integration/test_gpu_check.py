"""bench/gpu_check.py, the GPU path's check, as .ci/run runs it on a machine without a GPU:
on the CPU with staging on, so the copies through the worker's host buffers are made."""

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.slow  # (a server and two workers per transport, 200 steps of a CNN: ~15 s)
def test_the_gpu_check_runs_on_the_cpu_and_its_workers_equal_torch(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--steps", "40", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,  # (never the checkout: its `aps` for -m's)
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["device"] == "cpu" and report["steps"] == 40
    assert [r["transport"] for r in report["runs"]] == ["tcp", "shm"]
    for r in report["runs"]:
        assert r["transports_used"] == [r["transport"]]
        assert r["largest_difference"] <= 1e-4  # (not 0: two gradients' mean is summed unlike one batch's)
        assert r["aps_step_ms"] > 0 and r["torch_step_ms"] > 0
        staging = r["staging"]
        assert staging["pinned"] is False  # (nothing is pinned on the CPU)
        assert staging["bytes"] == 4 * sum(p.size for p in _digits_model_params())  # (float32 gradients)
        assert staging["d2h_ms"] >= 0 and staging["pageable_d2h_ms"] >= 0


def _digits_model_params():
    from aps import workloads

    return [p.detach().numpy() for p in workloads.make_model(8, seed=0).parameters()]
