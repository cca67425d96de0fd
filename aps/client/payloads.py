"""What a worker's calls carry besides weights and gradients, checked before anything is sent:
hyperparameter groups (``set_hyperparameters``), optimizer state (``optimizer_state``,
``load_optimizer_state``) and the run options a server states in its handshake.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import _core
from ..config import OPTIMIZER_STATE
from ..errors import (
    ConfigurationError,
    DTypeMismatch,
    InvalidState,
    LayoutMismatch,
    MalformedFrame,
    WeightsRefused,
)
from ..layout import Layout
from ..wire.protocol import (
    MAX_REPLY_STEPS,
    MAX_STEPS,
    HyperGroup,
    ServerInfo,
    decode_state_head,
    encode_state_head,
    state_digest,
)

__all__ = [
    "HYPER_KEYS",
    "checked_state",
    "flat_weights_of",
    "resolve_hyperparameters",
    "server_hyperparameters",
    "server_options",
    "state_from_reply",
    "state_payload",
]

log = logging.getLogger("aps.worker")


#: The keys of a group given to ``set_hyperparameters``.
HYPER_KEYS = ("stop", "lr", "weight_decay", "momentum", "dampening")


def server_options(info: ServerInfo | None) -> dict[str, Any] | None:
    """The run options a server said it was started with in the handshake (its
    ``--optimizer``, ``--lr``, ``--sync`` ...: ServerConfig.shard_description), or None
    when it did not say (an older server)."""
    try:
        described = json.loads(info.shard) if info is not None and info.shard else None
    except ValueError:
        return None
    return described if isinstance(described, dict) else None


def server_hyperparameters(info: ServerInfo | None) -> dict[str, float] | None:
    """The server's own value for each HYPER key but ``stop``, from what it said of its options
    in the handshake (for Adam and AdamW, ``momentum`` and ``dampening`` are its betas);
    None when it did not say (an older server)."""
    described = server_options(info)
    if described is None:
        return None
    try:
        common = {"lr": float(described["lr"]), "weight_decay": float(described["weight_decay"])}
        if described["optimizer"] in ("sgd", "delayed-nesterov"):
            # aps serve has no dampening option: its SGD runs with none (delayed Nesterov takes none).
            return {**common, "momentum": float(described["momentum"]), "dampening": 0.0}
        beta1, beta2 = described["betas"]
        return {**common, "momentum": float(beta1), "dampening": float(beta2)}
    except (KeyError, TypeError, ValueError):
        return None


def resolve_hyperparameters(groups: Any, numel: int, defaults: Mapping[str, float] | None) -> list[HyperGroup]:
    """The records of a HYPER request for ``groups`` (see :meth:`Worker.set_hyperparameters`):
    the last group's ``stop`` is ``numel`` when omitted, and a missing value is the server's
    (``defaults``; without them every value must be given). The values themselves are the
    server's to check."""
    if isinstance(groups, Mapping) or not isinstance(groups, Sequence) or not groups:
        raise ConfigurationError("set_hyperparameters takes a non-empty list of dicts, one per group")
    records = []
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise ConfigurationError(f"group {index} is a {type(group).__name__}, not a dict")
        unknown = sorted(set(group) - set(HYPER_KEYS))
        if unknown:
            raise ConfigurationError(f"group {index}: unknown keys {unknown}; a group has {', '.join(HYPER_KEYS)}")
        stop = group.get("stop", numel if index == len(groups) - 1 else None)
        if stop is None:
            raise ConfigurationError(f"group {index}: 'stop' is needed (only the last group may leave it out)")
        if isinstance(stop, bool) or not isinstance(stop, (int, np.integer)) or not 0 <= stop < 1 << 64:
            raise ConfigurationError(f"group {index}: stop must be a non-negative integer, got {stop!r}")
        values = []
        for key in HYPER_KEYS[1:]:
            if key in group:
                value = group[key]
            elif defaults is not None:
                value = defaults[key]
            else:
                raise ConfigurationError(f"group {index}: {key!r} is needed (the server did not say its own values)")
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ConfigurationError(f"group {index}: {key} must be a number, got {value!r}")
            try:
                values.append(float(value))
            except OverflowError:
                raise ConfigurationError(f"group {index}: {key} {value} is too large for a float") from None
        records.append(HyperGroup(int(stop), *values))
    return records


