"""What finishes a call after its worker rejoined (aps.client.recovery._after_recovery),
when the rejoin gave the worker another rank."""

from __future__ import annotations

import numpy as np
import pytest

from aps.client.core import _ClientCore
from aps.client.recovery import _after_recovery
from aps.wire.protocol import Op, unpack_header


def _joined() -> _ClientCore:
    core = _ClientCore(None, None)  # the server chooses the rank
    core.init_request({"w": np.zeros(4, np.float32)})
    core.rank = 1
    return core


def test_a_push_in_flight_when_the_rank_changed_is_not_sent_again_and_counts_as_dropped():
    core = _joined()
    core.begin_call()
    core.push_request(np.ones(4, np.float32), then_pull=True)
    assert core.reseat() == 1 and core.rank is None
    kind, request = _after_recovery(core, "push_pull", None)
    assert kind == "pull" and unpack_header(request()[0]).op == Op.PULL
    assert core.dropped and not core.has_pending_push and not core.reseated


def test_a_reseat_during_one_call_does_not_reach_the_next():
    """Re-seated while an init call reconnected (the rejoin was the init: nothing to finish);
    the next call's push, lost and rejoined under the same rank, is sent again."""
    core = _joined()
    core.begin_call()
    core.reseat()
    assert _after_recovery(core, "init", None) == (None, None)
    core.rank = 2
    core.begin_call()
    core.push_request(np.ones(4, np.float32), then_pull=False)
    kind, request = _after_recovery(core, "push", None)
    assert kind == "push" and request == core.resend_push and not core.dropped


@pytest.mark.parametrize("said, patience", [(2, 3.5), (1e12, 300.0), (float("inf"), 300.0), (0, 30.0),
                                            (-5, 30.0), (float("nan"), 30.0), ("2", 30.0), (True, 30.0), (None, 30.0)])
def test_how_long_a_rank_may_stay_taken_follows_the_server_within_a_bound(said, patience):
    """The server's --heartbeat-timeout plus 1.5 s; 30 s where it says none it can be held to; never
    more than 300 s, whatever it says (reconnect() waits that long at most before another rank)."""
    from types import SimpleNamespace

    from aps.client.steps import _ChannelSteps

    assert _ChannelSteps._seat_patience(SimpleNamespace(server_options={"heartbeat_timeout": said})) == patience
