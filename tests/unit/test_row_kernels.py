"""The embedding tables' native kernels (native/_rows.h) against their plain-Python twins,
and against torch's own sparse updates: the id hash, rows made from their id, the index,
and the row-wise optimizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aps import _core, _reference

seeds = st.integers(0, 2**32 - 1)
# torch asks that a program choose whether sparse tensors are checked (it warns otherwise)
torch.sparse.check_sparse_tensor_invariants.disable()


def batch(seed: int, n: int, distinct: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` entries over ``distinct`` rows (duplicates likely): where, and their gradients."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, distinct, n).astype(np.int64), rng.standard_normal((n, dim)).astype(np.float32)


@given(st.lists(st.integers(0, 2**63 - 1), max_size=50))
def test_mix64_is_the_same_on_both(values):
    ids = np.array(values, np.int64)
    native, twin = np.zeros(len(ids), np.uint64), np.zeros(len(ids), np.uint64)
    _core.mix64(ids, native)
    _reference.mix64(ids, twin)
    assert np.array_equal(native, twin)


def test_mix64_is_splitmix64():
    """The published SplitMix64 sequence from seed 0 is mix64(0), mix64(golden), mix64(2 golden)..."""
    golden = 0x9E3779B97F4A7C15
    ids = np.array([(k * golden) % 2**64 for k in range(3)], np.uint64).view(np.int64)
    out = np.zeros(3, np.uint64)
    _core.mix64(ids, out)
    assert [hex(v) for v in out.tolist()] == ["0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4", "0x6c45d188009454f"]


@pytest.mark.parametrize("kind", [_core.INIT_ZEROS, _core.INIT_NORMAL, _core.INIT_UNIFORM])
def test_a_row_is_made_from_its_id_alone(kind):
    ids = np.array([0, 1, 2**40 + 3, 1, 2**63 - 1], np.int64)
    native, twin = np.empty((5, 37), np.float32), np.empty((5, 37), np.float32)
    _core.rows_init(native, ids, 12345, kind, 0.5)
    _reference.rows_init(twin, ids, 12345, kind, 0.5)
    np.testing.assert_allclose(native, twin, rtol=1e-6, atol=1e-7)  # libm against numpy's log and cos
    assert np.array_equal(native[1], native[3])  # the same id, the same row, wherever it is made
    again = np.empty((1, 37), np.float32)
    _core.rows_init(again, ids[2:3], 12345, kind, 0.5)
    assert np.array_equal(again[0], native[2])
    other = np.empty((5, 37), np.float32)
    _core.rows_init(other, ids, 54321, kind, 0.5)
    assert (kind == _core.INIT_ZEROS) == np.array_equal(other, native)  # another seed, other rows


def test_the_initializers_draw_what_they_say():
    rows = np.empty((20_000, 16), np.float32)
    ids = np.arange(20_000, dtype=np.int64)
    _core.rows_init(rows, ids, 3, _core.INIT_NORMAL, 0.01)
    assert abs(rows.mean()) < 2e-4 and rows.std() == pytest.approx(0.01, rel=0.02)
    _core.rows_init(rows, ids, 3, _core.INIT_UNIFORM, 0.25)
    assert rows.min() > -0.25 and rows.max() < 0.25 and rows.std() == pytest.approx(0.25 / 3**0.5, rel=0.02)
    assert rows.min() < -0.249 and rows.max() > 0.249


@given(seeds, st.integers(0, 300), st.integers(1, 1000))
def test_the_index_is_the_same_on_both(seed, n, spread):
    rng = np.random.default_rng(seed)
    native, twin = _core.RowIndex(), _reference.RowIndex()
    for _ in range(3):  # growing past its first buckets on the way
        ids = rng.integers(0, spread, n).astype(np.int64) * 7919
        got, want = np.empty(n, np.int64), np.empty(n, np.int64)
        assert native.lookup(ids, got) == twin.lookup(ids, want)
        assert np.array_equal(got, want)
    assert len(native) == len(twin) and np.array_equal(native.ids(), twin.ids())
    probe = np.array([-0 + 1, 2**62], np.int64)
    got, want = np.empty(2, np.int64), np.empty(2, np.int64)
    native.lookup(probe, got, add=False)
    twin.lookup(probe, want, add=False)
    assert np.array_equal(got, want) and len(native) == len(twin)


def test_the_index_refuses_a_negative_id_and_changes_nothing():
    index = _core.RowIndex()
    index.lookup(np.array([4, 8], np.int64), np.empty(2, np.int64))
    with pytest.raises(ValueError, match=r"ids\[1\] = -3 is negative"):
        index.lookup(np.array([9, -3], np.int64), np.empty(2, np.int64))
    assert len(index) == 2 and index.ids().tolist() == [4, 8]


def test_the_index_holds_a_million_ids_in_32_bytes_each_at_most():
    index = _core.RowIndex()
    ids = (np.arange(1_000_000, dtype=np.int64) * 1_000_003) % (2**62)
    rows = np.empty(len(ids), np.int64)
    assert index.lookup(ids, rows) == 1_000_000 and np.array_equal(rows, np.arange(1_000_000))
    assert index.nbytes <= 32 * 2**20 * 2  # at most half full, 16 bytes a bucket
    again = np.empty(len(ids), np.int64)
    assert index.lookup(ids[::-1].copy(), again, add=False) == 0 and np.array_equal(again, rows[::-1])
    assert np.array_equal(index.ids(), ids)


@given(seeds, st.integers(0, 200), st.integers(1, 20), st.integers(0, 40))
def test_sgd_coalesce_adagrad_and_adam_are_the_same_on_both(seed, n, distinct, dim):
    where, grad = batch(seed, n, distinct, dim)
    rng = np.random.default_rng(seed + 1)
    w = rng.standard_normal((distinct, dim)).astype(np.float32)
    results = []
    for kernels in (_core, _reference):
        mine = w.copy()
        ok = kernels.rows_sgd(mine, where, grad, 0.1)
        summed = np.zeros((distinct, dim), np.float32)
        kernels.rows_coalesce(summed, where, grad)
        state, rowwise = np.full(distinct * dim, 0.1, np.float32), np.full(distinct, 0.1, np.float32)
        ada, ada_rows = w.copy(), w.copy()
        ok_ada = kernels.rows_adagrad(ada, state, summed, 0.05)
        ok_rows = kernels.rows_adagrad(ada_rows, rowwise, summed, 0.05, rowwise=True)
        m, v, adam = np.zeros_like(w), np.zeros_like(w), w.copy()
        ok_adam = kernels.rows_adam(adam, m, v, summed, 3, 1e-2)
        results.append((ok, mine, summed, ok_ada, ada, state, ok_rows, ada_rows, rowwise, ok_adam, adam, m, v))
    for native, twin in zip(*results, strict=True):
        if isinstance(native, bool):
            assert native == twin
        else:
            np.testing.assert_allclose(native, twin, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kernels", [_core, _reference], ids=["native", "reference"])
def test_a_non_finite_gradient_is_reported(kernels):
    w = np.zeros((2, 3), np.float32)
    grad = np.ones((2, 3), np.float32)
    grad[1, 2] = np.nan
    assert kernels.rows_sgd(w.copy(), np.array([0, 1], np.int64), grad, 0.1) is False
    assert kernels.rows_adagrad(w.copy(), np.zeros(6, np.float32), grad, 0.1) is False
    assert kernels.rows_adam(w.copy(), w.copy(), w.copy(), grad, 1, 0.1) is False
    with pytest.raises(ValueError, match=r"where\[0\] = 5 is not one of the 2 rows"):
        kernels.rows_sgd(w, np.array([5, 0], np.int64), grad, 0.1)


def apply(kind: str, w: np.ndarray, state: list[np.ndarray], ids: np.ndarray, grad: np.ndarray, step: int,
          lr: float) -> None:
    """One step on the rows ``ids`` touch, as the server makes it: the distinct rows gathered,
    the kernel on them, scattered back."""
    rows, where = np.unique(ids, return_inverse=True)
    compact = w[rows]
    if kind == "sgd":
        assert _core.rows_sgd(compact, where.astype(np.int64), grad, lr)
    else:
        summed = np.zeros((len(rows), w.shape[1]), np.float32)
        _core.rows_coalesce(summed, where.astype(np.int64), grad)
        if kind == "adagrad":
            s = state[0][rows]
            assert _core.rows_adagrad(compact, s.reshape(-1), summed, lr)
            state[0][rows] = s
        else:
            m, v = state[0][rows], state[1][rows]
            assert _core.rows_adam(compact, m, v, summed, step, lr)
            state[0][rows], state[1][rows] = m, v
    w[rows] = compact


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_the_row_optimizers_equal_torch_on_a_sparse_embedding(kind):
    """nn.Embedding(sparse=True) trained by torch.optim.SGD, Adagrad and SparseAdam, with
    duplicate ids in every batch: SGD bit for bit, Adagrad and Adam to float rounding."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(100, 16, sparse=True)
    w = emb.weight.detach().numpy().copy()
    lr = {"sgd": 0.1, "adagrad": 0.05, "adam": 0.01}[kind]
    opt = {"sgd": lambda: torch.optim.SGD(emb.parameters(), lr=lr),
           "adagrad": lambda: torch.optim.Adagrad(emb.parameters(), lr=lr),
           "adam": lambda: torch.optim.SparseAdam(emb.parameters(), lr=lr)}[kind]()
    state = [np.zeros_like(w), np.zeros_like(w)]
    rng = np.random.default_rng(1)
    for step in range(1, 21):
        ids = rng.zipf(1.3, 64).astype(np.int64) % 100  # skewed: a few ids many times a batch
        upstream = rng.standard_normal((64, 16)).astype(np.float32)
        opt.zero_grad()
        (emb(torch.from_numpy(ids)) * torch.from_numpy(upstream)).sum().backward()
        opt.step()
        apply(kind, w, state, ids, upstream, step, lr)
    if kind == "sgd":
        assert np.array_equal(w, emb.weight.detach().numpy())
    else:
        np.testing.assert_allclose(w, emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)


