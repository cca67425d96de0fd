"""What a worker checks before it pipelines its pushes (aps.client.pipeline)."""

import pytest

from aps.client.pipeline import check_pipeline, pipelines_allowed
from aps.errors import ConfigurationError


def test_a_server_that_does_not_say_it_takes_pipelined_pushes_is_refused_one():
    """An older aps serve (its handshake says nothing of pipelining) would refuse a held push
    mid-run: the worker refuses the pipeline at connect instead."""
    assert pipelines_allowed({"sync": "ssp", "pipelining": True}) is None
    assert "older aps serve" in pipelines_allowed({"sync": "ssp"})
    assert "older aps serve" in pipelines_allowed(None)
    assert "bsp" in pipelines_allowed({"sync": "bsp", "pipelining": True})


@pytest.mark.parametrize("depth", [0, -1, 1025, 2.5, True, "8"])
def test_the_depth_is_an_int_from_1_to_1024(depth):
    with pytest.raises(ConfigurationError, match="pipeline must be an int from 1 to 1024"):
        check_pipeline(depth)
    assert check_pipeline(1) == 1 and check_pipeline(1024) == 1024
