"""The embedding tables a server holds (aps.server.engine.rows.RowTable) with both kernel
implementations: rows made from their id by their first push (a pull reads a row not held
at its initial values and keeps nothing), pulls and pushes by id against torch's own sparse
embedding and optimizers, refusals that change nothing, checkpoints, memory that follows
the rows pushed, the limit on it, and ids spread evenly over shards."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import aps
from aps.errors import ConfigurationError, InvalidIds, NonFiniteGradient
from aps.server.engine.rows import RowTable
from aps.tables import Table, check_tables, shard_of

torch.sparse.check_sparse_tensor_invariants.disable()  # (torch warns unless a program chooses)

N, DIM = 200, 16


def zipf_batches(seed: int, steps: int, size: int = 64, rows: int = N):
    """Skewed ids (a few ids many times a batch) and upstream gradients, as a recommender's."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield (rng.zipf(1.3, size).astype(np.int64) % rows,
               rng.standard_normal((size, DIM)).astype(np.float32))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_a_table_trains_as_torch_trains_a_sparse_embedding(kernels, optimizer):
    """nn.Embedding(sparse=True) from the table's initial rows, with torch.optim.SGD, Adagrad
    and SparseAdam on the same batches: SGD bit for bit, Adagrad and Adam to float rounding."""
    lr = {"sgd": 0.1, "adagrad": 0.05, "adam": 0.01}[optimizer]
    table = Table(rows=N, dim=DIM, init="normal:0.5", optimizer=optimizer, lr=lr)
    rows = RowTable("items", table, capacity=4, kernels=kernels)  # growing on the way
    emb = torch.nn.Embedding(N, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(table.initial_rows("items", np.arange(N))))
    opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.SparseAdam}[optimizer](
        emb.parameters(), lr=lr)
    for ids, upstream in zipf_batches(1, 25):
        opt.zero_grad()
        (emb(torch.from_numpy(ids)) * torch.from_numpy(upstream)).sum().backward()
        opt.step()
        rows.push(ids, upstream)
    touched = np.unique(np.concatenate([ids for ids, _ in zipf_batches(1, 25)]))
    assert len(rows) == len(touched) and rows.steps == 25
    got, want = rows.pull(touched), emb.weight.detach().numpy()[touched]
    if optimizer == "sgd":
        assert np.array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rowwise_adagrad_keeps_one_value_a_row(kernels):
    """FBGEMM's row-wise Adagrad: s_r += mean(g_r * g_r); w_r -= lr * g_r / (sqrt(s_r) + eps)."""
    table = Table(rows=N, dim=DIM, init="uniform:0.1", optimizer="rowwise_adagrad", lr=0.2, eps=1e-6)
    rows = RowTable("t", table, kernels=kernels)
    w = table.initial_rows("t", np.arange(N)).astype(np.float64)
    s = np.zeros(N)
    for ids, upstream in zipf_batches(2, 10):
        rows.push(ids, upstream)
        g = np.zeros((N, DIM))
        np.add.at(g, ids, upstream.astype(np.float64))
        hit = np.unique(ids)
        s[hit] += (g[hit] ** 2).mean(axis=1)
        w[hit] -= 0.2 * g[hit] / (np.sqrt(s[hit])[:, None] + 1e-6)
    assert rows.arrays()["sum"].shape == (len(rows), 1)
    np.testing.assert_allclose(rows.pull(np.arange(N)), w, rtol=2e-5, atol=2e-6)


