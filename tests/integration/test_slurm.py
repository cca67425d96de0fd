"""aps on a real Slurm cluster (aps.testing.slurm: slurmctld and three slurmd, one network
namespace each): ``sbatch examples/deploy/slurm/train.sbatch`` trains with two server shards on
the first node and four workers on the others, and its result equals the same run launched by
hand (``aps launch``) but for the rounding of the order a round's gradients are summed in. Skipped, saying why, without root or Slurm."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aps.testing.slurm import SlurmCluster, require_slurm

pytestmark = pytest.mark.slow  # (a Slurm cluster and two training runs: about half a minute)

ROOT = Path(__file__).parents[2]
TEMPLATE = ROOT / "examples" / "deploy" / "slurm" / "train.sbatch"
SERVE = "--sync bsp --lr 0.05 --linger 2"


def test_the_sbatch_template_trains_two_shards_and_four_workers_as_by_hand(tmp_path):
    require_slurm()
    python = sys.executable
    train = f"{ROOT / 'examples' / 'digits_mlp.py'} --epochs 2 --save {tmp_path / 'slurm.npz'}"
    with SlurmCluster(nodes=3, cpus_per_node=2) as cluster:
        env = {"APS": f"{python} -m aps", "TRAIN": train, "APS_SERVE_ARGS": SERVE,
               "PATH": f"{os.path.dirname(python)}:{os.environ['PATH']}"}
        job = cluster.sbatch(str(TEMPLATE), f"--output={tmp_path}/aps-%j.out", env=env, cwd=str(tmp_path))
        state = cluster.wait(job, timeout=240)
        output = Path(cluster.output_path(job)).read_text()
        assert state == "COMPLETED", output[-4000:]
    assert "shard 0 of 2 serving on node1" in output and "shard 1 of 2 serving on node1" in output, output[-4000:]
    ranks = sorted(line.split(":")[0] for line in output.splitlines() if line.startswith("rank "))
    assert ranks == ["rank 0", "rank 1", "rank 2", "rank 3"], output[-4000:]
    by_hand = subprocess.run(
        [python, "-m", "aps", "launch", "--workers", "4", "--shards", "2", *SERVE.split()[:4], "--no-dashboard",
         "--log-dir", str(tmp_path / "logs"), str(ROOT / "examples" / "digits_mlp.py"), "--epochs", "2", "--save",
         str(tmp_path / "hand.npz")], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert by_hand.returncode == 0, by_hand.stdout[-3000:] + by_hand.stderr[-3000:]
    slurm, hand = np.load(tmp_path / "slurm.npz"), np.load(tmp_path / "hand.npz")
    assert sorted(slurm) == sorted(hand) == ["b1", "b2", "w1", "w2"]
    for name in hand:
        # BSP over two shards, the same rounds: equal but for the rounding of the order in which
        # each round's gradients were summed (they arrive in any order)
        np.testing.assert_allclose(slurm[name], hand[name], rtol=1e-4, atol=1e-6, err_msg=name)
        diff = np.abs(slurm[name] - hand[name]).max()
        assert diff <= 1e-4 * np.abs(hand[name]).max(), (name, diff)



def test_the_sbatch_template_runs_a_replicated_shard_and_its_backup_retires_with_the_run(tmp_path):
    """APS_REPLICA_COUNT=2: tasks 0 and 1 are one shard's primary and backup (an etcd on the
    controller decides), tasks 2-5 the workers; when they are done the primary retires the set,
    so the backup stops too instead of taking over, and the job completes."""
    require_slurm()
    from aps.testing.etcd import Etcd, etcd_available

    if not etcd_available():
        pytest.skip("etcd (Debian's etcd-server) is not installed")
    python = sys.executable
    train = f"{ROOT / 'examples' / 'digits_mlp.py'} --epochs 2 --save {tmp_path / 'slurm.npz'}"
    with SlurmCluster(nodes=3, cpus_per_node=2) as cluster:
        with Etcd(tmp_path / "etcd", host=cluster.controller) as etcd:
            env = {"APS": f"{python} -m aps", "TRAIN": train, "APS_SHARDS": "1", "APS_REPLICA_COUNT": "2",
                   "APS_SERVE_ARGS": f"{SERVE} --coordinator {etcd.url}",
                   "PATH": f"{os.path.dirname(python)}:{os.environ['PATH']}"}
            job = cluster.sbatch(str(TEMPLATE), f"--output={tmp_path}/aps-%j.out", env=env, cwd=str(tmp_path))
            state = cluster.wait(job, timeout=240)
            output = Path(cluster.output_path(job)).read_text()
    assert state == "COMPLETED", output[-4000:]
    # (either replica may be the first to reach the coordinator: the other is its backup)
    primary = "7450" if "shard 0 of 1 serving on node1:7450" in output else "7451"
    backup = "7451" if primary == "7450" else "7450"
    assert f"shard 0 of 1 serving on node1:{primary}" in output, output[-4000:]
    assert f"backup of replica set slurm-1-shard-0 on node1:{backup}" in output, output[-4000:]
    assert "retired it (the run is over)" in output, output[-4000:]
    ranks = sorted(line.split(":")[0] for line in output.splitlines() if line.startswith("rank "))
    assert ranks == ["rank 0", "rank 1", "rank 2", "rank 3"], output[-4000:]
    assert sorted(np.load(tmp_path / "slurm.npz")) == ["b1", "b2", "w1", "w2"]
