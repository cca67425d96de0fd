"""The engine: the server's state and rules, with no I/O.

It holds the weights, the optimizer, the tables, the members and the sync policy, and decides
every request it is handed; the connections (``aps.server.session``) read and write the bytes.
"""

from .engine import Engine

__all__ = ["Engine"]
