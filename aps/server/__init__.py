"""The server side: :class:`aps.Server` and what runs inside ``aps serve``.

``server`` (listeners, connections, the event loop), ``session`` (a
connection's requests and replies, whatever carries them) over ``tcp`` or
``shm``; ``engine`` (members, the sync policy's gate, releases; no I/O),
``lane`` (the update lane: one FIFO for every change of state) and its
``jobs``; ``sync`` (the policies), ``table`` and ``optim`` (versioned weights
and the optimizers over the native kernels), ``stats``, ``checkpointer``
(when and how checkpoints are taken), ``http`` and ``web`` (the dashboard,
metrics and JSON API).
"""

from .server import Server

__all__ = ["Server"]
