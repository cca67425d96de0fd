"""Delayed Nesterov, the outer step of asynchronous local SGD: the native kernel and its twin
against a NumPy transcription of the paper's Algorithm 3, the optimizer's transactions and
state, and its options."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aps import _core, _reference
from aps.config import ServerConfig
from aps.errors import ConfigurationError, InvalidHyperparameters
from aps.server.engine.optim import DelayedNesterov, make_optimizer
from aps.wire.protocol import HyperGroup


def algorithm_3(w, pushes, lr, beta, period, c):
    """Liu et al. (2024), "Asynchronous Local-SGD Training for Language Modeling", Algorithm 3,
    as written, in float64: for push t (from 0) with gradient g, Δ ← Δ + g; when (t + 1) mod N
    is 0, m ← βm + Δ/N, θ ← θ − ε((1 − cN + c)βm + g/N) and Δ ← 0; otherwise
    θ ← θ − ε(cβm + g/N)."""
    theta = np.asarray(w, np.float64).copy()
    m = np.zeros_like(theta)
    delta = np.zeros_like(theta)
    for t, g in enumerate(pushes):
        g = np.asarray(g, np.float64)
        delta += g
        if (t + 1) % period == 0:
            m = beta * m + delta / period
            theta -= lr * ((1 - c * period + c) * beta * m + g / period)
            delta[:] = 0
        else:
            theta -= lr * (c * beta * m + g / period)
    return theta, m, delta


def run(kernels, w, pushes, lr, beta, period, c, scale=1.0, dtype=_core.FLOAT32):
    """The kernel over ``pushes``, out of place, the state adopted after each as the server does."""
    w = w.copy()
    m, delta = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(pushes):
        w_out, m_out, delta_out = np.empty_like(w), np.empty_like(w), np.empty_like(w)
        assert kernels.delayed_nesterov_step(w_out, w, g, m_out, m, delta_out, delta, t + 1, lr, beta, period, c,
                                             scale, dtype) is True
        w, delta = w_out, delta_out
        if (t + 1) % period == 0:
            m = m_out
    return w, m, delta


def vectors(seed, n, count):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(count)]


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "twin"])
@pytest.mark.parametrize(("period", "c", "pushes"), [(1, 0.0, 5), (3, 0.0, 7), (4, 0.25, 9), (5, 0.1, 12)])
def test_the_kernel_is_algorithm_3(kernels, period, c, pushes):
    w, *grads = vectors(period, 257, 1 + pushes)
    got = run(kernels, w, grads, 0.7, 0.9, period, c)
    expected = algorithm_3(w, grads, 0.7, 0.9, period, c)
    for name, a, b in zip(("weights", "momentum", "delta"), got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.any(got[2]) == bool(pushes % period)  # the sum is empty right after a milestone only


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 300), st.integers(1, 6), st.sampled_from([0.0, 0.1, 0.2]),
       st.sampled_from([1.0, 0.5, 1 / 3]), st.sampled_from([_core.FLOAT32, _core.FLOAT16, _core.BFLOAT16]))
def test_native_and_twin_agree_bit_for_bit(seed, n, period, c, scale, dtype):
    c = min(c, 1.0 / max(period - 1, 1))
    w, *grads = vectors(seed, n, 8)
    if dtype != _core.FLOAT32:
        words = []
        for g in grads:
            out = np.empty(n, np.uint16)
            _core.narrow(out, g, dtype)
            words.append(out)
        grads = words
    native = run(_core, w, grads, 0.7, 0.9, period, c, scale, dtype)
    twin = run(_reference, w, grads, 0.7, 0.9, period, c, scale, dtype)
    for a, b in zip(native, twin):
        np.testing.assert_array_equal(a, b)


def test_a_period_of_one_is_torch_nesterov_sgd_bit_for_bit():
    torch = pytest.importorskip("torch")
    w, *grads = vectors(3, 1000, 9)
    param = torch.nn.Parameter(torch.from_numpy(w.copy()))
    opt = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:
        param.grad = torch.from_numpy(g * np.float32(0.5))
        opt.step()
    ours, momentum, _ = run(_core, w, grads, 0.7, 0.9, 1, 0.0, scale=0.5)
    np.testing.assert_array_equal(ours, param.detach().numpy())
    np.testing.assert_array_equal(momentum, opt.state[param]["momentum_buffer"].numpy())


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "twin"])
@pytest.mark.parametrize("step", [5, 6], ids=["between", "milestone"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_gradient_that_is_not_finite_is_refused(kernels, step, bad):
    w, g, m, delta = vectors(1, 64, 4)
    g[17] = bad
    outs = [np.zeros(64, np.float32) for _ in range(3)]
    assert kernels.delayed_nesterov_step(outs[0], w, g, outs[1], m, outs[2], delta, step, 0.7, 0.9, 3) is False


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "twin"])
def test_a_sum_that_overflows_is_refused(kernels):
    """Between milestones the weights move by d/N only: the sum Δ + d is checked on its own."""
    big = np.float32(3e38)
    w, m = np.zeros(4, np.float32), np.zeros(4, np.float32)
    delta, g = np.full(4, big), np.full(4, big)
    outs = [np.zeros(4, np.float32) for _ in range(3)]
    assert kernels.delayed_nesterov_step(outs[0], w, g, outs[1], m, outs[2], delta, 1, 1e-30, 0.9, 4) is False


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "twin"])
def test_arguments_are_checked(kernels):
    w = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="m_out"):
        kernels.delayed_nesterov_step(w.copy(), w, w, None, w, w.copy(), w, 3, 0.1, 0.9, 3)
    with pytest.raises(ValueError, match="period"):
        kernels.delayed_nesterov_step(w.copy(), w, w, w.copy(), w, w.copy(), w, 3, 0.1, 0.9, 0)
    with pytest.raises(ValueError, match="step"):
        kernels.delayed_nesterov_step(w.copy(), w, w, w.copy(), w, w.copy(), w, 0, 0.1, 0.9, 3)
    with pytest.raises(ValueError, match="delta_in"):
        kernels.delayed_nesterov_step(w.copy(), w, w, w.copy(), w, w.copy(), w[:3], 1, 0.1, 0.9, 3)


def optimizer(n=64, period=3, c=0.25):
    return make_optimizer("delayed-nesterov", n, lr=0.7, momentum=0.9, period=period, c=c)


def test_the_optimizer_steps_as_the_formula_and_commits_only_what_it_wrote():
    opt = optimizer()
    w, *grads = vectors(5, 64, 8)
    for t, g in enumerate(grads):
        out = np.empty_like(w)
        momentum_before = opt.momentum_buffer.copy()
        assert opt.milestone == ((t + 1) % 3 == 0)
        assert opt.step(out, w, g, scale=0.5)
        opt.commit()
        w = out
        if (t + 1) % 3:
            np.testing.assert_array_equal(opt.momentum_buffer, momentum_before)
    expected = run(_reference, vectors(5, 64, 8)[0], grads, 0.7, 0.9, 3, 0.25, 0.5)
    for a, b in zip((w, opt.momentum_buffer, opt.delta), expected):
        np.testing.assert_array_equal(a, b)
    assert opt.steps == 7
    assert list(opt.state_arrays()) == ["momentum_buffer", "delta"]


@pytest.mark.parametrize("at", [0, 2], ids=["between", "milestone"])
def test_a_refused_step_changes_nothing(at):
    """(The state lives in the spare until a commit: what shows a refusal changed nothing is that
    the next good step is the one it would have been.)"""
    opt = optimizer()
    w, *grads = vectors(6, 64, 5)
    for g in grads[:at]:
        out = np.empty_like(w)
        assert opt.step(out, w, g)
        opt.commit()
        w = out
    before = {name: value.copy() for name, value in opt.state_arrays().items()}
    bad = grads[3].copy()
    bad[9] = np.nan
    assert opt.milestone == (at == 2)
    assert not opt.step(np.empty_like(w), w, bad)
    assert opt.steps == at
    for name, value in opt.state_arrays().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    # and the next good step is the one it would have been
    out = np.empty_like(w)
    assert opt.step(out, w, grads[3])
    opt.commit()
    fresh = optimizer()
    w2 = vectors(6, 64, 5)[0]
    for g in [*grads[:at], grads[3]]:
        o2 = np.empty_like(w2)
        assert fresh.step(o2, w2, g)
        fresh.commit()
        w2 = o2
    np.testing.assert_array_equal(out, w2)


def test_a_saved_state_loads_and_goes_on_bit_for_bit():
    w, *grads = vectors(8, 64, 7)
    straight, resumed = optimizer(), optimizer()
    weights = w
    for index, g in enumerate(grads):
        out = np.empty_like(weights)
        assert straight.step(out, weights, g)
        straight.commit()
        if index == 3:  # mid-period: the sum is not empty
            saved = {name: value.copy() for name, value in straight.state_arrays().items()}
            saved_steps, saved_weights = straight.steps, out.copy()
        weights = out
    assert saved_steps % 3 and np.any(saved["delta"])
    assert resumed.state_problem({name: [value] for name, value in saved.items()}, saved_steps) is None
    resumed.load_state(saved, saved_steps)
    weights = saved_weights
    for g in grads[4:]:
        out = np.empty_like(weights)
        assert resumed.step(out, weights, g)
        resumed.commit()
        weights = out
    assert resumed.steps == straight.steps
    for name, value in straight.state_arrays().items():
        np.testing.assert_array_equal(resumed.state_arrays()[name], value, err_msg=name)


def test_a_state_with_a_sum_at_a_milestone_is_refused():
    opt = optimizer()
    zeros, ones = np.zeros(64, np.float32), np.ones(64, np.float32)
    problem = opt.state_problem({"momentum_buffer": [zeros], "delta": [ones]}, 6)
    assert problem is not None and "delta" in problem and "multiple of the period 3" in problem
    assert opt.state_problem({"momentum_buffer": [ones], "delta": [ones]}, 7) is None
    assert "in that order" in opt.state_problem({"exp_avg": [zeros], "delta": [zeros]}, 1)


def test_groups_take_a_learning_rate_and_a_momentum_only():
    """Five steps (a milestone at the third, then two between with c > 0: each group's momentum
    moves its momentum buffer and is applied) equal each group's range run alone."""
    opt = optimizer()
    groups = opt.check_groups([HyperGroup(32, 0.5, 0.0, 0.5, 0.0), HyperGroup(64, 0.7, 0.0, 0.9, 0.0)])
    w, *grads = vectors(9, 64, 6)
    weights = w
    for g in grads:
        out = np.empty_like(weights)
        assert opt.step(out, weights, g, groups=groups)
        opt.commit()
        weights = out
    first = run(_reference, w[:32], [g[:32] for g in grads], 0.5, 0.5, 3, 0.25)
    second = run(_reference, w[32:], [g[32:] for g in grads], 0.7, 0.9, 3, 0.25)
    for got, a, b in zip((weights, opt.momentum_buffer, opt.delta), first, second):
        np.testing.assert_array_equal(got, np.concatenate([a, b]))
    server_values = run(_reference, w, grads, 0.7, 0.9, 3, 0.25)[0]
    assert not np.array_equal(weights[:32], server_values[:32])  # (the first group's values were used)
    with pytest.raises(InvalidHyperparameters, match="learning rate and a momentum only"):
        opt.check_groups([HyperGroup(64, 0.5, 0.01, 0.9, 0.0)])
    with pytest.raises(InvalidHyperparameters, match="learning rate and a momentum only"):
        opt.check_groups([HyperGroup(64, 0.5, 0.0, 0.9, 0.1)])


