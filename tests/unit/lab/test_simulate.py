"""The simulator: the real policies at a scale no real run here reaches."""

import json
import subprocess
import sys

import pytest

from aps.errors import ConfigurationError
from aps.cli._args import parse_setting
from aps.lab.simulate import DEFAULT_SETTINGS, simulate, worker_speeds


def run(setting, speeds, iterations=2000, jitter=0.0, seed=0):
    return simulate(parse_setting(setting), speeds, iterations=iterations, jitter=jitter, seed=seed)


def test_deterministic_speeds_give_exact_rates():
    speeds = [1.0, 1.0, 1.0, 3.0]
    bsp = run("bsp", speeds)
    assert bsp["iterations_per_s"] == pytest.approx(4 / 3, rel=1e-3)  # one round per slowest iteration
    assert bsp["max_gap"] == 0 and bsp["max_staleness"] == 0 and bsp["updates"] == 2000 // 4
    asp = run("asp", speeds)
    assert asp["iterations_per_s"] == pytest.approx(3 + 1 / 3, rel=1e-2)  # nobody waits
    assert asp["mean_wait"] == 0 and asp["updates"] == 2000
    ssp = run("ssp:3", speeds)
    assert ssp["max_gap"] == 3
    # Bounded staleness caps the long-run rate at the slowest worker's pace.
    assert ssp["iterations_per_s"] == pytest.approx(4 / 3, rel=0.02)


@pytest.mark.parametrize("setting, bound", [("bsp", 0), ("ssp:0", 0), ("ssp:3", 3), ("dssp:3:15", 15),
                                            ("dssp:2:4", 4), ("softsync:4:2", 2), ("bsp:8", None)])
def test_bounds_and_liveness_at_scale(setting, bound):
    speeds = worker_speeds(None, 256, "lognormal:0.5", seed=1)
    result = run(setting, speeds, iterations=5000, jitter=0.3, seed=2)
    assert result["iterations"] == 5000  # no deadlock
    if bound is not None:
        assert result["max_gap"] <= bound
    if setting.startswith("dssp"):
        assert result["max_gap"] > int(setting.split(":")[1])  # DSSP used room beyond s_L


def test_dssp_with_equal_bounds_is_ssp():
    speeds = [1.0, 1.3, 2.0, 0.7]
    for s in (0, 2, 5):
        a = run(f"dssp:{s}:{s}", speeds, jitter=0.4, seed=5)
        b = run(f"ssp:{s}", speeds, jitter=0.4, seed=5)
        for key in ("iterations_per_s", "mean_wait", "p99_wait", "staleness_hist", "max_gap", "updates"):
            assert a[key] == b[key], key


def test_asp_staleness_grows_with_the_cluster():
    small = run("asp", [1.0] * 4, jitter=0.2)
    large = run("asp", [1.0] * 32, jitter=0.2)
    assert small["mean_staleness"] == pytest.approx(3, abs=0.5)  # about P - 1
    assert large["mean_staleness"] > 20


def test_settings_and_speeds_parse():
    assert parse_setting("dssp:3:15").options == {"sync": "dssp", "staleness": 3, "max_staleness": 15}
    assert parse_setting("softsync:2").options == {"sync": "softsync", "softsync_n": 2}
    assert parse_setting("asp+inverse").options == {"sync": "asp", "lr_staleness": "inverse"}
    assert parse_setting("bsp:1").options == {"sync": "bsp", "backup_workers": 1}
    for bad in ("ssp", "dssp:3", "gossip", "ssp:x", "asp+half", "softsync"):
        with pytest.raises(ConfigurationError):
            parse_setting(bad)
    assert worker_speeds("1,2", None, None, 0) == [1.0, 2.0]
    assert len(worker_speeds(None, 5, "lognormal:0.3", 0)) == 5
    for args in (("1,-1", None, None), (None, None, None), (None, 4, "uniform:2"), ("1,2", 3, None)):
        with pytest.raises(ConfigurationError):
            worker_speeds(*args, 0)


def test_cli_json_has_the_documented_fields(tmp_path):
    out = tmp_path / "sim.json"
    result = subprocess.run(
        [sys.executable, "-m", "aps", "simulate", "--speeds", "1,1,1,3", "--iterations", "400", "--json",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed == json.loads(out.read_text())
    assert [r["sync"] for r in printed] == list(DEFAULT_SETTINGS)
    for r in printed:
        for key in ("sync", "iterations_per_s", "mean_wait", "max_gap", "mean_staleness", "p99_wait"):
            assert key in r
    table = subprocess.run(
        [sys.executable, "-m", "aps", "simulate", "--workers", "8", "--hetero", "lognormal:0.5", "--iterations",
         "300", "--sync", "ssp:2", "--sync", "dssp:2:6"],
        capture_output=True, text=True, timeout=120,
    )
    assert table.returncode == 0 and "dssp:2:6" in table.stdout and "max gap" in table.stdout
