"""Delay compensation (docs/algorithms.md, "Delay compensation"): the kernels against a NumPy
transcription of each formula, element by element, native and twin alike; the engine applies
a stale gradient compensated for the weights it meets, under SGD, momentum and Adam; the
weights each worker was given are kept only as long as they can serve, and the state goes
through checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from aps import _core, _reference
from aps.config import ServerConfig
from aps.errors import ConfigurationError
from aps.server.engine.compensation import EPS, MEAN_SQUARE_DECAY, STEP_SCALE_DECAY, Compensation
from aps.server.engine import Engine
from tests.harness import Harness

F = np.float32
KERNELS = [pytest.param(_core, id="native"), pytest.param(_reference, id="twin")]


def dc(g, w, w_then, lam):
    """DC-ASGD (Zheng et al. 2017, eq. 10): g + lambda * g (.) g (.) (w_t - w_tau), in float32."""
    return g + F(lam) * ((g * g) * (w - w_then))


def dc_adaptive(g, w, w_then, lam, ms):
    """Its adaptive variant: lambda_t = lambda0 / sqrt(MeanSquare(t) + eps), MeanSquare(t) =
    m MeanSquare(t-1) + (1 - m) g (.) g, m = 0.95; returns (g', MeanSquare(t))."""
    ms = ms * F(MEAN_SQUARE_DECAY) + F(1 - MEAN_SQUARE_DECAY) * (g * g)
    return g + (F(lam) / np.sqrt(ms + F(EPS))) * ((g * g) * (w - w_then)), ms


def gap(g, w, w_then, scale, steps):
    """Gap-aware (Barkai et al. 2020): g / max(1, |w_t - w_tau| / C), C the bias-corrected
    running mean of each parameter's step (decay 0.99) plus eps."""
    corr = F(1.0 / (1.0 - STEP_SCALE_DECAY ** steps)) if steps else F(0)
    return g / np.maximum(np.abs(w - w_then) / (scale * corr + F(EPS)), F(1))


def vectors(n=2051, seed=0):
    rng = np.random.default_rng(seed)
    g, w = rng.standard_normal(n).astype(F), rng.standard_normal(n).astype(F)
    w_then = (w + rng.standard_normal(n) * 0.1).astype(F)
    w_then[:7] = w[:7]  # (fresh elements: no move)
    state = (np.abs(rng.standard_normal(n)) * 0.01).astype(F)
    return g, w, w_then, state


@pytest.mark.parametrize("kernels", KERNELS)
def test_each_kernel_is_its_formula_element_by_element(kernels):
    g, w, w_then, state = vectors()
    out, state_out = np.empty_like(g), np.empty_like(g)
    assert kernels.compensate(out, g, w, w_then, None, None, kernels.COMPENSATE_DC, 0.3)
    np.testing.assert_array_equal(out, dc(g, w, w_then, 0.3))
    assert kernels.compensate(out, g, w, w_then, state_out, state, kernels.COMPENSATE_DC_ADAPTIVE, 2.0,
                              MEAN_SQUARE_DECAY, EPS)
    expected, ms = dc_adaptive(g, w, w_then, 2.0, state)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(state_out, ms)
    corr = 1.0 / (1.0 - STEP_SCALE_DECAY ** 5)
    assert kernels.compensate(out, g, w, w_then, None, state, kernels.COMPENSATE_GAP, 0.0, 0.0, EPS, corr)
    np.testing.assert_array_equal(out, gap(g, w, w_then, state, 5))
    assert (np.abs(out) <= np.abs(g)).all() and np.array_equal(out[:7], g[:7])  # a penalty, never a boost
    kernels.step_scale(state_out, state, w, w_then, STEP_SCALE_DECAY)
    np.testing.assert_array_equal(state_out, state * F(0.99) + F(1 - 0.99) * np.abs(w - w_then))


def test_native_and_twin_agree_bit_for_bit_and_refuse_alike():
    g, w, w_then, state = vectors(seed=1)
    for kind in (1, 2, 3):
        outs = []
        for kernels in (_core, _reference):
            out, state_out = np.empty_like(g), np.zeros_like(g)
            assert kernels.compensate(out, g, w, w_then, state_out, state, kind, 0.7, 0.95, 1e-7, 1.5)
            outs.append((out, state_out))
        np.testing.assert_array_equal(outs[0][0], outs[1][0])
        np.testing.assert_array_equal(outs[0][1], outs[1][1])
    bad = g.copy()
    bad[100] = np.nan
    huge = np.full_like(g, 3e38)
    for kernels in (_core, _reference):
        out = np.empty_like(g)
        assert not kernels.compensate(out, bad, w, w_then, None, None, kernels.COMPENSATE_DC, 0.1)
        assert not kernels.compensate(out, huge, w, w_then, None, None, kernels.COMPENSATE_DC, 1.0)  # g*g overflows
        with pytest.raises(ValueError, match="needs its state"):
            kernels.compensate(out, g, w, w_then, None, None, kernels.COMPENSATE_GAP)
        with pytest.raises(ValueError, match="unknown compensation"):
            kernels.compensate(out, g, w, w_then, None, None, 9)
        with pytest.raises(ValueError, match="elements"):
            kernels.compensate(out[:5], g, w, w_then, None, None, kernels.COMPENSATE_DC)


def test_a_16_bit_gradient_is_widened_then_compensated():
    g, w, w_then, state = vectors(n=64, seed=2)
    words = np.empty(64, np.uint16)
    _core.narrow(words, g, _core.BFLOAT16)
    widened = np.empty_like(g)
    _core.widen(widened, words, _core.BFLOAT16)
    comp = Compensation("dc", 0.5, 64)
    out = comp.gradient(words, _core.BFLOAT16, w, w_then, 0, 64)
    np.testing.assert_array_equal(out, dc(widened, w, w_then, 0.5))


# The engine -------------------------------------------------------------------------------------

W0 = np.array([0.5, -1.0, 2.0, 0.25, -0.75], F)
G1, G2 = np.array([0.2, 0.1, -0.3, 0.4, 0.0], F), np.array([-0.1, 0.3, 0.2, -0.2, 0.5], F)
G0 = np.array([1.0, -2.0, 0.5, 0.3, -0.4], F)

OPTIMIZERS = {
    "sgd": {"lr": 0.1},
    "momentum": {"lr": 0.1, "momentum": 0.9},
    "adam": {"lr": 0.01, "optimizer": "adam"},
}


def run_stale(kernels, compensation, optimizer, **extra) -> Harness:
    """ASP, 2 workers: rank 1 makes two updates; rank 0 then pushes G0 computed on W0 (2 versions stale)."""
    h = Harness(kernels=kernels, workers=2, sync="asp", numel=5, compensation=compensation,
                **OPTIMIZERS[optimizer], **extra)
    h.join_all(W0)
    h.push(1, G1, then_pull=True)
    h.push(1, G2, then_pull=True)
    h.push(0, G0, then_pull=True)
    assert h.engine.version == 3 and not h.workers[0].errors
    return h


class Expected:
    """The same three updates by hand: the twin's optimizer kernels on the compensated gradients."""

    def __init__(self, optimizer: str) -> None:
        self.o = OPTIMIZERS[optimizer]
        self.w = W0.copy()
        self.buf = np.zeros(5, F)
        self.m, self.v = np.zeros(5, F), np.zeros(5, F)
        self.step_count = 0

    def step(self, g) -> np.ndarray:
        before, out = self.w, np.empty(5, F)
        self.step_count += 1
        if self.o.get("optimizer") == "adam":
            m, v = np.empty(5, F), np.empty(5, F)
            _reference.adam_step(out, before, g, m, self.m, v, self.v, self.step_count, self.o["lr"])
            self.m, self.v = m, v
        else:
            buf = np.empty(5, F)
            _reference.sgd_step(out, before, g, buf, self.buf, self.o["lr"], self.o.get("momentum", 0.0),
                                first=self.step_count == 1)
            self.buf = buf
        self.w = out
        return before


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_the_engine_compensates_a_stale_gradient_for_the_weights_it_meets(kernels, optimizer):
    for kind in ("dc:0.5", "dc-adaptive:0.5", "gap"):
        h = run_stale(kernels, kind, optimizer)
        e = Expected(optimizer)
        ms = scale = np.zeros(5, F)
        g1 = g2 = None
        if kind == "dc:0.5":
            g1, g2 = G1, G2  # (fresh: w_t = w_tau, nothing to compensate)
            w1 = e.step(g1)
            e.step(g2)
            g0 = dc(G0, e.w, W0, 0.5)
        elif kind == "dc-adaptive:0.5":
            g1, ms = dc_adaptive(G1, W0, W0, 0.5, ms)
            e.step(g1)
            w1 = e.w
            g2, ms = dc_adaptive(G2, w1, w1, 0.5, ms)
            e.step(g2)
            g0, ms = dc_adaptive(G0, e.w, W0, 0.5, ms)
        else:
            e.step(G1)
            scale = scale * F(0.99) + F(1 - 0.99) * np.abs(e.w - W0)
            w1 = e.w
            e.step(G2)
            scale = scale * F(0.99) + F(1 - 0.99) * np.abs(e.w - w1)
            g0 = gap(G0, e.w, W0, scale, 2)
        before = e.w
        e.step(g0)
        if optimizer == "adam":
            np.testing.assert_allclose(h.engine.weights, e.w, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(h.engine.weights, e.w)
        compensated = h.engine.model.table.compensation
        if kind == "gap":
            np.testing.assert_array_equal(compensated.state_arrays()["compensation_step_scale"],
                                          scale * F(0.99) + F(1 - 0.99) * np.abs(e.w - before))
        elif kind == "dc-adaptive:0.5":
            np.testing.assert_array_equal(compensated.state_arrays()["compensation_mean_square"], ms)
        assert compensated.steps == (0 if kind == "dc:0.5" else 3)  # (dc keeps no state)
        assert not np.array_equal(g0, G0)  # (the case compensates something)


def test_without_the_weights_it_was_computed_on_a_gradient_is_applied_as_it_is():
    """A gradient said to be computed on a version its worker was not given (none kept)."""
    h = Harness(workers=2, sync="asp", numel=5, compensation="dc:0.5", lr=0.1)
    h.join_all(W0)
    h.push(1, G1, then_pull=True)
    h.push(0, G0, version=1, then_pull=True)  # rank 0 was given version 0, not 1
    expected = W0 - F(0.1) * G1 - F(0.1) * G0
    np.testing.assert_allclose(h.engine.weights, expected, rtol=1e-6)
    stats = h.engine.stats.workers
    assert (stats[0].compensated, stats[0].uncompensated) == (0, 1)
    assert (stats[1].compensated, stats[1].uncompensated) == (1, 0)


def test_the_weights_kept_are_one_lease_per_worker_let_go_when_it_leaves_or_past_the_cutoff():
    h = Harness(workers=3, sync="asp", numel=5, compensation="gap", staleness_cutoff=3, lr=0.1)
    h.join_all(W0)
    members = [w.member for w in h.workers]
    assert [m.pulled.version for m in members] == [0, 0, 0]
    for _ in range(3):  # rank 1 runs ahead; ranks 0 and 2 hold version 0
        h.push(1, G1, then_pull=True)
    assert [m.pulled.version for m in members] == [0, 3, 0]
    h.push(1, G1, then_pull=True)  # version 4: version 0 is beyond the cutoff, its weights let go
    assert members[0].pulled is None and members[2].pulled is None and members[1].pulled.version == 4
    h.push(0, G0, then_pull=True)  # dropped (4 versions stale), answered with version 4
    assert h.workers[0].results[-1].dropped and members[0].pulled.version == 4
    for _ in range(200):
        h.push(1, G1, then_pull=True)
        h.push(0, G1, then_pull=True)
    assert h.engine.model.table.slot_count <= 3 + 3  # at most one kept per worker, plus the table's own
    h.leave(1)
    assert members[1].pulled is None


def test_compensation_state_goes_through_a_checkpoint_and_the_run_continues_exactly():
    """Stopped after the first part and resumed from its checkpoint state, the run goes on as
    if it had not stopped (the workers pull first, as they do when they rejoin a resumed run)."""
    def second_part(h):
        h.push(1, G2, then_pull=True)
        h.push(0, G1, then_pull=True)

    h = run_stale(_core, "dc-adaptive:0.5", "momentum")
    manifest, arrays = h.engine.durability.checkpoint_state()
    assert manifest["compensation"] == {"kind": "dc-adaptive:0.5", "steps": 3}
    assert set(arrays) == {"momentum_buffer", "compensation_mean_square"}
    saved = {key: value.copy() for key, value in arrays.items()}
    weights = h.engine.weights.copy()
    for rank in (0, 1):
        h.pull(rank)
    second_part(h)

    resumed = Harness(workers=2, sync="asp", numel=5, compensation="dc-adaptive:0.5", **OPTIMIZERS["momentum"])
    resumed.join_all(weights)
    engine = resumed.engine
    engine.model.table.optimizer.load_state({"momentum_buffer": saved["momentum_buffer"]}, 3)
    engine.model.table.compensation.load_state({"compensation_mean_square": saved["compensation_mean_square"]}, 3)
    for rank in (0, 1):  # (rejoined: they pull the weights they compute on)
        resumed.pull(rank)
    second_part(resumed)
    np.testing.assert_array_equal(resumed.engine.weights, h.engine.weights)
    np.testing.assert_array_equal(engine.model.table.compensation.state_arrays()["compensation_mean_square"],
                                  h.engine.model.table.compensation.state_arrays()["compensation_mean_square"])
    with pytest.raises(ValueError, match="keeps"):
        engine.model.table.compensation.load_state({"momentum_buffer": saved["momentum_buffer"]}, 1)
    for bad in (np.inf, -1e-7):  # (a negative mean square makes every gradient NaN; a negative step scale, 0)
        with pytest.raises(ValueError, match="finite values >= 0"):
            engine.model.table.compensation.load_state({"compensation_mean_square": np.full(5, bad, F)}, 1)


@pytest.mark.parametrize("value, message", [
    ("dc", "takes a LAMBDA"), ("dc:x", "takes a LAMBDA"), ("dc:-1", ">= 0"), ("dc:inf", "finite"),
    ("gap:2", "takes no value"), ("dcasgd", "unknown --compensation"),
])
def test_bad_values_are_refused(value, message):
    with pytest.raises(ConfigurationError, match=message):
        ServerConfig(sync="asp", compensation=value)


def test_one_value_has_one_spelling():
    """(Compared as text across shards and against a checkpoint: dc:.10 is dc:0.1.)"""
    assert ServerConfig(sync="asp", compensation="dc:.10").compensation == "dc:0.1"
    assert ServerConfig(sync="asp", compensation="dc-adaptive:2.0").compensation == "dc-adaptive:2"
    assert ServerConfig(sync="asp", compensation="gap").compensation == "gap"


def test_bsp_refuses_it_and_the_sync_description_says_it():
    with pytest.raises(ConfigurationError, match="staleness 0"):
        ServerConfig(sync="bsp", compensation="gap")
    assert "compensation=dc:0.04" in ServerConfig(sync="dssp", compensation="dc:0.04").describe_sync()
    assert ServerConfig(sync="asp", compensation="dc:.5") == ServerConfig(sync="asp", compensation="dc:0.5")
    assert Engine(ServerConfig(sync="asp")).model.table is None  # (none made before a model)


def test_softsync_compensates_each_gradient_of_a_group_against_the_weights_it_is_applied_to():
    """2 workers, n=1 (a group of 2): rank 1's two fresh gradients make version 1, then rank 0's
    gradient (computed on version 0) and rank 1's make version 2: rank 0's is compensated
    against version 1's weights; the group's mean is applied."""
    h = Harness(workers=2, sync="softsync", softsync_n=1, numel=5, compensation="dc:0.5", lr=0.1)
    h.join_all(W0)
    h.push(1, G1)
    h.push(0, G2, version=0)
    w1 = W0 - F(0.1) * ((G1 + G2) * F(0.5))
    np.testing.assert_allclose(h.engine.weights, w1, rtol=1e-6)
    h.pull(1)
    h.push(1, G1)
    h.push(0, G0, version=0)  # (given version 0 at its INIT, kept)
    expected = w1 - F(0.1) * ((G1 + dc(G0, w1, W0, 0.5)) * F(0.5))
    np.testing.assert_allclose(h.engine.weights, expected, rtol=1e-6)


def test_a_push_queued_before_its_worker_left_is_still_compensated():
    """The worker's connection goes while its gradient waits in the lane behind another (offloaded)
    update: compensated against the weights it was given all the same; let go of after it."""
    pending = []

    def drain():
        while pending:
            run, done = pending.pop(0)
            done(run())

    h = Harness(workers=3, sync="asp", numel=5, compensation="dc:0.5", lr=0.1,
                offload=lambda run, done: pending.append((run, done)))
    h.engine.lane._threshold = 0  # every update offloaded: the lane stays busy until drained
    h.join_all(W0)
    h.push(1, G1, then_pull=True)
    drain()
    h.pull(2)
    h.push(2, G1)  # in the lane
    h.push(0, G0)  # queued behind it, computed on version 0
    member = h.workers[0].member
    h.leave(0)
    assert member.pulled is not None and member.pulled.version == 0  # (still kept for its push)
    drain()
    drain()
    w2 = W0 - F(0.1) * G1 - F(0.1) * G1
    np.testing.assert_allclose(h.engine.weights, w2 - F(0.1) * dc(G0, w2, W0, 0.5), rtol=1e-6)
    assert member.pulled is None


@pytest.mark.parametrize("kind", ["dc:0.5", "dc-adaptive:0.5", "gap"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_block_by_block_is_the_whole_vector_at_once(kind, optimizer):
    """Compensation.apply (blocks kept in cache) writes what the compensation of the whole
    gradient, then the optimizer's step over it, then the step scale would: bit for bit."""
    from aps.config import parse_compensation
    from aps.server.engine.compensation import BLOCK
    from aps.server.engine.optim import make_optimizer

    n = 2 * BLOCK + 123
    g, w, w_then, _ = vectors(n=n, seed=3)
    options = dict(OPTIMIZERS[optimizer])
    name = options.pop("optimizer", "sgd")
    results = []
    for blocked in (True, False):
        opt = make_optimizer(name, n, **options)
        comp = Compensation(*parse_compensation(kind), n)
        out = np.empty(n, F)
        for _ in range(2):  # (the second with state: momentum, moments, mean square, step scale)
            comp.begin()
            if blocked:
                assert comp.apply(opt, out, w, g, _core.FLOAT32, w_then, 0.5)
            else:
                compensated = comp.gradient(g, _core.FLOAT32, w, w_then, 0, n)
                assert opt.step(out, w, compensated, 0.5)
                comp.stepped(out, w, 0, n)
            comp.commit()
            opt.commit()
        results.append((out.copy(), {k: v.copy() for k, v in comp.state_arrays().items()}))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for key in results[0][1]:
        np.testing.assert_array_equal(results[0][1][key], results[1][1][key])
