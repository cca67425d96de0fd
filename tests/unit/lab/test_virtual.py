"""Training on a virtual clock: real gradients, each on the weights its worker pulled, in virtual-time order."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from aps.lab.clock import IterationTimes, Stragglers, VirtualCluster
from aps.cli._args import parse_setting
from aps.config import ServerConfig
from aps.layout import Layout

torch = pytest.importorskip("torch")

from aps.workloads import load  # noqa: E402
from aps.lab.virtual import VirtualTrainer, train_virtual  # noqa: E402


def cluster_of(speeds, compute, values, **options):
    config = ServerConfig(workers=len(speeds), heartbeat_timeout=0, **options)
    return VirtualCluster(config, IterationTimes(speeds), Layout(("w",), ((len(values),),)),
                          np.asarray(values, np.float32), compute)


def test_each_gradient_is_computed_on_the_weights_its_pull_returned():
    """ASP, speeds 1 and 2.5, gradient = the weights it was computed on, lr 0.5: the sequence by hand."""
    seen = []

    def compute(rank, weights, grad, steps):
        assert steps == 1
        seen.append((rank, float(weights[0])))
        grad[:] = weights

    cluster = cluster_of([1.0, 2.5], compute, [1.0], sync="asp", lr=0.5)
    for _ in range(4):
        cluster.step()
    # t=1: rank 0 (on w=1) -> 0.5; t=2: rank 0 (on 0.5) -> 0.25; t=2.5: rank 1, on the w=1 it pulled at t=0,
    # two versions stale -> -0.25; t=3: rank 0 (on 0.25, pulled at t=2) -> -0.375.
    assert cluster.staleness == [0, 0, 2, 1]
    assert float(cluster.engine.weights[0]) == -0.375
    assert seen == [(0, 1.0), (1, 1.0), (0, 0.5), (0, 0.25), (1, -0.25), (0, -0.375)]
    assert cluster.now == 3.0


def test_bsp_on_a_virtual_clock_equals_large_batch_sgd_exactly():
    """Three workers under BSP: each round applies the mean of their batch gradients, i.e. SGD on the
    three batches as one (the mean loss of equal batches), equal bit for bit to torch.optim.SGD."""
    dataset = load("digits", seed=0)
    workers, rounds, lr, momentum = 3, 4, 0.1, 0.9
    trainer = VirtualTrainer(dataset, workers, batch_size=16, init_seed=0, seed=5)
    config = ServerConfig(workers=workers, sync="bsp", lr=lr, momentum=momentum, heartbeat_timeout=0)
    cluster = VirtualCluster(config, IterationTimes([1.0, 1.1, 1.2]), trainer.layout, trainer.initial,
                             trainer.compute)
    while cluster.pushes < workers * rounds:
        cluster.step()

    reference = VirtualTrainer(dataset, workers, batch_size=16, init_seed=0, seed=5)  # the same batches
    model = reference.model
    sgd = torch.optim.SGD(reference.params, lr=lr, momentum=momentum)
    grads = np.zeros((workers, reference.layout.numel), np.float32)
    for _ in range(rounds):
        weights = np.concatenate([p.detach().numpy().ravel() for p in reference.params])
        for rank in range(workers):
            reference.compute(rank, weights, grads[rank])
        total = grads[0].copy()
        for rank in range(1, workers):  # summed in arrival order (ranks 0, 1, 2: the speeds differ)
            total = total + grads[rank]
        mean = torch.from_numpy(total * np.float32(1.0 / workers))
        offset = 0
        for p in reference.params:
            p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        sgd.step()
    ours = cluster.engine.weights
    theirs = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    assert cluster.engine.version == rounds
    assert np.array_equal(ours, theirs)


def test_the_same_seed_gives_identical_curves_and_another_does_not():
    def run(seed):
        record = train_virtual(parse_setting("ssp:2"), [1.0, 1.0, 1.5, 2.0], dataset="digits", iterations=150,
                               jitter=0.3, stragglers=Stragglers(0.05, 5.0, 3.0), lr=0.05, target=0.8, seed=seed)
        return {k: v for k, v in record.items() if k not in ("wall_s", "gradient_s", "eval_s")}

    first, again, other = run(3), run(3), run(4)
    assert first == again
    assert first["curve"] != other["curve"]
    assert first["pushes"] == 150 and first["best_accuracy"] > 0.5
    assert sum(first["staleness_hist"].values()) == first["gradients_applied"]


def test_stragglers_turn_slow_and_recover():
    times = IterationTimes([1.0] * 4, stragglers=Stragglers(rate=0.1, duration=10.0, slowdown=4.0), seed=1)
    now, slow, steps = [0.0] * 4, [0] * 4, 5000
    for _ in range(steps):
        for rank in range(4):
            took = times.draw(rank, now[rank])
            assert took in (1.0, 4.0)
            slow[rank] += took == 4.0
            now[rank] += took
    # Slow half the time (10 s spells, one every 10 s on average): well over a tenth, well under nine.
    assert all(steps * 0.2 < s < steps * 0.9 for s in slow)
    assert IterationTimes([1.0], stragglers=None).draw(0, 5.0) == 1.0
    with pytest.raises(ValueError):
        Stragglers(0.0, 1.0, 2.0)


def test_a_diverging_run_is_reported_not_raised():
    record = train_virtual(parse_setting("asp"), [1.0, 1.0], dataset="digits", iterations=200, lr=1e38, seed=0)
    assert record["diverged"] and record["pushes"] < 200


@pytest.mark.slow
def test_the_cli_writes_results_and_figures(tmp_path, capsys):
    from aps.cli import main

    out = tmp_path / "run"
    assert main(["simulate", "--train", "digits", "--speeds", "1,1,2", "--sync", "bsp", "--sync", "ssp:2",
                 "--lr-staleness", "both", "--iterations", "100", "--seeds", "2", "--target", "0.5",
                 "--stragglers", "0.1:3:2", "--out", str(out)]) == 0
    records = json.loads((out / "results.json").read_text())
    assert sorted({r["label"] for r in records}) == ["BSP", "SSP s=2", "SSP s=2 lr/tau"]
    assert len(records) == 6 and {r["seed"] for r in records} == {0, 1}
    assert all(r["curve"][0][0] == 0.0 and len(r["curve"]) == len(r["curve_gradients"]) for r in records)
    assert "virtual time to 0.5" in (out / "results.md").read_text()
    assert (out / "accuracy.png").stat().st_size > 0 and (out / "accuracy-gradients.png").stat().st_size > 0
    parallel = tmp_path / "parallel"  # two processes at a time: the same records, in the same order
    done = subprocess.run(
        [sys.executable, "-m", "aps", "simulate", "--train", "digits", "--speeds", "1,1,2", "--sync", "ssp:2",
         "--iterations", "100", "--seeds", "2", "--target", "0.5", "--stragglers", "0.1:3:2", "--jobs", "2",
         "--out", str(parallel)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    again = json.loads((parallel / "results.json").read_text())
    assert [r["curve"] for r in again] == [r["curve"] for r in records if r["label"] == "SSP s=2"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        main(["simulate", "--train", "digits", "--stragglers", "1:2"])
    assert bad.value.code != 0 and "RATE:DURATION:SLOWDOWN" in capsys.readouterr().err


def test_an_experiment_runs_every_cluster_of_its_preset(tmp_path, monkeypatch, capsys):
    """``--experiment``: the preset's clusters, settings and seeds in one command, one table and
    one panel per cluster; the options that define its clusters are refused with it."""
    from aps.cli import main
    from aps.lab import simulate

    tiny = simulate.Experiment(
        title="two tiny clusters",
        clusters=(simulate.ClusterSpec("two even", (1.0, 1.0), iterations=40),
                  simulate.ClusterSpec("three, one slow", (1.0, 1.0, 3.0), jitter=0.1,
                                       stragglers=Stragglers(0.1, 3.0, 2.0), budget=20.0)),
        sync=("bsp", "asp"), lr_staleness="both", target=0.3, seeds=2)
    monkeypatch.setitem(simulate.EXPERIMENTS, "zhang", tiny)
    out = tmp_path / "zhang"
    assert main(["simulate", "--experiment", "zhang", "--train", "digits", "--out", str(out)]) == 0
    records = json.loads((out / "results.json").read_text())
    # per seed and cluster: BSP once, ASP with a fixed learning rate and with lr/tau
    assert [(r["cluster"], r["label"], r["seed"]) for r in records] == [
        (cluster, name, seed) for seed in (0, 1) for cluster in ("two even", "three, one slow")
        for name in ("BSP", "ASP", "ASP lr/tau")]
    even = [r for r in records if r["cluster"] == "two even"]
    assert all(r["pushes"] == 40 and r["workers"] == 2 for r in even)
    slow = [r for r in records if r["cluster"] == "three, one slow"]
    assert all(r["simulated_s"] == 20.0 and r["stragglers"] == {"rate": 0.1, "duration": 3.0, "slowdown": 2.0}
               for r in slow)
    table = (out / "results.md").read_text()
    assert "two tiny clusters" in table
    assert "### two even (speeds 1,1), 2 runs each" in table
    assert "### three, one slow (speeds 1,1,3, jitter 0.1, on/off stragglers 0.1/s for 3 s, 2x slower)" in table
    for figure in ("accuracy.png", "accuracy-gradients.png", "staleness.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main(["simulate", "--experiment", "zhao", "--speeds", "1,2", "--budget", "5"])
    assert refused.value.code == 2
    assert "--experiment zhao sets the clusters" in capsys.readouterr().err


def test_compensated_settings_train_with_the_servers_kernels_and_say_so_in_their_labels(tmp_path, monkeypatch):
    """``asp+gap``, ``asp+dc-adaptive:2``: the virtual server compensates with the real kernels
    (the runs differ from ASP's on the same seed); ``asp+inverse`` is ASP with lr/tau."""
    from aps.cli import main
    from aps.lab import simulate

    tiny = simulate.Experiment(
        title="compensated", clusters=(simulate.ClusterSpec("four, one slow", (1.0, 1.0, 1.0, 3.0), iterations=60),),
        sync=("asp", "asp+inverse", "asp+gap", "asp+dc-adaptive:2", "asp+cutoff:2"), lr_staleness="none",
        target=0.3, seeds=1)
    monkeypatch.setitem(simulate.EXPERIMENTS, "compensation", tiny)
    out = tmp_path / "c"
    assert main(["simulate", "--experiment", "compensation", "--train", "digits", "--out", str(out)]) == 0
    records = {r["label"]: r for r in json.loads((out / "results.json").read_text())}
    assert list(records) == ["ASP", "ASP lr/tau", "ASP gap", "ASP DC-a 2", "ASP cut-off 2"]
    assert records["ASP lr/tau"]["lr_staleness"] == "inverse"
    curves = {label: [row[1] for row in r["curve_gradients"]] for label, r in records.items()}
    for label in ("ASP lr/tau", "ASP gap", "ASP DC-a 2"):
        assert curves[label] != curves["ASP"], label
    assert records["ASP cut-off 2"]["updates"] < records["ASP"]["updates"]  # (the slow worker's gradients cut)


def test_the_tables_give_the_median_time_its_range_and_how_many_runs_got_there():
    from aps.lab.compare import markdown

    def record(label, seed, reached, best):
        return {"cluster": "c", "cluster_description": "speeds 1,2", "label": label, "sync": "asp", "repeat": seed,
                "speeds": [1.0, 2.0], "time_to_target_s": reached, "best_accuracy": best, "iterations_per_s": 2.0,
                "mean_wait_s": 0.0, "mean_staleness": 1.0, "lr_staleness": "none"}

    records = [record("ASP", 0, 30.0, 0.9), record("ASP", 1, 10.0, 0.92), record("ASP", 2, None, 0.8),
               record("SSP s=3", 0, 5.0, 0.91), record("SSP s=3", 1, None, 0.7), record("SSP s=3", 2, None, 0.7)]
    table = markdown(records, 0.85, virtual=True)
    assert "### c (speeds 1,2), 3 runs each: median time" in table
    # the median counts a run that never got there as slowest; the range is over those that did
    assert "| ASP | 30.0 s (10.0-30.0) | 2/3 | 0.873 ± 0.064 |" in table
    assert "| SSP s=3 | never | 1/3 | 0.770 ± 0.121 |" in table
    assert table.index("| ASP |") < table.index("| SSP s=3 |")


def test_the_presets_are_valid_and_the_simulate_flags_that_would_be_ignored_are_refused(capsys):
    from aps.cli import main
    from aps.lab import simulate

    for name, experiment in simulate.EXPERIMENTS.items():
        assert experiment.seeds >= 3 and experiment.clusters, name
        for cluster in experiment.clusters:
            assert (cluster.budget is None) != (cluster.iterations is None), (name, cluster.name)
            for text in experiment.sync:
                for mode in ("none", "inverse"):  # every server the preset would start
                    ServerConfig(workers=len(cluster.speeds),
                                 **{"lr": experiment.lr, "lr_staleness": mode, **parse_setting(text).options})
    for argv, message in [
        (["--lr", "0.1"], "--lr applies to training: add --train"),
        (["--seeds", "3", "--budget", "5"], "--budget, --seeds apply to training"),
        (["--train", "digits", "--json"], "--json prints the synchronization-only table"),
        (["--train", "digits", "--budget", "5", "--iterations", "10"], "give --budget or --iterations, not both"),
        (["--experiment", "zhang", "--jitter", "0.2"], "--experiment zhang sets the clusters"),
        (["--sync", "asp", "--sync", "bsp+local:10"], "local SGD trains a model between its syncs: add --train"),
    ]:
        with pytest.raises(SystemExit) as refused:
            main(["simulate", *argv])
        assert refused.value.code == 2
        assert message in capsys.readouterr().err, argv
