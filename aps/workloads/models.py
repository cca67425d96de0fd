"""The bundled models: small CNNs for single-channel images, and their accuracy."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["accuracy", "make_model"]


def make_model(side: int = 28, classes: int = 10, seed: int = 0) -> nn.Module:
    """A small CNN for ``side`` x ``side`` single-channel images, initialized from ``seed``."""
    torch.manual_seed(seed)
    if side >= 16:
        features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = 16 * (side // 4) ** 2
    else:
        features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        flat = 16 * (side // 2) ** 2
    return nn.Sequential(features, nn.Flatten(), nn.Linear(flat, 32), nn.ReLU(), nn.Linear(32, classes))


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y``."""
    model.eval()
    correct = 0
    for i in range(0, len(y), batch):
        correct += (model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum().item()
    model.train()
    return correct / len(y)