def test_a_row_is_the_same_whoever_makes_it_and_whenever(kernels):
    table = Table(rows=10**12, dim=8, init="normal:1", seed=7)
    first, second = RowTable("a", table, kernels=kernels), RowTable("a", table, kernels=kernels)
    ids = np.array([3, 10**11, 42, 3, 999_999_999_999], np.int64)
    a = first.pull(ids)
    second.push(ids[::-1].copy(), np.zeros((5, 8), np.float32))  # made by a push (of nothing)
    b = second.pull(ids)
    assert np.array_equal(a, b) and np.array_equal(a[0], a[3])
    np.testing.assert_array_equal(a, table.initial_rows("a", ids))
    other = RowTable("b", table, kernels=kernels).pull(ids)  # another table's rows differ
    assert not np.array_equal(a, other)
    assert len(first) == 0 and len(second) == 4


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("init", ["zeros", "normal:0.3", "uniform:2"])
def test_a_pull_keeps_nothing_and_reads_what_the_first_push_starts_from(kernels, optimizer, init):
    """A pull of rows not held reads their initial values and makes no row, however many it
    asks for; the first push of a row starts from exactly those values (and zero state): the
    same table pushed without any pull before holds the same rows, bit for bit."""
    table = Table(rows=10**12, dim=6, init=init, optimizer=optimizer, lr=0.1)
    pulled, direct = RowTable("t", table, kernels=kernels), RowTable("t", table, kernels=kernels)
    ids = np.array([10**11, 7, 7, 123_456_789, 5], np.int64)
    before = pulled.pull(ids)
    for _ in range(3):
        pulled.pull(np.arange(10**9, 10**9 + 2000))
    assert len(pulled) == 0 and pulled.rows_pulled == 6005 and pulled.steps == 0
    assert pulled.arrays()["ids"].size == 0
    np.testing.assert_array_equal(before, table.initial_rows("t", ids))
    pulled.push(ids, np.zeros((5, 6), np.float32))  # zero gradients: every optimizer keeps the values
    np.testing.assert_array_equal(pulled.pull(ids), before)
    direct.push(ids, np.zeros((5, 6), np.float32))
    grads = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    for rows in (pulled, direct):
        rows.push(np.array([7, 99, 5, 99]), grads)  # a row held, and one made by this push (twice)
    assert pulled.pull([99])[0].tolist() != table.initial_rows("t", np.array([99]))[0].tolist()
    direct, pulled = direct.arrays(), pulled.arrays()
    assert sorted(direct) == sorted(pulled) and sorted(pulled["ids"].tolist()) == [5, 7, 99, 123_456_789, 10**11]
    for key in direct:
        assert np.array_equal(direct[key], pulled[key]), key


def test_a_pull_of_rows_held_and_not_reads_each_as_it_is(kernels):
    table = Table(rows=10**6, dim=3, init="uniform:1", optimizer="sgd", lr=1.0)
    rows = RowTable("t", table, capacity=2, kernels=kernels)
    held = np.arange(1000, 0, -3, dtype=np.int64)  # more rows than the slab holds: it grows
    rows.push(held, np.ones((len(held), 3), np.float32))
    ids = np.array([2, 1000, 5, 997, 2, 1], np.int64)  # 2, 5: not held; 1000, 997, 1: held
    expected = table.initial_rows("t", ids)
    expected[[1, 3, 5]] -= np.float32(1.0)
    np.testing.assert_array_equal(rows.pull(ids), expected)
    np.testing.assert_array_equal(rows.pull(held), table.initial_rows("t", held) - np.float32(1.0))
    assert len(rows) == len(held)


def test_pulls_go_into_the_callers_buffer_in_order_with_duplicates():
    rows = RowTable("t", Table(rows=100, dim=4, init="uniform:1"))
    out = np.empty((3, 4), np.float32)
    assert rows.pull([9, 1, 9], out=out) is out and np.array_equal(out[0], out[2])
    with pytest.raises(InvalidIds, match=r"out must be C-contiguous float32 of shape \(3, 4\)"):
        rows.pull([9, 1, 9], out=np.empty((3, 5), np.float32))
    assert rows.rows_pulled == 3


