"""What workers report (LOG): the wire's checks, the curves' bound, the server's store."""

import inspect
import json
import math
import sys

import numpy as np
import pytest

from aps.client.logbook import LOG_EVERY_S, MAX_NAMES, Logbook, batch_digest
from aps.errors import MalformedFrame
from aps.server.engine import scalars as scalars_module
from aps.server.engine.scalars import BATCHES_KEPT, CURVE_POINTS, SAME_BATCHES, Curve, Scalars
from aps.wire.scalars import MAX_LOG_BYTES, MAX_LOG_POINTS, LogReport, decode_log, encode_log


def test_a_log_goes_through_the_wire_as_it_was_logged():
    payload = encode_log([(3, {"loss": 0.5, "lr": 0.1}), (4, {"loss": math.nan})],
                         {"pid": 42, "cpu_s": 1.5, "rss_bytes": 1 << 20}, [(3, "0123456789abcdef")])
    report = decode_log(payload)
    assert report.points[:2] == [(3, "loss", 0.5), (3, "lr", 0.1)]
    assert report.points[2][:2] == (4, "loss") and math.isnan(report.points[2][2])
    assert report.process == {"pid": 42, "cpu_s": 1.5, "rss_bytes": 1 << 20}
    assert report.batches == [(3, "0123456789abcdef")]


@pytest.mark.parametrize("body", [
    b"\xff", b"[]", b"not json", b"[" * 100000, json.dumps({"points": [[1, {"loss": 1}]], "extra": 1}).encode(),
    json.dumps({"points": [[-1, {"loss": 1}]]}).encode(),
    json.dumps({"points": [[True, {"loss": 1}]]}).encode(),
    json.dumps({"points": [[2 ** 53 + 1, {"loss": 1}]]}).encode(),
    json.dumps({"points": [[1, {"": 1}]]}).encode(),
    json.dumps({"points": [[1, {"lo ss": 1}]]}).encode(),
    json.dumps({"points": [[1, {"x" * 65: 1}]]}).encode(),
    json.dumps({"points": [[1, {"loss": "1"}]]}).encode(),
    json.dumps({"points": [[1, {"loss": None}]]}).encode(),
    json.dumps({"points": [[1, {"loss": True}]]}).encode(),
    json.dumps({"points": [[1, {f"n{i}": 1.0 for i in range(MAX_LOG_POINTS + 1)}]]}).encode(),
    json.dumps({"points": [[1, {"loss": 1}]] * (MAX_LOG_POINTS + 1)}).encode(),
    json.dumps({"points": {"1": {"loss": 1}}}).encode(),
    json.dumps({"batches": [[1, "0123"]]}).encode(),
    json.dumps({"batches": [[1, "0123456789ABCDEF"]]}).encode(),
    json.dumps({"process": {"pid": 0, "cpu_s": 1, "rss_bytes": 1}}).encode(),
    json.dumps({"process": {"pid": 1, "cpu_s": -1, "rss_bytes": 1}}).encode(),
    json.dumps({"process": {"pid": 1, "cpu_s": 1}}).encode(),
    b" " * (MAX_LOG_BYTES + 1),
])
def test_a_bad_log_is_refused_whole(body):
    with pytest.raises(MalformedFrame):
        decode_log(body)


def test_a_curve_keeps_the_runs_shape_in_a_bounded_size():
    curve = Curve()
    for step in range(10 * CURVE_POINTS):
        curve.add(step, float(step))
    points = curve.points()
    assert CURVE_POINTS // 2 <= len(points) < CURVE_POINTS
    steps = [p[0] for p in points]
    assert steps[0] == 0 and steps == sorted(steps), "from the first step on, in order"
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    assert gaps == {curve.stride}, "evenly spaced over the whole run"
    assert steps[-1] > 9 * CURVE_POINTS, "up to the last stretch"
    assert (curve.last_step, curve.last_value) == (10 * CURVE_POINTS - 1, 10 * CURVE_POINTS - 1.0)


def test_a_value_sent_again_is_not_a_new_point():
    curve = Curve()
    assert curve.add(1, 0.5) and not curve.add(1, 0.5) and curve.add(1, 0.25) and curve.add(2, 0.25)
    assert curve.add(3, math.nan) and not curve.add(3, math.nan)
    assert [p[0] for p in curve.points()] == [1, 1, 2, 3]


