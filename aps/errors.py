"""The exception tree of aps.

Everything aps raises on purpose derives from :class:`APSError`. Classes also
derive from the builtin a caller would naturally catch: configuration mistakes
are ``ValueError``, waits that run out are ``TimeoutError``, a lost connection
is ``ConnectionError``. Errors the server reports travel on the wire as an
error frame with a numeric code; each class registers its code
(``class RankTaken(ServerError, code=ErrorCode.RANK_TAKEN)``) and
:data:`ERROR_CODES` is what they registered, so the client raises the same
type the server meant.
"""

from __future__ import annotations

from enum import IntEnum
from types import MappingProxyType

__all__ = [
    "APSError",
    "APSConnectionError",
    "APSTimeoutError",
    "AuthenticationError",
    "ServerUnproven",
    "BadMagic",
    "CheckpointError",
    "CheckpointFailed",
    "ConfigurationError",
    "DTypeMismatch",
    "ERROR_CODES",
    "ErrorCode",
    "Evicted",
    "FrameTooLarge",
    "InitTimeout",
    "InternalServerError",
    "InvalidHyperparameters",
    "InvalidState",
    "WeightsRefused",
    "TableMismatch",
    "InvalidIds",
    "NotPrimary",
    "TableMemoryFull",
    "LayoutMismatch",
    "MalformedFrame",
    "NonFiniteGradient",
    "NotInitialized",
    "OutOfOrder",
    "PayloadSizeMismatch",
    "ProtocolError",
    "RankOutOfRange",
    "RankTaken",
    "RunChanged",
    "ServerError",
    "ServerOverloaded",
    "ServerSilent",
    "ShuttingDown",
    "UnknownOp",
    "UnsupportedVersion",
    "WorkerCountMismatch",
    "error_from_code",
]


class ErrorCode(IntEnum):
    """Numeric codes carried by error frames (docs/protocol.md lists them)."""

    BAD_MAGIC = 1
    UNSUPPORTED_VERSION = 2
    UNKNOWN_OP = 3
    FRAME_TOO_LARGE = 4
    MALFORMED_FRAME = 5
    PAYLOAD_SIZE_MISMATCH = 6
    DTYPE_MISMATCH = 7
    LAYOUT_MISMATCH = 8
    RANK_OUT_OF_RANGE = 9
    RANK_TAKEN = 10
    WORKER_COUNT_MISMATCH = 11
    NON_FINITE_GRADIENT = 12
    NOT_INITIALIZED = 13
    OUT_OF_ORDER = 14
    SHUTTING_DOWN = 15
    INTERNAL = 16
    EVICTED = 17
    OVERLOADED = 18
    AUTHENTICATION = 19
    CHECKPOINT_FAILED = 20
    INVALID_HYPERPARAMETERS = 21
    INVALID_STATE = 22
    WEIGHTS_REFUSED = 23
    TABLE_MISMATCH = 24
    INVALID_IDS = 25
    TABLE_MEMORY_FULL = 26
    NOT_PRIMARY = 27


class APSError(Exception):
    """Base class of every error aps raises on purpose.

    Troubleshooting: docs/guide/troubleshooting.md."""


class ConfigurationError(APSError, ValueError):
    """An option or argument is invalid (bad flag value, bad address, ...).

    Troubleshooting: docs/guide/troubleshooting.md."""


class APSTimeoutError(APSError, TimeoutError):
    """A wait ran out of time.

    Troubleshooting: docs/guide/troubleshooting.md."""


class InitTimeout(APSTimeoutError):
    """``Worker.init`` waited longer than its timeout for all workers to join.

    Troubleshooting: docs/guide/troubleshooting.md#workers-wait-for-the-others."""


class APSConnectionError(APSError, ConnectionError):
    """The connection to the server failed or was lost. Recoverable: reconnect.

    Troubleshooting: docs/guide/troubleshooting.md#workers-keep-reconnecting."""