@pytest.mark.parametrize(("ids", "grads", "error", "message"), [
    ([1, -2], np.ones((2, 4)), InvalidIds, "id -2 is negative"),
    ([1, 100], np.ones((2, 4)), InvalidIds, "id 100 is not below its 100 rows"),
    (np.array([1.0, 2.0]), np.ones((2, 4)), InvalidIds, "ids must be integers, got float64"),
    (np.array([[1, 2]]), np.ones((2, 4)), InvalidIds, "one-dimensional"),
    (np.array([2**63 + 5], np.uint64), np.ones((1, 4)), InvalidIds, "beyond int64"),
    ([1, 2], np.ones((2, 5)), InvalidIds, r"shape \(2, 4\) \(one row of dim 4 per id\), got \(2, 5\)"),
    ([1, 2], np.ones((2, 4), np.int32), InvalidIds, "must be floats, got int32"),
    ([1, 2], np.array([[1, 1, 1, np.nan], [1, 1, 1, 1]]), NonFiniteGradient, "NaN or infinity"),
    ([1, 2], np.full((2, 4), 1e38), NonFiniteGradient, "would make a weight or its optimizer state infinite"),
    ([7, 1, 8], np.full((3, 4), 1e38), NonFiniteGradient, "would make a weight or its optimizer state infinite"),
])
def test_bad_pushes_are_refused_and_change_nothing(kernels, ids, grads, error, message):
    rows = RowTable("t", Table(rows=100, dim=4, init="uniform:1", optimizer="adagrad", lr=1e10), kernels=kernels)
    rows.push([1, 2, 3], np.ones((3, 4)))
    before, steps = rows.arrays(), rows.steps
    with pytest.raises(error, match=message):
        rows.push(ids, grads)
    after = rows.arrays()
    assert rows.steps == steps and sorted(after) == sorted(before)
    for key in before:
        assert np.array_equal(after[key], before[key]), key


def test_a_checkpoint_restores_the_rows_and_their_state_exactly(kernels):
    table = Table(rows=10**9, dim=DIM, init="normal:0.1", optimizer="adam", lr=0.01)
    rows = RowTable("items", table, kernels=kernels)
    batches = list(zipf_batches(3, 20, rows=10**9))
    for ids, upstream in batches[:10]:
        rows.push(ids, upstream)
    saved = rows.arrays()
    assert sorted(saved) == ["exp_avg", "exp_avg_sq", "ids", "rows"] and len(saved["ids"]) == len(rows)
    restored = RowTable.restored("items", table, saved, rows.steps, kernels=kernels)
    for ids, upstream in batches[10:]:
        rows.push(ids, upstream)
        restored.push(ids, upstream)
    every = np.unique(np.concatenate([ids for ids, _ in batches]))
    assert np.array_equal(restored.pull(every), rows.pull(every))
    with pytest.raises(InvalidIds, match="names an id twice"):
        RowTable.restored("items", table, {**saved, "ids": np.zeros_like(saved["ids"])}, 1, kernels=kernels)
    with pytest.raises(InvalidIds, match="exp_avg has shape"):
        RowTable.restored("items", table, {**saved, "exp_avg": saved["exp_avg"][:, :3]}, 1, kernels=kernels)


def test_the_declaration_is_checked_naming_the_field():
    for fields, message in [({"rows": 0}, "rows=0"), ({"dim": 2**17}, "dim=131072"),
                            ({"init": "gauss:1"}, "init='gauss:1'"), ({"init": "normal:-1"}, "STD and BOUND"),
                            ({"optimizer": "lamb"}, "optimizer='lamb'"), ({"lr": float("nan")}, "lr=nan"),
                            ({"betas": (0.9, 1.0)}, "betas="), ({"evict": "no"}, "evict='no'"),
                            ({"eps": "1e-8"}, "eps='1e-8'"), ({"lr": np.True_}, "lr=np.True_"),
                            ({"rows": 1.0}, "rows=1.0"), ({"init": "uniform:1e39"}, "from 0 to 1e"),
                            ({"lr": 10**400}, "lr=")]:
        with pytest.raises(ConfigurationError, match=message):
            Table(**{"rows": 10, "dim": 4, **fields})
    table = Table(rows=10, dim=4, optimizer="adagrad")
    assert table.eps == 1e-10 and Table.from_description(table.describe()) == table
    assert table.difference("t", Table(rows=10, dim=8, optimizer="adagrad")) == (
        "table 't': dim is 4 in this run, 8 in the declaration")
    assert isinstance(Table(rows=10, dim=4, eps=np.float32(1e-6)).eps, float)  # (and so JSON can take it)
    with pytest.raises(ConfigurationError, match="without '/'"):
        check_tables({"a/b": table})
    with pytest.raises(ConfigurationError, match="unknown fields: colour"):
        Table.from_description({**table.describe(), "colour": "red"})
    assert Table(rows=1, dim=1).init_kind() == (aps._core.INIT_NORMAL, 0.01)


