"""The request handlers, one per op, by concern: the handshake, training (with the rows of a
request and its reply), the optimizer's state, the run. :data:`HANDLERS` is the table a
connection looks an op up in; each concern's module lists its own handlers."""

from __future__ import annotations

from ...wire.protocol import REQUEST_OPS
from . import handshake, run, state, training
from .base import Exchange, Handler, Request

__all__ = ["HANDLERS", "Exchange", "Handler", "Request"]

#: The handler of each request op.
HANDLERS: dict[int, Handler] = {
    handler.op: handler for module in (handshake, training, state, run) for handler in module.HANDLERS
}
if set(HANDLERS) != set(REQUEST_OPS):
    raise ImportError(f"request ops without a handler: {sorted(set(REQUEST_OPS) - set(HANDLERS))}")
