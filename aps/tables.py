"""Embedding tables: key spaces of rows, declared beside a model's dense parameters.

A :class:`Table` says what a table is (its key space, the length of a row, how a row
starts, the optimizer its rows are trained with); the server makes a row the first time
an id is pushed and keeps only the rows pushed (:mod:`aps.server.engine.rows`); a pull of a row
never pushed reads its initial values. Everything a
worker and every shard must agree on is here, computed the same way by every party: the
id hash, which shard holds an id, and each row's initial values.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from . import _core
from .errors import ConfigurationError, InvalidIds

__all__ = ["OPTIMIZERS", "Table", "shard_of"]

#: The row-wise optimizers: torch.optim.SGD, Adagrad and SparseAdam on a sparse gradient,
#: and FBGEMM's row-wise Adagrad (one state value per row).
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
_INITS = {"zeros": _core.INIT_ZEROS, "normal": _core.INIT_NORMAL, "uniform": _core.INIT_UNIFORM}
_DEFAULT_EPS = {"sgd": 0.0, "adagrad": 1e-10, "rowwise_adagrad": 1e-10, "adam": 1e-8}
#: The widest row (a float32 row of 256 KiB), the largest key space (int64 ids), and the
#: largest initial scale (rows far from float32's limits).
MAX_DIM = 65536
MAX_ROWS = 2**63
MAX_SCALE = 1e30


@dataclass(frozen=True)
class Table:
    """An embedding table: ``rows`` ids (int64 in ``[0, rows)``), each a float32 row of
    ``dim`` values.

    ``rows`` is a key space, not an allocation: a server holds the rows pushed, each made
    by its first push from its id alone (the same on every shard and after a resume); a
    pull of a row never pushed reads those initial values (:meth:`initial_rows`).

    Args:
        rows: the number of ids, up to 2**63.
        dim: the length of a row.
        init: ``"zeros"``, ``"normal:STD"`` (normal with standard deviation STD) or
            ``"uniform:BOUND"`` (uniform in (-BOUND, BOUND)); see :meth:`initial_rows`.
        optimizer: ``"sgd"``, ``"adagrad"`` (a state value per element, as
            ``torch.optim.Adagrad``), ``"rowwise_adagrad"`` (one per row) or ``"adam"``
            (lazy moments, as ``torch.optim.SparseAdam``).
        lr: the learning rate of the table's rows (the dense parameters keep the server's).
        eps: Adagrad's and Adam's epsilon (default 1e-10 and 1e-8, torch's).
        betas: Adam's (beta1, beta2).
        seed: mixed with the table's name into the seed of its rows' initial values.
        evict: whether the server may drop the least recently used rows when its table
            memory (``--table-memory``, by default half the memory available at its start)
            is full (a dropped row touched again starts from its initial values).

    Raises:
        ConfigurationError: a value out of range, naming the field.

    Example::

        worker.init(dense, tables={"items": aps.Table(rows=10**9, dim=64, init="normal:0.01",
                                                      optimizer="adagrad", lr=0.05)})
    """

    rows: int
    dim: int
    init: str = "normal:0.01"
    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0
    evict: bool = False

    def __post_init__(self) -> None:
        def field_error(name: str, what: str) -> ConfigurationError:
            return ConfigurationError(f"Table {name}={getattr(self, name)!r}: {what}")

        if not _whole(self.rows, 1, MAX_ROWS):
            raise field_error("rows", "an integer from 1 to 2**63 (the ids' key space)")
        if not _whole(self.dim, 1, MAX_DIM):
            raise field_error("dim", f"an integer from 1 to {MAX_DIM}")
        self.init_kind()  # checks the form
        if self.optimizer not in OPTIMIZERS:
            raise field_error("optimizer", f"one of {', '.join(OPTIMIZERS)}")
        if not _finite_at_least(self.lr, 0.0):
            raise field_error("lr", "a finite number at least 0")
        if self.eps is not None and not _finite_at_least(self.eps, 0.0):
            raise field_error("eps", "a finite number at least 0")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(_finite_at_least(b, 0.0) and b < 1.0 for b in betas):
            raise field_error("betas", "two numbers in [0, 1)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if not _whole(self.seed, 0, 2**64 - 1):
            raise field_error("seed", "an integer from 0 to 2**64 - 1")
        if not isinstance(self.evict, (bool, np.bool_)):
            raise field_error("evict", "True or False")
        object.__setattr__(self, "rows", int(self.rows))
        object.__setattr__(self, "dim", int(self.dim))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "evict", bool(self.evict))
        object.__setattr__(self, "eps", _DEFAULT_EPS[self.optimizer] if self.eps is None else float(self.eps))

    def init_kind(self) -> tuple[int, float]:
        """The initializer as ``aps._core.rows_init`` takes it: (kind, scale)."""
        name, _, value = str(self.init).partition(":")
        if name not in _INITS or (name == "zeros") != (value == ""):
            raise ConfigurationError(f"Table init={self.init!r}: 'zeros', 'normal:STD' or 'uniform:BOUND'")
        if name == "zeros":
            return _core.INIT_ZEROS, 0.0
        try:
            scale = float(value)
        except ValueError:
            scale = -1.0
        if not _finite_at_least(scale, 0.0) or scale > MAX_SCALE:
            raise ConfigurationError(f"Table init={self.init!r}: STD and BOUND are numbers from 0 to {MAX_SCALE:g}")
        return _INITS[name], scale

    def row_seed(self, name: str) -> int:
        """The seed of the rows of the table called ``name``: the first 8 bytes of the
        BLAKE2b digest of the name (little-endian) XOR ``seed``, so that two tables with
        the same ``seed`` still start with different rows."""
        digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "little") ^ self.seed

    def initial_rows(self, name: str, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The rows ``ids`` start with in the table called ``name`` (``out``: where to put
        them). A function of the id, the name and ``seed`` alone (native/_rows.h documents
        the draw): every shard, every resume and every process makes the same row."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if out is None:
            out = np.empty((len(ids), self.dim), np.float32)
        kind, scale = self.init_kind()
        _core.rows_init(out, ids, self.row_seed(name), kind, scale)
        return out

    def state_per_row(self) -> dict[str, int]:
        """The optimizer's state: float32 values per row, by name."""
        return {
            "sgd": {},
            "adagrad": {"sum": self.dim},
            "rowwise_adagrad": {"sum": 1},
            "adam": {"exp_avg": self.dim, "exp_avg_sq": self.dim},
        }[self.optimizer]

    def row_bytes(self) -> int:
        """Bytes a row takes on a server: its values and its optimizer state."""
        return 4 * (self.dim + sum(self.state_per_row().values()))

    def describe(self) -> dict[str, Any]:
        """Every field, as JSON takes them (what the workers and the checkpoints compare)."""
        out = asdict(self)
        out["betas"] = list(self.betas)
        return out

    @classmethod
    def from_description(cls, description: Any) -> Table:
        """The table :meth:`describe` gave (refused whole, naming the field, when a field
        is missing, unknown or wrong)."""
        if not isinstance(description, dict):
            raise ConfigurationError("a table's description is a JSON object")
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(description) - names)
        if unknown:
            raise ConfigurationError(f"a table's description has unknown fields: {', '.join(unknown)}")
        fields = dict(description)
        if "betas" in fields and isinstance(fields["betas"], list):
            fields["betas"] = tuple(fields["betas"])
        try:
            return cls(**fields)
        except TypeError as exc:  # a field missing
            raise ConfigurationError(f"a table's description is incomplete: {exc}") from None

    def difference(self, name: str, other: Table) -> str | None:
        """None when ``other`` is the same table, else which field differs (for the error)."""
        for field, mine in self.describe().items():
            theirs = other.describe()[field]
            if mine != theirs:
                return f"table {name!r}: {field} is {mine!r} in this run, {theirs!r} in the declaration"
        return None

    def check_ids(self, name: str, ids: Any) -> np.ndarray:
        """``ids`` as a contiguous int64 vector of this table's ids, or :class:`InvalidIds`."""
        if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1 and ids.flags.c_contiguous:
            array = ids  # (the common case, checked in one native pass)
            if len(array):
                self._check_range(name, *_core.ids_range(array))
            return array
        array = np.asarray(ids)
        if array.ndim != 1:
            raise InvalidIds(f"table {name!r}: ids must be one-dimensional, got shape {array.shape}")
        if array.dtype.kind not in "iu" and array.size:  # (an empty list is float64 to numpy)
            raise InvalidIds(f"table {name!r}: ids must be integers, got {array.dtype}")
        if array.dtype == np.uint64 and len(array) and int(array.max()) >= 2**63:
            raise InvalidIds(f"table {name!r}: id {int(array.max())} is beyond int64")
        array = np.ascontiguousarray(array, dtype=np.int64)
        if len(array):
            self._check_range(name, int(array.min()), int(array.max()))
        return array

    def _check_range(self, name: str, low: int, high: int) -> None:
        if low < 0:
            raise InvalidIds(f"table {name!r}: id {low} is negative")
        if high >= self.rows:
            raise InvalidIds(f"table {name!r}: id {high} is not below its {self.rows} rows")

    def check_rows(self, name: str, ids: np.ndarray, grads: Any) -> np.ndarray:
        """``grads`` as C-contiguous float32 rows, one per id, or :class:`InvalidIds`."""
        array = np.asarray(grads)
        if array.dtype.kind != "f":
            raise InvalidIds(f"table {name!r}: gradient rows must be floats, got {array.dtype}")
        if array.shape != (len(ids), self.dim):
            raise InvalidIds(
                f"table {name!r}: gradient rows must have shape ({len(ids)}, {self.dim}) "
                f"(one row of dim {self.dim} per id), got {array.shape}"
            )
        return np.ascontiguousarray(array, dtype=np.float32)


