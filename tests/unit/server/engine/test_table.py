import numpy as np

from aps.layout import Layout
from aps.server.engine.optim import SGD
from aps.server.engine.table import SLOT_MEMORY, ParameterTable


def make_table(n=8):
    layout = Layout(("w",), ((n,),))
    return ParameterTable(layout, np.zeros(n, np.float32), SGD(n, lr=1.0))


def update(table, value):
    slot = table.begin_update()
    assert table.optimizer.step(slot.array, table.current_array(), np.full(table.numel, -value, np.float32))
    table.optimizer.commit()
    return table.publish(slot)


def test_versions_and_out_of_place_updates():
    table = make_table()
    with table.snapshot() as first:
        assert first.version == 0
        assert update(table, 1.0) == 1
        assert update(table, 2.0) == 2
        # The leased snapshot still shows version 0.
        assert (first.array == 0).all()
    assert (table.weights == 3).all()


def test_leased_slots_are_never_reused():
    table = make_table()
    leases = []
    for step in range(5):
        leases.append(table.snapshot())
        update(table, 1.0)
    for version, lease in enumerate(leases):
        assert lease.version == version
        assert (lease.array == version).all()
    assert table.slot_count == 6
    for lease in leases:
        lease.release()
    for _ in range(10):
        update(table, 1.0)
    assert table.slot_count == 6  # kept: up to as many as were in use lately, and two more
    for _ in range(2 * SLOT_MEMORY):
        update(table, 1.0)
    assert table.slot_count == 3  # the burst is forgotten: the current one, the one being written, one spare


def test_readers_that_come_and_go_reuse_the_same_slots():
    """Leases that rise and fall (many workers pulling) do not make a new slot each time."""
    table = make_table()
    leases: list = []
    made: set[int] = set()
    for step in range(3 * SLOT_MEMORY):
        if step % 16 < 8:
            leases.append(table.snapshot())
        elif leases:
            leases.pop(0).release()
        update(table, 1.0)
        made |= table.slot_ids()
    assert len(made) <= 8 + 3  # at most 8 leases at once: no slot given back and made again


def test_abandoned_update_changes_nothing():
    table = make_table()
    slot = table.begin_update()
    slot.array[:] = 99
    table.abandon(slot)
    assert table.version == 0 and (table.weights == 0).all()
    assert update(table, 1.0) == 1 and (table.weights == 1).all()


def test_a_spare_slot_is_made_ahead_for_a_join():
    """add_spare makes the slot a joining worker's lease will need, before an update needs it:
    its page faults paid off the lane; one at a time; nothing when two are free already."""
    table = make_table()
    made: list = []
    asked: list = []

    def background(make, done):  # runs later, as a thread would
        asked.append(True)
        made.append((make, done))

    lease = table.snapshot()
    update(table, 1.0)  # slots: the leased version 0, the current version 1
    assert table.slot_count == 2
    table.add_spare(background)
    table.add_spare(background)  # one is coming already
    assert len(asked) == 1
    make, done = made.pop()
    block = make()
    assert block.nbytes == 4 * table.numel
    done(block)
    assert table.slot_count == 3 and block.id in table.slot_ids()
    second = table.snapshot()  # the joiner's lease: the update writes into the spare, no new slot
    update(table, 1.0)
    assert table.slot_count == 3 and (lease.array == 0).all() and (second.array == 1).all()
    lease.release()
    second.release()
    update(table, 1.0)
    table.add_spare(background)  # two free already (versions 0 and 1): nothing to make
    assert len(asked) == 1 and (table.weights == 3).all()


def test_a_spare_that_fails_or_comes_late_changes_nothing():
    table = make_table()
    calls: list = []
    table.add_spare(lambda make, done: calls.append(done))
    calls.pop()(MemoryError("no room"))  # the background work failed: slots are made when needed
    assert table.slot_count == 1
    update(table, 1.0)
    assert (table.weights == 1).all()
    table.add_spare(lambda make, done: calls.append((make, done)))  # asked again: it may come now

    class Block:
        def __init__(self):
            self.closed = False

        def close(self):
            self.closed = True

    late = Block()
    _, done = calls.pop()
    table.close()
    done(late)  # the table closed meanwhile: the block is given back, not kept
    assert late.closed



def test_a_spare_made_but_never_taken_in_is_given_back_at_close():
    """The loop stopped before it took the spare in (its callback cancelled, or the loop
    closed): the table still gives the block back when it closes; one made after the close
    is given back at once."""
    import threading

    from aps.server.engine.table import HeapBlock

    blocks: list = []

    class Block(HeapBlock):
        def __init__(self, numel, populate=False):
            super().__init__(numel, populate=populate)
            self.closed = False
            blocks.append(self)

        def close(self):
            self.closed = True

    layout = Layout(("w",), ((8,),))
    tables = [ParameterTable(layout, np.zeros(8, np.float32), SGD(8, lr=1.0), allocate=Block) for _ in range(2)]
    asked: list = []
    for table in tables:
        table.add_spare(lambda make, done: asked.append((make, done)))
    make, _ = asked[0]  # ``done`` never runs
    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    spare = blocks[-1]
    assert not spare.closed and tables[0].slot_count == 1
    tables[0].close()
    assert spare.closed and blocks[0].closed and not blocks[1].closed  # (blocks[1]: the other table's)

    make, done = asked[1]
    tables[1].close()
    assert make() is None and blocks[-1].closed  # allocated after the close: given back there
    done(None)
    assert tables[1].slot_count == 1