class ServerSilent(APSTimeoutError, APSConnectionError):
    """The server sent nothing for ``server_timeout`` seconds while a reply was due:
    it hung, or its host or the network is gone. The connection is dropped
    (a ConnectionError: reconnect when it is back).

    Troubleshooting: docs/guide/troubleshooting.md#workers-keep-reconnecting."""


class CheckpointError(APSError, ValueError):
    """A checkpoint cannot be written, read or used: a missing, corrupt or truncated
    file, a checksum that does not hold, a configuration that conflicts with the
    command line, or a directory that is read-only or full. The message says which.

    Troubleshooting: docs/guide/troubleshooting.md#a-resume-is-refused."""


class RunChanged(APSConnectionError):
    """The worker reconnected, but the server at its address no longer serves its run
    (it restarted without ``--resume``, or from another run's checkpoint): the
    worker's weights, clock and version mean nothing there.

    Troubleshooting: docs/guide/troubleshooting.md#the-run-changed."""


#: The classes by code, filled in by :meth:`ServerError.__init_subclass__`.
_REGISTRY: dict[ErrorCode, type[ServerError]] = {}
#: Each wire error code's class (read-only: the classes register themselves).
ERROR_CODES = MappingProxyType(_REGISTRY)


class ServerError(APSError):
    """An error the server reported in an error frame.

    Attributes:
        code: the :class:`ErrorCode` from the frame.
        message: the server's explanation.

    Troubleshooting: docs/guide/troubleshooting.md.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init_subclass__(cls, *, code: ErrorCode | None = None, **kwargs) -> None:
        """``class X(ServerError, code=ErrorCode.X)``: X is what a frame with that code raises
        (as asyncpg's exceptions register their SQLSTATE). A class without ``code=`` inherits
        its parent's code and registers nothing; one code has exactly one class."""
        super().__init_subclass__(**kwargs)
        if code is None:
            return
        code = ErrorCode(code)
        taken = _REGISTRY.get(code)
        if taken is not None:
            raise TypeError(f"error code {code.name} is {taken.__qualname__}'s already, not {cls.__qualname__}'s")
        cls.code = code
        _REGISTRY[code] = cls

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __reduce__(self):  # keep the code across pickling (multiprocessing)
        return (type(self), (self.message, self.code))


class ProtocolError(ServerError):
    """A frame broke the wire protocol (see docs/protocol.md).

    Troubleshooting: docs/guide/troubleshooting.md."""

    # The parent of the protocol errors registers no code: raised as it is, it goes out
    # as a malformed frame, and an error frame with that code comes back as MalformedFrame.
    code = ErrorCode.MALFORMED_FRAME


class BadMagic(ProtocolError, code=ErrorCode.BAD_MAGIC):
    """The frame does not start with the aps magic number.

    Troubleshooting: docs/guide/troubleshooting.md."""


class UnsupportedVersion(ProtocolError, code=ErrorCode.UNSUPPORTED_VERSION):
    """The peer speaks a protocol version this side does not.

    Troubleshooting: docs/guide/troubleshooting.md."""


class UnknownOp(ProtocolError, code=ErrorCode.UNKNOWN_OP):
    """The frame's operation code is not one this side knows.

    Troubleshooting: docs/guide/troubleshooting.md."""


class FrameTooLarge(ProtocolError, code=ErrorCode.FRAME_TOO_LARGE):
    """The frame's payload length is over the configured limit.

    Troubleshooting: docs/guide/troubleshooting.md."""


class MalformedFrame(ProtocolError, code=ErrorCode.MALFORMED_FRAME):
    """The frame's payload cannot be parsed.

    Troubleshooting: docs/guide/troubleshooting.md."""


class PayloadSizeMismatch(ServerError, ValueError, code=ErrorCode.PAYLOAD_SIZE_MISMATCH):
    """The payload's size does not match the registered model layout.

    Troubleshooting: docs/guide/troubleshooting.md."""


class DTypeMismatch(ServerError, TypeError, code=ErrorCode.DTYPE_MISMATCH):
    """The payload's dtype is not the model's (float32).

    Troubleshooting: docs/guide/troubleshooting.md."""


class LayoutMismatch(ServerError, ValueError, code=ErrorCode.LAYOUT_MISMATCH):
    """Tensor names or shapes differ from the registered model.

    Troubleshooting: docs/guide/troubleshooting.md#the-model-is-from-a-previous-run."""


class RankOutOfRange(ServerError, ValueError, code=ErrorCode.RANK_OUT_OF_RANGE):
    """The rank is not in ``0..num_workers-1``.

    Troubleshooting: docs/guide/troubleshooting.md#workers-wait-for-the-others."""


class RankTaken(ServerError, code=ErrorCode.RANK_TAKEN):
    """Another live connection already holds this rank.

    Troubleshooting: docs/guide/troubleshooting.md#workers-wait-for-the-others."""


class WorkerCountMismatch(ServerError, ValueError, code=ErrorCode.WORKER_COUNT_MISMATCH):
    """The worker's ``num_workers`` differs from the server's ``--workers``.

    Troubleshooting: docs/guide/troubleshooting.md#workers-wait-for-the-others."""


class NonFiniteGradient(ServerError, ValueError, code=ErrorCode.NON_FINITE_GRADIENT):
    """The gradient holds NaN or infinity; it was rejected and changed nothing.

    Troubleshooting: docs/guide/troubleshooting.md#a-gradient-is-not-finite."""


class NotInitialized(ServerError, code=ErrorCode.NOT_INITIALIZED):
    """The connection sent a request that needs ``init`` first.

    Troubleshooting: docs/guide/troubleshooting.md."""


class OutOfOrder(ServerError, code=ErrorCode.OUT_OF_ORDER):
    """The request breaks the iteration order (e.g. a push while held at the gate).

    Troubleshooting: docs/guide/troubleshooting.md."""


class ShuttingDown(ServerError, APSConnectionError, code=ErrorCode.SHUTTING_DOWN):
    """The server is shutting down (a ConnectionError). A server started with
    ``--checkpoint-dir`` can be resumed from its checkpoint (``resumable``): a worker
    waits for it and rejoins by itself, for up to its ``reconnect_timeout``; one
    without ends for good, and the worker's call raises this at once.

    Attributes:
        resumable: the server said it can be resumed where it stopped.

    Troubleshooting: docs/guide/troubleshooting.md#workers-keep-reconnecting.
    """

    resumable = True


class Evicted(ServerError, APSConnectionError, code=ErrorCode.EVICTED):
    """The server dropped this connection: it heard nothing from the worker for
    ``--heartbeat-timeout`` seconds, or the worker did not read its reply (a
    frozen or stuck process). ``reconnect()`` rejoins.

    Troubleshooting: docs/guide/troubleshooting.md#workers-keep-reconnecting."""


class ServerOverloaded(ServerError, APSConnectionError, code=ErrorCode.OVERLOADED):
    """The server refused the connection: it already has ``--max-connections``
    connections. Try again later.

    Troubleshooting: docs/guide/troubleshooting.md#authentications-refused-or-slow."""


class AuthenticationError(ServerError, APSConnectionError, code=ErrorCode.AUTHENTICATION):
    """The handshake failed: a missing or wrong token (the server closes the
    connection), or a server that cannot prove it knows the token (the worker
    refuses it).

    Troubleshooting: docs/guide/troubleshooting.md#authentications-refused-or-slow."""


class ServerUnproven(AuthenticationError):
    """The worker has a token (given, or found in its user's token file) and the server
    at its address cannot prove it knows it: it asks for no token, or its proof is wrong.
    Whoever listens there now is not the server the token belongs to (after a server dies,
    anybody may take its port). A worker's first connection raises it at once; a worker
    reconnecting to a lost server keeps waiting for the real one (it logs that it refused
    this one), up to its ``reconnect_timeout``.

    Troubleshooting: docs/guide/troubleshooting.md#the-server-cannot-prove-it-knows-the-token."""


class CheckpointFailed(ServerError, code=ErrorCode.CHECKPOINT_FAILED):
    """The server could not write the checkpoint it was asked for (no ``--checkpoint-dir``,
    a full or read-only directory); training goes on.

    Troubleshooting: docs/guide/troubleshooting.md."""


class InvalidHyperparameters(ServerError, ValueError, code=ErrorCode.INVALID_HYPERPARAMETERS):
    """A HYPER request (``Worker.set_hyperparameters``) was refused: a value that is not
    finite or out of range, group stops that do not cut the model, or too many groups.
    The message names the group and the value; nothing changed.

    Troubleshooting: docs/guide/troubleshooting.md."""


class InvalidState(ServerError, ValueError, code=ErrorCode.INVALID_STATE):
    """An optimizer state to load (LOAD_STATE, ``Worker.load_optimizer_state``) was refused:
    another optimizer, other or missing arrays, arrays not of the model's size, values that
    are not finite, a bad step count, or a server that has applied updates already (a
    state is loaded into a run that has not started). The message says which; nothing
    changed.

    Troubleshooting: docs/guide/troubleshooting.md."""


class TableMismatch(ServerError, ValueError, code=ErrorCode.TABLE_MISMATCH):
    """An embedding table was declared otherwise than the run's (another number of rows,
    dimension, initializer or optimizer: the message names the table and the field), or a
    request names a table the model does not have.

    Troubleshooting: docs/guide/troubleshooting.md."""


class InvalidIds(ServerError, ValueError, code=ErrorCode.INVALID_IDS):
    """Row ids that are not int64 ids of the table (negative, at least its ``rows``, not
    integers), or gradient rows of another dimension: refused, and nothing changed.

    Troubleshooting: docs/guide/troubleshooting.md."""


class NotPrimary(ServerError, APSConnectionError, code=ErrorCode.NOT_PRIMARY):
    """The address is a backup of a replica set (``aps serve --replicas``), which serves no
    worker: the message names its primary (:attr:`primary`), where a worker goes by itself
    (and where that server must still prove it knows the token). Seen only when the
    primary it names cannot be reached either.

    Troubleshooting: docs/guide/troubleshooting.md#a-worker-is-sent-to-a-backup."""

    SAYS = "it is a backup of its replica set; its primary is at "

    @property
    def primary(self) -> str | None:
        """``HOST:PORT`` of the primary, as the backup named it (None: it named none)."""
        _, found, address = self.message.rpartition(self.SAYS)
        return address.strip() or None if found else None


class TableMemoryFull(ServerError, MemoryError, code=ErrorCode.TABLE_MEMORY_FULL):
    """The rows a request would make do not fit in the server's ``--table-memory``, and no
    table declared ``evict=True`` has rows to give up: refused, and nothing changed.

    Troubleshooting: docs/guide/troubleshooting.md#table-memory-is-full."""


class WeightsRefused(ServerError, ValueError, code=ErrorCode.WEIGHTS_REFUSED):
    """Weights to load (LOAD_WEIGHTS, ``Worker.load_weights``, a model loaded before the
    first ``aps.torch.Optimizer.step()``) were refused: the server has applied updates (or
    taken gradients computed on its initial weights) already, another worker loaded other
    weights into this run, or a value is not finite. The message says which and how to
    load them; nothing changed.

    Troubleshooting: docs/guide/troubleshooting.md."""


class InternalServerError(ServerError, code=ErrorCode.INTERNAL):
    """The server failed unexpectedly while handling the request.

    Troubleshooting: docs/guide/troubleshooting.md."""


def error_from_code(code: int, message: str) -> ServerError:
    """The exception instance for a wire error ``code`` (unknown codes map to ServerError)."""
    try:
        known = ErrorCode(code)
    except ValueError:
        return ServerError(f"[code {code}] {message}", ErrorCode.INTERNAL)
    return ERROR_CODES[known](message, known)
