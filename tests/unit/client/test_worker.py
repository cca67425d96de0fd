"""The worker's public face over one server's stand-in channel, without a server, on both
drivers: ``pull_rows`` asks for the rows it is given and, with ``keep_version``, for a
reply whose version the worker does not take (aps.client.core applies it: test_rows)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from aps.client.aio import AsyncWorker
from aps.client.rowsets import RowsCall
from aps.client.worker import Worker
from aps.layout import Layout
from aps.tables import Table

LAYOUT = Layout.from_arrays({"w": np.zeros(4, np.float32)}, {"items": Table(rows=100, dim=2)})


def one_server(calls: list[RowsCall]) -> SimpleNamespace:
    """What the worker's rows verb uses of its one channel: the layout, and a pull of a call."""

    def pull(call: RowsCall):
        calls.append(call)
        for section, out in zip(call.pull, call.outs):
            out[:] = section.ids[:, None] * 10 + np.arange(2)
        return None
        yield

    return SimpleNamespace(layout=LAYOUT, _pull=pull)


@pytest.fixture(params=["blocking", "asyncio"])
def pull_rows(request):
    calls: list[RowsCall] = []
    if request.param == "blocking":
        worker = object.__new__(Worker)
        worker._setup([one_server(calls)])
        method = worker.pull_rows
    else:
        worker = AsyncWorker([one_server(calls)])

        def method(*args, **kwargs):
            return asyncio.run(worker.pull_rows(*args, **kwargs))

    return method, calls


@pytest.mark.parametrize("keep_version", [False, True])
def test_pull_rows_asks_for_the_rows_and_says_whether_the_version_is_kept(pull_rows, keep_version):
    method, calls = pull_rows
    rows = method("items", [3, 5, 3], keep_version=keep_version)
    assert rows.tolist() == [[30, 31], [50, 51], [30, 31]]
    (call,) = calls
    assert not call.dense and call.names == ["items"] and call.versioned is not keep_version
    several = method({"items": [7]}, keep_version=keep_version)
    assert list(several) == ["items"] and several["items"].tolist() == [[70, 71]]
    assert calls[1].versioned is not keep_version


def test_the_version_is_the_models_by_default(pull_rows):
    method, calls = pull_rows
    method("items", [1])
    assert calls[0].versioned
