"""16-bit gradients and weights: the conversions, and the kernels that widen as they read.

The conversions are checked against numpy's float16 and torch's bfloat16 (both
round to nearest even): widening over every one of the 65,536 words, narrowing
over the special values and a million random bit patterns, on the native
module (F16C and portable code) and its reference twin. Every kernel given a
16-bit gradient must equal the same kernel given that gradient widened to
float32, bit for bit, including the refusal of NaN and infinity.
"""

from __future__ import annotations

import numpy as np
import pytest

from aps import _core, _reference
from aps.wire.protocol import DType, Flag, unpack_header
from aps.client.core import _ClientCore

torch = pytest.importorskip("torch")

SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519.99, 65520, -65520, 1e5,
                    6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-9, 1.17549435e-38, 1e-40, 3.0e38, 3.4028235e38,
                    1 + 2**-8, 1 + 3 * 2**-9, 1 + 2**-11, 1 + 3 * 2**-12], np.float32)


def samples() -> np.ndarray:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    normal = rng.standard_normal(1 << 16).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 1 << 16)
    return np.concatenate([SPECIAL, bits, normal.astype(np.float32)])


def torch_bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.fixture(params=["f16c", "portable"])
def f16c(request):
    """The native fp16 conversions both ways: with F16C (when the CPU has it) and without."""
    _core.use_f16c(request.param == "f16c")
    yield request.param
    _core.use_f16c(True)


def test_widening_every_word(kernels, f16c):
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    expected = {
        _core.FLOAT16: words.view(np.float16).astype(np.float32),
        _core.BFLOAT16: torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).float().numpy(),
    }
    for dtype, want in expected.items():
        got = np.empty(len(words), np.float32)
        kernels.widen(got, words, dtype)
        nan = np.isnan(want)
        assert np.isnan(got[nan]).all()
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_narrowing_rounds_to_nearest_even(kernels, f16c):
    x = samples()
    nan = np.isnan(x)
    with np.errstate(over="ignore"):
        expected = {_core.FLOAT16: x.astype(np.float16).view(np.uint16), _core.BFLOAT16: torch_bf16(x)}
    for dtype, want in expected.items():
        got = np.empty(len(x), np.uint16)
        overflowed = kernels.narrow(got, x, dtype)
        assert np.array_equal(got[~nan], want[~nan])
        back = _reference.widened(got, dtype)
        assert np.isnan(back[nan]).all()  # NaN stays NaN: never a number, never infinity
        assert np.array_equal(np.signbit(back[nan]), np.signbit(x[nan]))
        assert overflowed == int((np.isinf(back) & np.isfinite(x)).sum())
    assert kernels.narrow(np.empty(2, np.uint16), np.array([65504, 65519], np.float32), _core.FLOAT16) == 0
    assert kernels.narrow(np.empty(2, np.uint16), np.array([65520, -1e9], np.float32), _core.FLOAT16) == 2


def test_conversions_refuse_bad_arguments(kernels):
    with pytest.raises(ValueError):
        kernels.narrow(np.empty(3, np.uint16), np.zeros(3, np.float32), _core.FLOAT32)
    with pytest.raises(ValueError):
        kernels.widen(np.empty(2, np.float32), np.zeros(3, np.uint16), _core.BFLOAT16)
    with pytest.raises(ValueError):
        kernels.all_finite(np.zeros(3, np.uint16), 99)


def half_case(dtype: int, n: int = 10_007, seed: int = 0):
    """A 16-bit gradient (more than two widening blocks, not a multiple of them) and its float32 twin."""
    rng = np.random.default_rng(seed)
    words = np.empty(n, np.uint16)
    _core.narrow(words, rng.standard_normal(n).astype(np.float32), dtype)
    return words, _reference.widened(words, dtype), rng