def test_a_step_in_pieces_and_on_threads_equals_one_call():
    from aps.server.engine.optim import KernelThreads

    n = 5000
    w, *grads = vectors(10, n, 5)
    whole, pieces, threaded = optimizer(n), optimizer(n), optimizer(n)
    threaded.threads = KernelThreads(3)
    threaded.threads.MIN_ELEMENTS = 16
    results = []
    for opt, cuts in ((whole, [0, n]), (pieces, [0, 17, 1000, 4096, n]), (threaded, [0, n])):
        weights = w
        for g in grads:
            out = np.empty_like(weights)
            assert all(opt.step_slice(out, weights, g, 1.0, lo, hi) for lo, hi in zip(cuts, cuts[1:]))
            opt.commit()
            weights = out
        results.append((weights, opt.momentum_buffer.copy(), opt.delta.copy()))
    threaded.threads.close()
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "twin"])
@pytest.mark.parametrize("step", [5, 6], ids=["between", "milestone"])
def test_in_place_equals_out_of_place(kernels, step):
    w, g, m, delta = vectors(11, 300, 4)
    outs = [np.empty(300, np.float32) for _ in range(3)]
    assert kernels.delayed_nesterov_step(outs[0], w, g, outs[1], m, outs[2], delta, step, 0.7, 0.9, 3, 0.25)
    wi, mi, di = w.copy(), m.copy(), delta.copy()
    assert kernels.delayed_nesterov_step(wi, wi, g, mi, mi, di, di, step, 0.7, 0.9, 3, 0.25)
    np.testing.assert_array_equal(wi, outs[0])
    np.testing.assert_array_equal(di, outs[2])
    np.testing.assert_array_equal(mi, outs[1] if step == 6 else m)


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "twin"])
@pytest.mark.parametrize("dtype", [_core.FLOAT16, _core.BFLOAT16])
def test_a_16_bit_gradient_that_is_not_finite_is_refused(kernels, dtype):
    w, g, m, delta = vectors(12, 64, 4)
    g[40] = np.inf
    words = np.empty(64, np.uint16)
    _core.narrow(words, g, dtype)
    outs = [np.zeros(64, np.float32) for _ in range(3)]
    for step in (5, 6):
        assert kernels.delayed_nesterov_step(outs[0], w, words, outs[1], m, outs[2], delta, step, 0.7, 0.9, 3,
                                             grad_dtype=dtype) is False


