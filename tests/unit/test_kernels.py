"""The native kernels against their plain-Python twins, and their transactions."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aps import _core, _reference

sizes = st.integers(0, 300)
seeds = st.integers(0, 2**32 - 1)


def vectors(seed, n, count):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(count)]


@given(seeds, sizes, st.integers(0, 299), st.sampled_from([np.nan, np.inf, -np.inf]))
def test_all_finite(seed, n, where, bad):
    (x,) = vectors(seed, n, 1)
    assert _core.all_finite(x) is True
    if n:
        x[where % n] = bad
        assert _core.all_finite(x) is False
        assert _reference.all_finite(x) is False


def test_all_finite_large_and_extremes():
    x = np.full(200_003, np.finfo(np.float32).max, np.float32)
    x[::2] = -np.finfo(np.float32).tiny
    assert _core.all_finite(x)
    x[-1] = np.nan
    assert not _core.all_finite(x)


@given(seeds, sizes, st.floats(-2, 2, width=32), st.booleans(), st.booleans())
def test_accumulate(seed, n, scale, first, in_place):
    acc, grad = vectors(seed, n, 2)
    results = []
    for kernels in (_core, _reference):
        current = acc.copy()
        out = current if in_place else np.empty_like(current)
        assert kernels.accumulate(out, current, grad, scale, first) is True
        results.append(out)
    np.testing.assert_array_equal(results[0], results[1])


sgd_options = st.fixed_dictionaries(
    {
        "lr": st.floats(0, 1),
        "momentum": st.sampled_from([0.0, 0.5, 0.9]),
        "dampening": st.sampled_from([0.0, 0.1]),
        "weight_decay": st.sampled_from([0.0, 1e-2]),
        "nesterov": st.booleans(),
        "scale": st.sampled_from([1.0, 0.25, 1 / 3]),
    }
)


@given(seeds, sizes, sgd_options, st.booleans(), st.integers(0, 3))
def test_sgd_matches_reference(seed, n, opts, in_place, offset):
    if opts["nesterov"] and (opts["momentum"] == 0 or opts["dampening"]):
        opts["nesterov"] = False
    w, g, buf = vectors(seed, n + offset, 3)
    # Unaligned starts exercise the streaming-store prologue.
    w, g, buf = w[offset:], g[offset:], buf[offset:]
    scale = opts.pop("scale")
    results = []
    for kernels in (_core, _reference):
        wk, bk = w.copy(), buf.copy()
        for step in range(3):
            out = wk if in_place else np.empty_like(wk)
            spare = np.empty_like(bk) if opts["momentum"] else None
            ok = kernels.sgd_step(out, wk, g, spare, bk if opts["momentum"] else None, first=step == 0,
                                  scale=scale, **opts)
            assert ok is True
            wk = out
            if opts["momentum"]:
                bk = spare
        results.append((wk, bk))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@given(
    seeds,
    sizes,
    st.floats(1e-4, 1e-1),
    st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.2, 0.99)]),
    st.sampled_from([0.0, 1e-2]),
    st.booleans(),
    st.sampled_from([1.0, 0.5]),
)
def test_adam_matches_reference(seed, n, lr, betas, weight_decay, decoupled, scale):
    w, g = vectors(seed, n, 2)
    results = []
    for kernels in (_core, _reference):
        wk = w.copy()
        m, v = np.zeros_like(w), np.zeros_like(w)
        for step in range(1, 4):
            out, m2, v2 = np.empty_like(w), np.empty_like(w), np.empty_like(w)
            assert kernels.adam_step(out, wk, g, m2, m, v2, v, step, lr, betas[0], betas[1], 1e-8, weight_decay,
                                     decoupled, scale)
            wk, m, v = out, m2, v2
        results.append((wk, m, v))
    for native, reference in zip(*results):
        np.testing.assert_allclose(native, reference, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "reference"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("n, where", [(1, 0), (37, 36), (1000, 3), (1000, 999)])
def test_a_refused_update_touches_no_input(kernels, bad, n, where):
    """Every kernel reports a non-finite gradient and writes nothing but its outputs."""
    rng = np.random.default_rng(n)
    w, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    g[where] = bad
    m, v = np.abs(rng.standard_normal((2, n))).astype(np.float32)
    before = [a.copy() for a in (w, g, m, v)]
    scratch = [np.empty_like(w) for _ in range(3)]
    assert kernels.sgd_step(scratch[0], w, g, None, None, 0.1) is False
    assert kernels.sgd_step(scratch[0], w, g, scratch[1], m, 0.1, momentum=0.9) is False
    assert kernels.sgd_step(scratch[0], w, g, None, None, 0.1, weight_decay=0.1) is False
    assert kernels.adam_step(scratch[0], w, g, scratch[1], m, scratch[2], v, 3, 1e-3) is False
    assert kernels.accumulate(scratch[0], m, g, 1.0, False) is False
    assert kernels.accumulate(scratch[0], None, g, 0.5, True) is False
    for a, b in zip((w, g, m, v), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "reference"])
def test_an_update_that_would_overflow_is_refused(kernels):
    w = np.full(8, 3e38, np.float32)
    g = np.full(8, -1e38, np.float32)  # finite, but w - 10 * g overflows
    out = np.empty_like(w)
    assert kernels.sgd_step(out, w, g, None, None, 10.0) is False
    acc = np.full(8, 3e38, np.float32)
    assert kernels.accumulate(out, acc, np.full(8, 3e38, np.float32), 1.0, False) is False


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "reference"])
def test_argument_errors(kernels):
    w = np.zeros(4, np.float32)
    with pytest.raises(ValueError):
        kernels.sgd_step(w, w, np.zeros(3, np.float32), None, None, 0.1)
    with pytest.raises(ValueError):
        kernels.sgd_step(w, w, w, None, None, 0.1, momentum=0.9)
    with pytest.raises(ValueError):
        kernels.adam_step(w, w, w, w.copy(), w.copy(), w.copy(), w.copy(), 0, 0.1)
    with pytest.raises(ValueError):
        kernels.accumulate(w, w, np.zeros(5, np.float32))
    with pytest.raises(ValueError):
        kernels.accumulate(w, None, w, 1.0, False)


def test_kernels_reject_other_dtypes():
    w = np.zeros(4, np.float64)
    with pytest.raises((ValueError, TypeError)):
        _core.sgd_step(w, w, w, None, None, 0.1)


def _chunked(kernel, n, *arrays, chunk=_core.STREAM_MIN // 3):
    """Run ``kernel`` over slices of ``arrays`` shorter than STREAM_MIN: the direct path."""
    oks = [kernel(*(a if a is None or np.ndim(a) == 0 else a[i:i + chunk] for a in arrays))
           for i in range(0, n, chunk)]
    return all(oks)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_large_updates_written_around_the_cache_equal_the_direct_path(dtype, offset):
    """From STREAM_MIN elements on, the kernels stage tiles and stream them out: bit for bit what
    the same kernels write directly (short slices, or outputs not 16-byte aligned)."""
    n = _core.STREAM_MIN + 37
    rng = np.random.default_rng(7)
    w, g, m = (rng.standard_normal(n + offset).astype(np.float32)[offset:] for _ in range(3))
    v = np.abs(m) + 1
    code = _core.FLOAT32
    if dtype == "bfloat16":
        code = _core.BFLOAT16
        words = np.empty(n, np.uint16)
        _core.narrow(words, g, code)
        g = words

    def outputs(k):
        return [np.empty(n + offset, np.float32)[offset:] for _ in range(k)]

    calls = {
        "sgd momentum": (lambda wo, bo, w, g, b: _core.sgd_step(wo, w, g, bo, b, 0.1, momentum=0.9, grad_dtype=code),
                         2, (w, g, m)),
        "sgd first": (lambda wo, bo, w, g: _core.sgd_step(wo, w, g, bo, None, 0.1, momentum=0.9, weight_decay=0.01,
                                                          first=True, grad_dtype=code), 2, (w, g)),
        "sgd decay": (lambda wo, w, g: _core.sgd_step(wo, w, g, None, None, 0.1, weight_decay=0.01, grad_dtype=code),
                      1, (w, g)),
        "adamw": (lambda wo, mo, vo, w, g, m, v: _core.adam_step(wo, w, g, mo, m, vo, v, 3, 1e-3, weight_decay=0.01,
                                                                 decoupled=True, grad_dtype=code), 3, (w, g, m, v)),
        "accumulate": (lambda o, a, g: _core.accumulate(o, a, g, 0.5, False, code), 1, (m, g)),
        "delayed nesterov milestone": (lambda wo, mo, do, w, g, m, d: _core.delayed_nesterov_step(
            wo, w, g, mo, m, do, d, 6, 0.7, 0.9, 3, 0.25, 0.5, code), 3, (w, g, m, v)),
        "delayed nesterov between": (lambda wo, do, w, g, m, d: _core.delayed_nesterov_step(
            wo, w, g, None, m, do, d, 5, 0.7, 0.9, 3, 0.25, 0.5, code), 2, (w, g, m, v)),
    }
    for name, (kernel, count, inputs) in calls.items():
        whole, parts = outputs(count), outputs(count)
        assert kernel(*whole, *inputs) is True, name
        assert _chunked(kernel, n, *parts, *inputs), name
        for a, b in zip(whole, parts):
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("where", [0, _core.STREAM_MIN - 1, _core.STREAM_MIN + 36])
def test_a_large_refused_update_touches_no_input(where):
    n = _core.STREAM_MIN + 37
    rng = np.random.default_rng(where)
    w, g, m = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    v = np.abs(m)
    g[where] = np.nan
    before = [a.copy() for a in (w, g, m, v)]
    scratch = [np.empty_like(w) for _ in range(3)]
    assert _core.sgd_step(scratch[0], w, g, scratch[1], m, 0.1, momentum=0.9) is False
    assert _core.adam_step(scratch[0], w, g, scratch[1], m, scratch[2], v, 3, 1e-3) is False
    assert _core.accumulate(scratch[0], m, g, 1.0, False) is False
    for step in (5, 6):  # delayed Nesterov, between milestones and at one
        assert _core.delayed_nesterov_step(scratch[0], w, g, scratch[1], m, scratch[2], v, step, 0.7, 0.9, 3) is False
    for a, b in zip((w, g, m, v), before):
        np.testing.assert_array_equal(a, b)
