"""The server side: :class:`aps.Server` and what runs inside ``aps serve``.

``server`` (listeners, the connections, the event loop); ``connection`` (one worker's
frames, its current request, its liveness) holding a transport, ``tcp`` or ``shm``
(``transport`` says what one is); ``requests`` (one handler per op, by concern: handshake,
training, rows, state, run); ``admission`` (what strangers may cost) and ``handshake``;
``engine`` (the state and the rules, with no I/O: members, the sync policies, the update
lane and its jobs, the tables, the optimizers); ``checkpointer`` (when and how checkpoints
are taken); ``http`` and ``web`` (the dashboard, metrics and JSON API).
"""

from .server import Server

__all__ = ["Server"]