def test_memory_follows_the_rows_touched_not_the_key_space():
    """A table of 10^10 declared rows with 10^6 distinct rows touched: the server's memory
    grows by at most 1.5 times the bytes of those rows and their Adagrad state."""
    script = """
import numpy as np, psutil
from aps.tables import Table
from aps.server.engine.rows import RowTable
table = Table(rows=10**10, dim=64, init="uniform:0.01", optimizer="adagrad", lr=0.1)
process = psutil.Process()
before = process.memory_info().rss
rows = RowTable("items", table)
rng = np.random.default_rng(0)
ids = rng.choice(10**10, 1_000_000, replace=False).astype(np.int64)
grad = np.ones((100_000, 64), np.float32)
for start in range(0, len(ids), 100_000):
    rows.push(ids[start:start + 100_000], grad)
del grad
grown = process.memory_info().rss - before
print(len(rows), grown, len(rows) * table.row_bytes())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    held, grown, needed = map(int, out.stdout.split())
    assert held == 1_000_000
    print(f"RSS grew {grown / 2**20:.0f} MiB for {needed / 2**20:.0f} MiB of rows and state ({grown / needed:.2f}x)")
    assert grown <= 1.5 * needed


def test_ids_spread_evenly_over_shards_even_when_skewed():
    """A Zipf(1.1) id stream (a few ids very often): the distinct ids each of 4 shards holds
    are within 10% of the mean, and within a shard the index still spreads them."""
    rng = np.random.default_rng(0)
    ids = np.unique(rng.zipf(1.1, 2_000_000).astype(np.int64) % 10**8)
    counts = np.bincount(shard_of(ids, 4), minlength=4)
    assert counts.sum() == len(ids) and counts.max() / counts.mean() <= 1.1, counts
    assert np.array_equal(shard_of(ids, 1), np.zeros(len(ids)))
    one = ids[shard_of(ids, 4) == 2]
    hashed = np.empty(len(one), np.uint64)
    aps._core.mix64(one, hashed)
    low = np.bincount((hashed & np.uint64(15)).astype(np.int64), minlength=16)  # the index's bits
    assert low.max() / low.mean() <= 1.1, low


# --table-memory ---------------------------------------------------------------------
def request(tables, name, ids, grads=None):
    """One request's rows through the tables, as the session takes it: checked (and fitted
    into the limit) first, then pushed (applied) or pulled."""
    from aps.wire.rows import RowSection

    index = list(tables).index(name)
    ids = np.asarray(ids, np.int64)
    if grads is None:
        tables.check([], [RowSection(index, ids, None)])
        return tables.pull([RowSection(index, ids, None)])[0]
    tables.check([RowSection(index, ids, grads)], [])
    tables.commit(tables.prepare([RowSection(index, ids, grads)]))
    return None


def test_the_least_recently_used_rows_give_way_and_come_back_from_their_initial_values(kernels):
    from aps.server.engine.rows import Tables

    table = Table(rows=10**9, dim=8, init="normal:0.1", optimizer="sgd", lr=1.0, evict=True)
    row_cost = table.row_bytes() + 32
    tables = Tables({"items": RowTable("items", table, kernels=kernels)}, limit=2000 * row_cost)
    fresh = RowTable("items", table, kernels=kernels)
    hot = np.arange(10)
    for step in range(50):  # the hot rows are touched every request, the cold ones once
        request(tables, "items", hot, np.ones((10, 8), np.float32))
        request(tables, "items", 1000 + step * 100 + np.arange(100), np.zeros((100, 8), np.float32))
        request(tables, "items", 10**8 + step * 1000 + np.arange(1000))  # a pull makes no row, evicts none
        assert tables.nbytes <= tables.limit + 100 * row_cost
    rows = tables["items"]
    assert rows.rows_evicted > 0 and len(rows) < 5010
    expected = fresh.pull(hot)
    for _ in range(50):  # the hot rows kept every update
        expected -= np.float32(1.0)
    assert np.array_equal(request(tables, "items", hot), expected)
    assert np.array_equal(request(tables, "items", [1000, 1001]), fresh.pull([1000, 1001]))  # evicted: initial


def test_a_request_that_cannot_fit_is_refused_and_changes_nothing(kernels):
    from aps.errors import TableMemoryFull
    from aps.server.engine.rows import Tables

    keep = Table(rows=10**6, dim=8, optimizer="sgd", lr=1.0)
    spare = Table(rows=10**6, dim=8, optimizer="sgd", lr=1.0, evict=True)
    cost = keep.row_bytes() + 32
    tables = Tables({"keep": RowTable("keep", keep, kernels=kernels), "spare": RowTable("spare", spare,
                                                                                         kernels=kernels)},
                    limit=250 * cost)
    zeros = np.zeros((200, 8), np.float32)
    request(tables, "spare", np.arange(200), zeros)
    request(tables, "keep", np.arange(200), zeros)  # the table that may evict gives up its rows
    assert len(tables["spare"]) < 200 and len(tables["keep"]) == 200
    before = tables["keep"].arrays()
    with pytest.raises(TableMemoryFull, match="no rows to give up|too few rows"):
        request(tables, "keep", 1000 + np.arange(250), np.ones((250, 8), np.float32))
    after = tables["keep"].arrays()
    assert all(np.array_equal(before[key], after[key]) for key in before)
    alone = Tables({"keep": RowTable("keep", keep, kernels=kernels)}, limit=100 * cost)
    with pytest.raises(TableMemoryFull, match=r"no table is declared evict=True: nothing changed\. Start the "
                       r"server with a larger --table-memory SIZE \(0: no limit\), or declare the tables evict=True"):
        request(alone, "keep", np.arange(200), zeros)
    assert len(alone["keep"]) == 0 and alone.used == 0
    request(alone, "keep", np.arange(200))  # a pull of as many rows goes through: it makes none
    assert len(alone["keep"]) == 0 and alone.used == 0


def test_a_request_that_makes_no_row_fits_whatever_the_tables_hold(kernels):
    """Past the limit (requests in flight may pass it), a request of rows held, or of one new
    id many times over, is counted for what it makes: nothing, or one row."""
    from aps.server.engine.rows import Tables

    table = Table(rows=10**6, dim=8, optimizer="sgd", lr=1.0)
    tables = Tables({"keep": RowTable("keep", table, kernels=kernels)}, limit=10**9)
    request(tables, "keep", np.arange(300), np.zeros((300, 8), np.float32))
    tables.limit = 100 * tables["keep"].row_cost  # (as if the limit were passed by requests in flight)
    request(tables, "keep", np.arange(300), np.ones((300, 8), np.float32))  # rows held: fits
    assert np.array_equal(request(tables, "keep", [5, 5, 5]), RowTable("keep", table).pull([5, 5, 5]) - 1.0)
    tables.limit = 301 * tables["keep"].row_cost
    request(tables, "keep", np.full(5000, 777), np.zeros((5000, 8), np.float32))  # one new row, 5,000 times: fits
    assert len(tables["keep"]) == 301


def test_a_refused_request_evicts_nothing_and_a_reply_is_bounded(kernels):
    from aps.errors import TableMemoryFull
    from aps.server.engine.rows import Tables

    spare = Table(rows=10**6, dim=8, optimizer="sgd", lr=1.0, evict=True)
    cost = spare.row_bytes() + 32
    tables = Tables({"spare": RowTable("spare", spare, kernels=kernels)}, limit=400 * cost, max_reply=1 << 16)
    request(tables, "spare", np.arange(200), np.ones((200, 8), np.float32))
    before = tables["spare"].arrays()
    with pytest.raises(TableMemoryFull, match="too few rows to give up"):
        request(tables, "spare", 10**5 + np.arange(1000), np.zeros((1000, 8), np.float32))  # past all the limit
    after = tables["spare"].arrays()
    assert all(np.array_equal(before[key], after[key]) for key in before)  # nothing dropped
    with pytest.raises(InvalidIds, match="over the 65536 a frame may carry"):
        request(tables, "spare", np.zeros(4096, np.int64))  # 128 KiB of rows asked with 32 KiB of ids


def test_rows_in_memory_their_sender_may_still_write_are_taken_safely(kernels):
    """A shared-memory worker's rows lie in its segment, which it may write again at any
    time: the ids checked are a copy (writing the segment afterwards changes nothing the
    server uses), and gradient rows kept for a round are copied; rows read straight into a
    reply's room lie there in the wire's layout, each table's 8-aligned."""
    from aps.server.engine.rows import Tables
    from aps.wire.rows import RowSection, encode_rows

    odd = Table(rows=100, dim=3, optimizer="sgd", lr=1.0)
    tables = Tables({"odd": RowTable("odd", odd, kernels=kernels), "even": RowTable("even", Table(rows=100, dim=4),
                                                                                  kernels=kernels)})
    grads = np.ones((3, 3), np.float32)
    parts = encode_rows([RowSection(0, np.array([1, 2, 1]), grads)], [3, 4], True)
    parts += encode_rows([RowSection(0, np.array([7]), None), RowSection(1, np.array([9]), None)], [3, 4], False)
    segment = np.frombuffer(b"".join(bytes(p) for p in parts), np.uint8).copy()
    segment.flags.writeable = False  # (the server maps a worker's segment read-only)
    pushed, pulled = tables.intake(segment, True, True, shared=True)
    segment.flags.writeable = True
    segment[:] = 0  # the worker writes there again: ids of 0, rows of zeros
    assert [list(section.ids) for section in pushed] == [[1, 2, 1]]
    assert [list(section.ids) for section in pulled] == [[7], [9]]
    tables.accumulate(tables.kept(pushed), 1.0, True, 0)
    kept = tables._round[0][0][2]
    assert kept.flags.writeable and not np.shares_memory(kept, segment) and not kept.any()
    segment[:] = 0xFF  # NaN written after the check: the copy a round would keep is refused
    with pytest.raises(NonFiniteGradient, match="NaN or infinity"):
        tables.kept(pushed)
    room = np.zeros(64, np.uint8)
    into = tables.pull(pulled, lambda nbytes: room[:nbytes])
    assert [np.shares_memory(rows, room) for rows in into] == [True, True]
    expected = np.concatenate([tables["odd"].pull(np.array([7])).ravel(), np.zeros(1, np.float32),
                               tables["even"].pull(np.array([9])).ravel()])
    assert np.array_equal(room[: expected.nbytes].view(np.float32), expected)