def check_tables(declared: Any) -> dict[str, Table]:
    """A model's tables: a mapping of name to :class:`Table` (names non-empty, at most 255 bytes)."""
    if declared is None:
        return {}
    if not isinstance(declared, dict):
        raise ConfigurationError("tables is a mapping of name to aps.Table")
    for name, table in declared.items():
        check_table_name(name)
        if not isinstance(table, Table):
            raise ConfigurationError(f"table {name!r} is not an aps.Table: {table!r}")
    return dict(declared)


def shard_of(ids: np.ndarray, shards: int) -> np.ndarray:
    """Which of ``shards`` servers holds each id: ``(mix64(id) >> 32) * shards >> 32``, the
    high half of the id hash scaled to the shard count (Lemire's multiply-shift), so the low
    half, which places an id in a server's index, stays spread within every shard."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    hashed = np.empty(len(ids), np.uint64)
    _core.mix64(np.ascontiguousarray(ids, dtype=np.int64), hashed)
    return (((hashed >> np.uint64(32)) * np.uint64(shards)) >> np.uint64(32)).astype(np.int64)


def _finite_at_least(value: Any, low: float) -> bool:
    if isinstance(value, (bool, np.bool_, str, bytes)):
        return False
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return math.isfinite(number) and number >= low


def _whole(value: Any, low: int, high: int) -> bool:
    return (
        isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and low <= int(value) <= high
    )


def check_table_name(name: Any) -> str:
    """A table's name: 1 to 255 bytes of UTF-8, without '/' (checkpoints file a table's
    arrays under ``tables/NAME/``)."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8")) > 255 or "/" in name:
        raise ConfigurationError(f"a table name is 1 to 255 bytes without '/', got {name!r}")
    return name
