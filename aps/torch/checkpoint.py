"""aps checkpoints read into a PyTorch model, no server needed: :func:`load_state_dict`."""

from __future__ import annotations

import os

import torch

from ..checkpoint import Checkpoint, load_checkpoint
from ..errors import CheckpointError

__all__ = ["load_state_dict"]


def load_state_dict(model: torch.nn.Module, path: str | os.PathLike, *, strict: bool = True) -> Checkpoint:
    """Load the weights of an aps checkpoint into ``model``, in place: no server needed.

    The checkpoint names tensors as :class:`aps.torch.Optimizer` does, by
    ``model.named_parameters()``, and holds the trainable parameters only;
    buffers (BatchNorm running statistics ...) keep their values. Each
    parameter keeps its own dtype and device (the values are copied into it).

    Args:
        model: the model the checkpoint was trained on (the same architecture).
        path: a checkpoint (``ckpts/checkpoint-00000007-v70``) or a checkpoint
            directory (its newest checkpoint).
        strict: require that every trainable parameter of ``model`` is in the
            checkpoint and every tensor of the checkpoint is a parameter of
            ``model``. With ``strict=False`` the names in both are loaded and the
            others left alone. Shapes must match either way.

    Returns:
        The checkpoint read (``.version``, ``.manifest``, ``.state`` ...).

    Raises:
        CheckpointError: the checkpoint is missing or damaged (see
            :func:`aps.load_checkpoint`), a parameter's shape differs, or
            (``strict``) names differ: the message lists the missing and
            unexpected parameter names.

    Example::

        model = Net()
        ckpt = aps.torch.load_state_dict(model, "ckpts")  # the newest checkpoint
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean()
        print(f"version {ckpt.version}: accuracy {accuracy:.3f}")
        # or fine-tune it locally: torch.optim.SGD(model.parameters(), lr=1e-3) ...
    """
    checkpoint = load_checkpoint(path)
    params = dict(model.named_parameters())
    if strict:
        missing = [name for name, param in params.items() if param.requires_grad and name not in checkpoint.weights]
        unexpected = [name for name in checkpoint.weights if name not in params]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(
                    f"missing from the checkpoint: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
                )
            if unexpected:
                parts.append(
                    f"not parameters of the model: {', '.join(unexpected[:10])}{' ...' if len(unexpected) > 10 else ''}"
                )
            raise CheckpointError(
                f"checkpoint {checkpoint.path} does not fit the model ({'; '.join(parts)}); "
                "pass strict=False to load the parameters both have"
            )
    state = {}
    for name, array in checkpoint.weights.items():
        if name not in params:
            continue
        if tuple(params[name].shape) != array.shape:
            raise CheckpointError(
                f"checkpoint {checkpoint.path}: parameter {name!r} has shape {array.shape}, "
                f"the model's is {tuple(params[name].shape)}"
            )
        state[name] = torch.from_numpy(array)
    model.load_state_dict(state, strict=False)
    return checkpoint
