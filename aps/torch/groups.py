"""torch.optim's param groups and the server's optimizer: which parameters a model gives,
group by group (:func:`split_groups`), what each group asks of the server's optimizer
(:class:`ServerOptimizer`: its defaults, the four values a group sends, the values it cannot
change), and that optimizer's state in torch's format and back.

Nothing here talks to a server: :class:`aps.torch.Optimizer` holds a :class:`ServerOptimizer`
made from the options the server said in its handshake, and sends what it computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigurationError
from ..layout import Layout

__all__ = ["ServerOptimizer", "split_groups", "uncompiled"]

#: What each server optimizer takes from a param group: the four HYPER values, in order.
_SENT: dict[str, Callable[[Mapping[str, Any]], tuple[Any, ...]]] = {
    "sgd": lambda group: (group["lr"], group["weight_decay"], group["momentum"], group["dampening"]),
    "adam": lambda group: (group["lr"], group["weight_decay"], *group["betas"]),
}
#: The keys of a param group whose values the server's optimizer takes (and may change at any step).
_KEYS = {"sgd": ("lr", "weight_decay", "momentum", "dampening"), "adam": ("lr", "weight_decay", "betas")}
#: The keys of a param group that are the server's options (``aps serve --nesterov``, ``--eps``).
_FIXED = {"sgd": ("nesterov",), "adam": ("eps",)}
#: The optimizer state torch.optim keeps per parameter, as the server keeps it (flat arrays).
_STATE = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (its parameters are the same; their names lack the
    wrapper's ``_orig_mod.`` prefix), or ``model`` itself."""
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, torch.nn.Module) else model


def split_groups(params: Any) -> list[dict[str, Any]]:
    """torch.optim's forms of ``params`` as group dicts (copies), each with a list of
    tensors under ``params`` and, when the tensors came named, ``param_names``.

    Raises:
        ConfigurationError: a set (no order), one tensor, an empty list, a group without
            ``params``, names given for some parameters only, or a tensor that is not a leaf.
    """
    if isinstance(params, torch.nn.Module):
        params = uncompiled(params).named_parameters()
    if isinstance(params, (set, frozenset)):
        raise ConfigurationError(
            "parameters must come in an ordered collection (a list), not a set: the flat layout follows their order"
        )
    if isinstance(params, torch.Tensor):
        raise ConfigurationError(
            "params must be an nn.Module, an iterable of tensors or of (name, tensor), "
            "or a list of param group dicts, not one tensor"
        )
    groups = list(params)
    if not groups:
        raise ConfigurationError("the optimizer got an empty parameter list")
    if not isinstance(groups[0], Mapping):
        groups = [{"params": groups}]
    parsed = []
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ConfigurationError(f"param group {index} must be a dict with 'params'")
        group = dict(group)
        members = group["params"]
        if isinstance(members, torch.Tensor):
            members = [members]
        elif isinstance(members, (set, frozenset)):
            raise ConfigurationError(
                f"param group {index}: parameters must come in an ordered collection "
                "(a list), not a set: the flat layout follows their order"
            )
        members = list(members)
        named = [isinstance(m, tuple) for m in members]
        if any(named) and not all(named):
            raise ConfigurationError(f"param group {index}: give every parameter with its name or none")
        if members and all(named):
            group["param_names"] = [str(name) for name, _ in members]
            members = [tensor for _, tensor in members]
        for member in members:
            if not isinstance(member, torch.Tensor):
                raise ConfigurationError(
                    f"param group {index}: parameters must be tensors, not {type(member).__name__}"
                )
            if not member.is_leaf:
                raise ConfigurationError(
                    f"param group {index}: a parameter is not a leaf tensor "
                    "(it was computed from others): it cannot be optimized"
                )
        group["params"] = members
        parsed.append(group)
    return parsed


