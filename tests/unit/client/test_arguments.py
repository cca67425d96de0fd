"""What a worker was given, filled in from the environment aps launch and torchrun set
(``aps.client.arguments.from_env``, which aps.lightning and aps.huggingface use too)."""

from __future__ import annotations

import pytest

from aps.client.arguments import from_env
from aps.errors import ConfigurationError


@pytest.fixture
def env(monkeypatch):
    for name in ("APS_ADDRESS", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_what_was_given_wins_and_the_rest_comes_from_the_environment(env):
    env.setenv("APS_ADDRESS", "tcp://ps:7450")
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "8")
    assert from_env(None, None, None) == ("tcp://ps:7450", 3, 8)
    assert from_env("tcp://other:1", 0, 2) == ("tcp://other:1", 0, 2)


def test_without_rank_or_count_the_server_decides(env):
    assert from_env("tcp://ps:7450", None, None) == ("tcp://ps:7450", None, None)


def test_no_address_anywhere_or_a_bad_variable_is_refused(env):
    with pytest.raises(ConfigurationError, match=r"no address given and \$APS_ADDRESS is not set"):
        from_env(None, 0, 1)
    env.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigurationError, match=r"\$WORLD_SIZE='four' is not valid"):
        from_env("tcp://ps:7450", 0, None)
