import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aps.errors import DTypeMismatch, LayoutMismatch
from aps.layout import SHARD_ALIGN, Layout, line_aligned, shard_bounds


def test_offsets_and_views_share_memory():
    layout = Layout.from_arrays({"w": np.zeros((2, 3)), "b": np.zeros(3), "s": np.float32(1.0)})
    assert layout.offsets == (0, 6, 9) and layout.sizes == (6, 3, 1)
    assert layout.numel == 10 and layout.nbytes == 40
    flat = np.arange(10, dtype=np.float32)
    views = layout.views(flat)
    assert views["w"].shape == (2, 3) and views["s"].shape == ()
    views["b"][:] = -1
    assert (flat[6:9] == -1).all()


def test_flatten_into_converts_and_orders():
    layout = Layout(("a", "b"), ((2,), (1,)))
    flat = np.zeros(3, np.float32)
    layout.flatten_into({"b": [9.0], "a": np.array([1, 2], np.int64)}, flat)
    assert flat.tolist() == [1.0, 2.0, 9.0]


def test_check_reports_names_shapes_and_dtypes():
    layout = Layout(("a", "b"), ((2,), (1,)))
    with pytest.raises(LayoutMismatch, match="missing"):
        layout.check({"a": np.zeros(2, np.float32)})
    with pytest.raises(LayoutMismatch, match="unexpected"):
        layout.check({"a": np.zeros(2, np.float32), "b": np.zeros(1, np.float32), "c": np.zeros(1, np.float32)})
    with pytest.raises(LayoutMismatch, match="shape"):
        layout.check({"a": np.zeros(3, np.float32), "b": np.zeros(1, np.float32)})
    with pytest.raises(DTypeMismatch):
        layout.check({"a": np.zeros(2, np.int64), "b": np.zeros(1, np.float32)})
    layout.check({"a": np.zeros(2, np.float64), "b": np.zeros(1, np.float16)})  # converted where copied


def test_difference():
    a = Layout(("x", "y"), ((2,), (3,)))
    assert a.difference(Layout(("x", "y"), ((2,), (3,)))) is None
    assert "order" in a.difference(Layout(("y", "x"), ((3,), (2,))))
    assert "shape" in a.difference(Layout(("x", "y"), ((2,), (4,))))
    assert "names" in a.difference(Layout(("x", "z"), ((2,), (3,))))


def test_invalid_layouts():
    with pytest.raises(LayoutMismatch):
        Layout(("a", "a"), ((1,), (1,)))
    with pytest.raises(LayoutMismatch):
        Layout(("",), ((1,),))


def test_sizes_never_wrap_around():
    with pytest.raises(LayoutMismatch, match="more than"):
        Layout(("w",), ((2**62 + 1, 4),))
    with pytest.raises(LayoutMismatch):
        Layout(("w",), ((-1, 4),))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3), min_size=1, max_size=8), st.integers(1, 5))
def test_shards_cut_the_flat_vector_into_balanced_pieces_that_put_back_together(shapes, shards):
    layout = Layout(tuple(f"t{i}" for i in range(len(shapes))), tuple(tuple(s) for s in shapes))
    if layout.numel < shards * SHARD_ALIGN and shards > 1:
        with pytest.raises(LayoutMismatch, match="too small"):
            shard_bounds(layout.numel, shards)
        return
    bounds = shard_bounds(layout.numel, shards)
    assert bounds[0] == 0 and bounds[-1] == layout.numel and list(bounds) == sorted(bounds)
    assert all(b % SHARD_ALIGN == 0 for b in bounds[1:-1])
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 2 * SHARD_ALIGN  # balanced in bytes
    flat = np.arange(layout.numel, dtype=np.float32)
    named = layout.views(flat)
    pieces, names = [], []
    for index in range(shards):
        piece = layout.shard(index, shards)
        assert piece.numel == sizes[index]
        for name, shape in zip(piece.names, piece.shapes):
            base, _, cut = name.partition("[")
            whole = named[base].reshape(-1)
            if cut:
                start, end = (int(x) for x in cut.rstrip("]").split(":"))
                assert shape == (end - start,) and 0 <= start < end <= whole.size
                pieces.append(whole[start:end])
            else:
                assert shape == layout.shapes[layout.names.index(name)]
                pieces.append(whole)
            names.append(base)
    assert np.array_equal(np.concatenate(pieces) if pieces else flat, flat)  # in order, nothing twice or lost
    assert sorted(set(names)) == sorted(layout.names)  # every tensor (the empty ones too) is somewhere


def test_one_shard_is_the_whole_layout():
    layout = Layout(("w", "b"), ((4, 3), (3,)))
    assert layout.shard(0, 1) == layout and shard_bounds(layout.numel, 1) == (0, 15)


@pytest.mark.parametrize("numel", [1, 15, 16, 1000, (1 << 20) + 3])
def test_line_aligned_vectors_start_a_cache_line(numel):
    vector = line_aligned(numel)
    assert vector.dtype == np.float32 and vector.shape == (numel,) and not vector.any()
    assert vector.ctypes.data % 64 == 0
    vector[:] = 1.0  # writable, and its own
    assert line_aligned(numel).sum() == 0


def test_the_servers_slots_and_optimizer_state_start_cache_lines():
    """The kernels' streaming stores write whole lines only into outputs that start one
    (numpy's own large arrays start 16 bytes into a page)."""
    from aps.server.engine.jobs.updates import Aggregate
    from aps.server.engine.optim import make_optimizer
    from aps.server.engine.table import HeapBlock

    numel = (1 << 20) + 5
    arrays = [HeapBlock(numel).array, *Aggregate(numel)._buffers]
    arrays += make_optimizer("sgd", numel, lr=0.1, momentum=0.9)._buffers
    adam = make_optimizer("adam", numel, lr=0.1)
    arrays += adam._m + adam._v
    assert all(array.ctypes.data % 64 == 0 for array in arrays)
