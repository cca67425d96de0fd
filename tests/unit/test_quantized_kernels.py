"""Quantized gradients (aps.wire.quantized) in the update kernels: decoded as they are read,
bit for bit what the same kernel does with the decoded float32 gradient, native and twin
alike, on the direct and the streaming path, sliced anywhere (a 4-bit code in the middle of
a byte), and refused where a decoded value is not finite."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aps import _core, _reference
from aps.wire.quantized import BLOCK, Quantized, dequantize, quantize, quantized_nbytes, scales_problem

KINDS = [_core.INT8Q, _core.INT4Q]


def payload_of(values: np.ndarray, dtype: int) -> Quantized:
    payload, _ = quantize(values, dtype)
    return Quantized(payload, len(values), dtype)


def kernel_calls(kernels, w, g, m, v, dtype):
    """Each kernel's outputs for gradient ``g`` of ``dtype`` (fresh output arrays)."""
    n = len(w)

    def out():
        return np.empty(n, np.float32)

    results = {}
    o = [out(), out()]
    assert kernels.sgd_step(o[0], w, g, o[1], m, 0.1, momentum=0.9, weight_decay=0.01, nesterov=True, scale=0.5,
                            grad_dtype=dtype)
    results["sgd"] = o
    o = [out()]
    assert kernels.sgd_step(o[0], w, g, None, None, 0.1, grad_dtype=dtype)
    results["sgd plain"] = o
    o = [out(), out(), out()]
    assert kernels.adam_step(o[0], w, g, o[1], m, o[2], v, 3, 1e-3, weight_decay=0.01, decoupled=True,
                             grad_dtype=dtype)
    results["adamw"] = o
    o = [out(), out(), out()]
    assert kernels.delayed_nesterov_step(o[0], w, g, o[1], m, o[2], v, 6, 0.7, 0.9, 3, 0.25, grad_dtype=dtype)
    results["delayed nesterov"] = o
    o = [out()]
    assert kernels.accumulate(o[0], m, g, 0.5, False, dtype)
    results["accumulate"] = o
    o = [out()]
    if dtype == _core.FLOAT32:
        o[0][:] = g
    else:
        kernels.widen(o[0], g, dtype)
    results["widen"] = o
    return results


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 2 * BLOCK + 7), st.sampled_from(KINDS), st.data())
def test_every_kernel_takes_a_quantized_gradient_as_its_decoded_values(seed, n, dtype, data):
    rng = np.random.default_rng(seed)
    w, g, m = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    v = np.abs(m) + 1
    whole = payload_of(g, dtype)
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start, n))
    piece = whole[start:stop]  # (a slice starting in the middle of a block, or of a 4-bit byte)
    decoded = dequantize(piece)
    for kernels in (_core, _reference):
        sliced = [a[start:stop] for a in (w, m, v)]
        got = kernel_calls(kernels, sliced[0], piece, sliced[1], sliced[2], dtype)
        want = kernel_calls(_reference, sliced[0], decoded, sliced[1], sliced[2], _core.FLOAT32)
        for name in got:
            for a, b in zip(got[name], want[name]):
                np.testing.assert_array_equal(a, b, err_msg=f"{kernels.__name__} {name}")