def test_a_worker_fills_in_the_servers_learning_rate_and_momentum():
    import json

    from aps.client.payloads import server_hyperparameters
    from aps.wire.protocol import ServerInfo

    described = ServerConfig(workers=2, optimizer="delayed-nesterov", lr=0.7, momentum=0.9).shard_description()
    info = ServerInfo("host", "", "run", shard=json.dumps(described))
    assert server_hyperparameters(info) == {"lr": 0.7, "weight_decay": 0.0, "momentum": 0.9, "dampening": 0.0}


def test_the_optimizer_refuses_values_it_cannot_run():
    with pytest.raises(ConfigurationError, match="milestone's share"):
        DelayedNesterov(8, 0.7, 0.9, period=4, c=0.5)
    with pytest.raises(ConfigurationError, match="period"):
        DelayedNesterov(8, 0.7, 0.9, period=0)
    with pytest.raises(ConfigurationError, match="no weight decay"):
        make_optimizer("delayed-nesterov", 8, lr=0.7, weight_decay=0.1)
    with pytest.raises(ConfigurationError, match="by construction"):
        make_optimizer("delayed-nesterov", 8, lr=0.7, momentum=0.9, nesterov=True)
    assert optimizer().describe() == "delayed-nesterov lr=0.7 momentum=0.9 period=3 c=0.25"
    assert optimizer().hyperparameters() == {"lr": 0.7, "momentum": 0.9, "period": 3, "c": 0.25}