@given(seeds, st.integers(0, 100), st.integers(1, 50), st.integers(0, 20))
def test_gather_and_scatter_are_the_same_on_both(seed, n, rows, dim):
    rng = np.random.default_rng(seed)
    slab = rng.standard_normal((rows, dim)).astype(np.float32)
    picked = rng.integers(0, rows, n).astype(np.int64)
    native, twin = np.empty((n, dim), np.float32), np.empty((n, dim), np.float32)
    _core.rows_gather(native, slab, picked)
    _reference.rows_gather(twin, slab, picked)
    assert np.array_equal(native, twin) and np.array_equal(native, slab[picked])
    distinct = np.unique(picked)
    values = rng.standard_normal((len(distinct), dim)).astype(np.float32)
    mine, theirs = slab.copy(), slab.copy()
    _core.rows_scatter(mine, values, distinct)
    _reference.rows_scatter(theirs, values, distinct)
    assert np.array_equal(mine, theirs) and np.array_equal(mine[distinct], values)
    with pytest.raises(ValueError, match="is not one of"):
        _core.rows_gather(np.empty((1, dim), np.float32), slab, np.array([rows], np.int64))


def test_an_index_too_large_to_address_is_refused_at_once():
    """(Doubling the buckets past 2**62 wrapped to 0, and the constructor spun forever.)"""
    for capacity in (2**61 + 1, 2**62, -1):
        with pytest.raises(ValueError, match="an index holds 0 to 2"):
            _core.RowIndex(capacity)


