"""aps slurm: where a task stands in its step, from Slurm's environment (no Slurm needed)."""

import pytest

from aps.cli.slurm import SlurmStep, tasks_per_node
from aps.errors import ConfigurationError


def test_a_task_reads_its_place_from_slurms_environment():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}
    step = SlurmStep(env, ["n1", "n2", "n3"])
    assert step.nodes == ["n1", "n1", "n2", "n2", "n3", "n3"] and step.local == 1
    assert step.addresses(2, 7450) == ["tcp://n1:7450", "tcp://n1:7451"]
    with pytest.raises(ConfigurationError, match="do not agree"):
        SlurmStep(env, ["n1", "n2"])
    with pytest.raises(ConfigurationError, match="SLURM_PROCID"):
        SlurmStep({}, ["n1"])


def test_with_replicas_each_shard_is_a_set_of_consecutive_tasks_and_workers_start_at_the_first():
    step = SlurmStep({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "2(x4)"},
                     ["n1", "n2", "n3", "n4"])
    # shard 0: tasks 0 and 1 (n1), shard 1: tasks 2 and 3 (n2); workers from task 4
    assert step.replica_set(0, 7450, 2) == ["n1:7450", "n1:7451"]
    assert step.replica_set(1, 7450, 2) == ["n2:7452", "n2:7453"]
    assert step.addresses(2, 7450, 2) == ["tcp://n1:7450", "tcp://n2:7452"]