def test_server_options():
    options = {"optimizer": "delayed-nesterov", "lr": 0.7, "momentum": 0.9, "sync": "asp"}
    # the period by default: one round's updates
    assert ServerConfig(workers=4, **options).delayed_period == 4
    assert ServerConfig(workers=6, min_workers=2, **{**options, "sync": "ssp"}).delayed_period == 6
    assert ServerConfig(workers=4, **{**options, "sync": "bsp"}).delayed_period == 1
    assert ServerConfig(workers=4, softsync_n=2, **{**options, "sync": "softsync"}).delayed_period == 2
    assert ServerConfig(workers=4, momentum_period=2, **options).delayed_period == 2
    assert ServerConfig(compensation="gap", **options).compensation == "gap"
    refused = [
        ({"optimizer": "sgd", "momentum_period": 2}, "apply to --optimizer delayed-nesterov"),
        ({"optimizer": "adam", "momentum_activation": 0.1}, "apply to --optimizer delayed-nesterov"),
        ({**options, "nesterov": True}, "by construction"),
        ({**options, "weight_decay": 0.1}, "no --weight-decay"),
        ({"optimizer": "delayed-nesterov"}, "needs a --momentum > 0"),
        ({**options, "workers": 4, "momentum_activation": 0.5}, r"1/\(N-1\)"),
        ({**options, "momentum_activation": -0.1}, r"1/\(N-1\)"),
        ({**options, "momentum_period": -1}, "0..16777216"),
        ({**options, "momentum_period": 2.5}, "whole number"),
        ({**options, "momentum_period": "3"}, "whole number"),
        ({**options, "momentum_activation": float("inf")}, "finite|1/"),
        ({**options, "compensation": "dc:0.5"}, "pseudo-gradients"),
        ({**options, "compensation": "dc-adaptive:0.5"}, "pseudo-gradients"),
        ({**options, "sync": "bsp", "workers": 4, "momentum_period": 4, "momentum_activation": 0.5}, r"1/\(N-1\)"),
    ]
    for given, message in refused:
        with pytest.raises(ConfigurationError, match=message):
            ServerConfig(**given)