def test_the_store_keeps_each_ranks_curves_and_its_process():
    now = [100.0]
    scalars = Scalars(now=lambda: now[0])
    process = {"pid": 7, "cpu_s": 10.0, "rss_bytes": 5 << 20}
    scalars.record(0, LogReport(points=[(1, "loss", 2.0), (1, "lr", 0.1)], process=process))
    scalars.record(1, LogReport(points=[(1, "loss", 3.0)]))
    now[0] = 102.0
    scalars.record(0, LogReport(points=[(2, "loss", 1.0)], process={**process, "cpu_s": 11.0}))
    assert scalars.curves() == {"0": {"loss": [[1, 2.0], [2, 1.0]], "lr": [[1, 0.1]]}, "1": {"loss": [[1, 3.0]]}}
    newest = scalars.newest()
    assert newest[0]["scalars"]["loss"] == {"step": 2, "value": 1.0}
    assert newest[0]["cpu_percent"] == pytest.approx(50.0) and newest[0]["process"]["rss_bytes"] == 5 << 20
    assert newest[1]["process"] is None and newest[1]["cpu_percent"] is None
    assert [p[1:] for p in scalars.points_after(0)] == [
        [0, "loss", 1, 2.0], [0, "lr", 1, 0.1], [1, "loss", 1, 3.0], [0, "loss", 2, 1.0]]
    assert scalars.points_after(scalars.seq) == [] and len(scalars.points_after(scalars.seq - 1)) == 1


def _logged(scalars: Scalars, steps: range) -> None:
    for step in steps:
        scalars.record(0, LogReport(points=[(step, "loss", 1.0 / (step + 1)), (step, "lr", 0.1)]))
        if step % 3 == 0:
            scalars.record(2, LogReport(points=[(step, "loss", math.nan if step % 9 == 0 else step / 7)]))


def _same(a: Scalars, b: Scalars) -> bool:
    """Equal curves and newest values (NaN equal to NaN)."""
    return json.dumps(a.curves()) == json.dumps(b.curves()) and \
        json.dumps({r: n["scalars"] for r, n in a.newest().items()}) == \
        json.dumps({r: n["scalars"] for r, n in b.newest().items()})


def test_a_checkpoints_curves_resume_as_if_the_server_had_not_stopped():
    """Saved (halved curves, NaN values) and taken up in a new store, the curves and newest
    values are the same, and go on exactly as the store that never stopped."""
    steps = 3 * CURVE_POINTS + 17
    kept = Scalars()
    _logged(kept, range(steps))
    assert kept._ranks[0].curves["loss"].stride > 1, "the curves were halved"
    index, saved_steps, saved_values = kept.saved()
    json.dumps(index, allow_nan=False)  # (the manifest's part is strict JSON)
    assert [entry[:2] for entry in index] == [[0, "loss"], [0, "lr"], [2, "loss"]]
    resumed = Scalars()
    resumed.record(5, LogReport(points=[(1, "stale", 1.0)]))  # (replaced by the restore)
    resumed.restore(json.loads(json.dumps(index)), saved_steps, saved_values)
    assert _same(resumed, kept) and "5" not in resumed.curves()
    assert resumed.points_after(0) == [], "nothing waits for the dashboards: they read the curves"
    assert resumed.newest()[0]["reported_s_ago"] is None and resumed.newest()[0]["process"] is None
    _logged(kept, range(steps, 2 * steps))
    _logged(resumed, range(steps, 2 * steps))
    assert _same(resumed, kept)
    empty = Scalars().saved()
    assert empty[0] == [] and len(empty[1]) == len(empty[2]) == 0


