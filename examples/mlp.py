"""A plain multi-layer perceptron classifier."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``depth`` hidden layers of width ``hidden`` with GeLU, then a linear classifier."""

    def __init__(self, in_dim: int = 784, hidden: int = 1024, depth: int = 4,
                 n_classes: int = 10) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * depth
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