class ServerOptimizer:
    """The server's optimizer (``sgd``, ``adam`` or ``adamw``) as ``torch.optim`` sees it.

    Made from the options the server said in its handshake (``optimizer``, ``lr``,
    ``weight_decay``, ``momentum``, ``nesterov``, ``betas``, ``eps``).

    Raises:
        ConfigurationError: the options do not say which optimizer the server runs.
    """

    def __init__(self, options: Mapping[str, Any] | None) -> None:
        if options is not None and options.get("optimizer") == "delayed-nesterov":
            raise ConfigurationError(
                "the server runs delayed-nesterov, an outer optimizer for local SGD: use aps.torch.LocalSGD "
                "with it (aps.torch.Optimizer mirrors sgd, adam and adamw)"
            )
        if options is None or options.get("optimizer") not in ("sgd", "adam", "adamw"):
            raise ConfigurationError(
                "the server did not say which optimizer it runs (an older aps?): "
                "aps.torch.Optimizer needs it for its param groups"
            )
        #: The server's optimizer: "sgd", "adam" or "adamw".
        self.name: str = options["optimizer"]
        #: "sgd", or "adam" for both Adam and AdamW (the same values and state).
        self.kind = "sgd" if self.name == "sgd" else "adam"
        common = {"lr": float(options["lr"]), "weight_decay": float(options["weight_decay"])}
        #: torch.optim's ``defaults`` for it: the server's own values.
        self.defaults: dict[str, Any]
        if self.kind == "sgd":
            self.defaults = {
                **common,
                "momentum": float(options["momentum"]),
                "dampening": 0.0,
                "nesterov": bool(options["nesterov"]),
                "maximize": False,
            }
        else:
            beta1, beta2 = options["betas"]
            self.defaults = {
                **common,
                "betas": (float(beta1), float(beta2)),
                "eps": float(options["eps"]),
                "amsgrad": False,
                "maximize": False,
            }
        #: The four values the server starts a connection with (what a group of defaults sends).
        self.server_values = self.sent(self.defaults)
        #: The names of its per-parameter state, as torch.optim's.
        self.state_names = _STATE[self.kind]

    def sent(self, group: Mapping[str, Any]) -> tuple[float, ...]:
        """The four values ``group`` asks of the server (lr, weight decay, then momentum and
        dampening, or Adam's two betas)."""
        return tuple(float(value) for value in _SENT[self.kind](group))

    def with_values(
        self,
        *,
        lr: float | None = None,
        weight_decay: float | None = None,
        momentum: float | None = None,
        dampening: float | None = None,
        betas: Iterable[float] | None = None,
    ) -> dict[str, Any]:
        """The defaults, with the values the caller gave (None: the server's) in their place.

        Raises:
            ConfigurationError: a value that is not the server's optimizer's (momentum for Adam).
        """
        defaults = dict(self.defaults)
        numbers = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "dampening": dampening}
        for key, value in numbers.items():
            if value is not None:
                self._offers(key)
                defaults[key] = float(value)
        if betas is not None:
            self._offers("betas")
            defaults["betas"] = tuple(float(b) for b in betas)
        return defaults

    def _offers(self, key: str) -> None:
        if key not in self.defaults:
            raise ConfigurationError(f"{key} is not an option of the server's optimizer ({self.name})")

    def group_values(self, param_groups: Sequence[Mapping[str, Any]]) -> list[tuple[float, ...]]:
        """The values each group asks of the server now, checking those it cannot change.

        Raises:
            ConfigurationError: a group lacks a value, is another optimizer's (AdamW's for Adam),
                changes a server option (``nesterov``, ``eps``), turns on ``maximize`` or
                ``amsgrad``, or holds a value that is not a number.
        """
        fixed = _FIXED[self.kind]
        values = []
        decoupled = self.name == "adamw"
        for index, group in enumerate(param_groups):
            missing = [key for key in (*fixed, *_KEYS[self.kind]) if key not in group]
            if missing:
                raise ConfigurationError(
                    f"param group {index} has no {', '.join(missing)}: not a group of the server's optimizer "
                    f"({self.name})"
                )
            if self.kind == "adam" and group.get("decoupled_weight_decay", decoupled) != decoupled:
                raise ConfigurationError(
                    f"param group {index}: decoupled_weight_decay is {group['decoupled_weight_decay']} (a group "
                    f"of torch.optim.{'Adam' if decoupled else 'AdamW'}); the server runs {self.name}"
                )
            for key in fixed:
                if group[key] != self.defaults[key]:
                    raise ConfigurationError(
                        f"param group {index}: {key} is {group[key]}, the server's is {self.defaults[key]}; "
                        f"it is the server's option (aps serve --{key}) and cannot be set per group"
                    )
            for key in ("maximize", "amsgrad"):
                if group.get(key):
                    raise ConfigurationError(f"param group {index}: {key} is not supported by the server's optimizer")
            try:
                values.append(self.sent(group))
            except (KeyError, TypeError, ValueError) as error:
                raise ConfigurationError(
                    f"param group {index}: its optimizer values are not numbers ({error})"
                ) from None
        return values

    def torch_state(
        self, server: Mapping[str, Any], params: Sequence[torch.Tensor], layout: Layout
    ) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """torch.optim's per-parameter state from the server's (:meth:`aps.Worker.optimizer_state`):
        each of ``params`` (in the layout's order) its slice of every array, reshaped, and Adam's
        ``step``; nothing before the first step."""
        arrays, steps = server["arrays"], int(server["steps"])
        if not arrays or steps == 0:
            return {}
        state = {}
        for param, offset, size in zip(params, layout.offsets, layout.sizes):
            one: dict[str, torch.Tensor] = {
                name: torch.from_numpy(array[offset : offset + size].copy()).view(param.shape)
                for name, array in arrays.items()
            }
            if self.kind == "adam":
                one = {"step": torch.tensor(float(steps)), **one}
            state[param] = one
        return state

    def server_state(
        self,
        state_dict: Mapping[str, Any],
        described: Mapping[str, Any],
        groups: Sequence[Mapping[str, Any]],
        params: Sequence[torch.Tensor],
        layout: Layout,
    ) -> dict[str, Any] | None:
        """The server's state from a torch-format ``state_dict`` (``groups``: the param groups it
        was loaded into; ``params``: the trainable parameters in the layout's order;
        ``described``: what its ``aps`` entry says), or None when it holds nothing to load.

        Raises:
            ConfigurationError: another optimizer's state, or Adam's parameters with different
                step counts (the server keeps one for the model).
        """
        saved = state_dict.get("state", {})
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        mine = [p for group in groups for p in group["params"]]
        by_param = {id(param): saved[index] for index, param in zip(saved_ids, mine) if index in saved}
        if not by_param:
            return None  # nothing to load: a state from before the first step
        names = self.state_names
        if described.get("optimizer", self.name) != self.name:
            raise ConfigurationError(f"the state is {described['optimizer']}'s; the server runs {self.name}")
        arrays = {name: np.zeros(layout.numel, np.float32) for name in names}
        steps = set()
        for param, offset, size in zip(params, layout.offsets, layout.sizes):
            state = by_param.get(id(param), {})
            unknown = set(state) - set(names) - {"step"}
            if unknown:
                raise ConfigurationError(
                    f"the state holds {sorted(unknown)}: not the server optimizer's ({self.name}: {', '.join(names)})"
                )
            if self.kind == "adam":
                steps.add(int(float(state["step"])) if "step" in state else 0)
            for name in names:
                if state.get(name) is not None:
                    arrays[name][offset : offset + size] = state[name].detach().to("cpu", torch.float32).reshape(-1)
        if self.kind == "adam":
            if len(steps) != 1:
                raise ConfigurationError(
                    f"the parameters' Adam steps differ ({sorted(steps)}): the server keeps "
                    "one step count for the whole model (a parameter without state has taken no step)"
                )
            count = steps.pop()
        else:  # a momentum buffer missing for a parameter starts at zero: the gradient, as torch starts it
            count = int(described.get("steps", 1))
            if not any(s.get("momentum_buffer") is not None for s in by_param.values()):
                return None
        return {"optimizer": self.name, "steps": count, "arrays": arrays}
