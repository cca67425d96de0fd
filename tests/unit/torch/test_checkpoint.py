"""An aps checkpoint read into a PyTorch model, no server: the model's parameters by name,
each keeping its dtype, and what does not fit named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aps.torch
from aps import checkpoint as ckpt
from aps.errors import CheckpointError


def saved(directory, weights: dict[str, np.ndarray]) -> str:
    layout = {"names": list(weights), "shapes": [list(a.shape) for a in weights.values()]}
    manifest = {"version": 7, "sequence": 1, "run_id": "run-1", "layout": layout}
    return ckpt.write_checkpoint(directory, ckpt.checkpoint_name(1, 7), manifest, weights, {})


def weights_of(model: torch.nn.Module, value: float) -> dict[str, np.ndarray]:
    return {name: np.full(tuple(p.shape), value, np.float32) for name, p in model.named_parameters()}


def test_the_newest_checkpoint_is_loaded_into_the_models_parameters(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).to(torch.bfloat16)
    saved(tmp_path, weights_of(model, 0.5))
    checkpoint = aps.torch.load_state_dict(model, tmp_path)
    assert checkpoint.version == 7
    assert all(p.dtype == torch.bfloat16 and (p == 0.5).all() for p in model.parameters())
    assert model[1].running_mean.tolist() == [0.0, 0.0]  # (buffers are not in a checkpoint)


def test_a_checkpoint_of_another_model_is_refused_with_the_names_or_shape_that_differ(tmp_path):
    model = torch.nn.Linear(3, 2)
    weights = weights_of(model, 1.0)
    path = saved(tmp_path / "a", {"weight": weights["weight"], "extra": np.zeros(1, np.float32)})
    with pytest.raises(CheckpointError, match="missing from the checkpoint: bias; not parameters of the model: extra"):
        aps.torch.load_state_dict(model, path)
    aps.torch.load_state_dict(model, path, strict=False)  # the names both have
    assert (model.weight == 1.0).all() and not (model.bias == 1.0).all()
    wrong = saved(tmp_path / "b", {**weights, "bias": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"'bias' has shape \(3,\), the model's is \(2,\)"):
        aps.torch.load_state_dict(model, wrong)
