"""The model (aps.server.engine.model) through its seams: the configuration and the sync
policy that say what to make, the allocator of the table's slots (a recording one here),
and what the other parts read of it (table, layout, running sum, embedding tables)."""

import numpy as np
import pytest

from aps import _core
from aps.config import ServerConfig
from aps.errors import LayoutMismatch, NonFiniteGradient, TableMismatch
from aps.layout import Layout
from aps.server.engine import model as model_module
from aps.server.engine.model import Model, check_model
from aps.server.engine.sync import make_policy
from aps.server.engine.table import HeapBlock
from aps.tables import Table

N = 5
TABLES = (("items", Table(rows=100, dim=2)),)
LAYOUT = Layout(("w",), ((N,),), TABLES)


class Block(HeapBlock):
    """A slot's memory that says when it is given back."""

    __slots__ = ("closed",)

    def close(self) -> None:
        self.closed.append(self)


class Blocks:
    """An allocator of snapshot slots that remembers which it gave out and which came back."""

    def __init__(self) -> None:
        self.made: list[Block] = []
        self.closed: list[Block] = []

    def __call__(self, numel, *, populate=False):
        block = Block(numel, populate=populate)
        block.closed = self.closed
        self.made.append(block)
        return block


def model(blocks=None, **options) -> Model:
    options.setdefault("sync", "asp")
    config = ServerConfig(**options)
    return Model(config, make_policy(config), _core, blocks)


def test_registration_makes_the_table_its_optimizer_and_the_tables_all_at_once():
    m = model(optimizer="adam", lr=0.01)
    assert m.table is None and m.version == 0 and m.weights is None
    m.create(LAYOUT, np.arange(N, dtype=np.float32))
    assert m.weights.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and m.layout is LAYOUT
    assert m.table.optimizer.name == "adam" and m.table.compensation is None
    assert list(m.rows) == ["items"] and m.rows.memory is m.table_memory
    assert m.aggregate is None  # ASP sums nothing


def test_a_policy_that_sums_gradients_gets_a_running_sum_and_compensation_its_state():
    bsp = model(sync="bsp", workers=2)
    bsp.create(LAYOUT, np.zeros(N, np.float32))
    assert bsp.aggregate is not None and len(bsp.aggregate.current) >= N
    compensated = model(compensation="dc:0.1")
    compensated.create(LAYOUT, np.zeros(N, np.float32))
    assert compensated.table.compensation is not None


def test_non_finite_initial_weights_make_nothing():
    blocks = Blocks()
    m = model(blocks)
    with pytest.raises(NonFiniteGradient):
        m.create(LAYOUT, np.array([0, 0, np.nan, 0, 0], np.float32))
    assert m.table is None and blocks.made == []


def test_a_failure_half_way_gives_back_what_was_made(monkeypatch):
    blocks = Blocks()
    m = model(blocks, sync="bsp", workers=2)

    def out_of_memory(numel):
        raise MemoryError("no room for the running sum")

    monkeypatch.setattr(model_module, "Aggregate", out_of_memory)
    with pytest.raises(MemoryError):
        m.create(LAYOUT, np.zeros(N, np.float32))
    assert m.table is None and blocks.made and blocks.closed == blocks.made


def test_forgetting_the_model_gives_its_slots_back():
    blocks = Blocks()
    m = model(blocks)
    m.create(LAYOUT, np.zeros(N, np.float32))
    m.forget()
    assert m.table is None and m.layout is None and m.aggregate is None and not m.rows
    assert blocks.closed == blocks.made


def test_a_joining_model_must_be_the_runs_tensors_and_tables():
    check_model(LAYOUT, Layout(("w",), ((N,),), TABLES))
    with pytest.raises(LayoutMismatch, match=r"1 tensors, 5 parameters, tables items.*Start a fresh server"):
        check_model(LAYOUT, Layout(("w",), ((N + 1,),), TABLES))
    with pytest.raises(TableMismatch, match="items"):
        check_model(LAYOUT, Layout(("w",), ((N,),), (("items", Table(rows=100, dim=3)),)))
