"""Fuzzed frames against a live server over TCP and the shared-memory socket, while a
legitimate worker trains beside them and checks its weights after every step
(aps/testing/fuzzing.py). bench/fuzz.py runs the same at 10^5 frames and more."""

import random

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aps.testing.fuzzing import Tally, Target, Trainer, run_case
from aps.testing import ServerProcess

from aps.testing import TOKEN


@pytest.fixture(scope="module", params=["tcp", "shm"])
def arena(request):
    """A token-protected server with one seat, taken by a worker that trains throughout."""
    server = ServerProcess("--workers", "1", "--sync", "asp", "--lr", "1", "--token", TOKEN,
                           "--max-frame-bytes", "64M", "--log-level", "warning")
    trainer = Trainer(server.address, request.param, TOKEN)
    trainer.start()
    rss = psutil.Process(server.proc.pid).memory_info().rss
    try:
        yield server, trainer, Target(server.port, server.unix_path, TOKEN.encode()), rss
    finally:
        trainer.finish()
        server.stop()


@pytest.mark.slow  # (thousands of fuzzed frames per transport: 15-20 s each)
def test_fuzzed_frames_crash_nothing_and_change_nothing(arena):
    server, trainer, target, rss_before = arena
    tally = Tally()

    @settings(max_examples=700, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.randoms(use_true_random=False))
    def one_case(rng: random.Random) -> None:
        run_case(target, rng, tally)
        assert server.alive(), "the server must never crash"

    one_case()
    steps = trainer.steps
    assert trainer.error is None, trainer.error
    assert trainer.deviations == 0  # the weights were exactly -k after every one of its k steps
    assert steps > 50 and tally.frames > 1000
    assert tally.error_frames > 100 and tally.closed_by_server > 100  # refusals, and closed connections
    growth = psutil.Process(server.proc.pid).memory_info().rss - rss_before
    assert growth < 64 << 20, f"the server grew by {growth >> 20} MiB"
    print(f"{tally.cases} cases, {tally.frames} frames: {tally.error_frames} error frames, {tally.replies} replies, "
          f"{tally.closed_by_server} closed by the server; the worker took {steps} steps")
