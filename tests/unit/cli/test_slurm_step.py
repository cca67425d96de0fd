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