def test_a_push_of_several_tables_refused_in_one_changes_none(kernels):
    """The second table's update would overflow: the first table's rows, held and new, and
    the second's are as before, and no row was made in either."""
    from aps.server.engine.rows import Tables
    from aps.wire.rows import RowSection

    calm = Table(rows=100, dim=4, init="uniform:1", optimizer="adam", lr=0.1)
    wild = Table(rows=100, dim=4, init="uniform:1", optimizer="adagrad", lr=1e10)
    tables = Tables({"calm": RowTable("calm", calm, kernels=kernels), "wild": RowTable("wild", wild, kernels=kernels)})
    for name in tables:
        request(tables, name, [1, 2], np.ones((2, 4), np.float32))
    before = {name: rows.arrays() for name, rows in tables.items()}
    pushed = [RowSection(0, np.array([1, 50, 51]), np.ones((3, 4), np.float32)),
              RowSection(1, np.array([2, 60]), np.full((2, 4), 1e38, np.float32))]
    tables.check(pushed, [])
    with pytest.raises(NonFiniteGradient, match="table 'wild': the update would make"):
        tables.commit(tables.prepare(pushed))
    for name, rows in tables.items():
        assert len(rows) == 2 and rows.steps == 1
        after = rows.arrays()
        assert all(np.array_equal(before[name][key], after[key]) for key in after), name
    assert np.array_equal(tables["calm"].pull([50]), calm.initial_rows("calm", np.array([50])))