@pytest.mark.parametrize("spoil", [
    lambda i, s, v: ({"0": i}, s, v),
    lambda i, s, v: (i + [[0, "loss", 0, 1, 1]], np.append(s, 1), np.append(v, 1.0)),  # a name twice
    lambda i, s, v: ([[0, "lo ss", *i[0][2:]]] + i[1:], s, v),
    lambda i, s, v: ([[-1, *i[0][1:]]] + i[1:], s, v),
    lambda i, s, v: ([[True, *i[0][1:]]] + i[1:], s, v),
    lambda i, s, v: ([[0, "loss", CURVE_POINTS, 1, CURVE_POINTS]] + i[1:], s, v),
    lambda i, s, v: ([[0, "loss", i[0][2], 3, i[0][4]]] + i[1:], s, v),  # a stride not a power of 2
    lambda i, s, v: ([[0, "loss", i[0][2], i[0][3], 0]] + i[1:], s, v),
    lambda i, s, v: ([[0, "loss", i[0][2], i[0][3]]] + i[1:], s, v),
    lambda i, s, v: ([[0, "loss", i[0][2], 2 ** 40, i[0][4]]] + i[1:], s, v),  # a stride that keeps no more
    lambda i, s, v: ([[0, "loss", i[0][2] - 1, i[0][3], i[0][4]]] + i[1:], s[1:], v[1:]),  # points != seen/stride
    lambda i, s, v: ([[0, ["loss"], *i[0][2:]]] + i[1:], s, v),
    lambda i, s, v: (i, s[:-1], v[:-1]),  # points missing
    lambda i, s, v: (i, np.append(s, 1), np.append(v, 1.0)),  # points of no curve
    lambda i, s, v: (i, s.astype(np.float64), v),
    lambda i, s, v: (i, s, v[:-1]),
    lambda i, s, v: (i, None, v),
    lambda i, s, v: (i, np.where(np.arange(len(s)) == 3, -1, s), v),
    lambda i, s, v: ([[r, f"n{k}", 0, 1, 1] for k in range(MAX_NAMES + 1) for r in (0,)],
                     np.ones(MAX_NAMES + 1, np.int64), np.ones(MAX_NAMES + 1)),
])
def test_curves_that_do_not_hold_together_are_refused_and_nothing_changes(spoil):
    source = Scalars()
    _logged(source, range(40))
    index, steps, values = source.saved()
    target = Scalars()
    target.record(1, LogReport(points=[(1, "kept", 1.0)]))
    with pytest.raises(ValueError):
        target.restore(*spoil(index, steps, values))
    assert target.curves() == {"1": {"kept": [[1, 1.0]]}}


def test_a_deeply_nested_entry_is_refused_at_any_depth_of_the_stack():
    """The message describes a bad entry without walking all of it (a resume runs deep in the
    server's stack: a RecursionError there would stop the resume)."""
    entry: list = []
    for _ in range(300):
        entry = [entry]

    def at_depth(n: int) -> None:
        if n > 0:
            return at_depth(n - 1)
        with pytest.raises(ValueError, match="not \\[rank, name, points, stride, seen\\]"):
            Scalars().restore([entry], np.zeros(1, np.int64), np.zeros(1))

    at_depth(sys.getrecursionlimit() - len(inspect.stack()) - 100)


def test_a_checkpoint_keeps_a_bounded_number_of_curves(monkeypatch, caplog):
    monkeypatch.setattr(scalars_module, "SAVED_CURVES", 5)
    scalars = Scalars()
    for rank in range(4):
        scalars.record(rank, LogReport(points=[(1, "loss", 1.0), (1, "lr", 0.1)]))
    for _ in range(2):
        index, steps, values = scalars.saved()
        assert [entry[:2] for entry in index] == [[0, "loss"], [0, "lr"], [1, "loss"], [1, "lr"]]
        assert len(steps) == len(values) == 8
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert said == ["checkpoints keep the curves of the first 5 logged scalars; those of rank 2 and after are "
                    "left out"], "said once"


def test_a_rank_logs_a_bounded_number_of_names():
    scalars = Scalars()
    scalars.record(0, LogReport(points=[(1, f"n{i}", 1.0) for i in range(MAX_NAMES)]))
    with pytest.raises(ValueError, match="at most"):
        scalars.record(0, LogReport(points=[(2, "n0", 2.0), (2, "one_more", 1.0)]))
    assert scalars.newest()[0]["scalars"]["n0"]["step"] == 1, "the refused report kept nothing"


