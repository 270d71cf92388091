"""A GPT-style decoder: pre-LayerNorm blocks, causal self-attention through torch's
scaled_dot_product_attention, GELU MLP, learned or rotary positions, optionally tied
embeddings.

Each block is a direct member of `blocks` (a ModuleList), so the engine's default units
are the embeddings, every block, and the final norm and head. Given the targets, the head
computes the loss itself, fused with the cross-entropy a chunk of tokens at a time
(shard/models/loss.py), so the logits of the whole batch are never written.

Initialization is per parameter and seeded by the parameter's name (`init_parameter`), so
a model built on the meta device and materialized one unit at a time by the engine has
exactly the values an eagerly built model would have, on any number of ranks.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shard.models.loss import linear_cross_entropy

POSITIONS = ("learned", "rotary")


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 4096
    context: int = 128
    width: int = 256
    layers: int = 4
    heads: int = 4
    tied: bool = True
    positions: str = "learned"
    bias: bool = False
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab", "context", "width", "layers", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be divisible by heads {self.heads}")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.positions == "rotary" and (self.width // self.heads) % 2:
            raise ValueError(f"rotary positions need an even head size, got {self.width // self.heads}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {tuple(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    def num_params(self) -> int:
        """Parameters (tied weights once), from the shapes alone."""
        d, norm = self.width, self.width * (2 if self.bias else 1)
        block = 12 * d * d + 2 * norm + (9 * d if self.bias else 0)   # qkv, proj, up, down
        embeddings = self.vocab * d * (1 if self.tied else 2)
        positions = self.context * d if self.positions == "learned" else 0
        return self.layers * block + embeddings + positions + norm

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token: 6 per weight that multiplies (forward 2, backward 4),
        which excludes table lookups (positions, and the token embedding unless it is tied
        to the head), plus the attention scores and values, 12 * layers * width * seq_len
        (PaLM appendix B; nanoGPT and torchtitan count the same way, without halving for
        the causal mask)."""
        t = self.context if seq_len is None else seq_len
        lookups = (self.context * self.width if self.positions == "learned" else 0)
        lookups += 0 if self.tied else self.vocab * self.width
        return 6 * (self.num_params() - lookups) + 12 * self.layers * self.width * t


# Table 1 of the PCCL paper takes its 7B and 13B shapes from OPT (Zhang et al., 2022); the
# smaller presets are OPT's too (vocabulary 50272, context 2048).
_OPT = dict(vocab=50272, context=2048)
PRESETS = {
    "tiny": GPTConfig(vocab=2048, context=256, width=128, layers=4, heads=4),
    "gpt_125m": GPTConfig(width=768, layers=12, heads=12, **_OPT),
    "gpt_350m": GPTConfig(width=1024, layers=24, heads=16, **_OPT),
    "gpt_1p3b": GPTConfig(width=2048, layers=24, heads=32, **_OPT),
    "gpt_2p7b": GPTConfig(width=2560, layers=32, heads=32, **_OPT),
    "gpt_7b": GPTConfig(width=4096, layers=32, heads=32, **_OPT),
    "gpt_13b": GPTConfig(width=5120, layers=40, heads=40, **_OPT),
    "gpt_66b": GPTConfig(width=9216, layers=64, heads=72, **_OPT),   # OPT-66B: the 70B class
}
# Each preset's peak learning rate, the rate its size was trained with: GPT-3's (Brown et
# al., 2020, "Language Models are Few-Shot Learners", Table 2.1: 125M 6.0e-4, 350M 3.0e-4,
# 1.3B 2.0e-4, 2.7B 1.6e-4, 6.7B 1.2e-4, 13B 1.0e-4), which OPT keeps for these shapes,
# and OPT-66B's own (Zhang et al., 2022, Table 1). tiny: 1e-3, at which `make train`'s
# loss falls within its 200 steps. Larger models need smaller rates to train stably.
PEAK_LR = {"tiny": 1.0e-3, "gpt_125m": 6.0e-4, "gpt_350m": 3.0e-4, "gpt_1p3b": 2.0e-4, "gpt_2p7b": 1.6e-4,
           "gpt_7b": 1.2e-4, "gpt_13b": 1.0e-4, "gpt_66b": 0.8e-4}


def peak_lr(preset: str) -> float:
    """The peak learning rate of a model preset (PEAK_LR)."""
    if preset not in PEAK_LR:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {tuple(PRESETS)}")
    return PEAK_LR[preset]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al., 2021) in the rotate-half form: each pair
    (x_i, x_{i+h/2}) of a head is turned by its position times that pair's frequency."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Rotary:
    """cos and sin tables per (length, device, dtype), computed on first use (no buffers,
    so nothing to materialize from the meta device)."""

    def __init__(self, head_size: int, theta: float):
        # on the CPU even in a model built under torch.device("meta"): the tables need values
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float64, device="cpu") / head_size)
        self.tables: dict = {}

    def __call__(self, length: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (length, str(device), dtype)
        if key not in self.tables:
            angles = torch.outer(torch.arange(length, dtype=torch.float64, device="cpu"), self.inv_freq)
            self.tables[key] = (angles.cos().to(device, dtype), angles.sin().to(device, dtype))
        return self.tables[key]


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)
        self.rotary = Rotary(cfg.width // cfg.heads, cfg.rope_theta) if cfg.positions == "rotary" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.rotary is not None:
            cos, sin = self.rotary(t, x.device, q.dtype)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.width, 4 * cfg.width, bias=cfg.bias)
        self.down = nn.Linear(4 * cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.width, bias=cfg.bias), SelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.width, bias=cfg.bias), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Linear):
    """The output head: the logits, or given the targets, the mean cross-entropy over
    them without the logits (linear_cross_entropy)."""

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width) if cfg.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.head = Head(cfg.width, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.embed.weight
        if self.embed.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.init_parameter(name, p)

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Initialize one parameter in place, from a generator seeded by (seed, name):
        GPT-2's scheme, normal(0, 0.02) weights, residual projections scaled by
        1/sqrt(2 * layers), zero biases, unit norm gains."""
        if name.endswith("bias"):
            tensor.zero_()
        elif tensor.dim() == 1:
            tensor.fill_(1.0)
        else:
            residual = name.endswith(("attn.proj.weight", "mlp.down.weight"))
            std = 0.02 / math.sqrt(2 * self.cfg.layers) if residual else 0.02
            generator = torch.Generator(tensor.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            tensor.normal_(0.0, std, generator=generator)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits of each position, or given `targets` (one per position), the mean
        cross-entropy of predicting them."""
        if tokens.shape[1] > self.cfg.context:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds the context of {self.cfg.context}")
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x), targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