def checked_state(state: Mapping[str, Any], numel: int) -> tuple[str, int, list[str], list[np.ndarray]]:
    """``(optimizer, steps, names, arrays)`` of ``state`` (see :meth:`Worker.load_optimizer_state`)
    for a model of ``numel`` elements, checked here as far as it can be without the server:
    the arrays in the optimizer's order, flat float32 of ``numel`` elements each, every
    value finite.

    Raises:
        InvalidState: a missing key, a bad step count, an array of another size or with
            a value that is not finite.
        DTypeMismatch: an array is not float32.
    """
    if not isinstance(state, Mapping) or any(key not in state for key in ("optimizer", "steps", "arrays")):
        raise InvalidState(
            "an optimizer state is a mapping of 'optimizer', 'steps' and 'arrays' (what optimizer_state() returns)"
        )
    optimizer, steps, given = state["optimizer"], state["steps"], state["arrays"]
    if not isinstance(optimizer, str):
        raise InvalidState(f"the state's optimizer is {optimizer!r}; it must be a name (sgd, adam, adamw)")
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or not 0 <= steps <= MAX_STEPS:
        raise InvalidState(f"steps is {steps!r}; it must be an integer from 0 to 2**53")
    if not isinstance(given, Mapping):
        raise InvalidState("the state's 'arrays' must be a mapping of name to flat float32 array")
    order = [name for name in OPTIMIZER_STATE.get(optimizer, ()) if name in given]
    names = order + [name for name in given if name not in order]  # the server refuses any other
    arrays = []
    for name in names:
        array = np.asarray(given[name])
        if array.dtype != np.float32:
            raise DTypeMismatch(f"the state's {name} is {array.dtype}; optimizer state is float32")
        array = np.ascontiguousarray(array).reshape(-1)
        if array.size != numel:
            raise InvalidState(f"the state's {name} has {array.size} elements; the model has {numel}")
        if not _core.all_finite(array):
            index = int(np.flatnonzero(~np.isfinite(array))[0])
            raise InvalidState(f"{name}[{index}] is {array[index]}: every value must be finite")
        arrays.append(array)
    return optimizer, int(steps), names, arrays


def state_payload(state: Mapping[str, Any], numel: int) -> tuple[bytes, list[np.ndarray]]:
    """The head (with its digest) and the arrays of a LOAD_STATE for ``state``, for a model
    of ``numel`` elements (checked: see :func:`checked_state`)."""
    optimizer, steps, names, arrays = checked_state(state, numel)
    return encode_state_head(optimizer, steps, numel, names, digest=state_digest(steps, arrays)), arrays


def flat_weights_of(params: Mapping[str, Any] | np.ndarray, layout: Layout) -> np.ndarray:
    """``params`` (a mapping of name to float32 array in the model's layout, or one flat
    float32 array of its size) as one flat contiguous float32 array (``params`` itself
    when it is one), every value checked finite.

    Raises:
        ConfigurationError: not a mapping or an array.
        LayoutMismatch: other names or shapes, or a flat array of another size.
        DTypeMismatch: not float32.
        WeightsRefused: a value is not finite.
    """
    if isinstance(params, np.ndarray):
        if params.dtype != np.float32:
            raise DTypeMismatch(f"the weights are {params.dtype}; the model is float32")
        if params.shape != (layout.numel,):
            raise LayoutMismatch(f"flat weights must have shape ({layout.numel},), got {params.shape}")
        flat = np.ascontiguousarray(params)
    elif isinstance(params, Mapping):
        layout.check(params, what="weights")
        flat = np.empty(layout.numel, np.float32)
        layout.flatten_into(params, flat)
    else:
        raise ConfigurationError("load_weights takes a mapping of name to float32 array, or a flat float32 array")
    if not _core.all_finite(flat):
        index = int(np.flatnonzero(~np.isfinite(flat))[0])
        raise WeightsRefused(f"weight {index} is {flat[index]}: every value must be finite")
    return flat


def state_from_reply(payload: memoryview, version: int) -> dict[str, Any]:
    """The state a STATE reply carries (see :meth:`Worker.optimizer_state`); the arrays are
    views into the reply's own buffer; its step count may pass 2**53 (a run that loaded a
    state of that many steps counts on), and such a state cannot be loaded again."""
    head = decode_state_head(payload, MAX_REPLY_STEPS)
    if head.payload_bytes != len(payload):
        raise MalformedFrame(f"STATE reply of {len(payload)} bytes; its description says {head.payload_bytes}")
    flat = np.frombuffer(payload, np.float32, offset=head.nbytes)
    numel = head.numel
    arrays = {name: flat[index * numel : (index + 1) * numel] for index, name in enumerate(head.arrays)}
    return {
        "optimizer": head.optimizer,
        "steps": head.steps,
        "version": head.version if head.version is not None else version,
        "arrays": arrays,
    }
