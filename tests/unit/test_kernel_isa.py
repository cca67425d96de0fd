"""The kernels compiled for several instruction sets (native/_wide.inc: Adam and AdamW, a
round's sum, delay compensation and its step scale) give the baseline's results bit for bit
on every one this processor runs, including which inputs they refuse; APS_KERNEL_ISA picks one."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from aps import _core
from aps.layout import line_aligned

ISAS = _core.kernel_isas()
#: Lengths that leave a remainder for every vector width, below and above the streaming-store size.
SIZES = (1, 7, 1003, _core.STREAM_MIN + 37)


@pytest.fixture(autouse=True)
def _restore_isa():
    chosen = _core.kernel_isa()
    yield
    _core.set_kernel_isa(chosen)


def _on_every_isa(run):
    """``run()`` (arrays, then whether the kernel took its input) on each instruction set: all
    must equal the baseline's (only the refusal, when refused: the outputs are scratch then)."""
    results = {}
    for isa in ISAS:
        _core.set_kernel_isa(isa)
        results[isa] = run()
    base = results["baseline"]
    for isa, got in results.items():
        assert got[-1] == base[-1], isa
        for expected, value in zip(base[:-1] if base[-1] else (), got):
            if isinstance(expected, np.ndarray):
                assert expected.tobytes() == value.tobytes(), isa
            else:
                assert expected == value, isa
    return base


def _out(n: int, aligned: bool) -> np.ndarray:
    """An output: 64-byte aligned as the server's buffers are (large results are then copied out
    with the widest streaming stores), or only 16 (SSE's)."""
    if aligned:
        return line_aligned(n)
    raw = line_aligned(n + 4)
    return raw[4:]  # (16 bytes past a line)


def _arrays(n: int, seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n, dtype=np.float32) for _ in range(count)]


@pytest.mark.parametrize("aligned", [True, False], ids=["line-aligned", "16-byte-aligned"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("decoupled, weight_decay, beta1", [(False, 0.0, 0.9), (False, 0.01, 0.3), (True, 0.01, 0.9),
                                                             (True, 0.0, 0.3)])
def test_adam_and_adamw_give_the_baselines_bits_on_every_instruction_set(n, decoupled, weight_decay, beta1, aligned):
    w, g, m = _arrays(n, n, 3)
    v = np.abs(_arrays(n, n + 1, 1)[0])

    def run():
        outs = [_out(n, aligned) for _ in range(3)]
        ok = _core.adam_step(outs[0], w, g, outs[1], m, outs[2], v, 7, 1e-3, beta1=beta1, weight_decay=weight_decay,
                             decoupled=decoupled, scale=0.5)
        return (*outs, ok)

    *_, ok = _on_every_isa(run)
    assert ok
    g[n // 2] = np.nan  # refused alike
    *_, ok = _on_every_isa(run)
    assert not ok


@pytest.mark.parametrize("aligned", [True, False], ids=["line-aligned", "16-byte-aligned"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("first", [True, False])
def test_a_rounds_sum_gives_the_baselines_bits_on_every_instruction_set(n, first, aligned):
    inp, g = _arrays(n, n, 2)

    def run():
        out = _out(n, aligned)
        return out, _core.accumulate(out, inp, g, 0.37, first)

    assert _on_every_isa(run)[1]
    g[-1] = np.inf
    assert not _on_every_isa(run)[1]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", [_core.COMPENSATE_DC, _core.COMPENSATE_DC_ADAPTIVE, _core.COMPENSATE_GAP])
def test_compensation_and_its_step_scale_give_the_baselines_bits_on_every_instruction_set(n, kind):
    g, w, then = _arrays(n, n, 3)
    state = np.abs(_arrays(n, n + 2, 1)[0])

    def run():
        out, state_out, scale = (np.empty(n, np.float32) for _ in range(3))
        ok = _core.compensate(out, g, w, then, state_out, state, kind, lam=0.04, decay=0.95, eps=1e-7, corr=1.3)
        _core.step_scale(scale, state, w, then, 0.9)
        return out, (state_out if kind == _core.COMPENSATE_DC_ADAPTIVE else None), scale, ok

    assert _on_every_isa(run)[-1]


def test_the_widest_instruction_set_runs_unless_one_is_chosen_and_a_bad_choice_changes_nothing():
    assert ISAS[0] == "baseline" and set(ISAS) <= set(_core.KERNEL_ISAS)
    for isa in ISAS:
        _core.set_kernel_isa(isa)
        assert _core.kernel_isa() == isa
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        _core.set_kernel_isa("sse9")
    assert _core.kernel_isa() == ISAS[-1]
    code = "from aps import _core; print(_core.kernel_isa())"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == ISAS[-1]  # the widest, by default
