"""The model and helpers of the keep tests (tests/test_keep.py): a GPT-like stack whose blocks
alternate written-out and fused attention, plans checkpointing every block while keeping
chosen nodes, and counters of the ATen calls a step makes."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from conftest import train_step
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from planner import Plan

WIDTH = 64
BLOCKS = 4
LINEARS = ("attention_qkv", "attention_proj", "fc1", "fc2")


class Attention(nn.Module):
    """Single-head attention written out (two matmuls, softmax, dropout), or two heads through
    F.scaled_dot_product_attention (the fused CPU kernel takes 4-D inputs)."""

    def __init__(self, fused: bool, dropout: float):
        super().__init__()
        self.fused = fused
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.qkv(x).chunk(3, dim=-1)  # indexed, not unpacked: fx cannot unpack
        q, k, v = parts[0], parts[1], parts[2]
        if self.fused:
            batch, length = x.size(0), x.size(1)
            q, k, v = (t.view(batch, length, 2, WIDTH // 2).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out = out.transpose(1, 2).reshape(batch, length, WIDTH)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(WIDTH)
            out = self.dropout(F.softmax(scores, dim=-1)) @ v
        return self.dropout(self.proj(out))


class Block(nn.Module):
    def __init__(self, fused: bool, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attention = Attention(fused, dropout)
        self.fc1, self.act, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.dropout(self.fc2(self.act(self.fc1(self.norm2(x)))))


class KeepGPT(nn.Module):
    """A GPT-like stack whose blocks alternate written-out and fused attention."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.embedding = nn.Embedding(128, WIDTH)
        self.blocks = nn.ModuleList(Block(i % 2 == 1, dropout) for i in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 128)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(dropout: float = 0.1) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return KeepGPT(dropout), torch.randint(0, 128, (8, 64))


BLOCK_NAMES = [f"blocks.{i}" for i in range(BLOCKS)]
KEPT_LINEARS = [f"blocks_{i}_{name}" for i in range(BLOCKS) for name in LINEARS]


def selective(p: Plan, kept: list[str] = KEPT_LINEARS) -> Plan:
    """Every block checkpointed, keeping `kept` (by default every linear's output)."""
    return p.with_submodules(BLOCK_NAMES, kept=kept)


def recomputed_ms(p: Plan) -> float:
    """The forward time a plan's recomputation runs (without checkpoint's and the policies' own cost)."""
    return sum(p.problem.region_recompute_ms(region, p.solution.kept) for region in p.solution.regions)


class CallCounter(TorchDispatchMode):
    """Counts the ATen calls made while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def backward_calls(module: nn.Module, tokens: torch.Tensor) -> Counter[str]:
    """The ATen calls of one backward (recomputation included)."""
    loss = module(tokens).pow(2).mean()
    with CallCounter() as counter:
        loss.backward()
    for parameter in module.parameters():
        parameter.grad = None
    return counter.calls


def assert_same_step(reference: nn.Module, planned: nn.Module, tokens: torch.Tensor) -> None:
    expected_output, expected = train_step(reference, tokens)
    output, grads = train_step(planned, tokens)
    torch.testing.assert_close(output, expected_output)
    assert grads.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(grads[key], expected[key], msg=key)