def test_the_default_limit_is_half_the_memory_available_and_given_overrides_it():
    import psutil

    from aps.errors import TableMemoryFull
    from aps.server.engine.memory import TableMemory, available_memory
    from aps.server.engine.rows import Tables

    default = TableMemory.resolve(None)
    assert 0 < default.limit <= psutil.virtual_memory().total // 2 and default.default
    assert default.available == pytest.approx(available_memory(), rel=0.5)
    assert "table memory up to" in default.describe() and "half the" in default.describe()
    assert TableMemory.resolve(None, available=3 << 30).limit == 3 << 29
    given = TableMemory.resolve(64 << 20)
    assert (given.limit, given.default, given.describe()) == (64 << 20, False, "table memory up to 64.0 MiB "
                                                                                "(--table-memory)")
    assert TableMemory.resolve(0).limit == 0 and "unlimited" in TableMemory.resolve(0).describe()
    table = Table(rows=10**6, dim=8)
    small = TableMemory.resolve(None, available=2 * 100 * (table.row_bytes() + 36))
    tables = Tables({"t": RowTable("t", table)}, memory=small)
    assert tables.limit == small.limit
    request(tables, "t", np.arange(100), np.zeros((100, 8), np.float32))
    with pytest.raises(TableMemoryFull, match=r"\(the default: half the 13\.3 KiB available when the server "
                                              r"started\), and this push makes up to 68 more"):
        request(tables, "t", [100], np.zeros((1, 8), np.float32))
    assert len(tables["t"]) == 100