@given(seeds, st.integers(0, 200), st.integers(1, 60))
def test_distinct_rows_are_the_same_on_both_and_leave_the_scratch_clean(seed, n, rows):
    picked = np.random.default_rng(seed).integers(0, rows, n).astype(np.int64)
    mark = np.zeros(rows, np.int32)
    where, twin_where = np.empty(n, np.int64), np.empty(n, np.int64)
    distinct = _core.rows_distinct(picked, where, mark)
    twin = _reference.rows_distinct(picked, twin_where, mark.copy())
    assert np.array_equal(distinct, twin) and np.array_equal(where, twin_where)
    assert np.array_equal(distinct[where], picked)  # each entry's place among them
    _, first = np.unique(picked, return_index=True)
    assert np.array_equal(distinct, picked[np.sort(first)])  # in the order first met
    assert not mark.any()
    with pytest.raises(ValueError, match="is not one of"):
        _core.rows_distinct(np.array([rows], np.int64), np.empty(1, np.int64), mark)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50))
def test_the_range_of_ids_is_the_same_on_both(values):
    ids = np.array(values, np.int64)
    assert _core.ids_range(ids) == _reference.ids_range(ids) == (min(values), max(values))


def test_a_lookup_without_adding_says_how_many_ids_it_did_not_find():
    for kind in (_core, _reference):
        index = kind.RowIndex(8)
        assert index.lookup(np.array([3, 9], np.int64), np.empty(2, np.int64)) == 2  # added
        rows = np.empty(4, np.int64)
        assert index.lookup(np.array([9, 4, 4, 3], np.int64), rows, add=False) == 2
        assert list(rows) == [1, -1, -1, 0] and len(index) == 2
