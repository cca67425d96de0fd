import numpy as np
import pytest

from aps.errors import DTypeMismatch, LayoutMismatch
from aps.layout import Layout


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
        layout.check({"a": np.zeros(2, np.float64), "b": np.zeros(1, np.float32)})


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