def test_the_memory_available_is_what_the_tightest_control_group_leaves(tmp_path):
    """A container's or a batch job's limit (cgroup v2 up the hierarchy, or v1) counts: the
    tightest limit less its use; none (``max``, v1's huge number) is no limit."""
    from aps.server.engine.memory import _cgroup_room

    def write(path, **files):
        (tmp_path / path).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (tmp_path / path / name.replace("_", ".", 1)).write_text(text)

    write("job/step", memory_max="max\n", memory_current="5\n")
    write("job", memory_max=f"{3 << 30}\n", memory_current=f"{1 << 30}\n")
    assert _cgroup_room("0::/job/step\n", tmp_path) == 2 << 30
    write("job/step", memory_max=f"{1 << 30}\n", memory_current=f"{1 << 29}\n")
    assert _cgroup_room("0::/job/step\n", tmp_path) == 1 << 29
    assert _cgroup_room("0::/elsewhere\n", tmp_path) is None and _cgroup_room("garbage\n", tmp_path) is None
    write("memory/slurm", **{"memory_limit_in_bytes": f"{4 << 30}\n", "memory_usage_in_bytes": f"{1 << 30}\n"})
    write("memory", **{"memory_limit_in_bytes": "9223372036854771712\n", "memory_usage_in_bytes": "7\n"})
    assert _cgroup_room("12:cpu,cpuacct:/slurm\n4:memory:/slurm\n", tmp_path) == 3 << 30
