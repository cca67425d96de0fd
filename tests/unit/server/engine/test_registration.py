"""Who provides the initial weights: one worker sends them; joins that arrive meanwhile
wait for its model instead of sending (or the server keeping) copies nobody uses."""

import threading
import time

import numpy as np
import pytest

from aps.errors import InternalServerError, LayoutMismatch
from aps.layout import Layout
from tests.harness import Harness


def test_joins_without_values_wait_for_the_registering_worker():
    h = Harness(workers=3, numel=4, sync="asp")
    engine, layout = h.engine, h.layout
    assert engine.membership.claim_registration(layout, "conn-0")
    assert not engine.membership.claim_registration(layout, "conn-1")  # one registrar at a time
    with pytest.raises(LayoutMismatch):  # checked against the model on its way
        engine.membership.check_join(1, 3, Layout(("v",), ((4,),)))
    errors = []
    for rank in (1, 2):  # they arrive first, without values
        h.workers[rank].member = engine.membership.join(rank, 3, layout, None, h._ready(h.workers[rank]), errors.append)
    assert engine.model.table is None and not errors
    h.join(0, np.full(4, 5.0, np.float32))  # the registrar's values arrive
    assert not errors and engine.roster.started
    assert all(w.weights.tolist() == [5.0] * 4 for w in h.workers)


def test_a_registrar_that_leaves_lets_the_waiting_joins_fail_clearly():
    h = Harness(workers=2, numel=4, sync="asp")
    engine = h.engine
    assert engine.membership.claim_registration(h.layout, "conn-0")
    errors = []
    engine.membership.join(1, 2, h.layout, None, h._ready(h.workers[1]), errors.append)
    engine.membership.release_registration("conn-0")  # its connection died before its values arrived
    assert isinstance(errors[0], InternalServerError) and "init again" in str(errors[0])
    assert 1 not in engine.roster.members  # the rank is free again
    h.join_all()  # and a fresh start works
    assert engine.roster.started


def test_layout_comparison_is_linear_in_the_number_of_tensors():
    """60,000 names in another order: a quadratic comparison would take minutes."""
    names = tuple(f"layer{i}.weight" for i in range(60_000))
    ours = Layout(names, ((1,),) * len(names))
    theirs = Layout(names[::-1], ((1,),) * len(names))
    other = Layout(names[:-1] + ("extra",), ((1,),) * len(names))
    result = {}
    worker = threading.Thread(target=lambda: result.update(a=ours.difference(theirs), b=ours.difference(other)))
    start = time.monotonic()
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), f"still comparing after {time.monotonic() - start:.0f} s"
    assert result["a"] == "the same tensor names in a different order"
    assert "missing ['layer59999.weight']" in result["b"] and "unexpected ['extra']" in result["b"]
