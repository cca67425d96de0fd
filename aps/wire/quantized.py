"""Block-quantized gradients on the wire: int8 and 4-bit, each block of :data:`BLOCK` elements
with a float32 scale (``compression="int8"`` or ``"int4"``; docs/protocol.md, "Quantized
pushes").

A payload of ``n`` elements is ``ceil(n / BLOCK)`` little-endian float32 scales, then the codes:
``n`` signed bytes (INT8), or ``ceil(n / 2)`` bytes of two signed 4-bit codes each, the lower
nibble the even element (INT4). Element ``i`` is ``code[i] * scale[i // BLOCK]`` in float32.
The encoder picks each block's scale as its largest magnitude over the largest code (127 or
7), and 1 for a block of zeros (or of values so small that the scale would round to 0), so
that every scale is finite and above 0: a receiver refuses any other (:func:`scales_problem`).

:class:`Quantized` is a payload seen as a gradient: it has a length and slices by element, as
the update kernels take gradients (``grad[start:stop]``), and the kernels decode its elements
as they read them (``aps._core``'s ``_Gradient``), in the same pass as the update.
"""

from __future__ import annotations

import numpy as np

from .protocol import DType

__all__ = [
    "BLOCK",
    "QUANTIZED",
    "Quantized",
    "dequantize",
    "quantize",
    "quantized_nbytes",
    "scales_problem",
]

#: Elements per scale.
BLOCK = 256
#: The quantized element types, with the largest code of each.
QUANTIZED = {int(DType.INT8Q): 127, int(DType.INT4Q): 7}


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _codes_nbytes(n: int, dtype: int) -> int:
    return n if dtype == DType.INT8Q else -(-n // 2)


def quantized_nbytes(n: int, dtype: int) -> int:
    """The payload's length for ``n`` elements of ``dtype`` (INT8Q or INT4Q)."""
    return 4 * _blocks(n) + _codes_nbytes(n, dtype)


class Quantized:
    """The elements ``[start, stop)`` of a quantized payload (a uint8 array): ``len()`` and slices
    by element, the whole payload kept (a slice is a view: the scales and codes stay where they are)."""

    __slots__ = ("codes", "dtype", "scales", "start", "stop")

    def __init__(self, payload: np.ndarray, n: int, dtype: int, start: int = 0, stop: int | None = None) -> None:
        if int(dtype) not in QUANTIZED:
            raise ValueError(f"element type {dtype} is not a quantized one")
        if payload.dtype != np.uint8 or payload.ndim != 1 or len(payload) != quantized_nbytes(n, dtype):
            raise ValueError(f"a quantized payload of {n} elements is {quantized_nbytes(n, dtype)} bytes")
        self.dtype = int(dtype)
        head = 4 * _blocks(n)
        self.scales = payload[:head].view(np.float32)
        self.codes = payload[head:]
        self.start, self.stop = start, n if stop is None else stop

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getitem__(self, index: slice) -> Quantized:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a quantized gradient slices by a range of elements")
        lo, hi, _ = index.indices(len(self))
        view = object.__new__(Quantized)
        view.dtype, view.scales, view.codes = self.dtype, self.scales, self.codes
        view.start, view.stop = self.start + lo, self.start + max(lo, hi)
        return view


def scales_problem(gradient: Quantized) -> str | None:
    """Why the scales of ``gradient`` (a whole payload) cannot be taken, or None: each must be
    finite and above 0 (the encoder's; a 0 would hide the codes, an infinity make them so)."""
    scales = gradient.scales
    bad = np.flatnonzero(~(np.isfinite(scales) & (scales > 0)))
    if len(bad):
        return f"scale {int(bad[0])} of the quantized gradient is {scales[bad[0]]}: every scale must be finite and > 0"
    return None


def _check_range(gradient: Quantized) -> None:
    codes = len(gradient.codes) if gradient.dtype == DType.INT8Q else 2 * len(gradient.codes)
    if not 0 <= gradient.start <= gradient.stop <= min(codes, BLOCK * len(gradient.scales)):
        raise ValueError("the quantized gradient's range is outside its payload")


def _codes_of(gradient: Quantized) -> np.ndarray:
    """The signed codes of ``gradient``'s elements, as int8."""
    _check_range(gradient)
    index = np.arange(gradient.start, gradient.stop)
    if gradient.dtype == DType.INT8Q:
        return gradient.codes[gradient.start : gradient.stop].view(np.int8)
    packed = gradient.codes[index >> 1]
    nibbles = np.where(index & 1, packed >> 4, packed & 15).astype(np.int8)
    return (nibbles ^ 8) - 8


def dequantize(gradient: Quantized) -> np.ndarray:
    """``gradient``'s elements in float32: ``code * scale``, as the kernels decode them."""
    codes = _codes_of(gradient)
    index = np.arange(gradient.start, gradient.stop)
    with np.errstate(over="ignore", invalid="ignore"):
        return codes.astype(np.float32) * gradient.scales[index // BLOCK]


def quantize(values: np.ndarray, dtype: int) -> tuple[np.ndarray, np.ndarray]:
    """``(payload, decoded)``: the float32 ``values`` quantized to ``dtype`` (INT8Q or INT4Q),
    each block's scale its largest magnitude over the largest code, codes rounded to nearest
    (ties to even); and what a receiver decodes of it, for the sender's error feedback. Values
    that are not finite give a scale that is not, which the receiver refuses."""
    top = QUANTIZED[int(dtype)]
    values = np.ascontiguousarray(values, np.float32).ravel()
    n = len(values)
    blocks = _blocks(n)
    padded = np.zeros(blocks * BLOCK, np.float32)
    padded[:n] = values
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        largest = np.abs(padded.reshape(blocks, BLOCK)).max(axis=1) if blocks else np.zeros(0, np.float32)
        scales = (largest / np.float32(top)).astype(np.float32)
        # A block whose largest value is a few subnormals has a scale that rounds to 0: it is sent
        # as zeros (scale 1), its values left to the sender's error feedback; so is a block of zeros.
        scales[scales == 0] = 1.0
        # Near float32's largest value, top * scale may round past it: the scale a step lower.
        for _ in range(4):
            over = np.isfinite(scales) & ~np.isfinite(scales * np.float32(top))
            if not over.any():
                break
            scales[over] = np.nextafter(scales[over], np.float32(0))
        # (a NaN or an infinity anywhere in a block makes its scale so: refused by the receiver)
        scales[~np.isfinite(largest)] = largest[~np.isfinite(largest)]
        codes = np.clip(np.rint(padded / np.repeat(scales, BLOCK)), -top, top)
        codes = np.nan_to_num(codes).astype(np.int8)[:n]
    payload = np.empty(quantized_nbytes(n, dtype), np.uint8)
    payload[: 4 * blocks] = scales.view(np.uint8)
    if dtype == DType.INT8Q:
        payload[4 * blocks :] = codes.view(np.uint8)
    else:
        nibbles = (codes.astype(np.uint8) & 15).astype(np.uint8)
        if n % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        payload[4 * blocks :] = nibbles[0::2] | (nibbles[1::2] << 4)
    return payload, dequantize(Quantized(payload, n, dtype))