@pytest.mark.parametrize("dtype", KINDS)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_large_quantized_updates_stream_as_the_direct_path_does(dtype, offset):
    n = _core.STREAM_MIN + 301
    rng = np.random.default_rng(11)
    w, g, m = (rng.standard_normal(n + offset).astype(np.float32)[offset:] for _ in range(3))
    v = np.abs(m) + 1
    q = payload_of(g, dtype)
    decoded = dequantize(q)
    got = kernel_calls(_core, w, q, m, v, dtype)
    want = kernel_calls(_core, w, decoded, m, v, _core.FLOAT32)
    for name in got:
        for a, b in zip(got[name], want[name]):
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "twin"])
@pytest.mark.parametrize("dtype", KINDS)
def test_a_scale_that_decodes_past_float32_is_refused(kernels, dtype):
    n = 3 * BLOCK
    g = np.ones(n, np.float32)
    q = payload_of(g, dtype)
    q.scales[1] = np.float32(3e38)  # (a code of 7 or 127 times it is infinite)
    assert scales_problem(q) is None  # (a finite scale above 0: the server takes it)
    assert kernels.all_finite(q, dtype) is False and kernels.all_finite(q[:BLOCK], dtype) is True
    w = np.zeros(n, np.float32)
    assert kernels.sgd_step(np.empty(n, np.float32), w, q, None, None, 0.1, grad_dtype=dtype) is False
    assert kernels.sgd_step(np.empty(BLOCK, np.float32), w[:BLOCK], q[:BLOCK], None, None, 0.1,
                            grad_dtype=dtype) is True


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "twin"])
def test_a_gradient_that_is_not_a_quantized_one_of_its_dtype_is_refused(kernels):
    q = payload_of(np.ones(10, np.float32), _core.INT8Q)
    with pytest.raises(TypeError, match="Quantized of that dtype"):
        kernels.all_finite(np.ones(10, np.float32), _core.INT8Q)
    with pytest.raises(TypeError, match="Quantized of that dtype"):
        kernels.all_finite(q, _core.INT4Q)


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "twin"])
def test_a_range_outside_its_payload_is_refused_before_the_kernel_reads(kernels):
    q = payload_of(np.ones(300, np.float32), _core.INT4Q)
    out = np.empty(600, np.float32)
    for start, stop in ((0, 301), (-1, 10), (20, 10), (0, 513)):
        bad = q[0:300]
        bad.start, bad.stop = start, stop
        with pytest.raises(ValueError, match="outside its payload"):
            kernels.widen(out[: max(0, stop - start)], bad, _core.INT4Q)


def test_the_payload_sizes_and_their_checks():
    assert quantized_nbytes(1000, _core.INT8Q) == 16 + 1000 and quantized_nbytes(1001, _core.INT4Q) == 16 + 501
    with pytest.raises(ValueError, match="1016 bytes"):
        Quantized(np.zeros(1015, np.uint8), 1000, _core.INT8Q)
    with pytest.raises(ValueError, match="not a quantized one"):
        Quantized(np.zeros(4000, np.uint8), 1000, _core.FLOAT32)
    q = payload_of(np.zeros(600, np.float32), _core.INT8Q)
    assert q.scales.tolist() == [1.0, 1.0, 1.0] and not dequantize(q).any()  # (a block of zeros: scale 1)
    q.scales[2] = 0.0
    assert "scale 2" in scales_problem(q)
    with pytest.raises(TypeError, match="range of elements"):
        q[::2]


@pytest.mark.parametrize("dtype", KINDS)
def test_every_scale_the_encoder_makes_is_finite_and_above_0_and_decodes_finite(dtype):
    """A block of a few subnormals (whose scale would round to 0) goes as zeros of scale 1; a
    block at float32's largest value gets the scale a step lower, so that the largest code
    times it is still finite."""
    top = np.finfo(np.float32).max
    tiny = np.float32(3e-45)  # (two subnormal steps: over 127 or 7 it rounds to 0)
    values = np.concatenate([np.full(BLOCK, tiny), np.full(BLOCK, top), -np.full(BLOCK, top), np.zeros(7)])
    values = values.astype(np.float32)
    payload, decoded = quantize(values, dtype)
    q = Quantized(payload, len(values), dtype)
    assert scales_problem(q) is None and np.isfinite(decoded).all()
    assert q.scales[0] == 1.0 and not decoded[:BLOCK].any()
    assert decoded[BLOCK] > top * 0.99 and decoded[2 * BLOCK] < -top * 0.99
    assert _core.all_finite(q, dtype)
