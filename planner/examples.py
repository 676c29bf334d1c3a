"""Built-in example models: each factory returns `(model, sample)`.

Example:
    >>> model, sample = EXAMPLES["gpt"]()
    >>> model(sample).shape
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.width = width
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attention_dropout = nn.Dropout(dropout)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, width, head = x.size(0), x.size(1), self.width, self.width // self.heads
        parts = self.qkv(x).split(width, dim=2)  # indexed, not unpacked: fx cannot unpack
        q, k, v = (parts[i].view(batch, length, self.heads, head).transpose(1, 2) for i in range(3))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head)
        mask = torch.narrow(torch.narrow(mask, 2, 0, length), 3, 0, length)  # traceable slicing
        scores = scores.masked_fill(mask == 0, float("-inf"))
        weights = self.attention_dropout(F.softmax(scores, dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, length, width)
        return self.residual_dropout(self.proj(out))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A small GPT-style decoder: token and position embeddings, pre-norm blocks with causal
    self-attention, dropout, a final layer norm and a language-model head."""

    def __init__(self, vocab: int = 512, width: int = 128, heads: int = 4, blocks: int = 8,
                 context: int = 128, dropout: float = 0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(context, context)).view(1, 1, context, context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.norm(x))


class SkipTransformer(nn.Module):
    """A U-Net-shaped transformer: the output of each block on the way down is added to the
    input of its mirror block on the way up, so activations live across many blocks."""

    def __init__(self, vocab: int = 512, width: int = 128, heads: int = 4, depth: int = 3,
                 context: int = 128, dropout: float = 0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.down = nn.ModuleList(Block(width, heads, dropout) for _ in range(depth))
        self.middle = Block(width, heads, dropout)
        self.up = nn.ModuleList(Block(width, heads, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(context, context)).view(1, 1, context, context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(tokens)
        skips = []
        for block in self.down:
            x = block(x, self.mask)
            skips.append(x)
        x = self.middle(x, self.mask)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x + skip, self.mask)
        return self.head(self.norm(x))


def skip_transformer(batch: int = 8, length: int = 128) -> tuple[nn.Module, torch.Tensor]:
    return SkipTransformer(context=length), torch.randint(0, 512, (batch, length))


def mlp(width: int = 256, depth: int = 8, batch: int = 64) -> tuple[nn.Module, torch.Tensor]:
    # Blocks of two layers, each block a submodule: a plan checkpoints submodule calls (a run of
    # a Sequential's children would need the container's forward to change).
    layers = [nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
              for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 10)), torch.randn(batch, width)


class SmallCNN(nn.Module):
    """Conv + BatchNorm + in-place ReLU stages with residual additions."""

    def __init__(self, channels: int = 32, stages: int = 4, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        self.stages = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
                nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
            )
            for _ in range(stages)
        )
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for stage in self.stages:
            x = self.relu(stage(x) + x)
        return self.head(x.mean(dim=(2, 3)))


def gpt(batch: int = 8, length: int = 128) -> tuple[nn.Module, torch.Tensor]:
    model = TinyGPT(context=length)
    return model, torch.randint(0, 512, (batch, length))


def cnn(batch: int = 16, size: int = 32) -> tuple[nn.Module, torch.Tensor]:
    return SmallCNN(), torch.randn(batch, 3, size, size)


EXAMPLES: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "gpt": gpt,
    "mlp": mlp,
    "cnn": cnn,
    "unet": skip_transformer,
}
