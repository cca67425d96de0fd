"""Weights narrowed for compressed pulls: once per version and element type, large ones off the loop."""

import numpy as np
import pytest

from aps import _core, _reference
from aps.server.engine.narrowing import INLINE_MAX, NarrowedWeights
from aps.server.engine.table import HeapBlock, Snapshot, _Slot


class Background:
    """The server's background thread, run by hand: work is kept until ``finish``."""

    def __init__(self):
        self.queued = []

    def __call__(self, work, done):
        self.queued.append((work, done))

    def finish(self):
        queued, self.queued = self.queued, []
        for work, done in queued:
            done(work())


def snapshot(n: int, version: int, seed: int = 0) -> tuple[Snapshot, _Slot]:
    slot = _Slot(HeapBlock(n))
    slot.array[:] = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return Snapshot(slot, version), slot


def expected(values: np.ndarray, dtype: int) -> np.ndarray:
    words = np.empty(len(values), np.uint16)
    _reference.narrow(words, values, dtype)
    return words


@pytest.mark.parametrize("dtype", [_core.BFLOAT16, _core.FLOAT16])
def test_a_large_model_is_narrowed_off_the_loop_once_per_version(dtype):
    background = Background()
    narrowed = NarrowedWeights(_core, background)
    snap, slot = snapshot(INLINE_MAX + 5, 3)
    answers = []
    narrowed.get(snap, dtype, answers.append)
    narrowed.get(snap.again(), dtype, answers.append)  # a second pull of the same version waits for the same work
    assert answers == [] and len(background.queued) == 1 and narrowed.under_way == 1
    assert slot.leases == 3  # the narrowing holds a lease of its own
    later = snap.again()
    snap.release()  # (the first reply's connection is lost meanwhile: the work goes on)
    background.finish()
    assert len(answers) == 2 and answers[0] is answers[1]
    np.testing.assert_array_equal(answers[0], expected(slot.array, dtype))
    assert slot.leases == 2 and narrowed.under_way == 0  # (the second reply's, and later's)
    narrowed.get(later, dtype, answers.append)  # kept: answered at once
    assert answers[2] is answers[0] and background.queued == []


def test_a_small_model_is_narrowed_on_the_loop():
    background = Background()
    narrowed = NarrowedWeights(_core, background)
    snap, slot = snapshot(1000, 1)
    answers = []
    narrowed.get(snap, _core.BFLOAT16, answers.append)
    assert background.queued == [] and len(answers) == 1
    np.testing.assert_array_equal(answers[0], expected(slot.array, _core.BFLOAT16))


def test_a_newer_version_replaces_the_kept_one_and_an_older_does_not():
    background = Background()
    narrowed = NarrowedWeights(_core, background)
    new, new_slot = snapshot(INLINE_MAX, 5, seed=1)
    old, old_slot = snapshot(INLINE_MAX, 4, seed=2)
    answers = []
    narrowed.get(new, _core.BFLOAT16, answers.append)
    narrowed.get(old, _core.BFLOAT16, answers.append)  # (a pull answered with an older lease)
    background.finish()
    np.testing.assert_array_equal(answers[0], expected(new_slot.array, _core.BFLOAT16))
    np.testing.assert_array_equal(answers[1], expected(old_slot.array, _core.BFLOAT16))
    narrowed.get(new.again(), _core.BFLOAT16, answers.append)
    assert answers[2] is answers[0] and background.queued == []


def test_weights_loaded_at_the_same_version_are_narrowed_again():
    background = Background()
    narrowed = NarrowedWeights(_core, background)
    before, before_slot = snapshot(INLINE_MAX, 0, seed=1)
    after, after_slot = snapshot(INLINE_MAX, 0, seed=2)
    answers = []
    narrowed.get(before, _core.BFLOAT16, answers.append)
    narrowed.forget()  # (LOAD_WEIGHTS while the old weights were being narrowed)
    narrowed.get(after, _core.BFLOAT16, answers.append)
    assert len(background.queued) == 2  # not joined to the old weights' narrowing
    background.finish()
    np.testing.assert_array_equal(answers[0], expected(before_slot.array, _core.BFLOAT16))
    np.testing.assert_array_equal(answers[1], expected(after_slot.array, _core.BFLOAT16))
    narrowed.get(after.again(), _core.BFLOAT16, answers.append)
    assert answers[2] is answers[1]  # the old weights' words were not kept as version 0's


def test_one_failing_answer_does_not_keep_the_others_waiting():
    background = Background()
    narrowed = NarrowedWeights(_core, background)
    snap, _ = snapshot(INLINE_MAX, 1)
    answers = []

    def broken(words):
        raise RuntimeError("a lost connection")

    narrowed.get(snap, _core.BFLOAT16, broken)
    narrowed.get(snap.again(), _core.BFLOAT16, answers.append)
    background.finish()
    assert len(answers) == 1
