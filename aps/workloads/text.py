"""A byte-level language model on text that ships with every Python: its standard library.

- :func:`stdlib_corpus`: the source files of this Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), split *by file* into training and held-out
  text, so no held-out file was ever seen in part; nothing downloaded;
- :class:`ByteLM`: a small decoder-only transformer over bytes (vocabulary 256, learned
  positions, pre-norm blocks, tied embeddings), a few million parameters at the defaults;
- :func:`lm_batch` and :func:`held_out_loss`: random training windows, and the mean
  next-byte cross-entropy over fixed held-out windows (nats per byte).

The corpus depends on the Python version (its stdlib); results name it.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ByteLM", "Corpus", "held_out_loss", "lm_batch", "stdlib_corpus"]

#: Folders of the stdlib left out: installed packages, and the interpreter's own test suite
#: (many generated, repetitive files that would dominate the corpus).
_SKIPPED = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}


@dataclass
class Corpus:
    """Training and held-out bytes (uint8), and where they came from."""

    train: np.ndarray
    held_out: np.ndarray
    train_files: int
    held_out_files: int
    source: str


def stdlib_corpus(held_out_fraction: float = 0.1, root: str | None = None) -> Corpus:
    """The ``.py`` files under the stdlib (``root``), each file assigned to training or
    held-out by a hash of its path relative to the root (stable across machines and runs)."""
    root = root or sysconfig.get_paths()["stdlib"]
    train: list[bytes] = []
    held_out: list[bytes] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path, "rb") as f:
                data = f.read()
            bucket = int.from_bytes(hashlib.sha256(relative.encode()).digest()[:4], "little") / 2**32
            (held_out if bucket < held_out_fraction else train).append(data)
    if not train or not held_out:
        raise ValueError(f"no Python sources to split under {root}")
    return Corpus(
        np.frombuffer(b"\n".join(train), np.uint8).copy(),
        np.frombuffer(b"\n".join(held_out), np.uint8).copy(),
        len(train),
        len(held_out),
        root,
    )


def lm_batch(data: np.ndarray, batch: int, context: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``data``: inputs (batch x context bytes) and the next bytes."""
    starts = rng.integers(0, len(data) - context - 1, batch)
    windows = np.stack([data[s : s + context + 1] for s in starts]).astype(np.int64)
    tokens = torch.from_numpy(windows)
    return tokens[:, :-1], tokens[:, 1:]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    """A decoder-only transformer over bytes: ``layers`` pre-norm blocks of ``width`` with
    ``heads`` causal attention heads, learned positions up to ``context``, the output layer
    tied to the byte embedding. Initialized from ``seed`` (GPT-2's scheme: N(0, 0.02), the
    residual projections scaled by 1/sqrt(2 * layers))."""

    def __init__(self, *, width: int = 256, layers: int = 4, heads: int = 4, context: int = 128, seed: int = 0) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        generator = torch.Generator().manual_seed(seed)
        self.context = context
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() < 2:
                    p.zero_() if name.endswith("bias") else p.fill_(1.0)
                    continue
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "mlp.2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=generator) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats)."""
        return F.cross_entropy(self(tokens).reshape(-1, 256), targets.reshape(-1))


@torch.no_grad()
def held_out_loss(model: ByteLM, windows: tuple[torch.Tensor, torch.Tensor], batch: int = 64) -> float:
    """Mean next-byte cross-entropy of ``model`` over fixed held-out ``windows`` (nats per byte)."""
    tokens, targets = windows
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(tokens), batch):
        total += model.loss(tokens[i : i + batch], targets[i : i + batch]).item() * len(tokens[i : i + batch])
    model.train(was_training)
    return total / len(tokens)
