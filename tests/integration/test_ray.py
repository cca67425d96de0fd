"""Ray Train with aps (``aps.ray``) on a local Ray cluster: the server as a Ray actor, a
``TorchTrainer``'s workers training on it, checkpoints through Ray's, a run Ray restarts after a
worker failed going on from the server's state, and misuse refused."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys
import tempfile

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
pytest.importorskip("ray.train.torch", reason="ray[train] is not installed (pip install -e '.[ray]')")
torch = pytest.importorskip("torch")

import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402

import aps.ray  # noqa: E402

pytestmark = [pytest.mark.slow,  # (a local Ray cluster: its processes take 10 to 20 s to start)
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "ray_worker.py"


@pytest.fixture(scope="module")
def cluster():
    spec = importlib.util.spec_from_file_location("ray_worker", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_worker"] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # (Ray's workers need not import it)
    # (a short directory of its own: Ray's socket paths under it must stay within 107 characters)
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=folder)
    yield module
    ray.shutdown()
    shutil.rmtree(folder, ignore_errors=True)


def _fit(module, server, workers, tmp_path, epochs, max_failures=0, **options):
    trainer = ray.train.torch.TorchTrainer(
        module.train_loop, train_loop_config={"server": ray.get(server.connection.remote()) if server else None,
                                              "epochs": epochs, **options.pop("config", {})},
        scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path), name="run",
                                       failure_config=ray.train.FailureConfig(max_failures=max_failures)),
        **options)
    return trainer.fit()


def test_torchtrainer_workers_learn_on_a_server_actor(cluster, tmp_path):
    server = aps.ray.ServerActor.remote(workers=2, sync="asp", optimizer="sgd", lr=0.05, momentum=0.9)
    result = _fit(cluster, server, 2, tmp_path, epochs=4)
    assert result.error is None and result.metrics["accuracy"] > 0.85, result.metrics
    stats = ray.get(server.stats.remote())
    assert [w["pushes"] > 0 for w in stats["workers"]] == [True, True]
    reported = set(stats["workers"][1]["reported"]["scalars"])
    assert reported == {"loss", "accuracy", "epoch", "started_at", "joined_at"}, "the numbers aps.ray.report had"
    ray.get(server.stop.remote())


def test_one_bsp_worker_equals_the_same_loop_with_torchs_own_sgd(cluster, tmp_path):
    plain = _fit(cluster, None, 1, tmp_path / "plain", epochs=2, config={"plain": True, "return_weights": True})
    server = aps.ray.ServerActor.remote(workers=1, sync="bsp", optimizer="sgd", lr=0.05, momentum=0.9)
    served = _fit(cluster, server, 1, tmp_path / "aps", epochs=2, config={"return_weights": True})
    assert served.metrics["weights"] == plain.metrics["weights"], "bit for bit"
    assert ray.get(server.stats.remote())["server"]["version"] == 2 * 45


def test_a_resumed_run_goes_on_from_rays_checkpoint_exactly(cluster, tmp_path):
    def fresh():
        return aps.ray.ServerActor.remote(workers=1, sync="bsp", optimizer="sgd", lr=0.05, momentum=0.9)

    whole = _fit(cluster, fresh(), 1, tmp_path / "whole", epochs=3, config={"return_weights": True})
    first = _fit(cluster, fresh(), 1, tmp_path / "first", epochs=2)
    assert first.metrics["epoch"] == 1 and first.checkpoint is not None
    server = fresh()
    resumed = _fit(cluster, server, 1, tmp_path / "second", epochs=3,
                   config={"return_weights": True, "resume": first.checkpoint})
    assert resumed.metrics["epoch"] == 2 and resumed.metrics["started_at"] == 2, "one epoch more, from the checkpoint"
    assert ray.get(server.stats.remote())["server"]["version"] == 45, "one epoch of 45 steps on the new server"
    assert resumed.metrics["weights"] == whole.metrics["weights"], "the same weights as a run that did not stop"


def test_a_trainer_of_more_workers_than_the_server_is_refused(cluster, tmp_path):
    server = aps.ray.ServerActor.remote(workers=1, sync="asp", optimizer="sgd")
    with pytest.raises(Exception, match="1 worker|workers"):
        _fit(cluster, server, 2, tmp_path, epochs=1)


def test_a_run_ray_restarts_after_a_failure_goes_on_from_the_servers_state(cluster, tmp_path):
    server = aps.ray.ServerActor.remote(workers=2, sync="bsp", optimizer="sgd", lr=0.05, momentum=0.9)
    marker = tmp_path / "failed"
    result = _fit(cluster, server, 2, tmp_path, epochs=3, max_failures=1,
                  config={"fail": {"epoch": 0, "rank": 1, "marker": str(marker)}})
    assert marker.exists(), "the failure was injected"
    assert result.error is None, result.error
    metrics = result.metrics
    assert metrics["epoch"] == 2 and metrics["started_at"] == 1, "Ray's restart went on after the checkpoint's epoch"
    # The restarted workers took the server's weights and state (its 23 updates of epoch 0, and what rank 0
    # pushed before the failure stopped it), then trained epochs 1 and 2 together: 23 BSP rounds each.
    assert metrics["joined_at"] >= 23, metrics["joined_at"]
    assert ray.get(server.stats.remote())["server"]["version"] == metrics["joined_at"] + 2 * 23
    assert metrics["accuracy"] > 0.85, metrics
    ray.get(server.stop.remote())
