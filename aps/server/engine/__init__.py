"""The engine: the server's state and rules, with no I/O.

It holds the weights, the optimizer, the tables, the members and the sync policy, and decides
every request it is handed; the connections (``aps.server.connection``) read and write the
bytes. :class:`Engine` is the sum of its parts, each an object behind the narrow Protocols the
others declare (see :mod:`aps.server.engine.engine`): the model, the roster, membership,
training, the loads, durability, the update lane and its jobs, the policies, the tables, the
optimizer and compensation.
"""

from .engine import Engine

__all__ = ["Engine"]
