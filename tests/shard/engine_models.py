"""Small models for the engine's tests: an MLP stack and a tiny transformer with a tied
embedding and head (which lands in the root unit). Sizes are odd on purpose, so flat
buffers need padding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class MLP(nn.Module):
    def __init__(self, inputs: int = 7, width: int = 29, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)

    def units(self):
        return [self.inp, *self.blocks, self.out]


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        # No qkv bias: the key bias has an exactly zero gradient (softmax ignores a shift),
        # so Adam would amplify rounding noise whose sign depends on summation order.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 61, width: int = 24, heads: int = 2, depth: int = 2, context: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(context, width) * 0.02)   # loose: root unit
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight                           # tied: root unit

    def forward(self, tokens, targets=None):
        """The logits, or given the targets, the loss (as the models compute it)."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return logits if targets is None else token_loss(logits, targets)

    def units(self):
        return [self.embed, *self.blocks, self.norm, self.head]


def mlp_batch(step: int, samples: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(samples, 7, generator=g), torch.randn(samples, 1, generator=g)


def token_batch(step: int, samples: int, vocab: int = 61, length: int = 12):
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, vocab, (samples, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def mlp_loss(out, target):
    return F.mse_loss(out.float(), target)


def token_loss(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))
