"""What aps.torch.Optimizer decides before it talks to a server: where it was given the
server, the rank and the count (aps's places, or torch.optim's learning rate), and whether
a process given neither rank nor count may run as rank 0 of 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from aps.errors import ConfigurationError
from aps.torch.optimizer import _check_alone, _places


def test_the_server_rank_and_count_in_place_or_by_keyword():
    assert _places((), None, None, None, None) == (None, None, None, None)
    assert _places(("tcp://h:1", 2, 4), None, None, None, None) == ("tcp://h:1", 2, 4, None)
    assert _places(("tcp://h:1",), None, 1, 3, 0.5) == ("tcp://h:1", 1, 3, 0.5)
    with pytest.raises(ConfigurationError, match="rank is given twice"):
        _places(("tcp://h:1", 2), None, 2, None, None)
    with pytest.raises(ConfigurationError, match="at most 3 of them in place"):
        _places(("tcp://h:1", 0, 1, 4), None, None, None, None)


def test_a_number_in_second_place_is_torch_optims_learning_rate():
    assert _places((0.1,), "tcp://h:1", None, None, None) == ("tcp://h:1", None, None, 0.1)
    assert _places((1,), None, None, None, None)[3] == 1.0
    with pytest.raises(ConfigurationError, match="the learning rate is given twice"):
        _places((0.1,), None, None, None, 0.2)
    with pytest.raises(ConfigurationError, match="give momentum= and torch's other options by keyword"):
        _places((0.1, 0.9), None, None, None, None)
    assert _places((True,), None, None, None, None)[0] is True  # (a bool is no learning rate)


@pytest.mark.parametrize("options", [{"workers": 1}, {"workers": 4, "min_workers": 1}, None])
def test_a_process_alone_runs_where_the_server_expects_one_worker_or_assigns_ranks(options):
    _check_alone(SimpleNamespace(server_options=options, address="tcp://h:1"))


def test_a_process_alone_is_refused_where_the_server_waits_for_others():
    with pytest.raises(ConfigurationError, match="expects 4 workers: give each process its rank"):
        _check_alone(SimpleNamespace(server_options={"workers": 4}, address="tcp://h:1"))