def test_two_ranks_on_the_same_batches_are_warned_of_once():
    scalars = Scalars()
    digests = [f"{i:016x}" for i in range(3 * SAME_BATCHES)]
    for step, digest in enumerate(digests):  # rank 2 reads its own data
        scalars.record(0, LogReport(batches=[(step, digest)]))
        scalars.record(2, LogReport(batches=[(step, f"{step + 1000:016x}")]))
    assert not scalars.warnings
    for step, digest in enumerate(digests[:SAME_BATCHES - 1]):
        scalars.record(1, LogReport(batches=[(step, digest)]))
    assert not scalars.warnings, "fewer than SAME_BATCHES shared"
    for step, digest in enumerate(digests[SAME_BATCHES - 1:], SAME_BATCHES - 1):
        scalars.record(1, LogReport(batches=[(step, digest)]))
    assert len(scalars.warnings) == 1 and scalars.warnings[0]["ranks"] == [0, 1]
    assert "same batches" in scalars.warnings[0]["message"]


def test_a_ranks_own_epochs_are_not_another_ranks_data():
    scalars = Scalars()
    for epoch in range(3):
        for step in range(BATCHES_KEPT // 4):
            scalars.record(0, LogReport(batches=[(step, f"{step:016x}")]))
    assert not scalars.warnings


def test_the_logbook_checks_what_it_is_given_and_sends_about_once_a_second():
    now = [0.0]
    book = Logbook(now=lambda: now[0])
    assert not book.add({"loss": np.float32(0.5), "acc": 1}, 1) and book.pending
    with pytest.raises(ValueError, match="name"):
        book.add({"bad name": 1.0}, 2)
    with pytest.raises(ValueError, match="a number"):
        book.add({"loss": "high"}, 2)
    with pytest.raises(ValueError, match="step"):
        book.add({"loss": 1.0}, -1)
    with pytest.raises(ValueError, match=f"{MAX_NAMES} names"):
        book.add({f"n{i}": 1.0 for i in range(MAX_NAMES)}, 2)
    now[0] = LOG_EVERY_S
    assert book.add({"loss": 0.25}, 2, batch=np.arange(10))
    report = decode_log(book.take())
    assert report.points == [(1, "loss", 0.5), (1, "acc", 1.0), (2, "loss", 0.25)]
    assert report.batches == [(2, batch_digest(np.arange(10)))] and report.process["cpu_s"] > 0
    assert not book.pending


def test_a_logbook_sends_before_a_log_would_pass_its_limits():
    book = Logbook(now=lambda: 0.0)
    names = {f"a_rather_long_scalar_name_number_{i:02d}": 1.0 for i in range(MAX_NAMES)}
    step = 0
    while not book.add(names, step):
        step += 1
    assert len(book.take()) <= MAX_LOG_BYTES and step * MAX_NAMES < MAX_LOG_POINTS


def test_batch_digests_tell_batches_apart():
    a = np.arange(12, dtype=np.float32)
    assert batch_digest(a) == batch_digest(a.copy()) != batch_digest(a + 1)
    assert batch_digest(a) != batch_digest(a.reshape(3, 4)) != batch_digest(a.astype(np.float64))
    assert batch_digest(b"abc") != batch_digest(b"abd") and len(batch_digest(b"")) == 16


def test_a_drawn_copy_is_the_curves_as_json_and_stays_as_it_was():
    scalars = Scalars()
    _logged(scalars, range(40))
    scalars.record(1, LogReport(points=[(5, "acc", math.inf), (6, "acc", -math.inf)]))
    before = scalars.changes
    drawn = scalars.drawn()
    expected = json.loads(json.dumps(scalars.curves()).replace("NaN", "null").replace("-Infinity", "null")
                          .replace("Infinity", "null"))
    _logged(scalars, range(40, 2000))  # (full curves thin out: their arrays are rewritten in place)
    assert scalars.changes > before and drawn.changes == before
    assert json.loads(drawn.json()) == expected, "what it was when drawn, non-finite values as null"
    assert drawn.seq == 2 * 40 + 14 + 2 and expected["2"]["loss"][0] == [0, None]
    assert json.loads(scalars.drawn().json()) != expected
    changes = scalars.changes
    scalars.forget(7)  # (not there: nothing changes)
    scalars.forget(1)
    assert scalars.changes == changes + 1 and "1" not in json.loads(scalars.drawn().json())