@pytest.mark.parametrize("dtype", [_core.BFLOAT16, _core.FLOAT16], ids=["bf16", "fp16"])
def test_kernels_on_16_bit_gradients_equal_them_on_the_widened_gradient(kernels, dtype):
    words, wide, rng = half_case(dtype)
    n = len(words)
    w = rng.standard_normal(n).astype(np.float32)
    state = rng.standard_normal(n).astype(np.float32)

    def both(call):
        outs = []
        for grad in (words, wide):
            out = [np.full(n, np.nan, np.float32) for _ in range(3)]
            ok = call(out, grad, dtype if grad is words else _core.FLOAT32)
            outs.append((ok, out))
        (ok16, out16), (ok32, out32) = outs
        assert ok16 is ok32 is True
        for a, b in zip(out16, out32):
            assert np.array_equal(a, b, equal_nan=True)

    both(lambda o, g, d: kernels.sgd_step(o[0], w, g, None, None, 0.1, scale=0.5, grad_dtype=d))
    both(lambda o, g, d: kernels.sgd_step(o[0], w, g, o[1], state, 0.1, 0.9, 0.1, 1e-2, False, False, 0.25,
                                          grad_dtype=d))
    both(lambda o, g, d: kernels.sgd_step(o[0], w, g, o[1], None, 0.1, 0.9, 0.0, 0.0, True, True, grad_dtype=d))
    both(lambda o, g, d: kernels.adam_step(o[0], w, g, o[1], state, o[2], np.abs(state), 3, 1e-3,
                                           weight_decay=0.01, decoupled=True, scale=2.0, grad_dtype=d))
    both(lambda o, g, d: kernels.accumulate(o[0], w, g, 0.5, False, grad_dtype=d))
    both(lambda o, g, d: kernels.accumulate(o[0], None, g, 0.5, True, grad_dtype=d))
    assert kernels.all_finite(words, dtype)


@pytest.mark.parametrize("dtype", [_core.BFLOAT16, _core.FLOAT16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("where", [0, 4095, 4096, 10_006])
def test_a_16_bit_nan_or_infinity_is_refused_wherever_it_is(kernels, dtype, where):
    words, _, rng = half_case(dtype)
    n = len(words)
    w = rng.standard_normal(n).astype(np.float32)
    exponent = 0x7F80 if dtype == _core.BFLOAT16 else 0x7C00
    for bad in (exponent, exponent | 1, exponent | 0x8000):  # +inf, NaN, -inf
        words[where] = bad
        out = np.empty(n, np.float32)
        assert not kernels.all_finite(words, dtype)
        assert kernels.sgd_step(out, w, words, None, None, 0.1, grad_dtype=dtype) is False
        assert kernels.adam_step(out, w, words, out.copy(), w, out.copy(), np.abs(w), 1, 1e-3,
                                 grad_dtype=dtype) is False
        assert kernels.accumulate(out, w, words, 1.0, False, grad_dtype=dtype) is False


def test_a_16_bit_gradient_must_be_uint16_words():
    with pytest.raises(ValueError):
        _core.sgd_step(np.empty(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32), None, None,
                       0.1, grad_dtype=_core.BFLOAT16)


def test_a_compressed_push_is_sent_again_exactly_as_first_sent():
    """A lost reply: the push goes again with its header's flags, dtype and 16-bit payload."""
    core = _ClientCore(0, 1)
    core.compression, core.compress_pulls = _core.BFLOAT16, True
    core.init_request({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)})
    grads = {"a": np.array([1, 2, 3], np.float32), "b": np.array([1 + 2**-9, -0.5], np.float32)}
    first = core.push_request(grads, then_pull=True)
    again = core.resend_push()
    head, head_again = unpack_header(first[0]), unpack_header(again[0])
    assert head == head_again
    assert head.dtype == DType.BFLOAT16 and head.flags == Flag.NARROW and head.length == 10
    assert bytes(first[1]) == bytes(again[1])
    assert np.frombuffer(bytes(first[1]), np.uint16).tolist() == [0x3F80, 0x4000, 0x4040, 0x3F80, 0xBF00]


def test_an_init_without_values_copies_none_and_a_retry_with_values_sends_the_callers():
    """A server that has the model gets the layout alone and the values are not copied; if the
    INIT goes again to a server without the model (it restarted meanwhile), the caller's values
    are what it sends."""
    core = _ClientCore(0, 1)
    params = {"a": np.array([1, 2, 3], np.float32), "b": np.array([4, 5], np.float32)}
    sent = core.init_request(params, values=False)
    assert len(sent) == 2 and (core.flat_weights == 0).all()  # header and layout; nothing copied
    again = core.init_request(None, rejoin=True, values=True)
    assert unpack_header(again[0]).length == len(again[1]) + 20
    assert np.frombuffer(bytes(again[2]), np.float32).tolist() == [1, 2, 3, 4, 5]
